"""Resident memory of a run's processes, sampled while it runs (the report's
``process_memory``).

A run that goes on for weeks must show where memory goes: a process whose peak keeps
rising over the run has a leak or a fragmented heap. Each process's figures come from
Linux's ``/proc/<pid>/status``:

- ``peak_rss_bytes``: the kernel's own high-water mark of the process's resident memory
  (``VmHWM``), the largest seen over its incarnations (a restarted process keeps its
  label);
- ``tree_peak_rss_bytes``: the largest sampled sum of its resident memory (``VmRSS``)
  and its descendants' (vLLM's engine core and its workers are children of the engine
  service process). A sampled peak, ``SAMPLE_EVERY_S`` apart: it can miss a spike
  between samples, which ``peak_rss_bytes`` cannot (for the process itself);
- ``samples``: how many samples saw the process alive. The last is taken just before
  the run stops its processes, so a process that runs to the end reports the peak of
  its whole life (a trainer exits by itself once it finished: its last sample is the
  one before).

Pages shared between processes (a forked process's inherited pages, shared memory that
several map) count in each that has them resident, as ``ps`` counts them. Elsewhere
than Linux nothing is sampled and the report's ``process_memory`` is empty.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")
SAMPLE_EVERY_S = 2.0
"""The run's supervision polls every 0.5 s; reading ``/proc`` of every process that
often would cost more than it tells."""


def resident_bytes(pid: int, proc: Path = PROC) -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of ``pid`` in bytes; None for a process that is gone, a zombie
    (no memory left to report) or no ``/proc`` here."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024  # the kernel writes kB
    if len(fields) < 2:
        return None
    return fields["VmRSS"], fields["VmHWM"]


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every live descendant of ``pid`` (children of each of its threads, recursively),
    from ``/proc/<pid>/task/<tid>/children``; [] where the kernel does not list them."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = list((proc / str(parent) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if child not in found:
                    found.append(child)
                    pending.append(child)
    return found


class ProcessMemory:
    """The figures of each labelled process (module docstring), updated by ``sample``."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, proc: Path = PROC) -> None:
        self.every_s = every_s
        self.proc = proc
        self.figures: dict[str, dict[str, int]] = {}
        """Label -> ``peak_rss_bytes``, ``tree_peak_rss_bytes``, ``samples``: the report's
        ``process_memory`` (the same dict)."""
        self._sampled = -math.inf

    def sample(
        self, pids: Mapping[str, int], now: float | None = None, force: bool = False
    ) -> bool:
        """Read every process of ``pids`` (label -> pid) unless the last sample was less
        than ``every_s`` ago (``force``: now anyway; the run's last sample, just before
        it stops its processes, when ``VmHWM`` holds each one's whole-life peak); returns
        whether it sampled."""
        now = time.monotonic() if now is None else now
        if now - self._sampled < self.every_s and not force:
            return False
        self._sampled = now
        for label, pid in pids.items():
            own = resident_bytes(pid, self.proc)
            if own is None:
                continue
            rss, high_water = own
            tree = rss
            for child in descendants(pid, self.proc):
                theirs = resident_bytes(child, self.proc)
                tree += theirs[0] if theirs is not None else 0
            figures = self.figures.setdefault(
                label, {"peak_rss_bytes": 0, "tree_peak_rss_bytes": 0, "samples": 0}
            )
            figures["peak_rss_bytes"] = max(figures["peak_rss_bytes"], high_water)
            figures["tree_peak_rss_bytes"] = max(figures["tree_peak_rss_bytes"], tree)
            figures["samples"] += 1
        return True
