"""The test suite under each of torch's CPU kernel sets, another thread count, and
beside a CPU hog: what a machine other than the developer's does to it.

Numeric tolerances in the suite come from what is compared, never from one CPU's
rounding; this runs the suite (or the given pytest arguments) once per variant and
reports each pass or fail, so a tolerance that holds only for one kernel's summation
order, or a test that only passes on an idle machine, shows here rather than on a
user's machine:

- ``ATEN_CPU_CAPABILITY`` = ``avx512``, ``avx2``, ``default`` (on a CPU without AVX-512
  torch falls back to the best it has, so that variant repeats ``avx2``); the ``avx2``
  variant also sets ``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2-only CPU without native bf16;
- ``OMP_NUM_THREADS=2`` (tests that pin their own thread count keep it);
- a busy loop pinned to core 0 (``taskset``, when present) for the whole run: the suite
  then shares a core with it, as on a loaded CI runner. The hog is killed at the end.

Usage: ``python loadtests/portability.py [pytest args]``; exit 1 if any variant failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

VARIANTS: list[tuple[str, dict[str, str], bool]] = [
    ("ATEN_CPU_CAPABILITY=avx512", {"ATEN_CPU_CAPABILITY": "avx512"}, False),
    # an AVX2-only CPU: torch's kernels and oneDNN's (which then reports no bf16, so
    # every ``auto`` precision resolves to float32, as on such a CPU)
    (
        "AVX2-only (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)",
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        False,
    ),
    ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}, False),
    ("OMP_NUM_THREADS=2", {"OMP_NUM_THREADS": "2"}, False),
    ("CPU hog on core 0", {}, True),
]


def start_hog() -> subprocess.Popen[bytes]:
    busy = [sys.executable, "-c", "while True: pass"]
    if shutil.which("taskset"):
        busy = ["taskset", "-c", "0", *busy]
    return subprocess.Popen(busy)


def run(pytest_args: list[str], env: dict[str, str], hog: bool) -> tuple[int, float]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    busy = start_hog() if hog else None
    started = time.monotonic()
    try:
        code = subprocess.call(command, env={**os.environ, **env})
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return code, time.monotonic() - started


def main(pytest_args: list[str]) -> int:
    results = []
    for label, env, hog in VARIANTS:
        print(f"== {label}", flush=True)
        code, seconds = run(pytest_args, env, hog)
        results.append((label, code, seconds))
    print("\nportability:")
    for label, code, seconds in results:
        print(f"  {'pass' if code == 0 else f'FAIL ({code})':10s} {label}  ({seconds:.0f} s)")
    return 0 if all(code == 0 for _, code, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
