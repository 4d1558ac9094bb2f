"""The same-host push ring (``weights.ring``) between real processes over gloo: when it
is chosen, what crosses a slot boundary, and how a member that stops copying out breaks
the group instead of hanging it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from seamlessflow.weights import collective
from seamlessflow.weights.ring import RingCollective, RingOutOfStep, same_host_ring
from tests.support import free_port

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

SLOT = 4096


def joined(rank: int, port: int, world: int) -> collective.TorchCollective:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return collective.TorchCollective()


def blind_member(rank: int, port: int, out: str) -> None:
    """Rank 2 looks for shared memory in a directory of its own (a container that does
    not share the host's): nobody gets the ring, and broadcasts still arrive."""
    import torch.distributed as dist

    group = joined(rank, port, 3)
    try:
        directory = Path(out, "own" if rank == 2 else "shared")
        directory.mkdir(exist_ok=True)
        chosen = same_host_ring(group, directory, SLOT, timeout_s=30)
        payload = (
            torch.arange(3 * SLOT, dtype=torch.uint8)
            if rank == 0
            else torch.zeros(3 * SLOT, dtype=torch.uint8)
        )
        chosen.broadcast(payload, 0)
        expected = torch.arange(3 * SLOT, dtype=torch.uint8)
        Path(out, f"rank{rank}").write_text(
            f"{type(chosen).__name__} {torch.equal(payload, expected)}"
        )
    finally:
        dist.destroy_process_group()


def test_a_member_that_cannot_map_the_ring_keeps_everyone_on_the_sockets(
    tmp_path: Path,
) -> None:
    mp.spawn(blind_member, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    for rank in range(3):
        assert (tmp_path / f"rank{rank}").read_text() == "TorchCollective True", rank
    assert not list((tmp_path / "shared").iterdir())  # the writer removed its ring


def two_members(rank: int, port: int, out: str) -> None:
    """Rank 0 writes, rank 1 copies out; then rank 1 stops copying out."""
    import torch.distributed as dist

    group = joined(rank, port, 2)
    try:
        ring = same_host_ring(group, Path(out), SLOT, timeout_s=2, inline_bytes=16)
        assert isinstance(ring, RingCollective)
        # larger than three slots, from memory outside the ring: four pieces through the
        # two copy slots in turn, each reused once the member copied it out
        big = torch.randn(3 * SLOT // 4 + 5)  # float32, not a multiple of a slot
        expected = torch.randn(big.numel(), generator=torch.Generator().manual_seed(7))
        if rank == 0:
            big.copy_(expected)
        ring.broadcast(big, 0)
        same_big = torch.equal(big, expected)
        # from a lent slot: no copy on the writer's side, the slot free once waited for
        if rank == 0:
            lent = ring.lend(2, SLOT)
            assert lent is not None and ring.lend(3, SLOT) is None
            lent[1].fill_(9)
            ring.start_broadcast(lent[1][:100], 0).wait()
            report = f"copied {ring.bytes_copied} lent {ring.bytes_lent}"
        else:
            got = torch.zeros(100, dtype=torch.uint8)
            ring.broadcast(got, 0)
            report = f"lent slot {bool((got == 9).all())}"
        # rank 1 now takes the announcement of the next bucket but never copies it out
        if rank == 0:
            lent = ring.lend(2, SLOT)
            assert lent is not None
            pending = ring.start_broadcast(lent[0], 0)
            try:
                pending.wait()
                report += " waited"
            except RingOutOfStep as exc:
                report += f" out of step: {exc}"
        else:
            control = torch.zeros(3, dtype=torch.int64)
            group.broadcast(control, 0)
        group.broadcast(torch.zeros(1), 0)  # both ends reach here before the group goes
        Path(out, f"rank{rank}").write_text(f"{same_big} {report}")
    finally:
        dist.destroy_process_group()


def test_the_ring_carries_what_spans_slots_and_a_member_that_stops_copying_breaks_it(
    tmp_path: Path,
) -> None:
    mp.spawn(two_members, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    writer = (tmp_path / "rank0").read_text()
    nbytes = (3 * SLOT // 4 + 5) * 4
    assert writer.startswith(f"True copied {nbytes} lent 100 out of step: ")
    assert "member(s) [1] did not copy out broadcast 6 within 2 s" in writer
    assert (tmp_path / "rank1").read_text() == "True lent slot True"


def member_dies(rank: int, port: int, out: str) -> None:
    """Rank 1 takes the announcement of a bucket, then its process ends without copying
    it out: the writer learns it from the member's silent beat, long before the group's
    timeout."""
    import torch.distributed as dist

    group = joined(rank, port, 2)
    ring = same_host_ring(group, Path(out), SLOT, timeout_s=600, inline_bytes=16)
    assert isinstance(ring, RingCollective)
    if rank == 1:
        control = torch.zeros(3, dtype=torch.int64)
        group.broadcast(control, 0)
        os._exit(0)  # gone, as a killed engine is: no clean-up, no goodbye
    ring.silence_s = 1.0
    lent = ring.lend(1, SLOT)
    assert lent is not None
    try:
        ring.start_broadcast(lent[0], 0).wait()
        outcome = "waited"
    except RingOutOfStep as exc:
        outcome = str(exc)
    Path(out, "writer").write_text(outcome)
    dist.destroy_process_group()


def test_a_member_that_dies_before_copying_out_breaks_the_group_by_its_silence(
    tmp_path: Path,
) -> None:
    mp.spawn(member_dies, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    outcome = (tmp_path / "writer").read_text()
    assert (
        outcome
        == "push ring: member(s) [1] stopped (no beat for 1 s) before copying out broadcast 1"
    )
