"""The run's sampling of its processes' resident memory (``sf_app.run.memory``), on real
processes: one that holds memory it touched, with a child that holds some too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sf_app.run.memory import ProcessMemory, descendants, resident_bytes

MB = 1 << 20

# A parent that touches 96 MB, starts a child that touches 48 MB, says so, and waits.
HOLDER = textwrap.dedent(
    """
    import subprocess, sys
    held = bytearray(96 << 20)
    held[:: 4096] = b"x" * len(held[:: 4096])
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys; held = bytearray(48 << 20); held[:: 4096] = b'x' * len(held[:: 4096]);"
        "print('child ready', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    sys.stdin.read()
    child.stdin.close()
    child.wait()
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc only")
def test_a_process_and_its_descendants_are_sampled_and_a_gone_one_is_skipped() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        child_pid = int(holder.stdout.readline())
        assert descendants(holder.pid) == [child_pid]
        own = resident_bytes(holder.pid)
        theirs = resident_bytes(child_pid)
        assert own is not None and theirs is not None
        assert own[0] >= 96 * MB and own[1] >= own[0]  # VmHWM is at least VmRSS
        assert theirs[0] >= 48 * MB

        memory = ProcessMemory(every_s=2.0)
        assert memory.sample({"holder": holder.pid}, now=100.0)
        figures = memory.figures["holder"]
        assert figures["samples"] == 1 and figures["peak_rss_bytes"] >= 96 * MB
        # the tree: the holder's and its child's, both touched
        assert figures["tree_peak_rss_bytes"] >= own[0] + 40 * MB
        assert not memory.sample({"holder": holder.pid}, now=101.0)  # too soon
        assert memory.figures["holder"]["samples"] == 1
        assert memory.sample({"holder": holder.pid}, now=101.0, force=True)  # the last one
        assert memory.figures["holder"]["samples"] == 2
    finally:
        holder.communicate(timeout=60)
    # gone (and reaped): skipped, the figures it left are kept
    assert resident_bytes(holder.pid) is None
    assert memory.sample({"holder": holder.pid}, now=104.0)
    assert memory.figures["holder"]["samples"] == 2
    assert memory.figures["holder"]["peak_rss_bytes"] >= 96 * MB


def test_a_zombie_or_no_proc_reports_nothing(tmp_path: Path) -> None:
    """A zombie's status has no memory lines; a missing /proc entry is None too."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("Name:\tgone\nState:\tZ (zombie)\n")
    assert resident_bytes(7, tmp_path) is None
    assert resident_bytes(8, tmp_path) is None
    assert descendants(8, tmp_path) == []
    memory = ProcessMemory(proc=tmp_path)
    assert memory.sample({"gone": 7, "never": 8}, now=0.0)
    assert memory.figures == {}
