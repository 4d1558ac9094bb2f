"""A weight set handed to another process of this host without serializing it.

vLLM's model runs in a worker process. Sending it tensors as bytes inside
``collective_rpc``'s arguments copied every weight four times on the host, and
serialized it through the engine core's socket. On an H200 that cost 5.98 s/GB for
SmolLM2 (docs/benchmarks.md, "vLLM on CUDA"). Here the engine writes the set once into
one buffer that the worker can map, and sends only where each tensor lies in it
(``StagedTensor``). The worker builds views over the mapping (no copy) and loads from
them.

Two kinds of buffer:
- **Host tensors** go to a file in shared memory (``/dev/shm``, RAM; else the temporary
  directory), mapped by the worker. This is the path on a CPU, and on a GPU when the
  weights arrive in host memory.
- **CUDA tensors** go to one device allocation that the worker maps over CUDA IPC
  (``seamlessflow.weights.device.CudaBuffers``: the handle is plain data). The copy into
  the model stays on the device.

Lifetime: the engine removes the buffer once the worker's call has returned. The call
is synchronous, and the worker holds no view after it. A file left by an engine that
was killed mid-load is removed by the next stage on the host (``sweep``: its pid is in
the name). A host file that would not fit
in the directory's free space is not written: ``stage`` returns None, and the caller
sends bytes as before.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes: a view of any dtype is aligned."""
HEADROOM = 64 << 20
"""Free space a host buffer leaves in its directory (other users of /dev/shm)."""
PREFIX = "sf-staged-weights-"
"""A staged file's name: this, the engine's pid, a random part."""


@dataclass(frozen=True)
class StagedTensor:
    """Where one tensor lies in the staged buffer (plain fields: it crosses processes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class StagedWeights:
    """One staged set: ``kind`` ``file`` (``where`` is the path) or ``cuda`` (``where``
    is the IPC handle's fields), and its tensors' places."""

    kind: str
    where: Any
    tensors: list[StagedTensor]
    nbytes: int
    _owned: Any = field(default=None, repr=False)
    """The engine's own reference to the buffer (the device allocation), held until
    ``close``."""

    def close(self) -> None:
        if self.kind == "file":
            Path(self.where).unlink(missing_ok=True)
        self._owned = None


def layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[StagedTensor], int]:
    """Each tensor's place in one buffer, in the state dict's order, ``ALIGN``-aligned."""
    places, offset = [], 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        places.append(StagedTensor(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return places, offset


def host_directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def stage(
    state_dict: Mapping[str, torch.Tensor], directory: Path | None = None
) -> StagedWeights | None:
    """``state_dict`` written into one buffer another process of this host can map: on
    the device when every tensor is on one CUDA device, else a host file; None when a
    host file would not fit (the caller sends the tensors another way)."""
    places, total = layout(state_dict)
    devices = {t.device for t in state_dict.values()}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return _stage_on_device(state_dict, places, total, next(iter(devices)))
    directory = directory or host_directory()
    free = shutil.disk_usage(directory).free
    if total + HEADROOM > free:
        log.warning("weights (%.2f GB) do not fit in %s (%.2f GB free): sent as bytes",
                    total / 1e9, directory, free / 1e9)  # fmt: skip
        return None
    sweep(directory)
    path = directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(total, 1))
        with mmap.mmap(fd, max(total, 1)) as mapping:
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
            for place, tensor in zip(places, state_dict.values(), strict=True):
                if place.nbytes:
                    end = place.offset + place.nbytes
                    buffer[place.offset : end].copy_(_bytes_of(tensor.detach().to("cpu")))
            del buffer  # no view may outlive the mapping
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return StagedWeights("file", str(path), places, total)


def sweep(directory: Path) -> int:
    """Remove the staged files of engine processes that no longer run (one killed
    between writing a set and removing it would otherwise leave it in RAM); returns how
    many went."""
    removed = 0
    for path in directory.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def _stage_on_device(
    state_dict: Mapping[str, torch.Tensor],
    places: list[StagedTensor],
    total: int,
    device: torch.device,
) -> StagedWeights:
    import msgspec

    from seamlessflow.weights.device import CudaBuffers

    buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    for place, tensor in zip(places, state_dict.values(), strict=True):
        if place.nbytes:
            buffer[place.offset : place.offset + place.nbytes].copy_(_bytes_of(tensor.detach()))
    torch.cuda.synchronize(device)  # complete before the worker reads on its own stream
    handle = CudaBuffers(str(device)).export(buffer)
    return StagedWeights("cuda", msgspec.to_builtins(handle), places, total, _owned=buffer)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def opened(kind: str, where: Any, tensors: list[Any]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """In the worker: views of the staged tensors (``tensors`` as ``StagedTensor`` fields,
    however the call's serialization delivered them), valid inside the block."""
    places = [t if isinstance(t, StagedTensor) else _place(t) for t in tensors]
    if kind == "file":
        with open(where, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            # a private copy-on-write mapping: writable views, no copy unless written
            mapping = mmap.mmap(source.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
            yield _views(buffer, places)
            del buffer
        finally:
            with contextlib.suppress(BufferError):  # a view kept past the block pins it
                mapping.close()
    elif kind == "cuda":
        import msgspec

        from seamlessflow.protocol import DeviceHandle
        from seamlessflow.weights.device import CudaBuffers

        buffer = CudaBuffers().open(msgspec.convert(where, DeviceHandle))
        try:
            yield _views(buffer, places)
        finally:
            del buffer  # the last reference: the mapping is released
    else:
        raise ValueError(f"unknown staged weights kind {kind!r}")


def _place(fields: Any) -> StagedTensor:
    if isinstance(fields, Mapping):
        name, dtype, shape = fields["name"], fields["dtype"], fields["shape"]
        offset, nbytes = fields["offset"], fields["nbytes"]
    else:
        name, dtype, shape, offset, nbytes = fields
    return StagedTensor(str(name), str(dtype), tuple(int(n) for n in shape), int(offset),
                        int(nbytes))  # fmt: skip


def _views(buffer: torch.Tensor, places: list[StagedTensor]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for place in places:
        dtype = getattr(torch, place.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{place.name}: not a dtype: {place.dtype!r}")
        raw = buffer[place.offset : place.offset + place.nbytes]
        out.append((place.name, raw.view(dtype).reshape(place.shape)))
    return out
