"""The collective (push) transport on CPU: three gloo processes, rank 0 the trainer.

Exactly the code the NCCL path runs (handshake, bucketing, receiver checks), over
``torch.distributed`` gloo, with the buckets on the sockets or through the same-host
shared-memory ring (``weights.ring``); only ``CupyNcclCollective`` is left to the GPU
test.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from seamlessflow.weights import (
    SharedMemoryPayloads,
    WeightEncoder,
    WeightMirror,
    WeightPublisher,
    WeightsCorrupted,
    collective,
)
from seamlessflow.weights.codec import EncodedWeights
from seamlessflow.weights.layout import plan_layout
from seamlessflow.weights.ring import RingCollective, same_host_ring
from tests.support import free_port

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


async def publish_streamed(group: collective.Collective, out: Path, version: int) -> None:
    """``version`` as the trainer publishes it: bucket by bucket as it is encoded, to the
    store and the push group at once; the store then holds what ``encode`` would have."""
    store = SharedMemoryPayloads("streamed", out)
    publisher = WeightPublisher(store, WeightEncoder(bucket_bytes=BUCKET))
    publisher.push = group
    state = state_at(version)
    manifest = await publisher.publish_streamed(
        version,
        lambda sink: asyncio.to_thread(
            publisher.encoder.encode_buckets, version, plan_layout(state), iter(state.items()), sink
        ),
    )
    whole = WeightEncoder(bucket_bytes=BUCKET).encode(version, state)
    assert bytes(await store.fetch(manifest)) == bytes(whole.payload)
    assert publisher.push is group  # nothing broke on the way
    lent = group.bytes_lent if isinstance(group, RingCollective) else 0
    (out / "streamed.log").write_text(
        f"{manifest.transport} {len(manifest.bucket_digests)} {manifest.payload_bytes} lent {lent}"
    )
    publisher.push = None  # the caller sends the stop, after this version
    await publisher.close()


def run_rank(rank: int, port: int, out: str, ring: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        group: collective.Collective = collective.TorchCollective()
        if ring:  # headers stay on the sockets, buckets and manifests go through the ring
            group = same_host_ring(group, Path(out), BUCKET, timeout_s=60, inline_bytes=64)
            assert isinstance(group, RingCollective)
        if rank == 0:
            encoder = WeightEncoder(bucket_bytes=BUCKET, deltas=True, full_every=10)
            for version in (1, 2, 3):
                collective.send(group, encoder.encode(version, state_at(version)))
            damaged = encoder.encode(4, state_at(4))
            wrong = bytearray(damaged.payload)
            wrong[0] ^= 0xFF
            collective.send(group, EncodedWeights(damaged.manifest, memoryview(wrong)))
            asyncio.run(publish_streamed(group, Path(out), version=5))
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
        if isinstance(group, RingCollective):
            log.append(f"ring consumed {group.ring.consumed(rank)}")
        Path(out, f"rank{rank}.log").write_text("\n".join(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ring", [False, True], ids=["sockets", "shared-memory ring"])
def test_three_gloo_ranks_receive_every_version_and_refuse_a_damaged_one(
    tmp_path: Path, ring: bool
) -> None:
    mp.spawn(run_rank, args=(free_port(), str(tmp_path), ring), nprocs=WORLD, join=True)
    for rank in (1, 2):
        log = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        assert log[:6] == [
            "full 1 exact",
            "delta 2 exact",
            "delta 3 exact",
            "refused 4",
            "full 5 exact",
            "holding 5",
        ], rank
        if ring:  # every broadcast through the ring was copied out, the last included
            assert log[6].startswith("ring consumed ") and int(log[6].split()[-1]) > 10
    # 40 kB of bf16 and 12 bytes of float32, aligned, in 4 kB buckets; through the ring
    # every byte of the streamed version left from the encoder's lent slots
    payload = 40_064
    lent = payload if ring else 0
    assert (tmp_path / "streamed.log").read_text() == f"shm 10 {payload} lent {lent}"
    if ring:  # unlinked once every member had mapped it
        assert not list(tmp_path.glob("sf-push-ring-*"))


def trainer_rank_or_engine(process: int, ports: tuple[int, int], out: str) -> None:
    """Processes 0 and 1 are a trainer's two ranks (their own torch.distributed world);
    process 0 also forms the push group with process 2, an engine, as the mesh does
    (``GlooGroup``, then the ring)."""
    import torch.distributed as dist

    from seamlessflow.weights.group import how_buckets_travel

    torch.set_num_threads(1)
    world, push = ports
    if process < 2:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world))
        dist.init_process_group("gloo", rank=process, world_size=2)
        total = torch.ones(1)
        dist.all_reduce(total)  # the trainer's world works
        if process == 1:
            dist.barrier()
            dist.destroy_process_group()
            return
    rank = 0 if process == 0 else 1
    group: collective.Collective = collective.GlooGroup(
        f"127.0.0.1:{push}", rank, 2, timedelta(seconds=60)
    )
    group = same_host_ring(group, Path(out), BUCKET, timeout_s=60)
    if rank == 0:
        asyncio.run(publish_streamed(group, Path(out), version=6))
        collective.send_stop(group)
        Path(out, "trainer.log").write_text(f"{int(total)} ranks; {how_buckets_travel(group)}")
        collective.close(group)  # as the publisher's close does: the group's threads joined
        dist.barrier()
        dist.destroy_process_group()
        return
    mirror = WeightMirror()
    reused = collective.new_buffer(1 << 20)
    while (received := collective.receive(group, buffer=lambda n: reused[:n])) is not None:
        mirror.apply(received.manifest, received.payload, received.bucket_digests)
    collective.close(group)  # as the push listener does once the trainer stops it
    got = mirror.tensors()
    exact = all(torch.equal(got[k], v) for k, v in state_at(6).items())
    Path(out, "engine.log").write_text(f"version {mirror.version} {'exact' if exact else 'WRONG'}")


def test_a_trainer_rank_in_its_own_world_pushes_to_an_engine_beside_it(tmp_path: Path) -> None:
    """The push group is a gloo group of its own, so a trainer of several ranks (a
    torch.distributed world already) pushes its versions too; through the ring here."""
    ports = (free_port(), free_port())
    mp.spawn(trainer_rank_or_engine, args=(ports, str(tmp_path)), nprocs=3, join=True)
    assert (tmp_path / "trainer.log").read_text() == "2 ranks; buckets through shared memory"
    assert (tmp_path / "engine.log").read_text() == "version 6 exact"
