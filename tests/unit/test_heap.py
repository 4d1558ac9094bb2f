"""``seamlessflow.heap.compact_heap``: blocks of megabytes that a process frees go back to
the kernel, where glibc's defaults keep them resident (its mmap threshold rises to the
largest block freed). Each case runs in a fresh interpreter: the heap is per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
import torch
from seamlessflow.heap import compact_heap

def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

if sys.argv[1] == "compact":
    assert compact_heap()
first = torch.ones(1 << 20)  # 4 MiB: freeing it raises glibc's dynamic threshold
del first
before = resident()
big, small = [], []
for _ in range(100):  # 400 MiB in blocks of 4 MiB, small tensors between them
    big.append(torch.ones(1 << 20))
    small.append(torch.ones(16))
held = resident() - before
del big
print(held, resident() - before)
"""


def held_then_kept(mode: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    held, kept = map(int, done.stdout.split())
    return held, kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_blocks_of_megabytes_leave_the_process() -> None:
    held, kept = held_then_kept("compact")
    assert held > 350 * 2**20  # the blocks were resident
    default_held, default_kept = held_then_kept("default")
    assert kept < 0.1 * held, (
        f"compact: {kept / 2**20:.0f} MiB of {held / 2**20:.0f} still resident after the "
        f"free (glibc's defaults: {default_kept / 2**20:.0f} of {default_held / 2**20:.0f})"
    )
