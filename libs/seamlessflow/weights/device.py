"""Device buffers that another process on the host can map: the thin, swappable layer
under the ``cuda_ipc`` transport (``weights.ipc``).

A ``DeviceBuffers`` allocates a buffer filled with one payload bucket (or adopts one the
trainer packed on its device), exports a handle to it (plain data:
``protocol.DeviceHandle``), opens a handle another process exported, gives an opened
buffer as a uint8 tensor where it lies, and closes or frees. Two implementations:

- ``CudaBuffers``: uint8 CUDA tensors, handles from torch's CUDA IPC (the fields of
  ``torch.multiprocessing.reductions.reduce_tensor``'s recipe, rebuilt with
  ``rebuild_cuda_tensor``); no pickle travels, so a peer's message is never executed.
- ``SharedMemoryBuffers``: the CPU stand-in, one file per buffer in a shared-memory
  directory named by the handle. Its semantics are those the protocol relies on: a
  buffer freed by its owner stays readable by whoever mapped it (an unlinked file's
  mapping; CUDA: torch keeps a shared allocation until importers release it), and a
  handle opened after the free fails (``BufferGone``).

Every method blocks (device copies, file I/O): callers run them in a worker thread. All
protocol logic (handles in manifests, acknowledgements, lifetime, fallbacks) is in
``weights.ipc`` and runs on CPU over the stand-in.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from seamlessflow.protocol import DeviceHandle


class BufferGone(Exception):
    """A handle that cannot be opened here (freed, another host, no such device)."""


class DeviceBuffers(Protocol):
    kind: str
    """The ``DeviceHandle.kind`` this layer exports and opens."""

    def allocate(self, data: memoryview) -> Any:
        """A new buffer holding a copy of ``data``, complete when this returns."""
        ...

    def adopt(self, bucket: Any) -> Any:
        """A buffer holding ``bucket`` (a uint8 tensor the trainer packed on its device):
        the tensor itself where this layer's buffers are such tensors, else a copy;
        complete when this returns."""
        ...

    def export(self, buffer: Any) -> DeviceHandle:
        """A handle other processes on this host can ``open``."""
        ...

    def checksum(self, buffer: Any) -> int:
        """``byte_sum`` of an allocated buffer, computed where it lies."""
        ...

    def free(self, buffer: Any) -> None:
        """The owner is done with ``buffer``; opened mappings stay valid until closed."""
        ...

    def open(self, handle: DeviceHandle) -> Any:
        """Map another process's buffer. Raises ``BufferGone``."""
        ...

    def close(self, mapping: Any) -> None:
        """Release a mapping ``open`` returned."""
        ...

    def tensor(self, mapping: Any) -> Any:
        """The mapped buffer as a uint8 tensor where it lies (read it, never write it)."""
        ...


def byte_sum(buffer: Any) -> int:
    """A uint8 tensor's bytes summed as int64, computed on its device: the checksum of a
    device bucket (``DevicePayload.checksums``)."""
    import torch

    return int(buffer.sum(dtype=torch.int64)) if buffer.numel() else 0


class SharedMemoryBuffers:
    """The stand-in: each buffer a file ``<prefix>buffer-<uuid>`` in ``directory``."""

    kind = "shm"

    def __init__(self, directory: Path, prefix: str) -> None:
        self.directory, self.prefix = directory, prefix

    def allocate(self, data: memoryview) -> Path:
        path = self.directory / f"{self.prefix}buffer-{uuid.uuid4().hex}"
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)  # whole or absent, as a device allocation is
        return path

    def adopt(self, bucket: Any) -> Path:
        from seamlessflow.weights.layout import as_bytes

        return self.allocate(as_bytes(bucket.detach().cpu().contiguous()))

    def export(self, buffer: Path) -> DeviceHandle:
        return DeviceHandle(kind="shm", name=buffer.name.encode(), nbytes=buffer.stat().st_size)

    def checksum(self, buffer: Path) -> int:
        import torch

        data = bytearray(buffer.read_bytes())
        return byte_sum(torch.frombuffer(data, dtype=torch.uint8)) if data else 0

    def free(self, buffer: Path) -> None:
        buffer.unlink(missing_ok=True)

    def open(self, handle: DeviceHandle) -> mmap.mmap:
        name = handle.name.decode(errors="replace")
        # a handle is input: only this run's buffers, and only a plain name in the directory
        if not name.startswith(self.prefix) or "/" in name or handle.kind != self.kind:
            raise BufferGone(f"{name!r} is not a buffer of this run")
        try:
            with (self.directory / name).open("rb") as source:
                if os.fstat(source.fileno()).st_size != handle.nbytes or handle.nbytes == 0:
                    raise BufferGone(f"{name}: not {handle.nbytes} bytes")
                return mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:
            raise BufferGone(f"{name} (freed, or another host)") from exc

    def close(self, mapping: mmap.mmap) -> None:
        mapping.close()

    def tensor(self, mapping: mmap.mmap) -> Any:
        import warnings

        import torch

        with warnings.catch_warnings():  # a read-only mapping: it is only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mapping, dtype=torch.uint8)


class CudaBuffers:
    """uint8 CUDA tensors shared by CUDA IPC (through torch, which keeps the allocation
    alive while an importer holds it: its shared reference counter)."""

    kind = "cuda"

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self.device = torch.device(device)

    def allocate(self, data: memoryview) -> Any:
        import torch

        host = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
        buffer = torch.empty(len(data), dtype=torch.uint8, device=self.device)
        buffer.copy_(host)
        # complete before any handle to it leaves: importers read on their own streams
        torch.cuda.synchronize(self.device)
        return buffer

    def adopt(self, bucket: Any) -> Any:
        """``bucket`` itself: a uint8 tensor on this layer's device that is a whole
        allocation of its own (``export`` maps storages, not views)."""
        import torch

        if bucket.device != self.device or bucket.dtype != torch.uint8:
            raise ValueError(
                f"a {bucket.dtype} bucket on {bucket.device}, not uint8 on {self.device}"
            )
        if bucket.storage_offset() or bucket.untyped_storage().nbytes() != bucket.numel():
            raise ValueError("a bucket must be a whole storage of its own")
        # packed on the trainer's stream: complete before any handle to it leaves
        torch.cuda.synchronize(self.device)
        return bucket

    def export(self, buffer: Any) -> DeviceHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        _rebuild, recipe = reduce_tensor(buffer)
        (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device, handle,
         storage_bytes, storage_offset, _grad, counter, counter_offset, event,
         event_sync) = recipe  # fmt: skip
        if tensor_offset != 0 or storage_bytes != buffer.numel():
            raise ValueError("a buffer must be a whole storage of its own")
        return DeviceHandle(
            kind="cuda",
            name=handle,
            nbytes=storage_bytes,
            offset=storage_offset,
            device=device,
            ref_counter=counter,
            ref_counter_offset=counter_offset,
            event=event or b"",
            event_sync=bool(event_sync),
        )

    def checksum(self, buffer: Any) -> int:
        return byte_sum(buffer)

    def free(self, buffer: Any) -> None:
        del buffer  # the caller drops its reference too; torch frees once importers let go

    def open(self, handle: DeviceHandle) -> Any:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if handle.kind != self.kind or handle.nbytes <= 0:
            raise BufferGone(f"not a CUDA buffer: {handle.kind}, {handle.nbytes} bytes")
        try:
            return rebuild_cuda_tensor(
                torch.Tensor, (handle.nbytes,), (1,), 0, torch.storage.TypedStorage,
                torch.uint8, handle.device, handle.name, handle.nbytes, handle.offset,
                False, handle.ref_counter, handle.ref_counter_offset, handle.event or None,
                handle.event_sync,
            )  # fmt: skip
        except (RuntimeError, TypeError, ValueError) as exc:  # a CUDA error is a RuntimeError
            raise BufferGone(f"CUDA IPC handle not opened: {exc}") from exc

    def close(self, mapping: Any) -> None:
        del mapping  # the last reference: torch closes the handle and tells the exporter

    def tensor(self, mapping: Any) -> Any:
        return mapping  # already a uint8 CUDA tensor
