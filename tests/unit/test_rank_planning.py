"""The trainer's planning for several ranks, in process: samples partitioned by tokens
(balanced, covering every sample, deterministic), every rank given the same number of
passes (padded with untrained ones), one rank's plan the budgeted micro-batches, the
loss normalizer counting the whole batch's trained tokens, and the rows a rank owns as
FSDP2 splits them. The ranks as real processes are tests/mesh/test_trainer_distributed.py."""

from __future__ import annotations

import torch

from seamlessflow.protocol import TrainSample
from sf_trainer.distributed import partition_by_tokens
from sf_trainer.sharded_loading import own_rows
from sf_trainer.step import micro_batches, plan_micro_batches, trained_token_count


def sample(length: int, trained: int) -> TrainSample:
    return TrainSample(
        session_id=f"s{length}-{trained}",
        token_ids=[1] * length,
        loss_mask=[0] * (length - trained) + [1] * trained,
        behaviour_logprobs=[0.0] * length,
        versions=[0] * length,
        reward=0.0,
    )


def test_partition_balances_tokens_covers_every_sample_and_is_deterministic() -> None:
    lengths = [40, 4, 4, 4, 4, 4, 4, 4, 4, 30, 12, 9]
    parts = partition_by_tokens(lengths, 3)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in part) for part in parts]
    assert max(loads) - min(loads) <= max(lengths)
    assert loads == [40, 42, 41]  # longest first, each to the lightest part (by hand)
    assert parts == partition_by_tokens(lengths, 3)
    assert partition_by_tokens([5, 5], 1) == [[0, 1]]
    assert partition_by_tokens([5], 2) == [[0], []]


def test_every_rank_gets_the_same_number_of_passes_padded_with_untrained_ones() -> None:
    samples = [sample(40, 20)] + [sample(4, 2) for _ in range(8)]
    plans = plan_micro_batches(samples, world_size=2, token_budget=8)
    trained = [[m for m in plan if m.trained] for plan in plans]
    # the long sample alone on one rank (1 pass), the 8 short ones on the other (4 passes)
    assert [len(t) for t in trained] == [1, 4]
    assert [len(plan) for plan in plans] == [4, 4]
    padding = [m for m in plans[0] if not m.trained]
    assert all(m.indices == [1] for m in padding)  # the shortest sample
    covered = sorted(i for t in trained for m in t for i in m.indices)
    assert covered == list(range(9))


def test_one_rank_plans_exactly_the_budgeted_micro_batches() -> None:
    samples = [sample(n, 1) for n in (3, 9, 4, 7, 2)]
    (plan,) = plan_micro_batches(samples, world_size=1, token_budget=12)
    assert [m.indices for m in plan] == micro_batches(samples, token_budget=12)
    assert all(m.trained for m in plan)
    assert plan_micro_batches([], world_size=2, token_budget=12) == [[], []]


def test_the_normalizer_counts_trained_tokens_of_the_whole_batch() -> None:
    assert trained_token_count([sample(10, 4), sample(6, 6), sample(3, 0)]) == 10


def test_rows_split_as_fsdp2_splits_them() -> None:
    # torch.chunk's split: ceil(n / ranks) rows each, the last ranks fewer or none
    assert [own_rows(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [own_rows(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for total, ranks in [(10, 4), (7, 3), (1, 2), (151936, 2), (5, 8)]:
        chunks = torch.arange(total).chunk(ranks)
        for rank in range(ranks):
            start, end = own_rows(total, rank, ranks)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(start, end)) == expected, (total, ranks, rank)
