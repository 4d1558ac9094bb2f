"""A version leaves two trainer ranks in blocks of rows (``TrainGroup.host_tensors``):
each rank sends its own rows of a sharded tensor to rank 0, block by block, and rank 0
gets every tensor's exact bytes in order without ever holding a whole large one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import free_port

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

BLOCK_BYTES = 1000


def small_model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Embedding(301, 16),  # uneven: 151 rows on rank 0, 150 on rank 1
        torch.nn.Linear(16, 1),  # a bias of one row: rank 1 holds none of it
    )
    return model


def rank_main(rank: int, port: int, out: str) -> None:
    from sf_trainer.distributed import TrainGroup

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    group = TrainGroup.from_env("cpu", timeout_s=60)
    try:
        model = small_model()
        expected = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
        group.shard(model)
        pieces = list(group.host_tensors(model, torch.bfloat16, block_bytes=BLOCK_BYTES))
        if rank != 0:
            assert pieces == []
            return
        report = []
        for name, tensor in expected.items():
            mine = [piece for got, piece in pieces if got == name]
            largest = max(piece.numel() * piece.element_size() for piece in mine)
            whole = torch.cat([piece.reshape(-1, *tensor.shape[1:]) for piece in mine])
            report.append(
                f"{name} {len(mine)} pieces, largest {largest} B, "
                f"{'exact' if torch.equal(whole.reshape(tensor.shape), tensor) else 'WRONG'}"
            )
        order = [name for name, _ in pieces]
        report.append("in order" if order == sorted(order, key=list(expected).index) else "MIXED")
        Path(out, "rank0.log").write_text("\n".join(report))
    finally:
        group.close()


def test_two_ranks_publish_a_sharded_tensor_in_blocks_of_rows(tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    # 16 bf16 columns = 32 bytes a row: blocks of 31 rows (992 B); rank 0's 151 rows
    # make 5 blocks, rank 1's 150 make 5; the Linear's 16 weights are one row, its bias
    # a single value on rank 0
    assert (tmp_path / "rank0.log").read_text().splitlines() == [
        "0.weight 10 pieces, largest 992 B, exact",
        "1.weight 1 pieces, largest 32 B, exact",
        "1.bias 1 pieces, largest 2 B, exact",
        "in order",
    ]
