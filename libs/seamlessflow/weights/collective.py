"""Push transport: the trainer broadcasts a payload to a fixed group of engines.

The handshake and bucketing are written once here, over a minimal ``Collective`` (a
rank, a world size, an in-place ``broadcast``). Two thin implementations:

- ``GlooGroup``: a gloo process group of its own (the mesh's push group on CPU: beside
  any torch.distributed world of a trainer's ranks); ``TorchCollective``: a group of
  torch.distributed's world (the tests and benchmarks run it with several processes);
- ``CupyNcclCollective``: NCCL through CuPy (``cupy.cuda.nccl``), GPU only, with the
  NCCL unique id handed out by rank 0 (over NATS in the mesh).

Protocol, in band, from ``src``:
1. a header ``int64[3]``: ``MORE``, the payload's length, its bucket size (``STOP``:
   no more payloads);
2. the payload in buckets, ``IN_FLIGHT`` of them on the wire at once (one when the
   sender streams a version as it is gathered: ``StreamSend``). On the CPU (gloo) the
   buckets go straight from the sender's memory into the receiver's buffer; a GPU
   collective stages them through device buffers of a bucket each, so a payload of any
   size moves with a fixed transfer budget;
3. a header whose first value is the manifest's length, then the manifest (msgspec
   JSON, uint8). It comes last: a streamed version's digests exist only once its last
   bucket has been hashed.

Receivers do not trust the wire: the receiver hashes each bucket as it lands, while the
next one is on the wire, and ``WeightMirror.apply`` compares those digests with the
manifest's (and the state digest after a delta) before anything is served. The receiver
writes into a buffer its caller hands it (``PushListener`` reuses two): allocating, and
so faulting in, a fresh payload per version cost about 0.5 s per GB here. The payload
also sits in the pull store, so an engine that refuses a broadcast, or joins after the
group formed, fetches it from there.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec
import torch

from seamlessflow.protocol import WeightManifest
from seamlessflow.weights.codec import EncodedWeights
from seamlessflow.weights.layout import as_bytes, bucket_ranges, digest_of

if TYPE_CHECKING:
    import torch.distributed as dist


IN_FLIGHT = 2
"""Buckets broadcast at once: while one is on the wire the sender prepares the next and
the receiver hashes the one before."""
MORE, STOP = 1, 0
"""The first value of a payload's header: a payload follows, or the sender is done."""


class Pending(Protocol):
    def wait(self) -> None:
        """Block until the broadcast is complete on this rank."""
        ...


class Collective(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place on every rank: ``tensor`` becomes ``src``'s (blocking)."""
        ...

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        """``broadcast``, started: ``tensor`` is ``src``'s once the result's ``wait``
        returns, and neither side touches it before. Every rank starts the same
        broadcasts in the same order."""
        ...


@runtime_checkable
class LendsSendMemory(Protocol):
    def lend(self, count: int, nbytes: int) -> list[torch.Tensor] | None:
        """``count`` buffers of ``nbytes`` that this rank broadcasts without a copy, or
        None. A lent buffer may be written again once its broadcast was waited for."""
        ...


class Completed:
    """A broadcast that completed when it was started (a collective that only broadcasts
    synchronously)."""

    def wait(self) -> None:
        pass


@dataclass(frozen=True)
class Received:
    """One payload off the wire, not yet checked against its manifest."""

    manifest: WeightManifest
    payload: memoryview
    bucket_digests: list[str]
    """The digest of each bucket as it arrived (for ``WeightMirror.apply``)."""


class TorchCollective:
    """A torch.distributed process group; the caller has initialised it."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: str = "cpu") -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        source = self._dist.get_global_rank(self.group, src) if self.group is not None else src
        work = self._dist.broadcast(tensor, source, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns the work
        return work


class GlooGroup:
    """A gloo process group of its own, rendezvousing through a TCP store that rank 0
    hosts at ``address`` (``host:port``). It is not torch.distributed's default world and
    needs none: a trainer whose ranks train over their own world forms the push group with
    its engines beside it."""

    def __init__(self, address: str, rank: int, world_size: int, timeout: timedelta) -> None:
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        # rank 0's store waits (up to ``timeout``) until every member has connected
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, int(port), world_size, rank == 0, timeout
        )
        self._group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            self._store, rank, world_size, timeout
        )
        self._options = dist.BroadcastOptions
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")

    def close(self) -> None:
        """Join the group's threads now: left to the interpreter's exit, the destruction
        of a gloo group (its peers gone, its threads still up) can abort the process
        ("terminate called without an active exception", seen under CI load)."""
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()
        self._store = None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        if self._group is None:
            raise RuntimeError("the push group was closed")
        options = self._options()
        options.rootRank, options.rootTensor = src, 0
        work: Pending = self._group.broadcast([tensor], options)  # type: ignore[attr-defined]
        return work


class CupyNcclCollective:  # pragma: no cover - needs a GPU (tests/unit/test_gpu_weights.py)
    """NCCL through CuPy: one communicator per process, tensors on the current GPU."""

    def __init__(self, world_size: int, rank: int, unique_id: tuple[int, ...]) -> None:
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl = cupy, nccl
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        try:  # CuPy < 14 takes the id as a tuple of ints
            self._comm = nccl.NcclCommunicator(world_size, unique_id, rank)
        except TypeError:  # CuPy 14 as bytes (seen on an H100 machine, cupy-cuda13x 14.2)
            id_bytes = bytes(value & 0xFF for value in unique_id)
            self._comm = nccl.NcclCommunicator(world_size, id_bytes, rank)

    @staticmethod
    def new_unique_id() -> tuple[int, ...]:
        """The id as a tuple of ints whichever form CuPy gives (bytes or a tuple), so it
        travels in a message as a list."""
        from cupy.cuda import nccl

        return tuple(nccl.get_unique_id())

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        # bytes as uint8: NCCL needs no dtype knowledge for a broadcast
        raw = tensor.view(torch.uint8)
        stream = torch.cuda.current_stream()
        self._comm.bcast(
            raw.data_ptr(), raw.numel(), self._nccl.NCCL_UINT8, src, stream.cuda_stream
        )
        return _StreamDone(stream)


class _StreamDone:  # pragma: no cover - needs a GPU
    """A GPU broadcast queued on ``stream``: ``wait`` blocks the host until it ran (a
    CUDA event's own ``wait`` would only make another stream wait)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()


class StreamSend:
    """One payload broadcast from ``src`` (this rank) bucket by bucket, as the buckets
    come; its manifest goes last, so the digests of a payload still being built can
    travel with it. Up to ``in_flight`` buckets are on the wire at once; the memory of a
    bucket on the wire must stay as it is until ``flush`` (or a later ``bucket`` call
    waited for it)."""

    def __init__(
        self,
        collective: Collective,
        payload_bytes: int,
        bucket_bytes: int,
        src: int = 0,
        in_flight: int = IN_FLIGHT,
    ) -> None:
        if bucket_bytes <= 0 or payload_bytes < 0:
            raise ValueError("a payload needs a positive bucket size")
        self.collective, self.src = collective, src
        self.in_flight = in_flight
        self._ranges = list(bucket_ranges(payload_bytes, bucket_bytes))
        self._bucket_bytes = bucket_bytes
        self._sent = 0
        self._pending: deque[Pending] = deque()
        self._staging = _staging(collective, bucket_bytes, in_flight)
        _header(collective, src, (MORE, payload_bytes, bucket_bytes))

    def lent_buffers(self, count: int) -> list[torch.Tensor] | None:
        """``count`` bucket buffers the collective sends without a copy (a same-host
        ring's slots: ``ring.RingCollective``), or None: fill buckets anywhere."""
        if not isinstance(self.collective, LendsSendMemory):
            return None
        return self.collective.lend(count, self._bucket_bytes)

    def bucket(self, data: memoryview) -> None:
        """The next bucket: exactly the size its place in the payload has."""
        if self._sent == len(self._ranges):
            raise ValueError("every bucket of this payload was sent")
        start, end = self._ranges[self._sent]
        if len(data) != end - start:
            raise ValueError(f"bucket {self._sent} is {end - start} bytes, not {len(data)}")
        if len(self._pending) == self.in_flight:
            self._pending.popleft().wait()  # its staging buffer, or its source, is free
        source = _read_only_bytes(data)
        if self._staging:
            piece = self._staging[self._sent % self.in_flight][: len(data)]
            piece.copy_(source)
        else:
            piece = source  # gloo only reads the source rank's tensor
        self._pending.append(self.collective.start_broadcast(piece, self.src))
        self._sent += 1

    def flush(self) -> None:
        """Wait until every bucket sent so far is off the wire."""
        while self._pending:
            self._pending.popleft().wait()

    def finish(self, manifest: WeightManifest) -> None:
        """Every bucket sent: wait for them, then send the manifest."""
        if self._sent != len(self._ranges):
            raise ValueError(f"{self._sent} of {len(self._ranges)} buckets sent")
        self.flush()
        encoded = msgspec.json.encode(manifest)
        _header(self.collective, self.src, (len(encoded), 0, 0))
        self.collective.broadcast(
            torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(self.collective.device),
            self.src,
        )


def send(collective: Collective, encoded: EncodedWeights, src: int = 0) -> None:
    """Broadcast one whole payload from ``src`` (this rank) to every other rank."""
    payload, bucket_bytes = encoded.payload, encoded.manifest.bucket_bytes
    sending = StreamSend(collective, len(payload), bucket_bytes, src)
    for start, end in bucket_ranges(len(payload), bucket_bytes):
        sending.bucket(payload[start:end])
    sending.finish(encoded.manifest)


def _staging(collective: Collective, bucket_bytes: int, count: int) -> list[torch.Tensor]:
    """A bucket-sized buffer per broadcast in flight on a GPU collective; none on the
    CPU, where the payload itself is broadcast."""
    if collective.device.type == "cpu":
        return []
    return [
        torch.empty(bucket_bytes, dtype=torch.uint8, device=collective.device) for _ in range(count)
    ]


def _read_only_bytes(payload: memoryview) -> torch.Tensor:
    """`payload` as a uint8 tensor without a copy. A delta's payload is immutable
    `bytes`; torch warns that it cannot mark the tensor read-only, but `send` only reads
    it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def send_stop(collective: Collective, src: int = 0) -> None:
    """Tell every receiver's loop that no more payloads come."""
    _header(collective, src, (STOP, 0, 0))


def close(collective: Collective) -> None:
    """Release a group this process made (``GlooGroup``, ``RingCollective``: those with
    a ``close``); a group of torch.distributed's world is its owner's to destroy."""
    closing = getattr(collective, "close", None)
    if closing is not None:
        closing()


def new_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def receive(
    collective: Collective, src: int = 0, buffer: Callable[[int], torch.Tensor] = new_buffer
) -> Received | None:
    """The next payload broadcast by ``src``, or None after ``send_stop``. It lands in
    ``buffer(n)``, a contiguous CPU uint8 tensor of ``n`` bytes that nobody else touches
    until the payload is applied."""
    more, payload_length, bucket_bytes = _header(collective, src, (STOP, 0, 0))
    if more == STOP:
        return None
    if more != MORE or payload_length < 0 or bucket_bytes <= 0:
        raise ValueError(f"not a payload header: {more}, {payload_length}, {bucket_bytes}")
    payload = buffer(payload_length)
    if payload.numel() != payload_length or payload.dtype != torch.uint8:
        raise ValueError(
            f"a buffer of {payload.numel()} {payload.dtype} for {payload_length} bytes"
        )
    view = as_bytes(payload)
    staging = _staging(collective, bucket_bytes, IN_FLIGHT)
    digests: list[str] = []
    in_flight: deque[tuple[Pending, int, int, torch.Tensor]] = deque()

    def land(pending: Pending, start: int, end: int, piece: torch.Tensor) -> None:
        pending.wait()
        if staging:
            payload[start:end].copy_(piece)
        digests.append(digest_of(view[start:end]))

    for index, (start, end) in enumerate(bucket_ranges(payload_length, bucket_bytes)):
        if len(in_flight) == IN_FLIGHT:
            land(*in_flight.popleft())
        piece = staging[index % IN_FLIGHT][: end - start] if staging else payload[start:end]
        in_flight.append((collective.start_broadcast(piece, src), start, end, piece))
    while in_flight:
        land(*in_flight.popleft())
    manifest_length = _header(collective, src, (0, 0, 0))[0]
    manifest_bytes = torch.empty(manifest_length, dtype=torch.uint8, device=collective.device)
    collective.broadcast(manifest_bytes, src)
    manifest = msgspec.json.decode(manifest_bytes.cpu().numpy().tobytes(), type=WeightManifest)
    if (manifest.payload_bytes, manifest.bucket_bytes) != (payload_length, bucket_bytes):
        raise ValueError("the header and the manifest disagree on the payload's sizes")
    return Received(manifest, view, digests)


def _header(collective: Collective, src: int, values: tuple[int, int, int]) -> tuple[int, int, int]:
    """Three int64 from ``src`` (``values`` there; a placeholder elsewhere)."""
    header = torch.tensor(values, dtype=torch.int64, device=collective.device)
    collective.broadcast(header, src)
    return int(header[0]), int(header[1]), int(header[2])
