"""The learner's intra-op threads: its own, plus cores lent by idle rollout engines.

Lending in the other direction (the tag-scheduler's ``CoresLent``): while the trainer
trains, a dedicated rollout engine on its host that has nothing to generate lends it
its cores, and takes them back with its next request. The message arrives on the
event loop; the thread count may only change on the learner thread (torch's intra-op
pool size is the calling thread's OpenMP setting), so :meth:`ThreadBudget.lend`
records the offer and :meth:`ThreadBudget.apply` puts it into effect at the next
boundary: before each layer's forward and when each layer's gradient is computed
(:meth:`ThreadBudget.install`), so a change takes effect within one layer's work.

Never more threads than the cores this process may run on (``os.sched_getaffinity``):
a trainer pinned to its own slots (``--pin-slots``) or in a container's cpuset gains
nothing from a lent core it cannot use, and oversubscribing its own would slow it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def usable_cpus() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ThreadBudget:
    def __init__(self, own: int, cpus: int | None = None) -> None:
        """``own``: the trainer's threads on its own slots (``SF_TRAINER_TORCH_THREADS``);
        ``cpus``: the most it may run (default: :func:`usable_cpus`)."""
        if own < 1:
            raise ValueError(f"own threads must be >= 1, got {own}")
        self.own = own
        self.cpus = max(own, cpus if cpus is not None else usable_cpus())
        self._lent = 0
        """Written by the event loop thread, read by the learner thread: one int, so a
        read sees the old or the new offer, both valid."""
        self._applied = own
        self._since = time.monotonic()
        self._extra_thread_s = 0.0
        self.switches = 0

    def lend(self, threads: int) -> None:
        """Any thread: ``threads`` lent cores from now on (0: they went back)."""
        self._lent = max(0, threads)

    @property
    def wanted(self) -> int:
        return min(self.own + self._lent, self.cpus)

    @property
    def applied(self) -> int:
        return self._applied

    def apply(self) -> None:
        """Learner thread only: run on the threads offered now, if that changed."""
        wanted = self.wanted
        if wanted == self._applied:
            return
        now = time.monotonic()
        self._extra_thread_s += (self._applied - self.own) * (now - self._since)
        self._since = now
        torch.set_num_threads(wanted)
        self._applied = wanted
        self.switches += 1

    def extra_thread_seconds(self) -> float:
        """Thread-seconds run beyond its own so far (a step's share: the difference of
        two readings)."""
        open_interval = (self._applied - self.own) * (time.monotonic() - self._since)
        return self._extra_thread_s + open_interval

    def install(self, model: torch.nn.Module) -> list[RemovableHandle]:
        """:meth:`apply` before the forward of the model and of each layer of its
        layer stacks (the children of every ``ModuleList``), and when the gradient of
        each such layer's first parameter is computed (backward runs on the caller's
        thread on the CPU, so this is the learner thread too)."""

        def before_forward(_module: torch.nn.Module, _args: Any) -> None:
            self.apply()

        def on_gradient(_grad: torch.Tensor) -> None:
            self.apply()

        handles = [model.register_forward_pre_hook(before_forward)]
        for stack in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
            for layer in stack:
                handles.append(layer.register_forward_pre_hook(before_forward))
                first = next((p for p in layer.parameters() if p.requires_grad), None)
                if first is not None:
                    handles.append(first.register_hook(on_gradient))
        return handles
