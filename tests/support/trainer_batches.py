"""TrainBatches of random tokens for the trainer tests: every group's rewards differ, so
every sample carries a learning signal."""

from __future__ import annotations

import random

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
