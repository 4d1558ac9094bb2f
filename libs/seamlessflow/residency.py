"""A model's memory moved off its device and back: the trainer while its slot is lent to
rollout, an engine asleep.

``Residency`` holds the storages of the tensors it is given (parameters, optimizer
state; views and tied matrices share one storage and count once) and moves them through

    resident --offload--> offloaded --reload--> resident

Offload copies every storage's bytes into a host buffer (pinned on CUDA, so the copies
run at the copy engine's pace), waits for the copies, then frees each storage in place
(``UntypedStorage.resize_(0)``). Reload allocates each storage again at its size and
copies the bytes back. Because the storages themselves are freed and refilled, not
replaced, every tensor, view, parameter object and optimizer-state key stays what it was:
FSDP2's sharded parameters (views of its padded flat shard), a tied head, AdamW's state
dict. Nothing else needs re-pointing.

Invariants:
- a transition either completes or leaves the state it started from: an offload frees
  nothing until every copy is done; a reload that fails (the device out of memory
  because the memory lent has not been given back) frees again what it had allocated,
  so it can be retried;
- the contents are bitwise what they were: the bytes are copied, never cast;
- every transition is accounted (``Transition``): its seconds and, before and after it,
  the bytes of the held storages on the device, the host copies, and the device
  allocator's own count where there is one (CUDA). Host copies are freed at reload
  unless ``keep_host_copies`` (pinned host memory is slow to allocate: kept, the next
  offload reuses it, at the price of holding it while resident).

While offloaded, the tensors keep their shapes over storages of no bytes: reading or
writing one is undefined (torch does not check every access; a read can crash the
process). The owner alone touches them and reloads first (the trainer's ``Learner``
reloads before any command that is not an offload).

A storage that cannot be resized (a tensor read straight from a memory-mapped
safetensors file: a CPU model loaded in the file's dtype) is refused when the tensors are
given; ``resizable_parameters`` gives such a module's parameters storages of their own.
Tensors not on the device (an optimizer's ``step`` counters, FSDP2 shards offloaded to
the host) are left where they are.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from torch import nn

State = Literal["resident", "offloading", "offloaded", "reloading"]
LEDGER_LENGTH = 64


class ResidencyError(RuntimeError):
    """A transition asked from the wrong state, or tensors that cannot be moved."""


@dataclass(frozen=True)
class MemoryFigures:
    """Memory at one moment, in bytes."""

    on_device: int
    """The held storages' bytes on the device now."""
    host_copies: int
    """The host buffers this residency holds."""
    allocated: int | None
    """The device allocator's count (``torch.cuda.memory_allocated``); None on a CPU,
    whose allocator keeps no such count."""


@dataclass(frozen=True)
class Transition:
    """One offload or reload, accounted."""

    name: Literal["offload", "reload"]
    seconds: float
    before: MemoryFigures
    after: MemoryFigures

    @property
    def device_bytes_moved(self) -> int:
        """How much device memory the transition freed (offload) or took (reload)."""
        return abs(self.before.on_device - self.after.on_device)

    def in_words(self) -> str:
        gb = 1e9
        allocator = (
            f", allocator {self.before.allocated / gb:.3f} -> {self.after.allocated / gb:.3f} GB"
            if self.before.allocated is not None and self.after.allocated is not None
            else ""
        )
        return (
            f"{self.name} in {self.seconds:.3f}s: on the device "
            f"{self.before.on_device / gb:.3f} -> {self.after.on_device / gb:.3f} GB, "
            f"host copies {self.before.host_copies / gb:.3f} -> "
            f"{self.after.host_copies / gb:.3f} GB{allocator}"
        )


class _Held:
    """One storage and its host copy."""

    __slots__ = ("host", "nbytes", "storage")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host: torch.Tensor | None = None

    def device_bytes(self) -> torch.Tensor:
        """The storage's bytes as a flat uint8 tensor (valid while allocated)."""
        return torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(self.storage)


class Residency:
    """Offload and reload the storages of ``tensors`` on ``device`` (see the module)."""

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        keep_host_copies: bool = False,
    ) -> None:
        if device.type == "cuda" and device.index is None:
            # a tensor's device always names its index: compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.keep_host_copies = keep_host_copies
        self.pinned = device.type == "cuda"
        self.ledger: collections.deque[Transition] = collections.deque(maxlen=LEDGER_LENGTH)
        """The latest transitions, oldest first (an owner may move its memory every
        step for weeks)."""
        self._state: State = "resident"
        self._held = self._storages(tensors)

    @property
    def state(self) -> State:
        return self._state

    @property
    def nbytes(self) -> int:
        """The bytes of every storage held (what an offload moves)."""
        return sum(held.nbytes for held in self._held)

    def holds(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether ``tensors`` lie in exactly the storages held (an owner whose tensors
        did not change keeps one residency, and with it its host copies)."""
        given = {id_ for id_, storage in self._device_storages(tensors) if storage.nbytes()}
        return given == {held.storage._cdata for held in self._held}

    def _device_storages(
        self, tensors: Iterable[torch.Tensor]
    ) -> Iterable[tuple[int, torch.UntypedStorage]]:
        """Each tensor's storage on the device, by the identity of the storage itself
        (it outlives a resize, unlike its data pointer)."""
        for tensor in tensors:
            local = _local(tensor)
            if local.device == self.device:
                storage = local.untyped_storage()
                yield storage._cdata, storage

    def _storages(self, tensors: Iterable[torch.Tensor]) -> list[_Held]:
        seen: dict[int, _Held] = {}
        unresizable = 0
        for identity, storage in self._device_storages(tensors):
            if storage.nbytes() == 0 or identity in seen:
                continue
            if not storage.resizable():
                unresizable += 1
                continue
            seen[identity] = _Held(storage)
        if unresizable:
            raise ResidencyError(
                f"{unresizable} tensors on {self.device} cannot be freed in place (their "
                "memory is mapped from a file): give their module storages of its own "
                "first (seamlessflow.residency.resizable_parameters)"
            )
        return list(seen.values())

    def figures(self) -> MemoryFigures:
        on_device = sum(held.storage.nbytes() for held in self._held)
        host = sum(held.host.numel() for held in self._held if held.host is not None)
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        return MemoryFigures(on_device=on_device, host_copies=host, allocated=allocated)

    def offload(self) -> Transition:
        """Copy every storage to the host, then free it on the device."""
        self._expect("resident", "offload")
        before, started = self.figures(), time.perf_counter()
        self._state = "offloading"
        try:
            for held in self._held:
                if held.host is None or held.host.numel() != held.nbytes:
                    held.host = torch.empty(held.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
                held.host.copy_(held.device_bytes(), non_blocking=self.pinned)
            self._synchronize()
        except BaseException:
            self._state = "resident"  # nothing was freed yet
            raise
        for held in self._held:
            held.storage.resize_(0)
        self._state = "offloaded"
        return self._record("offload", started, before)

    def reload(self) -> Transition:
        """Allocate every storage again and copy its bytes back from the host."""
        self._expect("offloaded", "reload")
        before, started = self.figures(), time.perf_counter()
        self._state = "reloading"
        try:
            for held in self._held:
                held.storage.resize_(held.nbytes)
                assert held.host is not None  # set by the offload
                held.device_bytes().copy_(held.host, non_blocking=self.pinned)
            self._synchronize()
        except BaseException:
            # give back what was allocated: the device stays as the offload left it
            for held in self._held:
                held.storage.resize_(0)
            self._state = "offloaded"
            raise
        if not self.keep_host_copies:
            for held in self._held:
                held.host = None
        self._state = "resident"
        return self._record("reload", started, before)

    def _expect(self, state: State, transition: str) -> None:
        if self._state != state:
            raise ResidencyError(f"cannot {transition} while {self._state} (needs {state})")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record(
        self, name: Literal["offload", "reload"], started: float, before: MemoryFigures
    ) -> Transition:
        transition = Transition(name, time.perf_counter() - started, before, self.figures())
        self.ledger.append(transition)
        return transition


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage is the memory this rank holds)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def resizable_parameters(module: nn.Module) -> int:
    """Give every parameter of ``module`` whose storage cannot be resized (mapped from
    a file) a copy of its own; returns how many were copied. Tied parameters are one
    object, so they stay tied; the bytes are unchanged."""
    copied = 0
    for param in module.parameters():
        if not _local(param).untyped_storage().resizable():
            param.data = param.data.clone()
            copied += 1
    return copied
