"""The engine's size from its settings: tensor parallelism and CUDA graphs, the vllm
backend's own settings (``VllmSettings``, ``SF_ENGINE_VLLM_``), reach vLLM's engine
arguments; the engine settings they used to be refuse their old spelling."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sf_engine.backends.vllm_engine import BACKEND, VllmEngine
from sf_engine.settings import EngineSettings, HfSettings, VllmSettings


def vllm_args(tmp_path: Path) -> dict[str, object]:
    engine = BACKEND.build(EngineSettings(backend="vllm", dtype="float32"), str(tmp_path))
    assert isinstance(engine, VllmEngine)
    return engine.engine_args()  # what start() hands vLLM (no vLLM import needed)


def test_by_default_one_gpu_runs_eagerly(tmp_path: Path) -> None:
    args = vllm_args(tmp_path)
    assert args["tensor_parallel_size"] == 1
    assert args["enforce_eager"] is True


def test_tensor_parallelism_and_cuda_graphs_are_the_backends_own_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_ENGINE_VLLM_TENSOR_PARALLEL", "4")
    monkeypatch.setenv("SF_ENGINE_VLLM_CUDA_GRAPHS", "true")
    args = vllm_args(tmp_path)
    assert args["tensor_parallel_size"] == 4
    assert args["enforce_eager"] is False
    assert BACKEND.settings is VllmSettings
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        VllmSettings(tensor_parallel=0)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("SF_ENGINE_TENSOR_PARALLEL", "SF_ENGINE_VLLM_TENSOR_PARALLEL"),
        ("SF_ENGINE_CUDA_GRAPHS", "SF_ENGINE_VLLM_CUDA_GRAPHS"),
        ("SF_ENGINE_DEVICE", "SF_ENGINE_HF_DEVICE"),
        ("SF_ENGINE_PREFIX_CACHE_MB", "SF_ENGINE_HF_PREFIX_CACHE_MB"),
    ],
)
def test_a_setting_that_became_a_backends_own_names_its_new_variable(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(old, "1")
    with pytest.raises(ValidationError, match=f"{old} .* is no longer read: .* is {new}"):
        EngineSettings(dtype="float32")


def test_the_hf_backends_device_decides_what_auto_computes_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SF_ENGINE_HF_DEVICE", "cpu")
    assert HfSettings().model_device() == "cpu"
    assert EngineSettings(backend="hf").dtype == "float32"  # every CPU computes in fp32
