"""One optimizer step on a TrainBatch (runs in a worker thread; pure torch).

With several ranks (``sf_trainer.distributed``) every rank runs :func:`train_step` on
the same batch: each trains its share of the samples, in the same number of
forward/backward passes, and the ranks' gradients are summed. The loss is normalised
by whole-batch quantities on every rank (``sf_trainer.losses.BatchTotals``), so the
step is the one a single process would take on the whole batch (up to float summation
order).

A step (:func:`train_step`, the learner's part of one step: the whole step is
``TrainerService._step``): shaped rewards -> advantages (``SF_TRAINER_ADVANTAGE``) ->
for each micro-batch, policy (and, with ``SF_TRAINER_KL_COEF`` > 0, reference) logprobs,
each token's at the temperature it was sampled at (``TrainSample.temperatures``), from
the final hidden states in chunks of ``SF_TRAINER_LOGPROB_CHUNK_TOKENS`` (with the
policy's entropy at the trained tokens, a metric) -> loss (``SF_TRAINER_LOSS``, with its
own settings) -> backward; then one clipped optimizer step; then the step's figures
(:func:`step_result`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, astuple, dataclass

import torch

from seamlessflow.protocol import (
    UNRECORDED_TEMPERATURE,
    TrainBatch,
    TrainSample,
    TrainStepMetrics,
    WeightManifest,
)
from sf_trainer.advantages import batch_advantages
from sf_trainer.distributed import TrainGroup, as_float, forward_precision, partition_by_tokens
from sf_trainer.logprobs import target_logprobs
from sf_trainer.losses import BatchTotals, LossInputs, LossOutput, chosen_loss
from sf_trainer.memory import AUTO_BOUNDS
from sf_trainer.settings import TrainerSettings


@dataclass
class StepResult:
    loss: float
    mean_reward: float
    clip_fraction: float
    samples: int
    tokens_generated: int
    tokens_trained: int
    max_staleness: int
    staleness_histogram: dict[int, int]
    """Trained tokens by how many versions behind the trained policy they were made."""
    logprob_abs_diff: float
    """Mean |trainer - engine| logprob over trained tokens (mismatch + staleness)."""
    truncated_fraction: float
    grad_norm: float
    """Global gradient norm before clipping."""
    kl_mean: float
    """Mean k3 KL to the reference model over trained tokens (0: no KL term)."""
    reward_std: float
    """Standard deviation of the samples' rewards (population: over the batch's samples,
    divided by their count), as ``mean_reward`` before any shaping."""
    reward_min: float
    """Lowest sample reward (0 for an empty batch)."""
    reward_max: float
    """Highest sample reward (0 for an empty batch)."""
    completion_tokens_mean: float
    """Mean over samples of the tokens the policy generated and is trained on (loss mask
    1), over all turns of a multi-turn sample."""
    completion_tokens_max: int
    """Most such tokens of one sample."""
    prompt_tokens_mean: float
    """Mean over samples of the tokens the policy did not generate (loss mask 0): the
    prompt and, in a multi-turn sample, the tool results and other context between its
    turns (and a constrained turn's tokens, which are never trained)."""
    entropy_mean: float
    """Mean over trained tokens of the entropy (nats) of the policy's next-token
    distribution, at each token's sampling temperature (1 for a greedy token, like its
    logprob), under the weights before this step's update."""
    mean_staleness: float
    """Trained tokens' mean version gap (``staleness_histogram`` weighted by tokens)."""
    completions_truncated_fraction: float
    """Fraction of the samples whose last generation stopped at its token budget
    (``TrainSample.finish_reason`` ``length``)."""
    lr: float = 0.0
    """The learning rate the optimizer step used."""


def metrics_of(
    result: StepResult,
    *,
    policy: str,
    step: int,
    version: int,
    batch_index: int,
    manifest: WeightManifest,
    wait_seconds: float,
    step_seconds: float,
    publish_seconds: float,
    lent_thread_seconds: float,
) -> TrainStepMetrics:
    """A step's durable record: every figure of ``result`` (each ``StepResult`` field is
    the ``TrainStepMetrics`` field of that name), where the step stands in the run, how
    long its parts took and the weights it published (``manifest``)."""
    return TrainStepMetrics(
        **asdict(result),
        policy=policy,
        step=step,
        version=version,
        batch_index=batch_index,
        wait_seconds=wait_seconds,
        step_seconds=step_seconds,
        publish_seconds=publish_seconds,
        lent_thread_seconds=lent_thread_seconds,
        weights_kind=manifest.kind,
        weights_payload_bytes=manifest.payload_bytes,
        weights_state_bytes=manifest.state_bytes,
    )


@dataclass
class PackedSamples:
    """Right-padded tensors of a list of samples, shifted for next-token prediction."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T-1]: token t+1 predicted at position t
    loss_mask: torch.Tensor  # [B, T-1]
    old_logprobs: torch.Tensor  # [B, T-1]
    temperatures: torch.Tensor  # [B, T-1]: each target's sampling temperature (0 = greedy)
    advantages: torch.Tensor  # [B, 1]

    def to(self, device: torch.device) -> PackedSamples:
        return PackedSamples(**{name: value.to(device) for name, value in vars(self).items()})


def pack(
    samples: list[TrainSample], advantages: list[float], unrecorded_temperature: float = 1.0
) -> PackedSamples:
    """``unrecorded_temperature``: for tokens without a recorded temperature
    (``UNRECORDED_TEMPERATURE``, or a sample without ``temperatures``)."""
    length = max(len(s.token_ids) for s in samples)
    batch = len(samples)
    ids = torch.zeros(batch, length, dtype=torch.long)
    attention = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.float32)
    old = torch.zeros(batch, length, dtype=torch.float32)
    temperatures = torch.full((batch, length), UNRECORDED_TEMPERATURE, dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        ids[row, :n] = torch.tensor(sample.token_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        old[row, :n] = torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)
        if sample.temperatures:
            temperatures[row, :n] = torch.tensor(sample.temperatures, dtype=torch.float32)
    temperatures = temperatures.masked_fill(temperatures < 0, unrecorded_temperature)
    return PackedSamples(
        input_ids=ids,
        attention_mask=attention,
        targets=ids[:, 1:],
        # a token at position t is predicted by position t-1; position 0 is never trained
        loss_mask=mask[:, 1:],
        old_logprobs=old[:, 1:],
        temperatures=temperatures[:, 1:],
        advantages=torch.tensor(advantages, dtype=torch.float32).unsqueeze(-1),
    )


def micro_batches(samples: list[TrainSample], token_budget: int) -> list[list[int]]:
    """Indices of samples grouped so that rows x longest row stays within the budget."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        n = len(samples[index].token_ids)
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class MicroBatch:
    """The samples of one forward/backward pass."""

    indices: list[int]
    trained: bool = True
    """False for a padding pass: its loss mask is zeroed (zero loss, zero gradient)."""


def trained_token_count(samples: list[TrainSample]) -> int:
    """Tokens the loss is taken over (loss mask 1)."""
    return sum(sum(s.loss_mask) for s in samples)


def plan_micro_batches(
    samples: list[TrainSample], world_size: int, token_budget: int
) -> list[list[MicroBatch]]:
    """Each rank's forward/backward passes for one step (index = rank).

    The samples are split across ranks by token count (``partition_by_tokens``), then
    each rank's share is grouped into micro-batches within the token budget. Every rank
    gets the same number of passes: FSDP all-gathers in each forward and reduce-scatters
    in each backward, so a rank that stopped early would leave the others waiting
    forever. Shorter plans are padded with untrained passes over the batch's shortest
    sample.
    """
    lengths = [len(s.token_ids) for s in samples]
    plans: list[list[MicroBatch]] = []
    for part in partition_by_tokens(lengths, world_size):
        share = [samples[i] for i in part]
        plans.append(
            [MicroBatch([part[i] for i in group]) for group in micro_batches(share, token_budget)]
        )
    passes = max(len(plan) for plan in plans)
    if passes == 0:
        return plans
    shortest = min(range(len(samples)), key=lambda i: (lengths[i], i))
    padding = MicroBatch([shortest], trained=False)
    return [plan + [padding] * (passes - len(plan)) for plan in plans]


@dataclass
class PassSums:
    """What the passes of a step add up (one rank's, then all ranks' summed)."""

    loss: float = 0.0
    clipped: float = 0.0
    truncated: float = 0.0
    abs_diff: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0

    def add(self, output: LossOutput, logprobs: torch.Tensor, packed: PackedSamples,
            entropy: torch.Tensor) -> None:  # fmt: skip
        mask = packed.loss_mask
        self.loss += float(output.loss.detach())
        self.clipped += output.clipped_tokens
        self.truncated += output.truncated_tokens
        self.kl += output.kl_sum
        self.abs_diff += float(((logprobs.detach() - packed.old_logprobs).abs() * mask).sum())
        self.entropy += float((entropy * mask).sum())

    def summed_over(self, group: TrainGroup) -> PassSums:
        return PassSums(*group.all_reduce_sum(list(astuple(self))))


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    settings: TrainerSettings,
    current_version: int,
    group: TrainGroup | None = None,
    reference: torch.nn.Module | None = None,
) -> StepResult:
    """One optimizer step on ``batch``; every rank of ``group`` calls it with the same
    batch. The metrics are the whole batch's (summed over ranks). ``reference`` is the
    frozen reference model (sharded like ``model``), required when ``kl_coef`` > 0."""
    if settings.kl_coef > 0 and reference is None:
        raise ValueError("SF_TRAINER_KL_COEF > 0 needs the reference model")
    group = group or TrainGroup(device=torch.device(settings.device))
    samples = [s for sample_group in batch.groups for s in sample_group.samples]
    advantages = batch_advantages(batch.groups, settings)
    # every rank holds the whole batch, so these are global counts without a collective
    totals = BatchTotals.of(s.loss_mask for s in samples)
    loss, loss_settings = chosen_loss(settings.loss)

    optimizer.zero_grad(set_to_none=True)
    sums = PassSums()
    # 0 (automatic) is resolved by the Learner from the memory it finds; a step run
    # without one (tools, tests) takes the largest automatic budget, the old default
    budget = settings.micro_batch_tokens or AUTO_BOUNDS[1]
    plan = plan_micro_batches(samples, group.world_size, budget)
    for micro in plan[group.rank]:
        packed = pack(
            [samples[i] for i in micro.indices],
            [advantages[i] for i in micro.indices],
            unrecorded_temperature=settings.temperature,
        ).to(group.device)
        if not micro.trained:
            packed.loss_mask.zero_()
        entropy: list[torch.Tensor] = []
        logprobs = _logprobs(model, packed, settings, group, entropy)
        inputs = LossInputs(
            logprobs=logprobs,
            behaviour_logprobs=packed.old_logprobs,
            advantages=packed.advantages,
            mask=packed.loss_mask,
            reference_logprobs=(
                None
                if reference is None
                else _reference_logprobs(reference, packed, settings, group)
            ),
        )
        output = loss(inputs, loss_settings, totals, settings.kl_coef)
        output.loss.backward()
        sums.add(output, logprobs, packed, entropy[0])
    sums = sums.summed_over(group)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    optimizer.step()
    lr = float(optimizer.param_groups[0]["lr"])
    return step_result(samples, sums, totals, as_float(grad_norm), lr, current_version)


def step_result(
    samples: list[TrainSample],
    sums: PassSums,
    totals: BatchTotals,
    grad_norm: float,
    lr: float,
    current_version: int,
) -> StepResult:
    """The step's figures: the passes' sums over the batch's totals, and the batch's own
    (every rank holds the whole batch: its per-sample figures need no collective)."""
    total_tokens = trained_token_count(samples)
    versions = [v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    histogram = Counter(current_version - v for v in versions)
    rewards = [s.reward for s in samples]
    mean_reward = sum(rewards) / max(len(samples), 1)
    completion = [sum(s.loss_mask) for s in samples]
    prompt = [len(s.token_ids) - n for s, n in zip(samples, completion, strict=True)]
    return StepResult(
        loss=sums.loss,
        mean_reward=mean_reward,
        clip_fraction=sums.clipped / totals.tokens,
        samples=len(samples),
        tokens_generated=total_tokens,
        tokens_trained=total_tokens,
        max_staleness=current_version - min(versions) if versions else 0,
        staleness_histogram=dict(sorted(histogram.items())),
        logprob_abs_diff=sums.abs_diff / totals.tokens,
        truncated_fraction=sums.truncated / totals.tokens,
        grad_norm=grad_norm,
        kl_mean=sums.kl / totals.tokens,
        reward_std=math.sqrt(sum((r - mean_reward) ** 2 for r in rewards) / max(len(samples), 1)),
        reward_min=min(rewards, default=0.0),
        reward_max=max(rewards, default=0.0),
        completion_tokens_mean=sum(completion) / max(len(samples), 1),
        completion_tokens_max=max(completion, default=0),
        prompt_tokens_mean=sum(prompt) / max(len(samples), 1),
        entropy_mean=sums.entropy / totals.tokens,
        mean_staleness=sum(gap * n for gap, n in histogram.items()) / max(len(versions), 1),
        completions_truncated_fraction=(
            sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1)
        ),
        lr=lr,
    )


def _reference_logprobs(
    reference: torch.nn.Module,
    packed: PackedSamples,
    settings: TrainerSettings,
    group: TrainGroup,
) -> torch.Tensor:
    """The targets' logprobs under the frozen reference model, in the policy's precision
    and at each token's sampling temperature like the policy's. Every pass runs it, the
    padding passes too: a sharded reference all-gathers in its forward like the policy."""
    with torch.no_grad():
        return _logprobs(reference, packed, settings, group)


def _logprobs(
    model: torch.nn.Module,
    packed: PackedSamples,
    settings: TrainerSettings,
    group: TrainGroup,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The targets' logprobs, float32, chunked by ``logprob_chunk_tokens``
    (``sf_trainer.logprobs``), the forward in the step's precision; only the trained
    positions' (the loss mask's), 0 elsewhere: every loss and metric masks the rest.
    ``entropy``: receives the next-token distributions' entropies at those positions
    (``target_logprobs``)."""
    return target_logprobs(
        model,
        packed.input_ids,
        packed.attention_mask,
        packed.targets,
        packed.temperatures,
        settings.logprob_chunk_tokens,
        lambda: forward_precision(settings.precision == "bf16-mixed", group),
        needed=packed.loss_mask > 0,
        entropy=entropy,
    )
