"""The per-step metrics practitioners plot (issue 17 item 3): the policy's entropy at the
trained tokens, read off the log-softmax the logprobs come from (whole logits or chunks,
checked against the full softmax), and the batch figures a step reports (rewards,
lengths, staleness, completions cut at their token budget)."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics

import msgspec
import pytest
import torch

import sf_trainer.grpo
from seamlessflow.protocol import (
    SampleGroup,
    TrainBatch,
    TrainSample,
    TrainStepMetrics,
    TurnRecorded,
    decode,
)
from sf_trainer.grpo import chunked_token_logprobs, row_entropy, token_logprobs
from sf_trainer.logprobs import target_logprobs
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import train_step
from sf_trajectory.grouping import branch
from tests.support.tiny_models import gamma, tiny_model

FP32_EPS = torch.finfo(torch.float32).eps

FLOAT64_ENTROPY = 1e-9
"""Relative to the entropy, what float64 may change between two computations of it:
each is a sum of V = 512 terms (and the logits a dot product over H = 64) rounded at
2**-53, so they differ by ~1e-13 of the entropy's magnitude; 1e-9 leaves 10**4 of
headroom and is far below what a wrong position or temperature changes (> 1e-3)."""


def softmax_entropy(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The definition, in float64: H = -sum p log p, p = softmax(logits / T), T = 1 where
    the token was greedy (T = 0), as its logprob is taken."""
    scale = torch.where(temperatures > 0, temperatures, 1.0).double().unsqueeze(-1)
    p = torch.softmax(logits.double() / scale, dim=-1)
    return -(p * torch.log(p)).sum(-1)


def mixed_temperatures(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Greedy, 0.7, 1.0 and 1.3, cycling over the positions."""
    cycle = torch.tensor([0.0, 0.7, 1.0, 1.3], dtype=dtype)
    n = math.prod(shape)
    return cycle.repeat(n // 4 + 1)[:n].reshape(shape)


# the entropy alone ---------------------------------------------------------------------


def test_row_entropy_is_the_softmax_entropy_in_any_number_of_rows_at_a_time() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 13, generator=generator, dtype=torch.float64) * 3
    expected = softmax_entropy(logits, torch.ones(2, 7))
    for rows in (1, 3, 14, 100):
        got = row_entropy(torch.log_softmax(logits, -1), rows=rows)
        assert got.shape == (2, 7)
        assert torch.allclose(got, expected, rtol=FLOAT64_ENTROPY, atol=0)
    # a token of probability 0 (a -inf logit) adds 0: two equal tokens left, H = log 2;
    # NaN logits are not hidden
    masked = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, float("nan"), 0.0]])
    got = row_entropy(torch.log_softmax(masked, -1))
    assert got[0].item() == pytest.approx(math.log(2)) and got[1].isnan()


def test_the_heads_entropy_in_float32_is_the_softmax_entropy_within_its_roundings() -> None:
    """Whole logits and chunks (float32, as the trainer runs) against float64 exact.
    The float32 log-probabilities are off by at most e_l = 2 delta + 8 eps (the row's
    largest |z / T| + log V), delta the largest scaled logit error of the GEMM (gamma_H
    |h| |W| / T) (the bound of test_chunked_logprobs_head). H = -sum e^l l moves by sum p |l +
    1| e_l <= (H + 1) e_l; rounding e^l and -p log p adds (H + 1) 2 eps, summing the V
    non-negative terms gamma_V H."""
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab, chunk = 53, 32, 97, 7
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    temperatures = mixed_temperatures((tokens,), torch.float32)

    whole: list[torch.Tensor] = []
    chunked: list[torch.Tensor] = []
    token_logprobs(hidden @ weight.T, targets, temperatures, whole)
    chunked_token_logprobs(hidden, weight, targets, temperatures, chunk, chunked)

    z = hidden.double() @ weight.double().T
    expected = softmax_entropy(z, temperatures)
    scale = torch.where(temperatures > 0, temperatures, 1.0).double()
    delta = (gamma(hidden_size) * hidden.double().abs() @ weight.double().abs().T).amax(-1)
    delta = delta / scale
    row_size = (z.abs().amax(-1) / scale) + math.log(vocab)
    log_error = 2 * delta + 8 * FP32_EPS * row_size
    bound = (expected + 1) * (log_error + 2 * FP32_EPS) + gamma(vocab) * expected
    for got in (whole[0], chunked[0]):
        assert got.dtype == torch.float32 and got.shape == (tokens,)
        assert ((got.double() - expected).abs() <= bound).all()
    # the temperature matters far beyond the bound: the same rows at T = 1
    at_one = softmax_entropy(z, torch.ones(tokens))
    changed = (temperatures != 1) & (temperatures > 0)  # greedy rows are at T = 1
    assert ((at_one - expected)[changed].abs() > 100 * bound[changed]).all()


# the trainer's path: a tiny model, whole logits and chunks -----------------------------


@pytest.mark.parametrize("chunk", [0, 3, 1024], ids=["whole", "chunks", "one-chunk"])
def test_target_entropy_is_the_full_softmax_entropy_at_each_tokens_temperature(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With and without ``needed`` (the trained positions), under autograd (checkpointed
    chunks are recomputed in the backward): the entropy at a computed position is the
    model's full softmax at that token's temperature, 0 at the others; it is taken once
    per chunk (the backward's recomputation does not take it again); and the logprobs
    and gradients are bit for bit those computed without it."""
    model = tiny_model(tied=False).double()
    ids = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(2))
    needed = torch.zeros(3, 9, dtype=torch.bool)
    needed[0, 6:] = needed[1, 4:7] = needed[2, 8] = True
    temperatures = mixed_temperatures((3, 9), torch.float64)
    with torch.no_grad():
        expected = softmax_entropy(model(input_ids=ids).logits[:, :-1], temperatures)

    taken: list[int] = []
    row_entropy_of = sf_trainer.grpo.row_entropy

    def counting(log_probs: torch.Tensor) -> torch.Tensor:
        taken.append(log_probs.shape[:-1].numel())
        return row_entropy_of(log_probs)

    monkeypatch.setattr(sf_trainer.grpo, "row_entropy", counting)

    def run(
        mask: torch.Tensor | None, with_entropy: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        entropy: list[torch.Tensor] | None = [] if with_entropy else None
        logprobs = target_logprobs(
            model, ids, torch.ones_like(ids), ids[:, 1:], temperatures, chunk,
            contextlib.nullcontext, needed=mask, entropy=entropy,
        )  # fmt: skip
        (logprobs * needed).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), entropy or [], grads

    for mask in (needed, None):
        computed = torch.ones_like(needed) if mask is None else needed
        plain, _, plain_grads = run(mask, with_entropy=False)
        taken.clear()
        logprobs, entropy, grads = run(mask, with_entropy=True)
        assert len(entropy) == 1 and entropy[0].shape == (3, 9)
        assert not entropy[0].requires_grad and entropy[0].dtype == torch.float64
        assert (entropy[0][~computed] == 0).all()
        assert torch.allclose(
            entropy[0][computed], expected[computed], rtol=FLOAT64_ENTROPY, atol=0
        )
        rows = int(computed.sum())
        # once per chunk (whole logits: one), the backward's recomputation included
        size = chunk or rows
        assert taken == [min(size, rows - start) for start in range(0, rows, size)]
        assert torch.equal(logprobs, plain)
        assert grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


# a step's figures ------------------------------------------------------------------------

CURRENT_VERSION = 3


def sample(
    name: str,
    mask: list[int],
    reward: float,
    versions: list[int],
    finish_reason: str,
    temperatures: list[float] | None = None,
) -> TrainSample:
    """Token ids from the name (distinct per sample); ``versions``, one per trained
    token, placed where the mask is 1."""
    trained = iter(versions)
    seed = sum(map(ord, name))
    return TrainSample(
        session_id=name,
        token_ids=[(seed * 31 + 7 * i) % 500 + 5 for i in range(len(mask))],
        loss_mask=mask,
        behaviour_logprobs=[-1.5 if m else 0.0 for m in mask],
        versions=[next(trained) if m else -1 for m in mask],
        reward=reward,
        temperatures=temperatures or [],
        finish_reason=finish_reason,
    )


def metrics_batch() -> TrainBatch:
    """Single- and multi-turn samples (a tool result between two completions), one
    without recorded temperatures, one greedy turn; two cut at their token budget."""
    samples = [
        sample("a", [0, 0, 0, 1, 1, 1, 1], 1.0, [2, 2, 1, 1], "length",
               [1.0] * 3 + [0.7] * 4),
        sample("b", [0, 0, 1, 1, 0, 0, 0, 1, 1], 0.0, [3, 3, 3, 3], "stop",
               [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.3, 1.3]),
        sample("c", [0, 0, 0, 0, 0, 1], 0.5, [0], ""),
        sample("d", [0, 0, 0, 0, 1, 1, 1, 1, 1, 1], 0.25, [3, 3, 3, 2, 2, 2], "length",
               [1.0] * 4 + [1.3] * 6),
    ]  # fmt: skip
    return TrainBatch(
        batch_index=0,
        groups=[
            SampleGroup(group_id="g0", task_id="t0", samples=samples[:2]),
            SampleGroup(group_id="g1", task_id="t1", samples=samples[2:]),
        ],
    )


def direct_entropy_mean(model: torch.nn.Module, batch: TrainBatch, unrecorded: float) -> float:
    """Each sample alone through the model, the full softmax's entropy at each trained
    token (predicted one position earlier) at its temperature, averaged over them."""
    entropies = []
    for s in (s for g in batch.groups for s in g.samples):
        temperatures = torch.tensor(s.temperatures or [unrecorded] * len(s.token_ids))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1]
        h = softmax_entropy(logits, temperatures[1:])
        entropies += [h[t - 1].item() for t, m in enumerate(s.loss_mask) if m]
    return sum(entropies) / len(entropies)


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole", "chunks"])
def test_a_step_reports_the_batch_figures_and_the_policys_entropy(chunk: int) -> None:
    """Float64 model: the entropy mean equals the definition computed sample by sample
    (padding and micro-batches change only summation order); the other figures are
    exact functions of the batch."""
    model = tiny_model(tied=False).double()
    before = copy.deepcopy(model)
    settings = TrainerSettings(
        lr=1e-3, micro_batch_tokens=20, logprob_chunk_tokens=chunk, temperature=0.9
    )
    batch = metrics_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    result = train_step(model, optimizer, batch, settings, CURRENT_VERSION)

    rewards = [1.0, 0.0, 0.5, 0.25]
    assert result.mean_reward == statistics.fmean(rewards)
    assert result.reward_std == pytest.approx(statistics.pstdev(rewards), rel=1e-15)
    assert (result.reward_min, result.reward_max) == (0.0, 1.0)
    # generated (loss mask 1) and not generated (prompt, tool result) tokens per sample
    assert result.completion_tokens_mean == (4 + 4 + 1 + 6) / 4
    assert result.completion_tokens_max == 6
    assert result.prompt_tokens_mean == (3 + 5 + 5 + 4) / 4
    # trained tokens' gaps to version 3: a 1,1,2,2; b 0 x4; c 3; d 0,0,0,1,1,1
    assert result.staleness_histogram == {0: 7, 1: 5, 2: 2, 3: 1}
    assert result.mean_staleness == (5 * 1 + 2 * 2 + 1 * 3) / 15
    assert result.completions_truncated_fraction == 2 / 4
    expected = direct_entropy_mean(before, batch, settings.temperature)
    assert result.entropy_mean == pytest.approx(expected, rel=FLOAT64_ENTROPY)
    assert result.grad_norm > 0


def test_an_empty_batch_reports_zeros() -> None:
    model = tiny_model(tied=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    result = train_step(model, optimizer, TrainBatch(batch_index=0, groups=[]),
                        TrainerSettings(), CURRENT_VERSION)  # fmt: skip
    assert (result.reward_std, result.reward_min, result.reward_max) == (0.0, 0.0, 0.0)
    assert (result.completion_tokens_mean, result.completion_tokens_max) == (0.0, 0)
    assert (result.prompt_tokens_mean, result.entropy_mean) == (0.0, 0.0)
    assert (result.mean_staleness, result.completions_truncated_fraction) == (0.0, 0.0)


# where the figures come from and go --------------------------------------------------


def test_a_sample_carries_how_its_last_generation_ended() -> None:
    def turn(index: int, prompt: list[int], completion: list[int], reason: str) -> TurnRecorded:
        return TurnRecorded(
            session_id="s", turn_index=index, request_id=f"r{index}", engine_id="e",
            prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion),
            versions=[0] * len(completion), finish_reason=reason, completion_text="",
        )  # fmt: skip

    first = turn(0, [1, 2], [3, 4], "length")
    second = turn(1, [1, 2, 3, 4, 9], [5], "stop")
    assert branch([first, second], second)[0].finish_reason == "stop"
    assert branch([first, second], first)[0].finish_reason == "length"


def test_older_messages_decode_with_the_new_figures_at_their_defaults() -> None:
    """A TrainStepMetrics or TrainSample from a build before these fields still decodes."""
    metrics = TrainStepMetrics(
        step=1, version=1, batch_index=0, mean_reward=0.5, loss=0.1, clip_fraction=0.0,
        samples=2, tokens_generated=3, tokens_trained=3, max_staleness=0,
        step_seconds=0.1, wait_seconds=0.0, publish_seconds=0.0,
    )  # fmt: skip
    new = ("grad_norm", "reward_std", "reward_min", "reward_max", "completion_tokens_mean",
           "completion_tokens_max", "prompt_tokens_mean", "entropy_mean", "mean_staleness",
           "completions_truncated_fraction")  # fmt: skip
    old = {k: v for k, v in msgspec.to_builtins(metrics).items() if k not in new}
    decoded = decode(msgspec.json.encode(old), TrainStepMetrics)
    assert all(getattr(decoded, name) == 0 for name in new)
    old_sample = {"session_id": "s", "token_ids": [1], "loss_mask": [0],
                  "behaviour_logprobs": [0.0], "versions": [-1], "reward": 0.0}  # fmt: skip
    sample = msgspec.json.decode(msgspec.json.encode(old_sample), type=TrainSample)
    assert sample.finish_reason == ""


def test_the_live_trainer_idle_share_is_waiting_over_the_trainers_time() -> None:
    """The live table's "trainer idle": a trainer that waited 3 s for each batch and
    trained + published for 1 s is idle 75% of the time; one never waiting, 0%."""
    from sf_app.run.report import trainer_idle

    def step(wait: float, train: float, publish: float) -> TrainStepMetrics:
        return TrainStepMetrics(step=1, version=1, batch_index=0, mean_reward=0.0, loss=0.0,
                                clip_fraction=0.0, samples=1, tokens_generated=1,
                                tokens_trained=1, max_staleness=0, step_seconds=train,
                                wait_seconds=wait, publish_seconds=publish)  # fmt: skip

    assert trainer_idle([step(3.0, 0.75, 0.25), step(3.0, 0.5, 0.5)]) == 0.75
    assert trainer_idle([step(0.0, 1.0, 0.1)]) == 0.0
    assert trainer_idle([]) == 0.0


def test_a_steps_record_carries_every_figure_of_its_result() -> None:
    """``metrics_of``: each StepResult field lands in the TrainStepMetrics field of its
    name, next to the step's place, timings and published weights."""
    import dataclasses

    from seamlessflow.protocol import WeightManifest, encode
    from sf_trainer.step import metrics_of

    model = tiny_model(tied=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    result = train_step(model, optimizer, metrics_batch(), TrainerSettings(), CURRENT_VERSION)
    manifest = WeightManifest(
        version=4, kind="delta", transport="object", location="weights-4", payload_bytes=10,
        bucket_bytes=10, digest="xxh3-128", bucket_digests=[], state_bytes=40, state_digest="",
        layout=[],
    )  # fmt: skip
    record = metrics_of(
        result, policy="solver", step=4, version=4, batch_index=7, manifest=manifest,
        wait_seconds=0.5, step_seconds=1.5, publish_seconds=0.25, lent_thread_seconds=0.125,
    )  # fmt: skip
    for name, value in dataclasses.asdict(result).items():
        assert getattr(record, name) == value, name
    assert (record.policy, record.step, record.version, record.batch_index) == ("solver", 4, 4, 7)
    assert (record.wait_seconds, record.step_seconds, record.publish_seconds,
            record.lent_thread_seconds) == (0.5, 1.5, 0.25, 0.125)  # fmt: skip
    assert (record.weights_kind, record.weights_payload_bytes, record.weights_state_bytes) == (
        "delta",
        10,
        40,
    )
    # a record survives the wire as it was made
    assert decode(encode(record), TrainStepMetrics) == record
