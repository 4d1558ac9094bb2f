"""What this machine can do, and the defaults that follow from it.

- ``machine_description``: what a benchmark result was measured on, written next to its
  figures so that a regression check can tell a slower commit from other hardware.
- ``resolve_precision`` / ``engine_dtype``: the ``auto`` precision rule. bfloat16 is
  chosen only where the device computes it natively: a CUDA device that supports it, or
  a CPU whose oneDNN reports bf16 support (AVX512-BF16 / AMX class). Elsewhere float32:
  on an AVX2-only CPU (most laptops, many cloud CPUs) a bf16-autocast matmul is ~40x
  slower than the same matmul in float32 (docs/benchmarks.md, "Precision by CPU kind").
- ``capabilities``: everything ``seamlessflow doctor`` prints.

torch is imported inside the functions: ``seamlessflow --help`` stays instant.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

PrecisionName = Literal["fp32", "bf16-mixed"]
PRECISIONS = ("auto", "fp32", "bf16-mixed")
"""What ``--precision`` / ``SF_PRECISION`` take; ``auto`` is resolved here."""


def machine_description() -> dict[str, Any]:
    """Cores, platform and the versions that set the speed of a run (torch,
    transformers), plus the load average when it is called: the machine is shared with
    other jobs, so call it just before measuring."""
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable_cores(),
        "cpu_isa": cpu_isa(),
        "cpu_bf16": cpu_computes_bf16(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def usable_cores() -> int:
    """Cores this process may run on (its affinity, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_isa() -> str:
    """The kernel set torch's CPU ops dispatch to (``AVX512``, ``AVX2``, ``DEFAULT``...;
    ``ATEN_CPU_CAPABILITY`` lowers it)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def cpu_computes_bf16() -> bool:
    """Whether oneDNN, which computes torch's CPU matmuls under autocast, reports bf16
    support on this CPU (``ONEDNN_MAX_CPU_ISA=AVX2`` makes it say no, as an AVX2-only
    CPU does)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def cuda_computes_bf16(device: str = "cuda") -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    index = torch.device(device).index
    with torch.cuda.device(index if index is not None else 0):
        return bool(torch.cuda.is_bf16_supported())


def computes_bf16(device: str) -> tuple[bool, str]:
    """Whether ``device`` (``cpu``, ``cuda``, ``cuda:1``) computes bfloat16 natively, and
    the reason in words."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return False, f"{device} asked for but torch sees no CUDA device"
        name = torch.cuda.get_device_name(torch.device(device))
        if cuda_computes_bf16(device):
            return True, f"{name} computes bf16 natively"
        return False, f"{name} does not support bf16"
    if kind != "cpu":
        return False, f"device {device}: bf16 support not known"
    isa = cpu_isa()
    if cpu_computes_bf16():
        return True, f"the CPU computes bf16 natively (oneDNN reports bf16; ISA {isa})"
    return False, (
        f"the CPU has no native bf16 (oneDNN reports none; ISA {isa}): bf16 autocast "
        "would be ~40x slower than float32 here"
    )


@dataclass(frozen=True)
class PrecisionChoice:
    """A run's compute precision and why: recorded in summary.json and printed first."""

    requested: str
    chosen: PrecisionName
    reason: str

    def line(self) -> str:
        how = "auto: " if self.requested == "auto" else "as asked: "
        return f"precision {self.chosen} ({how}{self.reason})"

    def record(self) -> dict[str, str]:
        return asdict(self)


def resolve_precision(requested: str, device: str = "cpu") -> PrecisionChoice:
    """``auto``: ``bf16-mixed`` where ``device`` computes bf16 natively, ``fp32``
    elsewhere. An explicit choice is kept (the reason says what the hardware does)."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(PRECISIONS)}")
    native, why = computes_bf16(device)
    if requested == "auto":
        return PrecisionChoice("auto", "bf16-mixed" if native else "fp32", why)
    chosen: PrecisionName = "bf16-mixed" if requested == "bf16-mixed" else "fp32"
    return PrecisionChoice(requested, chosen, why)


def engine_dtype(requested: str, device: str = "cpu") -> str:
    """An engine's weights dtype: ``auto`` is ``bfloat16`` on a CUDA device that computes
    it natively and ``float32`` on a CPU, every kind. On a CPU the engine stays float32
    even where bf16 is native: its logprobs are what the trainer's ratio is taken
    against, and CPU engines were measured (and their tolerances set) in float32.
    Anything else is a torch dtype name, kept."""
    if requested != "auto":
        return requested
    import torch

    if torch.device(device).type == "cuda" and computes_bf16(device)[0]:
        return "bfloat16"
    return "float32"


def matmul_seconds(dtype: str, repeats: int = 3) -> float:
    """One thread, the shape of a SmolLM2 MLP projection over 512 tokens (512x576 by
    576x1536): the best of ``repeats``, in float32 or under bf16 autocast. What the
    ``auto`` rule stands on, measured (``seamlessflow doctor --measure``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 576), torch.randn(576, 1536)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms oneDNN's kernel cache
            start = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
                a @ b
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _answers(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def capabilities() -> dict[str, Any]:
    """The machine as a run sees it: CPU kind, bf16, cores, GPUs, Docker and a compose
    CLI (``seamlessflow doctor``)."""
    import torch

    gpus = [
        {
            "name": torch.cuda.get_device_name(i),
            "bf16": cuda_computes_bf16(f"cuda:{i}"),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ]
    docker_cli = shutil.which("docker") is not None
    compose = ""
    if docker_cli and _answers(["docker", "compose", "version"]):
        compose = "docker compose"
    elif shutil.which("docker-compose"):
        compose = "docker-compose"
    return {
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_bf16": cpu_computes_bf16(),
        "cores": usable_cores(),
        "gpus": gpus,
        "docker_cli": docker_cli,
        "docker_daemon": docker_cli and _answers(["docker", "info"]),
        "dockerd_installed": shutil.which("dockerd") is not None,
        "compose_cli": compose,
        "torch": torch.__version__,
    }
