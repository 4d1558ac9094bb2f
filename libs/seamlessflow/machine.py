"""What a benchmark result was measured on: written next to its figures so that a
regression check can tell a slower commit from other hardware or library versions."""

from __future__ import annotations

import os
import platform
from importlib.metadata import version
from typing import Any


def machine_description() -> dict[str, Any]:
    """Cores, platform and the versions that set the speed of a run (torch,
    transformers), plus the load average when it is called: the machine is shared with
    other jobs, so call it just before measuring."""
    import torch  # here, not at import: ``seamlessflow --help`` stays instant

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
