"""TrainBatches of random tokens for the trainer tests: ``make_batch``, whose every
group's rewards differ, so every sample carries a learning signal, and ``big_batch``, of
real size (ids of a 150k vocabulary, float32 behaviour logprobs), for the tests of the
batches' encoding and delivery; and ``fields_of``, a record's fields as keyword
arguments (to build it again with one of them changed)."""

from __future__ import annotations

import random

import numpy as np

from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample


def make_batch(batch_index: int, group_lengths: list[list[int]], seed: int) -> TrainBatch:
    """One group per entry of ``group_lengths``, one sample per length: a third prompt
    (untrained), the rest completion with behaviour logprobs in [-4, -0.5]."""
    rng = random.Random(seed)
    groups = []
    for g, lengths in enumerate(group_lengths):
        samples = []
        for s, length in enumerate(lengths):
            prompt = max(1, length // 3)
            completion = length - prompt
            samples.append(
                TrainSample(
                    session_id=f"b{batch_index}-g{g}-s{s}",
                    token_ids=[rng.randrange(400) for _ in range(length)],
                    loss_mask=[0] * prompt + [1] * completion,
                    behaviour_logprobs=[0.0] * prompt
                    + [-rng.uniform(0.5, 4.0) for _ in range(completion)],
                    versions=[-1] * prompt + [0] * completion,
                    reward=rng.random(),
                )
            )
        groups.append(SampleGroup(group_id=f"b{batch_index}-g{g}", task_id="t", samples=samples))
    return TrainBatch(batch_index=batch_index, groups=groups)


def big_batch(batch_index: int, group_lengths: list[list[int]], vocab: int = 151_000) -> TrainBatch:
    """Samples of the given lengths: a third prompt, the rest completion with float32
    behaviour logprobs; ids of a ``vocab``-token vocabulary."""
    rng = np.random.default_rng(batch_index)
    groups = []
    for g, lengths in enumerate(group_lengths):
        samples = []
        for s, length in enumerate(lengths):
            prompt = length // 3
            samples.append(
                TrainSample(
                    session_id=f"b{batch_index}-g{g}-s{s}",
                    token_ids=rng.integers(0, vocab, length).tolist(),
                    loss_mask=[0] * prompt + [1] * (length - prompt),
                    behaviour_logprobs=[0.0] * prompt
                    + (-rng.uniform(0, 8, length - prompt)).astype(np.float32).tolist(),
                    versions=[-1] * prompt + [0] * (length - prompt),
                    reward=float(s % 2),
                )
            )
        groups.append(SampleGroup(group_id=f"b{batch_index}-g{g}", task_id="t", samples=samples))
    return TrainBatch(batch_index=batch_index, groups=groups)


def fields_of(sample: TrainSample) -> dict:  # type: ignore[type-arg]
    """The record's fields by name (a ``TrainSample``'s, or any protocol record's)."""
    return {name: getattr(sample, name) for name in sample.__struct_fields__}
