"""Results of the deployment-modes benchmark (``seamlessflow bench --out``) as the
regression check (loadtests/regression.py) reads them: the machine, the settings and the
ratios, with given values of the ratios."""

from __future__ import annotations

from typing import Any

RATIO = "disaggregated_steps_per_s_vs_colocated"
"""The ratio ``seamlessflow bench`` writes for the disaggregated mode against colocated."""


def modes_result(**ratios: float) -> dict[str, Any]:
    """A ``seamlessflow bench --out`` result with these ratios (figures left out: the
    check reads only the machine and the ratios)."""
    return {
        "machine": {"cpu_count": 2, "platform": "Linux-test", "python": "3.11.7"},
        "settings": {"steps": 60, "modes": ["colocated", "disaggregated", "multiplexed"]},
        "modes": [],
        "ratios": dict(ratios),
    }
