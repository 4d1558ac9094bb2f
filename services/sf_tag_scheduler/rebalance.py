"""Rebalance on lend: which in-flight requests to move onto freshly lent engines.

A freshly lent engine otherwise gets only requests made after it joined, while the
step's requests sit on the dedicated engines. The plan moves in-flight requests from the
busiest engines onto it (partial rollout: they keep their tokens and resume there) until
it holds its share. Pure: the tag-scheduler sends the plan to the engines
(``engine.shed.<engine>``); the simulator applies it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shed:
    """Move ``count`` in-flight requests from engine ``donor`` onto engine ``target``."""

    donor: str
    target: str
    count: int


def shed_plan(loads: dict[str, int], targets: Sequence[str]) -> list[Shed]:
    """Requests to move onto freshly lent engines ``targets``.

    ``loads``: requests in flight per serving engine (the targets included). Each
    target is filled up to the mean load (rounded down), from the busiest engines
    first, none of which is taken below the mean. Targets are filled in order; a
    target is never a donor."""
    if not targets or not loads:
        return []
    load = dict(loads)
    share = sum(load.values()) // len(load)
    plan: list[Shed] = []
    for target in targets:
        donors = sorted((r for r in load if r not in targets), key=lambda r: (-load[r], r))
        for donor in donors:
            wanted = share - load.get(target, 0)
            excess = load[donor] - share
            if wanted <= 0:
                break
            if excess <= 0:
                continue
            count = min(wanted, excess)
            load[donor] -= count
            load[target] = load.get(target, 0) + count
            plan.append(Shed(donor, target, count))
    return plan
