"""The trainer on several ranks: FSDP2 over gloo, in real processes.

The reference for every multi-rank result is one process taking the same steps on the
same batches: two ranks must produce the same weights, optimizer state and metrics (up
to float summation order). The plain planning functions are tested in process in
tests/unit/test_rank_planning.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seamlessflow.assets.families import build_family_model
from seamlessflow.bus import Bus
from seamlessflow.protocol import TrainingFinished, TrainStepMetrics, WeightsPublished, decode
from seamlessflow.weights import ObjectStorePayloads, WeightMirror
from sf_trainer.checkpoint import load_model_state, load_optimizer_state, read_state
from sf_trainer.step import plan_micro_batches
from tests.support import InProcessMesh
from tests.support.ranks import (
    BATCH_FIGURES,
    BATCHES,
    GRADIENT_NOISE,
    SETTINGS,
    assert_same_checkpoint,
    assert_same_results,
    grad_norm_noise,
    run_one_process,
    run_ranks,
    spec,
)
from tests.support.trainer_batches import make_batch

# two gloo ranks ----------------------------------------------------------------------


def assert_trained(checkpoint: Path, base_model_dir: Path) -> None:
    """The comparison means something: the steps moved the weights."""
    weights, base = load_model_state(checkpoint), load_model_state(base_model_dir)
    moved = max((weights[name] - base[name]).abs().max().item() for name in base)
    assert moved > 1e-4


def test_two_fsdp_ranks_take_the_same_steps_as_one_process(
    base_model_dir: Path, tmp_path: Path
) -> None:
    ranks = run_ranks(2, spec(base_model_dir, BATCHES, tmp_path / "ranks"))
    alone = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "alone"))
    assert_same_results(ranks, alone, tmp_path / "alone")
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")
    assert_trained(tmp_path / "alone" / "checkpoint", base_model_dir)


def test_two_ranks_match_one_process_with_gspo_rloo_and_a_sharded_reference(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """A sequence-level loss (divided by the whole batch's sequence count) and the KL
    term, whose reference model is sharded like the policy. The GSPO clip is widened so
    that most sequences train (at the paper's 3e-4 these random batches clip nearly all)."""
    gspo = {"name": "gspo", "clip_eps_low": 0.5, "clip_eps_high": 0.5}
    settings = {**SETTINGS, "loss": gspo, "advantage": "rloo", "kl_coef": 0.1}
    ranks = run_ranks(2, spec(base_model_dir, BATCHES, tmp_path / "ranks", settings=settings))
    alone = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "alone", settings=settings))
    assert_same_results(ranks, alone, tmp_path / "alone")
    # step 1 starts at the reference; step 2 has moved away from it
    assert alone[0]["kl_mean"] == 0.0 and alone[1]["kl_mean"] > 0.0
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")
    assert_trained(tmp_path / "alone" / "checkpoint", base_model_dir)


def test_ranks_with_unequal_micro_batch_counts_finish_the_same_step(
    base_model_dir: Path, tmp_path: Path
) -> None:
    batch = make_batch(0, [[40, 4, 4, 4, 4], [4, 4, 4, 4]], seed=3)
    settings = {**SETTINGS, "micro_batch_tokens": 8}
    samples = [s for g in batch.groups for s in g.samples]
    plans = plan_micro_batches(samples, world_size=2, token_budget=8)
    # the case under test: rank 0 trains in 1 pass, rank 1 in 4
    assert [sum(m.trained for m in plan) for plan in plans] == [1, 4]

    ranks = run_ranks(2, spec(base_model_dir, [batch], tmp_path / "ranks", settings=settings))
    alone = run_one_process(spec(base_model_dir, [batch], tmp_path / "alone", settings=settings))
    assert_same_results(ranks, alone, tmp_path / "alone")
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")


def test_two_ranks_resume_a_one_process_checkpoint_and_continue_identically(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """Restore on FSDP2 (rank 0 reads, broadcasts); the checkpoint format does not
    depend on the world size."""
    first = run_one_process(spec(base_model_dir, BATCHES[:1], tmp_path / "first"))
    assert len(first) == 1
    resumed = run_ranks(
        2, spec(base_model_dir, BATCHES[1:], tmp_path / "resumed", tmp_path / "first/checkpoint")
    )
    straight = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "straight"))
    assert_same_results(resumed, straight[1:], tmp_path / "straight")
    assert_same_checkpoint(tmp_path / "resumed" / "checkpoint", tmp_path / "straight")


@pytest.mark.integration  # rank processes
@pytest.mark.parametrize("family", ["qwen3", "llama3-tied"])
def test_each_rank_reads_only_its_shard_and_the_ranks_step_as_one_process(
    family: str, tmp_path: Path
) -> None:
    """Two ranks build the model on the meta device and read their own rows from the
    safetensors (``sf_trainer.sharded_loading``); one process loads it whole. Gathered,
    the ranks hold the file's weights bit for bit, and publish them so (tensor by tensor
    into a bf16 payload, ``Learner.encode_weights``); the step's figures and weights then
    match one process's, which they would not with a wrong buffer the file does not
    hold (rotary frequencies) or a tied matrix loaded twice."""
    model_dir = build_family_model(family, tmp_path / "model")
    batch = make_batch(0, [[6, 9, 14], [8, 11, 5]], seed=4)
    job = spec(model_dir, [batch], tmp_path / "ranks")
    ranks = run_ranks(2, {**job, "save_loaded": True})
    alone = run_one_process(spec(model_dir, [batch], tmp_path / "alone"))

    loaded = torch.load(tmp_path / "ranks" / "loaded.pt", weights_only=True)
    published = torch.load(tmp_path / "ranks" / "published.pt", weights_only=True)
    packed = torch.load(tmp_path / "ranks" / "packed.pt", weights_only=True)
    stored = load_model_state(model_dir)
    assert loaded.keys() == stored.keys() == published.keys() == packed.keys()
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name
        # the version engines get: gathered tensor by tensor into the payload, in bf16
        assert torch.equal(published[name], tensor.to(torch.bfloat16)), name
        # and packed where rank 0 computes (cuda_ipc), its row blocks kept there
        assert torch.equal(packed[name], tensor.to(torch.bfloat16)), name
    assert_same_results(ranks, alone, tmp_path / "alone")
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")


def test_bf16_master_weights_train_and_checkpoint_in_bf16_on_one_and_two_ranks(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """``SF_TRAINER_MASTER_DTYPE=bfloat16``: the weights AdamW updates and its moments are
    bf16 (half the state), in one process and on two ranks; the steps still train.
    (bf16 rounding differs between the two, so they are not compared entry by entry.)
    With ``precision`` fp32, two ranks gather the bf16 shards into float32 and compute
    in it: their first step is the float32 step of one process on the same weights
    rounded to bf16 (bf16 arithmetic moved its loss by 3e-4, 3x the bound)."""
    settings = {**SETTINGS, "master_dtype": "bfloat16"}
    alone = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "alone", settings=settings))
    ranks = run_ranks(2, spec(base_model_dir, BATCHES, tmp_path / "ranks", settings=settings))
    rounded = rounded_to_bf16(base_model_dir, tmp_path / "rounded")
    (float32,) = run_one_process(
        spec(rounded, BATCHES[:1], tmp_path / "float32", settings=SETTINGS)
    )
    for key in ("loss", "logprob_abs_diff"):
        assert ranks[0][key] == pytest.approx(float32[key], rel=0, abs=GRADIENT_NOISE), key
    base = load_model_state(base_model_dir)
    for run, results in (("alone", alone), ("ranks", ranks)):
        weights = load_model_state(tmp_path / run / "checkpoint")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}, run
        moved = max((weights[n].float() - base[n].float()).abs().max().item() for n in base)
        assert moved > 1e-3, run
        moments = load_optimizer_state(tmp_path / run / "checkpoint")["state"]
        assert {m["exp_avg"].dtype for m in moments.values()} == {torch.bfloat16}, run
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in results), run
    # the same batches, split over the ranks: the same tokens trained
    assert [r["tokens_trained"] for r in ranks] == [r["tokens_trained"] for r in alone]


def rounded_to_bf16(model_dir: Path, out: Path) -> Path:
    """A float32 copy of the model whose weights are rounded to bf16, with its tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model.float().save_pretrained(out)
    for name in model_dir.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    return out


# the service, launched as documented ---------------------------------------------------


async def start_torchrun(
    mesh: InProcessMesh, model_dir: Path, run_dir: Path, steps: int
) -> asyncio.subprocess.Process:
    """``torchrun --standalone --nproc-per-node 2 -m sf_trainer``; its output goes to
    ``<run_dir>.log``."""
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    env = {
        **os.environ,
        "SF_NATS_URL": mesh.mesh.nats_url,
        "SF_RUN_ID": mesh.mesh.run_id,
        "SF_RUN_DIR": str(run_dir),
        "SF_MODEL_DIR": str(model_dir),
        "SF_STEPS": str(steps),
        "SF_LR": str(SETTINGS["lr"]),
        "SF_TRAINER_MICRO_BATCH_TOKENS": str(SETTINGS["micro_batch_tokens"]),
        # every version streams bucket by bucket as the ranks gather it, in buckets
        # smaller than most tensors
        "SF_WEIGHTS_DELTA_MAX_MB": "0",
        "SF_WEIGHTS_BUCKET_MB": "0.05",
        "OMP_NUM_THREADS": "1",
    }
    torchrun = Path(sys.executable).with_name("torchrun")
    with run_dir.with_suffix(".log").open("wb") as log:
        return await asyncio.create_subprocess_exec(
            *(str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "sf_trainer"),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def wait_for_exit(launcher: asyncio.subprocess.Process, timeout: float) -> int:
    try:
        return await asyncio.wait_for(launcher.wait(), timeout)
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()


async def test_the_trainer_service_on_two_ranks_trains_and_publishes_versions(
    mesh: InProcessMesh, bus: Bus, base_model_dir: Path, tmp_path: Path
) -> None:
    subjects = bus.subjects
    for batch in BATCHES:
        await bus.js_publish(subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}")
    run_dir = tmp_path / "run"
    launcher = await start_torchrun(mesh, base_model_dir, run_dir, steps=len(BATCHES))
    code = await wait_for_exit(launcher, 120)
    assert code == 0, run_dir.with_suffix(".log").read_text()[-5000:]

    metrics = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_metrics())
    ]
    assert [(m.version, m.batch_index) for m in metrics] == [(1, 0), (2, 1)]
    published = [
        decode(m.data, WeightsPublished)
        for m in await bus.read_subject(subjects.stream_weights(), subjects.weights_published())
    ]
    assert [p.version for p in published] == [1, 2]
    (finished,) = [
        decode(m.data, TrainingFinished)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_finished())
    ]
    assert (finished.steps, finished.final_version) == (2, 2)

    final = run_dir / "checkpoints" / "final"
    assert read_state(final).data_position == 1
    # each version left rank 0 bucket by bucket, in full; the last one, read back from
    # the store, is the final checkpoint's weights in the travel dtype
    last = published[-1].manifest
    assert [p.manifest.kind for p in published] == ["full", "full"]
    assert len(last.bucket_digests) > 10
    mirror = WeightMirror()
    mirror.apply(last, await ObjectStorePayloads(bus).fetch(last))
    saved = load_model_state(final)
    for name, tensor in mirror.tensors().items():
        assert torch.equal(tensor, saved[name].to(tensor.dtype)), name
    alone = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "alone"))
    expected_losses = [r["loss"] for r in alone]
    assert [m.loss for m in metrics] == pytest.approx(expected_losses, rel=0, abs=GRADIENT_NOISE)
    # the step's figures reach its published metrics (tolerances: assert_same_results)
    for m, r in zip(metrics, alone, strict=True):
        assert {k: getattr(m, k) for k in BATCH_FIGURES} == {k: r[k] for k in BATCH_FIGURES}
        assert m.entropy_mean == pytest.approx(r["entropy_mean"], rel=GRADIENT_NOISE)
    bounds = grad_norm_noise(tmp_path / "alone")
    for m, r, bound in zip(metrics, alone, bounds, strict=True):
        assert m.grad_norm == pytest.approx(r["grad_norm"], rel=bound)
    # the final checkpoint has read one more batch than the reference's (data position)
    assert_same_checkpoint(final, tmp_path / "alone", same_state=False)


async def test_sigterm_to_torchrun_still_leaves_a_final_checkpoint_of_both_ranks(
    mesh: InProcessMesh, bus: Bus, base_model_dir: Path, tmp_path: Path
) -> None:
    """torchrun forwards SIGTERM to every rank: rank 0 drains and gathers its final
    checkpoint, which needs rank 1, which ignores the signal and stops on rank 0's word."""
    subjects = bus.subjects
    stepped = await bus.nc.subscribe(subjects.train_metrics())
    await bus.js_publish(subjects.batch_ready(), BATCHES[0], msg_id="batch-0")
    run_dir = tmp_path / "run"
    launcher = await start_torchrun(mesh, base_model_dir, run_dir, steps=5)
    try:
        await stepped.next_msg(timeout=90)
    finally:
        launcher.terminate()
        await stepped.unsubscribe()
    await wait_for_exit(launcher, 60)  # torchrun itself exits 1 after a signal
    log = run_dir.with_suffix(".log").read_text()
    # torchrun's own SignalException is the one traceback: no rank failed
    assert log.count("Traceback") == 1, log[-5000:]
    assert read_state(run_dir / "checkpoints" / "final").data_position == 0, log[-5000:]
