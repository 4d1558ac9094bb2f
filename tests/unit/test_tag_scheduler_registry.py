"""The tag-scheduler's resource registry on its own: what it stores for a resource is
what a restarted scheduler restores (``sf_tag_scheduler.registry``; the restart on a
real bucket is in test_faults.py)."""

from __future__ import annotations

from typing import cast

from seamlessflow.bus import KeyValueBucket
from sf_tag_scheduler.policy import PolicyConfig, ResourceView
from sf_tag_scheduler.registry import ResourceRegistry, ResourceState


class MemoryBucket:
    """A key-value bucket in memory, as ``seamlessflow.bus.KeyValueBucket`` behaves."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def keys(self) -> list[str]:
        return list(self.values)

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value


def registry_on(bucket: MemoryBucket) -> ResourceRegistry:
    registry = ResourceRegistry(lambda: PolicyConfig(mode="colocated"))
    registry.kv = cast(KeyValueBucket, bucket)
    return registry


def engine(rid: str, *tags: str) -> ResourceView:
    return ResourceView(rid, "engine", frozenset(tags), (rid,))


async def test_a_stored_resource_is_restored_and_a_stale_role_is_to_be_told() -> None:
    bucket = MemoryBucket()
    before = registry_on(bucket)
    states = {
        # lent before the restart: the policy says idle now (nothing is lent afresh)
        "lent": ResourceState(engine("lent", "train", "rollout"), "policy", "rollout"),
        "dedicated": ResourceState(engine("dedicated", "rollout"), "policy", "rollout"),
        "gone": ResourceState(
            engine("gone", "rollout"), "solver", "rollout", alive=False, process=("h", 7)
        ),
    }
    for rid, state in states.items():
        before.resources[rid] = state
        await before.store(rid)

    after = registry_on(bucket)
    stale = await after.restore()
    assert stale == ["lent"]
    assert set(after.resources) == set(states)
    assert after.resources["gone"].process == ("h", 7) and not after.resources["gone"].alive
    assert after.resources["lent"].view == states["lent"].view
    assert set(after.policies) == {"policy", "solver"}
    assert after.decisions("solver").dedicated == []  # the dead one counts for nothing
    assert after.decisions("policy").dedicated == ["dedicated"]


def test_loads_are_the_engines_of_one_policy() -> None:
    registry = registry_on(MemoryBucket())
    registry.resources["a"] = ResourceState(engine("a", "rollout"), "policy", "rollout")
    registry.resources["b"] = ResourceState(engine("b", "rollout"), "policy", "idle")
    registry.resources["c"] = ResourceState(engine("c", "rollout"), "solver", "rollout")
    registry.resources["a"].in_flight = 3
    assert registry.serving_loads("policy") == {"a": 3}
    assert [load.view.resource_id for load in registry.engine_loads("policy")] == ["a", "b"]
