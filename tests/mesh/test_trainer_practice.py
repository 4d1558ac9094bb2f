"""Training as practitioners run it: the learning-rate schedule, bf16 mixed precision,
gradient checkpointing and held-out evaluation, each on by a setting. The schedule's
formula and the weights' travel dtype on their own are
tests/unit/test_trainer_practice_settings.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from seamlessflow.tasks import get_task_source
from sf_trainer.checkpoint import TrainerState, load_model_state, load_optimizer_state
from sf_trainer.distributed import TrainGroup
from sf_trainer.evaluation import EvalSet
from sf_trainer.grpo import token_logprobs
from sf_trainer.learner import Learner
from sf_trainer.schedule import lr_at
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import pack
from tests.support import small_embedded_run
from tests.support.ranks import (
    BATCHES,
    assert_same_checkpoint,
    assert_same_results,
    run_one_process,
    run_ranks,
    spec,
)
from tests.support.trainer_batches import make_batch

BASE = {"lr": 1e-3, "micro_batch_tokens": 48}
BF16_UNIT_ROUNDOFF = 2.0**-8
"""bfloat16 keeps 8 significant bits: rounding to it moves a value by at most this,
relative (half of bf16's machine epsilon, 2**-7)."""


def learner(model_dir: Path, **settings: object) -> Learner:
    return Learner(
        TrainerSettings(**{**BASE, **settings}),  # type: ignore[arg-type]
        TrainGroup(device=torch.device("cpu")),
        model_dir,
    )


# learning-rate schedule ----------------------------------------------------------------


def test_each_step_uses_its_scheduled_rate_and_a_resume_continues_the_schedule(
    base_model_dir: Path, tmp_path: Path
) -> None:
    schedule = {"steps": 4, "warmup_steps": 2, "lr_schedule": "cosine", "min_lr_ratio": 0.2}
    settings = TrainerSettings(**{**BASE, **schedule})  # type: ignore[arg-type]
    batches = BATCHES + BATCHES
    straight = learner(base_model_dir, **schedule)
    rates = [straight.step(batch, version=i).lr for i, batch in enumerate(batches)]
    assert rates == [lr_at(s, settings) for s in range(4)]
    assert len(set(rates)) == 3  # warming up, the peak (twice), decayed

    first = learner(base_model_dir, **schedule)
    first.step(BATCHES[0], version=0)
    first.save(tmp_path / "step-1", TrainerState(step=1, version=1, data_position=0))
    resumed = learner(base_model_dir, **schedule)
    resumed.restore(tmp_path / "step-1")
    later = [resumed.step(batch, version=1 + i).lr for i, batch in enumerate(batches[1:])]
    assert later == rates[1:]
    # and so the same weights as the uninterrupted run (one process: the same float ops)
    expected = straight.full_weights()
    for name, tensor in resumed.full_weights().items():
        assert torch.equal(tensor, expected[name]), name


# bf16 mixed precision ------------------------------------------------------------------
# These name bf16-mixed on every CPU: bf16 is what they test. On an AVX2-only CPU it is
# ~40x slower than float32, which on the toy model is seconds.


def logprob_bound(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Per position, how far bf16 compute may move a token's logprob, to first order.

    Autocast rounds the inputs of every matmul (activations and weights) to bf16: each
    adds at most 2 u (u = ``BF16_UNIT_ROUNDOFF``) relative error to the matmul's
    output, and the errors of the sequential matmuls of the longest path add up (first
    order): per decoder layer q/k/v, q k^T, attention x v, o, gate/up, down (6), plus the
    head: R = 6 layers + 1. A logit then moves by at most 2 u R |logit scale|, with the
    position's largest |logit| as the scale, and a logprob (logit minus logsumexp) by
    at most twice a logit's error."""
    layers = model.config.num_hidden_layers
    roundings = 6 * layers + 1
    scale = logits.abs().amax(dim=-1)
    return 2 * (2 * BF16_UNIT_ROUNDOFF * roundings) * scale


def test_a_bf16_mixed_step_keeps_float32_master_weights_and_logprobs_near_float32(
    base_model_dir: Path,
) -> None:
    fp32 = learner(base_model_dir)
    bf16 = learner(base_model_dir, precision="bf16-mixed")
    batch = BATCHES[0]
    samples = [s for g in batch.groups for s in g.samples]
    packed = pack(samples, [0.0] * len(samples))

    def logprobs(which: Learner) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=which is bf16):
            logits = which.model(
                input_ids=packed.input_ids, attention_mask=packed.attention_mask
            ).logits
        return token_logprobs(logits[:, :-1], packed.targets, 1.0), logits.float()[:, :-1]

    exact, logits = logprobs(fp32)
    approximate, bf16_logits = logprobs(bf16)
    assert bf16_logits.dtype == torch.float32 and logprobs(bf16)[0].dtype == torch.float32
    gap = (approximate - exact).abs() * packed.loss_mask
    bound = logprob_bound(fp32.model, logits)
    assert (gap <= bound).all(), f"largest gap / bound {(gap / bound).max():.3g}"
    assert gap.max() > 0  # bf16 did compute: float32 would give these exactly

    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    result_fp32, result_bf16 = fp32.step(batch, version=0), bf16.step(batch, version=0)
    # the trainer's figure: mean |trainer - behaviour| logprob, moved by at most the gap
    mean_bound = float((bound * packed.loss_mask).sum() / packed.loss_mask.sum())
    # and the step computed in bf16: float32 gives another figure
    assert 0 < abs(result_bf16.logprob_abs_diff - result_fp32.logprob_abs_diff) <= mean_bound
    # master weights, their gradients and AdamW's moments stay float32, and they moved
    for name, parameter in bf16.model.named_parameters():
        assert parameter.dtype == torch.float32, name
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name
    moments = bf16.optimizer.state_dict()["state"]
    assert all(m["exp_avg"].dtype == torch.float32 for m in moments.values())
    moved = max(
        (p.detach() - before[n]).abs().max().item() for n, p in bf16.model.named_parameters()
    )
    assert moved > 0.5 * BASE["lr"]  # Adam moves a trained entry by about lr


def test_two_ranks_train_in_bf16_mixed_with_gradient_checkpointing(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """FSDP2's MixedPrecisionPolicy (bf16 parameters in compute, float32 reduction) on
    gloo, with checkpointed layers (their recompute all-gathers again) and a held-out
    evaluation after the step (both ranks generate together): the step runs,
    the gathered checkpoint is float32 and trained, and the first step's logprob gap to
    the behaviour logprobs (taken at the base weights) is the float32 run's within the
    bf16 bound. Under the policy every parameter is bf16, so besides autocast's matmul
    inputs the embeddings, the norms' weights and the residual stream are rounded too:
    4 more roundings per layer and 2 more outside them than ``logprob_bound`` counts."""
    settings = {**BASE, "torch_threads": 1}
    mixed = {**settings, "precision": "bf16-mixed", "gradient_checkpointing": True}
    mixed |= {"eval_every": 1, "eval_items": 5, "eval_max_tokens": 4}
    (first,) = run_ranks(2, spec(base_model_dir, BATCHES[:1], tmp_path / "bf16", settings=mixed))
    (reference,) = run_ranks(
        2, spec(base_model_dir, BATCHES[:1], tmp_path / "fp32", settings=settings)
    )
    weights = load_model_state(tmp_path / "bf16" / "checkpoint")
    base = load_model_state(base_model_dir)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert max((weights[n] - base[n]).abs().max().item() for n in base) > 0.5 * BASE["lr"]
    moments = load_optimizer_state(tmp_path / "bf16" / "checkpoint")["state"]
    assert all(m["exp_avg"].dtype == torch.float32 for m in moments.values())
    evaluated = json.loads((tmp_path / "bf16" / "eval.json").read_text())
    assert evaluated["samples"] == 5 and 0.0 <= evaluated["mean_reward"] <= 1.0

    model = learner(base_model_dir).model
    samples = [s for g in BATCHES[0].groups for s in g.samples]
    packed = pack(samples, [0.0] * len(samples))
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
    layers = model.config.num_hidden_layers
    per_token = logprob_bound(model, logits[:, :-1]) * (10 * layers + 3) / (6 * layers + 1)
    mean_bound = float((per_token * packed.loss_mask).sum() / packed.loss_mask.sum())
    gap = abs(first["logprob_abs_diff"] - reference["logprob_abs_diff"])
    assert 0 < gap <= mean_bound  # bf16 did compute: float32 gives another figure


# gradient checkpointing ----------------------------------------------------------------


def saved_activation_bytes(model: torch.nn.Module, batch_index: int = 0) -> int:
    """Bytes the autograd graph keeps for backward during one training forward."""
    saved = 0

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    samples = [s for g in BATCHES[batch_index].groups for s in g.samples]
    packed = pack(samples, [0.0] * len(samples))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=packed.input_ids, attention_mask=packed.attention_mask)
    return saved


def test_gradient_checkpointing_is_on_and_gives_the_same_gradients(
    base_model_dir: Path,
) -> None:
    # lr 0: the step leaves the weights (and so the next comparison) alone; the
    # gradients stay on the parameters after it
    plain = learner(base_model_dir, lr=0.0)
    checkpointed = learner(base_model_dir, lr=0.0, gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    assert not plain.model.is_gradient_checkpointing
    # it changes what the forward keeps: each layer's input instead of its activations
    assert saved_activation_bytes(checkpointed.model) < saved_activation_bytes(plain.model) / 2

    batch = make_batch(0, [[30, 41, 18, 25], [22, 37, 15, 28]], seed=5)
    plain.step(batch, version=0)
    checkpointed.step(batch, version=0)
    for (name, a), (_, b) in zip(
        plain.model.named_parameters(), checkpointed.model.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        # the recompute runs the same kernels on the same inputs as the first forward:
        # the same floats, up to a few roundings if a kernel picked another reduction
        # order (bounded relative to the tensor's largest entry, as in the FSDP tests)
        tolerance = 16 * torch.finfo(torch.float32).eps * a.grad.abs().max()
        assert (a.grad - b.grad).abs().max() <= tolerance, name


def test_two_ranks_with_checkpointed_layers_step_as_one_process_without(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """Under FSDP2 the recompute all-gathers each layer again in the backward: the step
    is still the one-process step (without checkpointing), up to float summation order."""
    settings = {**BASE, "torch_threads": 1}
    checkpointed = {**settings, "gradient_checkpointing": True}
    ranks = run_ranks(2, spec(base_model_dir, BATCHES, tmp_path / "ranks", settings=checkpointed))
    alone = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "alone", settings=settings))
    assert_same_results(ranks, alone, tmp_path / "alone")
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")


# held-out evaluation ---------------------------------------------------------------------


def test_the_eval_set_is_the_task_s_held_out_split(base_model_dir: Path) -> None:
    settings = TrainerSettings(eval_every=1, eval_items=5)
    eval_set = EvalSet.from_settings(settings, seed=3)
    source = get_task_source("arithmetic", seed=3)
    assert eval_set.items == source.items("eval")[:5]
    train_ids = {item.task_id for item in source.items("train")}
    assert not any(item.task_id in train_ids for item in eval_set.items)
    policy = learner(base_model_dir, eval_every=1, eval_items=5)
    evaluated = policy.evaluate()
    assert evaluated.samples == 5 and 0.0 <= evaluated.mean_reward <= 1.0
    assert policy.model.training  # back to training after the greedy answers


SCORED: list[tuple[str, str]] = []


def recording_reward(completion: str, reference: str) -> float:
    """A reward that records what it scores; its value is known from its input."""
    SCORED.append((completion, reference))
    return len(completion) % 3 / 2


def test_evaluation_scores_each_greedy_completion_once_against_its_reference(
    base_model_dir: Path, tmp_path: Path
) -> None:
    rows = [
        {"prompt": "What is " + " + ".join(["1"] * (n + 1)) + "?", "reference": f"ref-{n}"}
        for n in range(40)
    ]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = f"{data}?reward={__name__}:recording_reward&eval_fraction=0.5"
    items = get_task_source(task).items("eval")
    assert len(items) > 16  # more than one generation batch
    policy = learner(base_model_dir, eval_every=1, eval_task=task, eval_items=0, eval_batch_size=16)
    SCORED.clear()
    evaluated = policy.evaluate()
    # every held-out prompt (prompts of differing lengths: left-padded together) scored
    # once, in order, against its own reference; the mean is the reward's
    assert [reference for _, reference in SCORED] == [item.reference for item in items]
    assert evaluated.samples == len(items)
    values = [len(text) % 3 / 2 for text, _ in SCORED]
    assert evaluated.mean_reward == pytest.approx(sum(values) / len(values))
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    for text, _ in SCORED:
        # the completion alone, within the budget
        assert "What is" not in text
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 16


def full_marks(completion: str, reference: str) -> float:
    return 1.0


def test_several_eval_tasks_are_each_scored_by_their_own_reward_and_reported_apart(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """Two tasks of different sizes and rewards, ``eval_items`` of each: each task's
    score is its own reward's mean over its own prompts, and the overall figure is the
    mean of the two (a task with more prompts does not weigh more)."""
    tasks = []
    for name, count, reward in (("sums", 40, "recording_reward"), ("echo", 12, "full_marks")):
        rows = [{"prompt": f"{name} {n}?", "reference": f"{name}-{n}"} for n in range(count)]
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tasks.append(f"{data}?reward={__name__}:{reward}&eval_fraction=0.5")
    policy = learner(
        base_model_dir, eval_every=1, eval_task=",".join(tasks), eval_items=4, eval_batch_size=3
    )
    SCORED.clear()
    evaluated = policy.evaluate()
    sums_items = get_task_source(tasks[0]).items("eval")[:4]
    assert [reference for _, reference in SCORED] == [item.reference for item in sums_items]
    sums = sum(len(text) % 3 / 2 for text, _ in SCORED) / 4
    assert evaluated.samples == 8
    assert evaluated.by_task == {tasks[0]: pytest.approx(sums), tasks[1]: 1.0}
    assert evaluated.mean_reward == pytest.approx((sums + 1.0) / 2)


@pytest.mark.slow
async def test_an_embedded_run_records_evaluations_and_rates_in_metrics_jsonl(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = 5
    for name, value in {
        "SF_TRAINER_EVAL_ITEMS": "8",
        "SF_TRAINER_WARMUP_STEPS": "2",
        "SF_TRAINER_LR_SCHEDULE": "linear",
    }.items():
        monkeypatch.setenv(name, value)
    run = small_embedded_run(
        run_id, tmp_path, base_model_dir, steps, nats_url=nats_url, eval_every=2
    )
    summary = await run.run()
    assert summary.status == "finished", summary
    metrics = (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()
    lines = [json.loads(line) for line in metrics]
    step_records = [r for r in lines if r["type"] == "train.metrics"]
    evals = [r for r in lines if r["type"] == "train.eval"]
    assert [r["step"] for r in step_records] == [1, 2, 3, 4, 5]
    # the base model before the first step, every 2 steps, and after the last
    assert [(r["step"], r["version"]) for r in evals] == [(0, 0), (2, 2), (4, 4), (5, 5)]
    assert all(r["samples"] == 8 and r["task"] == "arithmetic" for r in evals)
    assert all(0.0 <= r["mean_reward"] <= 1.0 for r in evals)
    assert summary.eval_first is not None and summary.eval_last is not None
    assert (summary.eval_first["step"], summary.eval_last["step"]) == (0, steps)
    assert summary.eval_first["mean_reward"] == evals[0]["mean_reward"]
    assert summary.eval_last["mean_reward"] == evals[-1]["mean_reward"]
    settings = TrainerSettings(lr=run.config.lr, steps=steps, warmup_steps=2, lr_schedule="linear")
    assert [r["lr"] for r in step_records] == pytest.approx(
        [lr_at(s, settings) for s in range(steps)]
    )
