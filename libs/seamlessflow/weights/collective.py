"""Push transport: the trainer broadcasts a payload to a fixed group of engines.

The handshake and bucketing are written once here, over a minimal ``Collective`` (a
rank, a world size, an in-place ``broadcast``). Two thin implementations:

- ``TorchCollective``: a ``torch.distributed`` process group (gloo on CPU, which the
  tests run with several processes; nccl on GPUs);
- ``CupyNcclCollective``: NCCL through CuPy (``cupy.cuda.nccl``), GPU only, with the
  NCCL unique id handed out by rank 0 (over NATS in the mesh).

Protocol, in band, from ``src``:
1. a header ``int64[2]``: manifest length, payload length (both 0 = "no more");
2. the manifest (msgspec JSON, uint8);
3. the payload in buckets of ``manifest.bucket_bytes`` through one staging buffer of
   that size on the collective's device, so a payload of any size moves with a fixed
   transfer budget.

Receivers do not trust the wire: ``WeightMirror.apply`` checks every bucket's digest (and
the state digest after a delta) before anything is served. The payload also sits in the
pull store, so an engine that refuses a broadcast, or joins after the group formed,
fetches it from there.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from seamlessflow.protocol import WeightManifest
from seamlessflow.weights.codec import EncodedWeights
from seamlessflow.weights.layout import bucket_ranges

if TYPE_CHECKING:
    import torch.distributed as dist


class Collective(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place on every rank: ``tensor`` becomes ``src``'s (blocking)."""
        ...


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
        source = self._dist.get_global_rank(self.group, src) if self.group is not None else src
        self._dist.broadcast(tensor, source, group=self.group)


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
        # bytes as uint8: NCCL needs no dtype knowledge for a broadcast
        raw = tensor.view(torch.uint8)
        stream = torch.cuda.current_stream().cuda_stream
        self._comm.bcast(raw.data_ptr(), raw.numel(), self._nccl.NCCL_UINT8, src, stream)
        torch.cuda.current_stream().synchronize()


def send(collective: Collective, encoded: EncodedWeights, src: int = 0) -> None:
    """Broadcast one payload from ``src`` (this rank) to every other rank."""
    manifest = msgspec.json.encode(encoded.manifest)
    payload = encoded.payload
    _header(collective, src, len(manifest), len(payload))
    collective.broadcast(
        torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(collective.device), src
    )
    staging = torch.empty(
        encoded.manifest.bucket_bytes, dtype=torch.uint8, device=collective.device
    )
    source = _read_only_bytes(payload) if len(payload) else None
    for start, end in bucket_ranges(len(payload), encoded.manifest.bucket_bytes):
        assert source is not None
        staging[: end - start].copy_(source[start:end])
        collective.broadcast(staging[: end - start], src)


def _read_only_bytes(payload: memoryview) -> torch.Tensor:
    """`payload` as a uint8 tensor without a copy. A delta's payload is immutable
    `bytes`; torch warns that it cannot mark the tensor read-only, but `send` only reads
    it (into the staging buffer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def send_stop(collective: Collective, src: int = 0) -> None:
    """Tell every receiver's loop that no more payloads come."""
    _header(collective, src, 0, 0)


def receive(collective: Collective, src: int = 0) -> tuple[WeightManifest, memoryview] | None:
    """The next payload broadcast by ``src`` (unverified), or None after ``send_stop``."""
    manifest_length, payload_length = _header(collective, src, 0, 0)
    if manifest_length == 0:
        return None
    manifest_bytes = torch.empty(manifest_length, dtype=torch.uint8, device=collective.device)
    collective.broadcast(manifest_bytes, src)
    manifest = msgspec.json.decode(manifest_bytes.cpu().numpy().tobytes(), type=WeightManifest)
    if manifest.payload_bytes != payload_length:
        raise ValueError("header and manifest disagree on the payload size")
    payload = torch.empty(payload_length, dtype=torch.uint8)
    staging = torch.empty(manifest.bucket_bytes, dtype=torch.uint8, device=collective.device)
    for start, end in bucket_ranges(payload_length, manifest.bucket_bytes):
        collective.broadcast(staging[: end - start], src)
        payload[start:end].copy_(staging[: end - start])
    array: Any = payload.numpy()
    return manifest, memoryview(array).cast("B")


def _header(
    collective: Collective, src: int, manifest_length: int, payload_length: int
) -> tuple[int, int]:
    header = torch.tensor(
        [manifest_length, payload_length], dtype=torch.int64, device=collective.device
    )
    collective.broadcast(header, src)
    return int(header[0]), int(header[1])
