"""Scheduling policies: which role a resource plays, decided from its tags alone.

A policy is a plain object with no I/O, so the same object drives the live service and
(issue 3) the simulator. Colocated, disaggregated and multiplexed deployments are
configurations of the tags and the mode, never separate code paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from seamlessflow.protocol import Role

Mode = Literal["colocated", "disaggregated", "multiplexed"]

# The role a kind of process can play, and the tag that allows it.
ROLE_FOR_KIND: dict[str, tuple[Role, str]] = {
    "engine": ("rollout", "rollout"),
    "trainer": ("train", "train"),
}


@dataclass(frozen=True)
class ResourceView:
    resource_id: str
    kind: str
    tags: frozenset[str]


@dataclass(frozen=True)
class Decision:
    role: Role
    reason: str


class StaticTagPolicy:
    """Match a resource's kind to the role it can play, if its tags allow that role.

    A resource without the required tag stays ``idle`` (it is registered and visible,
    but gets no work): tags, not process kinds, decide where work runs.
    """

    def __init__(self, mode: Mode = "disaggregated") -> None:
        self.mode = mode

    def assign(self, resource: ResourceView) -> Decision:
        role_and_tag = ROLE_FOR_KIND.get(resource.kind)
        if role_and_tag is None:
            return Decision("idle", f"no role for kind {resource.kind!r}")
        role, tag = role_and_tag
        if tag not in resource.tags:
            return Decision("idle", f"kind {resource.kind!r} lacks tag {tag!r}")
        return Decision(role, f"{self.mode}: tag {tag!r} -> {role}")
