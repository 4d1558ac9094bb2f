"""``seamlessflow up`` with vLLM engines on a GPU shares the card with the trainer: the
launcher tells each engine how many engines share it (``colocated_engines``), and each
takes half the card over that many (vLLM's own 0.9 would leave the trainer a tenth),
unless the user set ``gpu_memory_utilization`` (in the environment or a run file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamlessflow.runfile import RUN_FILE_VARIABLE
from sf_engine.backends.vllm_engine import gpu_engine_kwargs
from sf_engine.settings import ENGINES_GPU_SHARE, VllmSettings


@pytest.fixture(autouse=True)
def _on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VllmSettings, "model_device", lambda self: "cuda")
    for name in ("GPU_MEMORY_UTILIZATION", "COLOCATED_ENGINES"):
        monkeypatch.delenv(f"SF_ENGINE_VLLM_{name}", raising=False)


@pytest.mark.parametrize("engines", [1, 2, 4])
def test_engines_sharing_the_card_with_the_trainer_take_half_of_it_together(
    engines: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_ENGINE_VLLM_COLOCATED_ENGINES", str(engines))
    share = gpu_engine_kwargs(VllmSettings())["gpu_memory_utilization"]
    assert share * engines == pytest.approx(ENGINES_GPU_SHARE, abs=5e-3)


def test_alone_on_the_card_vllm_takes_its_own_default() -> None:
    assert "gpu_memory_utilization" not in gpu_engine_kwargs(VllmSettings())


def test_the_users_setting_wins_from_the_environment_or_a_run_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SF_ENGINE_VLLM_COLOCATED_ENGINES", "2")
    monkeypatch.setenv("SF_ENGINE_VLLM_GPU_MEMORY_UTILIZATION", "0.7")
    assert gpu_engine_kwargs(VllmSettings())["gpu_memory_utilization"] == 0.7
    monkeypatch.delenv("SF_ENGINE_VLLM_GPU_MEMORY_UTILIZATION")
    run_file = tmp_path / "run.toml"
    run_file.write_text("[engine_vllm]\ngpu_memory_utilization = 0.6\n")
    monkeypatch.setenv(RUN_FILE_VARIABLE, str(run_file))
    assert gpu_engine_kwargs(VllmSettings())["gpu_memory_utilization"] == 0.6
