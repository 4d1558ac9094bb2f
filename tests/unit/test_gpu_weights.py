"""The thin GPU layer of the push transport: NCCL through CuPy between two GPUs.

Skipped without CUDA (the ``gpu`` mark) or with fewer than two GPUs; everything above
this layer runs on CPU in ``test_weights_collective.py`` with the same code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from seamlessflow.weights import WeightEncoder, WeightMirror, collective

pytestmark = pytest.mark.gpu


def state_at(version: int) -> dict[str, torch.Tensor]:
    """Version 2 differs from version 1 in a hundred elements: it travels as a delta."""
    weights = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    if version == 2:
        weights.view(-1)[:100] += 1.0
    return {"w": weights}


def run_rank(rank: int, unique_id: tuple[int, ...], out: str) -> None:
    torch.cuda.set_device(rank)
    group = collective.CupyNcclCollective(2, rank, unique_id)
    if rank == 0:
        encoder = WeightEncoder(bucket_bytes=1 << 20, deltas=True)
        for version in (1, 2):
            collective.send(group, encoder.encode(version, state_at(version)))
        collective.send_stop(group)
        return
    mirror = WeightMirror()
    while (received := collective.receive(group)) is not None:
        mirror.apply(received.manifest, received.payload, received.bucket_digests)
    exact = torch.equal(mirror.tensors()["w"], state_at(2)["w"])
    Path(out, "rank1").write_text(f"{mirror.version} {exact}")


def test_two_gpus_receive_full_and_delta_over_nccl(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    unique_id = collective.CupyNcclCollective.new_unique_id()
    mp.spawn(run_rank, args=(unique_id, str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank1").read_text() == "2 True"
