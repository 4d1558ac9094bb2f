"""The collective (push) transport on CPU: three gloo processes, rank 0 the trainer.

Exactly the code the NCCL path runs (handshake, bucketing, receiver checks), over
``torch.distributed`` gloo; only ``CupyNcclCollective`` is left to the GPU test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from support import free_port

from seamlessflow.weights import WeightEncoder, WeightMirror, WeightsCorrupted, collective
from seamlessflow.weights.codec import EncodedWeights

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

WORLD = 3
BUCKET = 4096  # much smaller than the 40 kB tensor: it crosses many buckets


def state_at(version: int) -> dict[str, torch.Tensor]:
    """The trainer's state at ``version``: each rank can rebuild it to check what it got."""
    generator = torch.Generator().manual_seed(version)
    big = torch.zeros(100, 200, dtype=torch.bfloat16)
    big.view(-1)[torch.randint(0, big.numel(), (50 * version,), generator=generator)] = 1.0
    return {"big": big, "small": torch.full((3,), float(version))}


def run_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        group = collective.TorchCollective()
        if rank == 0:
            encoder = WeightEncoder(bucket_bytes=BUCKET, deltas=True, full_every=10)
            for version in (1, 2, 3):
                collective.send(group, encoder.encode(version, state_at(version)))
            damaged = encoder.encode(4, state_at(4))
            wrong = bytearray(damaged.payload)
            wrong[0] ^= 0xFF
            collective.send(group, EncodedWeights(damaged.manifest, memoryview(wrong)))
            collective.send_stop(group)
            return
        mirror = WeightMirror()
        log = []
        # one buffer for every payload: each is applied (copied out) before the next lands
        reused = collective.new_buffer(1 << 20)
        while (received := collective.receive(group, buffer=lambda n: reused[:n])) is not None:
            manifest = received.manifest
            try:
                mirror.apply(manifest, received.payload, received.bucket_digests)
            except WeightsCorrupted:
                log.append(f"refused {manifest.version}")
                continue
            got = mirror.tensors()
            same = all(torch.equal(got[k], v) for k, v in state_at(manifest.version).items())
            log.append(f"{manifest.kind} {manifest.version} {'exact' if same else 'WRONG'}")
        log.append(f"holding {mirror.version}")
        Path(out, f"rank{rank}.log").write_text("\n".join(log))
    finally:
        dist.destroy_process_group()


def test_three_gloo_ranks_receive_every_version_and_refuse_a_damaged_one(tmp_path: Path) -> None:
    mp.spawn(run_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in (1, 2):
        log = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        assert log == [
            "full 1 exact",
            "delta 2 exact",
            "delta 3 exact",
            "refused 4",
            "holding 3",
        ], rank
