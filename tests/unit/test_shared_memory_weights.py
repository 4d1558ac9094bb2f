"""Weight payloads in shared memory, without NATS: a payload is written whole and read
in place, under names of its run and policy (two policies publish the same version at
once apart, and each prunes only its own), and a publisher keeps only its latest chains.
Both stores on a real nats-server, and engines following the versions, are
tests/service/test_weight_sync.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from seamlessflow.weights import (
    PayloadMissing,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightMirror,
    WeightPublisher,
)
from tests.support.weight_states import publish_three, round_trip, small_state


async def test_shared_memory_is_written_whole_and_read_in_place(tmp_path: Path) -> None:
    store = SharedMemoryPayloads("shm-test", tmp_path)
    state = small_state(1)
    encoded = WeightEncoder(bucket_bytes=10_000).encode(3, state)
    got = await round_trip(store, encoded)
    assert all(torch.equal(got[name], state[name]) for name in state)
    assert os.listdir(tmp_path) == ["seamlessflow-shm-test-policy-weights-v00000003-full"]
    manifest = await store.put(encoded)
    other_run = SharedMemoryPayloads("other-run", tmp_path)
    with pytest.raises(PayloadMissing):
        await other_run.fetch(manifest)
    await store.delete(manifest)
    with pytest.raises(PayloadMissing):
        await store.fetch(manifest)


async def test_two_policies_of_a_run_publish_the_same_version_at_once_apart(
    tmp_path: Path,
) -> None:
    """A solver and a verifier publish version 1 at the same moment: before each policy
    had its own names, one trainer's rename took the other's file and it crashed (seen
    in a fresh CI), and one policy's pruning removed the other's versions."""
    stores = {policy: SharedMemoryPayloads("run", tmp_path, policy) for policy in ("a", "b")}
    states = {policy: small_state(seed) for seed, policy in enumerate(stores)}
    encoded = {p: WeightEncoder(bucket_bytes=10_000).encode(1, states[p]) for p in stores}
    manifests = dict(
        zip(stores, await asyncio.gather(*(stores[p].put(encoded[p]) for p in stores)), strict=True)
    )
    for policy, store in stores.items():
        mirror = WeightMirror()
        mirror.apply(manifests[policy], await store.fetch(manifests[policy]))
        got = mirror.tensors()
        assert all(torch.equal(got[k], states[policy][k]) for k in states[policy])
    with pytest.raises(PayloadMissing):  # an engine of b never serves a's weights
        await stores["b"].fetch(manifests["a"])
    await stores["a"].delete_before(2)  # a prunes its own versions only
    assert sorted(os.listdir(tmp_path)) == ["seamlessflow-run-b-weights-v00000001-full"]


async def test_the_publisher_keeps_only_its_latest_chains(tmp_path: Path) -> None:
    store = SharedMemoryPayloads("prune", tmp_path)
    encoder = WeightEncoder(bucket_bytes=1 << 20, deltas=True, full_every=2)
    publisher = WeightPublisher(store, encoder, keep_chains=1, dtype=torch.bfloat16)
    manifests, _ = await publish_three(publisher)
    assert [m.kind for m in manifests] == ["full", "delta", "full"]
    assert manifests[1].payload_bytes < manifests[0].payload_bytes / 10
    assert manifests[0].layout[0].dtype == "bfloat16"
    for pruned in manifests[:2]:
        with pytest.raises(PayloadMissing):
            await store.fetch(pruned)
    assert len(await store.fetch(manifests[2])) == manifests[2].payload_bytes
    await publisher.close()  # shared memory is RAM: nothing outlives the publisher
    assert os.listdir(tmp_path) == []
