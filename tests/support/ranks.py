"""Trainer ranks started as processes (``trainer_rank.py``, one per rank, torchrun's
environment) and their results compared: the same batches on one process and on
several must give the same steps, checkpoints and weights, within bounds derived from
float noise measured on the one-process run (its AdamW trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from seamlessflow.protocol import (
    TrainBatch,
)
from sf_trainer.checkpoint import (
    load_model_state,
    load_optimizer_state,
    read_state,
)
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from tests.support import SUPPORT_DIR, free_port
from tests.support.trainer_batches import make_batch
from tests.support.trainer_rank import lead

WORKER = SUPPORT_DIR / "trainer_rank.py"


# lr 1e-3 moves the weights enough that a wrong split or normaliser shows; a budget of
# 48 tokens makes every rank accumulate over several micro-batches
SETTINGS = {"lr": 1e-3, "micro_batch_tokens": 48, "torch_threads": 1}


BATCHES = [
    make_batch(0, [[6, 9, 14, 20], [8, 11, 5, 17]], seed=1),
    make_batch(1, [[12, 7, 19, 10], [9, 15, 6, 13]], seed=2),
]


def spec(
    model_dir: Path,
    batches: list[TrainBatch],
    out: Path,
    resume: Path | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir),
        "settings": settings or SETTINGS,
        "batches": [msgspec.json.encode(b).decode() for b in batches],
        "resume": str(resume) if resume else None,
        "out": str(out),
    }


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's environment for one rank on this host, one thread."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def run_ranks(world_size: int, job: dict[str, Any], timeout: float = 300.0) -> list[dict[str, Any]]:
    """Start one process per rank with torchrun's environment; rank 0's results.
    ``timeout`` bounds a hang, nothing else: the ranks take 10-30 s on two idle cores,
    and 60 s was too short beside the suite's other workers (two ranks of a
    checkpointed step had not logged a line after 60 s)."""
    out = Path(job["out"])
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(job))
    port = free_port()
    ranks = []
    for rank in range(world_size):
        env = rank_environment(rank, world_size, port)
        with (out / f"rank{rank}.log").open("wb") as log:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(spec_path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [process.wait(timeout=timeout) for process in ranks]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
    assert codes == [0] * world_size, f"ranks ended with {codes}:\n{logs}"
    results: list[dict[str, Any]] = json.loads((out / "results.json").read_text())
    return results


def run_one_process(job: dict[str, Any]) -> list[dict[str, Any]]:
    out = Path(job["out"])
    out.mkdir(parents=True)
    settings = TrainerSettings(**job["settings"])
    lead(Learner(settings, TrainGroup(device=torch.device("cpu")), Path(job["model_dir"])), job)
    results: list[dict[str, Any]] = json.loads((out / "results.json").read_text())
    return results


def assert_same_results(
    got: list[dict[str, Any]], expected: list[dict[str, Any]], reference_run: Path
) -> None:
    """``expected``: the last steps of the one-process ``reference_run``."""
    assert len(got) == len(expected)
    grad_norm_bounds = grad_norm_noise(reference_run)[-len(expected) :]
    for a, b, grad_norm_bound in zip(got, expected, grad_norm_bounds, strict=True):
        for key in ("samples", "tokens_trained", "max_staleness", *BATCH_FIGURES):
            assert a[key] == b[key], key
        # means over trained tokens (or sequences) of terms of order 1 (a ratio times a
        # unit-scale advantage, a log-probability gap, a reward): float noise is relative
        # to the terms, not to their mean, which cancels towards 0
        for key in ("loss", "logprob_abs_diff", "mean_reward", "kl_mean"):
            assert a[key] == pytest.approx(b[key], rel=0, abs=GRADIENT_NOISE), key
        # an entropy H moves by at most 2 H x the largest change of a (scaled) logit
        # (|dH| <= sum p |log p + H| |dz|), a logprob by at most 2 x it: the logprobs'
        # bound above, relative to H (a mean of positive terms: no cancellation)
        assert a["entropy_mean"] == pytest.approx(b["entropy_mean"], rel=GRADIENT_NOISE)
        assert b["entropy_mean"] > 0
        # noise can tip a ratio sitting on the clip boundary: one token either way
        one_token = 1 / b["tokens_trained"]
        assert a["clip_fraction"] == pytest.approx(b["clip_fraction"], abs=one_token * 1.001)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=grad_norm_bound), (
            "grad_norm",
            a["grad_norm"],
            b["grad_norm"],
        )


BATCH_FIGURES = (
    "reward_std",
    "reward_min",
    "reward_max",
    "completion_tokens_mean",
    "completion_tokens_max",
    "prompt_tokens_mean",
    "mean_staleness",
    "completions_truncated_fraction",
)
"""Step figures that are functions of the batch alone, which every rank holds whole:
the same numbers on any number of ranks."""


# How far float noise can move a gradient entry, relative to the largest entry of its
# tensor in that step. The ranks sum the same per-token terms as one process in another
# order (each rank's share, then gloo's sum) and with other SIMD kernels (AVX-512, AVX2
# or scalar reductions: 16, 8 or 1 lanes): float32 rounding (2**-24 per operation) over
# sums of hundreds of terms whose signs cancel (advantages sum to zero) leaves an error
# that scales with the tensor's magnitude, not with the entry's. Measured with each
# ATEN_CPU_CAPABILITY: at most 2e-6; the bound leaves 50x headroom and is still 10**4
# below what a wrong normaliser or a missing rank's share does to a gradient (a factor).
GRADIENT_NOISE = 1e-4


def adam_trace(reference_run: Path) -> tuple[list[dict[str, dict[str, torch.Tensor]]], dict]:
    """The one-process run's AdamW moments after each step, with the gradient each step
    fed them (``exp_avg`` is a lerp towards it), and its hyperparameters."""
    trace: list[dict[str, dict[str, torch.Tensor]]] = torch.load(
        reference_run / "adam_trace.pt", weights_only=True
    )
    (group,) = load_optimizer_state(reference_run / "checkpoint")["param_groups"]
    beta1 = group["betas"][0]
    previous = {name: torch.zeros_like(state["exp_avg"]) for name, state in trace[0].items()}
    for step in trace:
        for name, state in step.items():
            state["gradient"] = (state["exp_avg"] - beta1 * previous[name]) / (1 - beta1)
            previous[name] = state["exp_avg"]
    return trace, group


def adam_noise_bounds(reference_run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter, the largest difference float noise can make to its weight and to
    its AdamW moments, from the one-process run's moments after each of its steps.

    With gradients off by at most D per entry (D_t = GRADIENT_NOISE x the tensor's
    largest |g_t|, D = the largest D_s so far; 0 on an entry no token has touched yet,
    whose gradient has no terms to round): m_hat (a weighted mean of gradients, weights
    summing to 1) moves by at most D and sqrt(v_hat) (a weighted RMS) too, so Adam's
    direction m_hat / (sqrt(v_hat) + eps), of magnitude at most about 1 (|m_hat| <=
    sqrt(v_hat) over these few steps), moves by at most 2 D / (sqrt(v_hat) - D + eps),
    and never by more than 2. The weight moves lr times that per step: noise is
    amplified on entries whose gradient is small next to their tensor's largest, which
    a tolerance in units of the weight cannot express.
    """
    trace, group = adam_trace(reference_run)
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    bounds = {}
    for name in group["params"]:
        zeros = torch.zeros_like(trace[0][name]["exp_avg"])
        weight, exp_avg, exp_avg_sq, noise = zeros.clone(), zeros.clone(), zeros.clone(), zeros
        for t, step in enumerate(trace, start=1):
            state = step[name]
            touched = state["exp_avg_sq"] != 0
            step_noise = touched * GRADIENT_NOISE * state["gradient"].abs().max()
            noise = torch.maximum(noise, step_noise)
            root_v_hat = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
            direction = 2 * noise / (root_v_hat - noise + eps).clamp(min=eps)
            weight += lr * direction.clamp(max=2.0)
            exp_avg = beta1 * exp_avg + (1 - beta1) * step_noise
            exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * step_noise**2
        bounds[name] = {"weight": weight, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return bounds


def grad_norm_noise(reference_run: Path) -> list[float]:
    """Per step, the relative difference float noise can make to the gradient norm:
    ||dg|| <= sqrt(sum over tensors of size x D_t**2), divided by the norm itself (both
    scale alike under clipping, so the clipped gradients in the trace give the ratio)."""
    trace, _ = adam_trace(reference_run)
    bounds = []
    for step in trace:
        gradients = [state["gradient"] for state in step.values()]
        noise = sum(g.numel() * (GRADIENT_NOISE * g.abs().max().item()) ** 2 for g in gradients)
        norm = sum(g.square().sum().item() for g in gradients)
        bounds.append((noise / norm) ** 0.5)
    return bounds


def assert_within(
    got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str
) -> None:
    # plus the rounding of the compared values themselves (a few float32 ulps)
    allowed = bound + 4 * torch.finfo(torch.float32).eps * expected.abs()
    difference = (got - expected).abs()
    excess = torch.where(difference == 0, 0.0, difference / allowed)  # 0 / 0: untouched
    assert excess.max() <= 1.0, (
        f"{what}: off by {excess.max().item():.3g}x its float-noise bound "
        f"at {int((excess > 1).sum())} of {excess.numel()} entries"
    )


def assert_same_checkpoint(got: Path, reference_run: Path, same_state: bool = True) -> None:
    """Same weights and AdamW moments as the one-process ``reference_run``, within what
    float summation order can change (``adam_noise_bounds``); with ``same_state`` also
    the same trainer state (step, version, data position)."""
    expected = reference_run / "checkpoint"
    bounds = adam_noise_bounds(reference_run)
    weights, reference = load_model_state(got), load_model_state(expected)
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        # (a tied matrix is written once, under the name the optimizer knows it by)
        assert_within(tensor, reference[name], bounds[name]["weight"], name)
    moments, reference_moments = load_optimizer_state(got), load_optimizer_state(expected)
    assert moments["state"].keys() == reference_moments["state"].keys()
    for name, state in moments["state"].items():
        want = reference_moments["state"][name]
        assert state["step"] == want["step"], name
        assert_within(state["exp_avg"], want["exp_avg"], bounds[name]["exp_avg"], name)
        # sqrt(v) is a weighted RMS of the gradients: noise D moves it by at most D
        assert_within(
            state["exp_avg_sq"].sqrt(),
            want["exp_avg_sq"].sqrt(),
            bounds[name]["exp_avg_sq"].sqrt(),
            f"{name} sqrt(exp_avg_sq)",
        )
    if same_state:
        assert read_state(got) == read_state(expected)
