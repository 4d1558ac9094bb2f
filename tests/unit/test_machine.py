"""The ``auto`` precision rule (``seamlessflow.machine``): bfloat16 only where the device
computes it natively, float32 elsewhere; the trainer's and the engine's settings resolve
it when read, and ``seamlessflow doctor`` prints what a run would choose."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from seamlessflow import machine
from seamlessflow.machine import engine_dtype, resolve_precision

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""How an AVX2-only CPU without native bf16 is emulated on a bigger one: oneDNN and
torch's own kernels limited to AVX2."""


@pytest.mark.parametrize("native", [True, False])
def test_auto_takes_bf16_only_where_the_cpu_computes_it(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine, "cpu_computes_bf16", lambda: native)
    choice = resolve_precision("auto", "cpu")
    assert choice.chosen == ("bf16-mixed" if native else "fp32")
    assert choice.requested == "auto"
    assert ("natively" in choice.reason) is native
    assert choice.line().startswith(f"precision {choice.chosen} (auto: ")


@pytest.mark.parametrize("asked", ["fp32", "bf16-mixed"])
def test_an_explicit_precision_is_kept_whatever_the_cpu(
    asked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for native in (True, False):
        monkeypatch.setattr(machine, "cpu_computes_bf16", lambda native=native: native)
        choice = resolve_precision(asked, "cpu")
        assert (choice.chosen, choice.requested) == (asked, asked)
        assert choice.line().startswith(f"precision {asked} (as asked: ")


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="expected one of auto, fp32, bf16-mixed"):
        resolve_precision("fp16", "cpu")


def test_the_cpu_engine_stays_float32_and_a_named_dtype_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "cpu_computes_bf16", lambda: True)
    assert engine_dtype("auto", "cpu") == "float32"
    assert engine_dtype("bfloat16", "cpu") == "bfloat16"


def test_this_machine_resolves_as_its_onednn_reports() -> None:
    """No stand-in: the rule on the CPU the suite runs on."""
    import torch

    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert resolve_precision("auto").chosen == ("bf16-mixed" if native else "fp32")


def python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_avx2_emulation_reads_as_an_avx2_cpu_without_bf16() -> None:
    """Whatever CPU runs the suite, the emulation's torch sees AVX2 kernels and no bf16,
    and every setting that says ``auto`` resolves to float32 under it."""
    code = (
        "import json; from seamlessflow.machine import cpu_isa, cpu_computes_bf16;"
        "from sf_trainer.settings import TrainerSettings;"
        "from sf_engine.settings import EngineSettings;"
        "print(json.dumps([cpu_isa(), cpu_computes_bf16(), TrainerSettings().precision,"
        " EngineSettings().dtype]))"
    )
    clean = {"SF_PRECISION": "auto", "SF_ENGINE_DTYPE": "auto"}
    assert json.loads(python(code, {**AVX2_ONLY, **clean})) == ["AVX2", False, "fp32", "float32"]


def test_settings_resolve_auto_and_keep_an_explicit_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from sf_engine.settings import EngineSettings
    from sf_trainer.settings import TrainerSettings

    monkeypatch.delenv("SF_PRECISION", raising=False)
    monkeypatch.delenv("SF_ENGINE_DTYPE", raising=False)
    expected = resolve_precision("auto").chosen
    settings = TrainerSettings()
    assert settings.precision == expected and settings.precision_choice.requested == "auto"
    assert TrainerSettings(precision="bf16-mixed").precision == "bf16-mixed"
    assert TrainerSettings(precision="fp32").precision_choice.line().startswith("precision fp32")
    assert EngineSettings().dtype == "float32"  # the engine's device is the CPU
    assert EngineSettings(dtype="bfloat16").dtype == "bfloat16"


def test_doctor_prints_the_machine_and_the_defaults_a_run_would_choose() -> None:
    from typer.testing import CliRunner

    from sf_app.cli import app

    result = CliRunner().invoke(app, ["doctor", "--json", "--measure"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    facts = report["machine"]
    assert facts["cores"] >= 1 and facts["cpu_isa"] and isinstance(facts["cpu_bf16"], bool)
    assert set(facts) >= {"gpus", "docker_cli", "docker_daemon", "compose_cli"}
    cpu = report["defaults"]["cpu"]
    assert cpu["precision"] == ("bf16-mixed" if facts["cpu_bf16"] else "fp32")
    assert cpu["engine_dtype"] == "float32"
    figures = report["matmul_512x576x1536_one_thread_ms"]
    assert figures["float32"] > 0 and figures["bf16_autocast"] > 0
    text = CliRunner().invoke(app, ["doctor"]).output
    assert f"on cpu:    precision {cpu['precision']}" in text
    assert "docker:" in text and "compose:" in text
