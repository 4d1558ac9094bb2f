"""Same-host push: the group's buckets through shared memory, its control over the group.

When every member of the push group runs on one host and sees the same shared-memory
directory, a bucket need not cross a socket: the trainer writes it into a slot of a
mapped ring and tells the members where it lies; each member copies it out and says so.
``RingCollective`` wraps the group's own collective (gloo), which keeps carrying the
control messages and everything small, so the push protocol of ``collective`` (headers,
buckets, manifest) runs on it unchanged. It is the CPU form of the GPU hand-off by CUDA
IPC (the trainer's buckets mapped by the engines): the same slot lifetime, with host
memory in place of device memory.

The ring (one file, mapped by every member, unlinked once all have mapped it, so nothing
is left behind by a crash):
- a control page: a magic, the trainer's nonce, the sizes, ``consumed[rank]``, the
  sequence number of the last broadcast member ``rank`` copied out, and ``beats[rank]``,
  which a thread of each member advances every ``BEAT_S``;
- ``SLOTS`` slots of one bucket each. The first ``LENT_SLOTS`` are lent to the trainer's
  encoder (``lend``), which fills its buckets straight into them: a lent bucket is sent
  without any copy on the trainer's side. The others take a copy of anything else large
  the trainer broadcasts (a whole payload's buckets).

Slot lifetime (the handle protocol): the trainer writes a slot only once every member's
``consumed`` has reached the sequence number of that slot's previous broadcast, and a
member advances its ``consumed`` only after its copy finished. On x86-64 a store is never
made visible before the loads that precede it, so a member's copy has read the slot by the
time the trainer sees its number. A member that does not consume within the group's
timeout breaks the group (the store still has every payload), and so does one whose beat
stops for ``SILENCE_S`` while the trainer waits on it: a member that died, which a socket
would have told at once but shared memory does not.

Each broadcast from the trainer sends ``int64[3]`` over the group first: its sequence
number, the offset of its bytes in the ring (``INLINE``: the bytes follow over the group
instead) and their length. Members check the sequence number, so a ring out of step
fails loudly instead of handing over another bucket's bytes.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from seamlessflow.weights.collective import Collective, Completed, Pending, close

log = logging.getLogger(__name__)

MAGIC = b"SFRING01"
CONTROL_BYTES = 4096
"""The control page: the header, then one int64 ``consumed`` per member, and in its
second half one int64 ``beats`` per member."""
CONSUMED_OFFSET = 64
BEATS_OFFSET = CONTROL_BYTES // 2 + CONSUMED_OFFSET
MAX_MEMBERS = (CONTROL_BYTES // 2 - CONSUMED_OFFSET) // 8
BEAT_S = 0.1
SILENCE_S = 10.0
"""A member whose beat has not moved for this long while the trainer waits on it is
gone. Generous: the beat is a Python thread, which a busy process still schedules
every few milliseconds."""
SLOTS = 4
LENT_SLOTS = 2
"""Slots lent to the encoder (its two bucket buffers); the rest take copies."""
INLINE_BYTES = 64 * 1024
"""Broadcasts up to this size (headers, manifests) go over the group itself."""
INLINE = -1
DESCRIPTOR_BYTES = 1024
PAGE = 4096


class RingOutOfStep(RuntimeError):
    """A member was told of a broadcast other than the one it expected, or was not
    consumed within the group's timeout: the group is broken."""


@dataclass(frozen=True)
class RingDescriptor:
    """What the trainer tells the members about the ring it made. Each member looks for
    ``name`` in its own shared-memory directory: containers mount the host's at paths of
    their own."""

    name: str
    nonce: str
    slots: int
    slot_bytes: int
    members: int

    @property
    def file_bytes(self) -> int:
        return CONTROL_BYTES + self.slots * self.slot_bytes


class SharedRing:
    """The mapped ring file of one member."""

    def __init__(self, descriptor: RingDescriptor, path: Path, mapping: mmap.mmap) -> None:
        self.descriptor, self.path = descriptor, path
        self._mapping = mapping
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self.data = whole[CONTROL_BYTES:]
        self.base = self.data.data_ptr()

    @classmethod
    def create(cls, directory: Path, slot_bytes: int, members: int) -> SharedRing:
        """A new ring file in ``directory``, its pages allocated now (a first write into
        a tmpfs page faults it in: not on the first bucket's clock)."""
        if members > MAX_MEMBERS:
            raise ValueError(f"a ring holds at most {MAX_MEMBERS} members, not {members}")
        slot_bytes = -(-slot_bytes // PAGE) * PAGE
        nonce = secrets.token_hex(16)
        descriptor = RingDescriptor(f"sf-push-ring-{nonce}", nonce, SLOTS, slot_bytes, members)
        path = Path(directory) / descriptor.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, descriptor.file_bytes)
            mapping = mmap.mmap(fd, descriptor.file_bytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        mapping[: len(MAGIC)] = MAGIC
        mapping[len(MAGIC) : len(MAGIC) + 16] = bytes.fromhex(nonce)
        return cls(descriptor, path, mapping)

    @classmethod
    def open(cls, directory: Path, descriptor: RingDescriptor) -> SharedRing:
        """The ring ``descriptor`` names, in ``directory``; raises OSError when this
        member cannot map it, and ValueError when the file there is not that ring."""
        path = Path(directory) / descriptor.name
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != descriptor.file_bytes:
                raise ValueError(f"{path} is not {descriptor.file_bytes} bytes")
            mapping = mmap.mmap(fd, descriptor.file_bytes)
        finally:
            os.close(fd)
        header = mapping[: len(MAGIC) + 16]
        if header != MAGIC + bytes.fromhex(descriptor.nonce):
            mapping.close()
            raise ValueError(f"{path} holds another ring")
        return cls(descriptor, path, mapping)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def slot(self, index: int) -> torch.Tensor:
        size = self.descriptor.slot_bytes
        return self.data[index * size : (index + 1) * size]

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor``'s bytes lie in the slots, if they all do."""
        start = tensor.data_ptr() - self.base
        if 0 <= start and start + tensor.numel() <= self.data.numel():
            return start
        return None

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):  # a lent view still alive: unmapped at exit
            self._mapping.close()

    # The control page is read and written with ``struct`` on the mapping, which holds
    # the GIL throughout: a torch op would let it go, and a member's beat thread could
    # then write into a mapping the interpreter unmaps as the process exits.

    def consumed(self, rank: int) -> int:
        return int(struct.unpack_from("<q", self._mapping, CONSUMED_OFFSET + 8 * rank)[0])

    def set_consumed(self, rank: int, sequence: int) -> None:
        struct.pack_into("<q", self._mapping, CONSUMED_OFFSET + 8 * rank, sequence)

    def beats(self, rank: int) -> int:
        return int(struct.unpack_from("<q", self._mapping, BEATS_OFFSET + 8 * rank)[0])

    def beat(self, rank: int) -> None:
        """One more beat of member ``rank``; ValueError once the mapping is closed."""
        struct.pack_into("<q", self._mapping, BEATS_OFFSET + 8 * rank, self.beats(rank) + 1)


class RingCollective:
    """The group's collective with the trainer's large broadcasts through a ``SharedRing``
    (module docstring). Broadcasts from another rank go over the group as they are."""

    def __init__(
        self,
        group: Collective,
        ring: SharedRing,
        timeout_s: float,
        writer: int = 0,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        self.group, self.ring, self.writer = group, ring, writer
        self.rank, self.world_size, self.device = group.rank, group.world_size, group.device
        self.timeout_s, self.inline_bytes = timeout_s, inline_bytes
        self.bytes_lent = 0
        """Bytes the writer broadcast straight from lent slots (no copy on its side)."""
        self.bytes_copied = 0
        """Bytes the writer copied into the ring to broadcast them."""
        self._sequence = 0
        """The last broadcast from the writer (both ends count)."""
        self._slot_sequence = [0] * SLOTS
        """The writer's last broadcast out of each slot."""
        self._next_copy_slot = LENT_SLOTS
        self.silence_s = SILENCE_S
        self._closed = threading.Event()
        if self.rank != writer:
            threading.Thread(target=self._beat, name="push-ring-beat", daemon=True).start()

    # ---------------------------------------------------------------- the writer's side

    def lend(self, count: int, nbytes: int) -> list[torch.Tensor] | None:
        """``count`` buffers of ``nbytes`` that a broadcast sends without a copy (the
        encoder's bucket buffers), or None when the ring cannot lend them. A lent slot is
        free again once a broadcast of it has been waited for (``Pending.wait``)."""
        if self.rank != self.writer or count > LENT_SLOTS:
            return None
        if nbytes > self.ring.descriptor.slot_bytes:
            return None
        for index in range(count):
            self._wait_consumed(self._slot_sequence[index])
        return [self.ring.slot(index)[:nbytes] for index in range(count)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        if src != self.writer:
            return self.group.start_broadcast(tensor, src)
        raw = _flat_bytes(tensor)
        if self.rank != src:
            return _Landing(self, raw)
        if raw.numel() <= self.inline_bytes:
            self._announce(INLINE, raw.numel())
            if raw.numel():
                self.group.broadcast(raw, src)
            return Completed()
        offset = self.ring.offset_of(raw)
        if offset is not None:  # a lent slot: nothing to copy
            slot = offset // self.ring.descriptor.slot_bytes
            sequence = self._announce(offset, raw.numel())
            self._slot_sequence[slot] = sequence
            self.bytes_lent += raw.numel()
            return _Consumed(self, sequence)
        return self._send_copied(raw)

    def _send_copied(self, raw: torch.Tensor) -> Pending:
        """``raw`` through the copy slots, a slot at a time; the source is free once this
        returns."""
        slot_bytes = self.ring.descriptor.slot_bytes
        for start in range(0, raw.numel(), slot_bytes):
            piece = raw[start : start + slot_bytes]
            slot = self._next_copy_slot
            self._next_copy_slot = LENT_SLOTS + (slot + 1 - LENT_SLOTS) % (SLOTS - LENT_SLOTS)
            self._wait_consumed(self._slot_sequence[slot])
            self.ring.slot(slot)[: piece.numel()].copy_(piece)
            self._slot_sequence[slot] = self._announce(slot * slot_bytes, piece.numel())
            self.bytes_copied += piece.numel()
        return Completed()

    def _announce(self, offset: int, nbytes: int) -> int:
        self._sequence += 1
        control = torch.tensor([self._sequence, offset, nbytes], dtype=torch.int64)
        self.group.broadcast(control.to(self.device), self.writer)
        return self._sequence

    def _wait_consumed(self, sequence: int) -> None:
        """Until every member copied out broadcast ``sequence`` (0: nothing to wait for)."""
        if sequence == 0:
            return
        members = [rank for rank in range(self.world_size) if rank != self.writer]
        started = time.monotonic()
        beats = {rank: (self.ring.beats(rank), started) for rank in members}
        pause = 0.0
        while True:
            behind = [rank for rank in members if self.ring.consumed(rank) < sequence]
            if not behind:
                return
            now = time.monotonic()
            for rank in behind:
                beat = self.ring.beats(rank)
                if beat != beats[rank][0]:
                    beats[rank] = (beat, now)
            silent = [rank for rank in behind if now - beats[rank][1] > self.silence_s]
            if silent:
                raise RingOutOfStep(
                    f"push ring: member(s) {silent} stopped (no beat for "
                    f"{self.silence_s:g} s) before copying out broadcast {sequence}"
                )
            if now - started > self.timeout_s:
                raise RingOutOfStep(
                    f"push ring: member(s) {behind} did not copy out broadcast {sequence} "
                    f"within {self.timeout_s:g} s"
                )
            time.sleep(pause)  # a bucket takes milliseconds to copy: poll finely, then less
            pause = min(0.002, pause * 2 or 0.00005)

    # ---------------------------------------------------------------- a member's side

    def _land(self, raw: torch.Tensor) -> None:
        """The writer's next broadcast into ``raw`` (a slot at a time if it is large)."""
        done = 0
        while True:
            control = torch.zeros(3, dtype=torch.int64, device=self.device)
            self.group.broadcast(control, self.writer)
            sequence, offset, nbytes = (int(value) for value in control.cpu())
            if sequence != self._sequence + 1 or done + nbytes > raw.numel():
                raise RingOutOfStep(
                    f"push ring: broadcast {sequence} of {nbytes} bytes announced where "
                    f"{self._sequence + 1} was due with {raw.numel() - done} bytes left"
                )
            self._sequence = sequence
            target = raw[done : done + nbytes]
            if offset == INLINE:
                if nbytes:
                    self.group.broadcast(target, self.writer)
            else:
                target.copy_(self.ring.data[offset : offset + nbytes])
                self.ring.set_consumed(self.rank, sequence)  # after the copy (docstring)
            done += nbytes
            if done == raw.numel():
                return

    def _beat(self) -> None:
        while not self._closed.wait(BEAT_S):
            try:
                self.ring.beat(self.rank)
            except ValueError:  # the mapping was closed meanwhile
                return

    def close(self) -> None:
        """Stop the beat, unmap the ring and close the group under it."""
        self._closed.set()
        self.ring.close()
        close(self.group)


class _Landing:
    """A member's broadcast, run when waited for: members wait in the order they started,
    as ``collective.receive`` does, so the group's messages stay in order."""

    def __init__(self, ring: RingCollective, raw: torch.Tensor) -> None:
        self.ring, self.raw = ring, raw

    def wait(self) -> None:
        self.ring._land(self.raw)


class _Consumed:
    """A lent slot's broadcast: done when every member has copied it out."""

    def __init__(self, ring: RingCollective, sequence: int) -> None:
        self.ring, self.sequence = ring, sequence

    def wait(self) -> None:
        self.ring._wait_consumed(self.sequence)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("a ring broadcasts contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


def same_host_ring(
    group: Collective,
    directory: Path,
    slot_bytes: int,
    timeout_s: float,
    writer: int = 0,
    inline_bytes: int = INLINE_BYTES,
) -> Collective:
    """``group`` with a ``SharedRing`` when every member can map the one the writer makes
    in ``directory``, else ``group`` itself (members on other hosts, or in containers
    that do not share the directory). Every member calls it, in the same place of the
    group's sequence of broadcasts."""
    ring: SharedRing | None = None
    descriptor = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
    if group.rank == writer:
        try:
            ring = SharedRing.create(directory, slot_bytes, group.world_size)
        except OSError as exc:
            log.warning(
                "push ring: cannot make one in %s (%r); buckets go over the group", directory, exc
            )
        else:
            encoded = msgspec.json.encode(ring.descriptor)
            descriptor[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    descriptor = descriptor.to(group.device)
    group.broadcast(descriptor, writer)
    text = bytes(descriptor.cpu().numpy()).rstrip(b"\0")
    if not text:
        return group
    offered = msgspec.json.decode(text, type=RingDescriptor)
    if group.rank != writer:
        try:
            ring = SharedRing.open(directory, offered)
        except (OSError, ValueError) as exc:
            log.info("push ring: cannot map %s in %s (%r)", offered.name, directory, exc)
    seen = _everyone_says(group, ring is not None)
    if group.rank == writer and ring is not None:
        ring.unlink()  # every member that could map it has: nothing outlives the group
    if not all(seen):
        if ring is not None:
            ring.close()
        if group.rank == writer:
            blind = [rank for rank, ok in enumerate(seen) if not ok]
            log.info("push ring: member(s) %s cannot map it; buckets go over the group", blind)
        return group
    assert ring is not None
    if group.rank == writer:
        log.info("push ring: every member maps %s; buckets go through shared memory", ring.path)
    return RingCollective(group, ring, timeout_s, writer, inline_bytes)


def _everyone_says(group: Collective, mine: bool) -> list[bool]:
    """Each member's ``mine``, on every member (a broadcast from each in turn)."""
    said = []
    for rank in range(group.world_size):
        flag = torch.tensor([int(mine) if rank == group.rank else 0], dtype=torch.int64)
        flag = flag.to(group.device)
        group.broadcast(flag, rank)
        said.append(bool(int(flag.cpu()[0])))
    return said
