"""Weight sync on a real nats-server: both pull stores, pruning, and engines that follow
full and delta versions, join late, refuse corrupted payloads and survive a weight-sync
restart. Shared memory's store and a publisher's pruning on their own are
tests/unit/test_shared_memory_weights.py."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from seamlessflow.bus import Bus
from seamlessflow.protocol import CurrentVersion, CurrentVersionQuery, TensorSpec, WeightManifest
from seamlessflow.weights import (
    EncodedWeights,
    ObjectStorePayloads,
    PayloadMissing,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightMirror,
    WeightPublisher,
)
from seamlessflow.weights.codec import BucketSink
from seamlessflow.weights.layout import plan_layout
from seamlessflow.weights.settings import WeightTransferSettings, publisher
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support.weight_states import round_trip, small_state


async def test_object_store_moves_a_payload_in_buckets_and_loses_it_on_delete(bus: Bus) -> None:
    store = ObjectStorePayloads(bus)
    state = small_state(0)
    encoded = WeightEncoder(bucket_bytes=10_000).encode(1, state)
    assert len(encoded.manifest.bucket_digests) == 7  # 67,648 bytes in 10 kB buckets
    got = await round_trip(store, encoded)
    assert all(torch.equal(got[name], state[name]) for name in state)
    manifest = await store.put(encoded)
    assert manifest.transport == "object" and manifest.location
    await store.delete(manifest)
    with pytest.raises(PayloadMissing):
        await store.fetch(manifest)


async def test_a_streamed_version_is_stored_bucket_by_bucket_or_not_at_all(
    bus: Bus, tmp_path: Path
) -> None:
    """``publish_streamed`` (the trainer's publish): each store holds exactly what a whole
    payload would have been; a version whose encoding fails half-way leaves nothing a
    reader could take for it, and no partial objects or files."""
    state = small_state(4)
    layout = plan_layout(state)
    whole = WeightEncoder(bucket_bytes=10_000).encode(1, state)
    for store in (ObjectStorePayloads(bus), SharedMemoryPayloads("streamed", tmp_path)):
        publisher = WeightPublisher(store, WeightEncoder(bucket_bytes=10_000))

        stream = iter(state.items())
        manifest = await publisher.publish_streamed(1, in_thread(publisher, 1, layout, stream))
        assert manifest.transport == store.name
        assert manifest.bucket_digests == whole.manifest.bucket_digests
        assert bytes(await store.fetch(manifest)) == bytes(whole.payload)

        with pytest.raises(RuntimeError, match="gather failed"):
            stream = failing_after(iter(state.items()), 1)
            await publisher.publish_streamed(2, in_thread(publisher, 2, layout, stream))
        broken = msgspec.structs.replace(
            manifest, version=2, location=manifest.location.replace("v00000001", "v00000002")
        )
        with pytest.raises(PayloadMissing):
            await store.fetch(broken)
        if isinstance(store, SharedMemoryPayloads):
            assert os.listdir(tmp_path) == [manifest.location]
        else:
            objects = await (await bus.object_bucket(bus.subjects.object_store_weights())).names()
            assert all(name.startswith(manifest.location) for name in objects), objects
        await publisher.close()


async def test_versions_over_the_delta_bound_stream_in_full(bus: Bus) -> None:
    """Deltas keep two whole versions on rank 0: only a version up to
    ``SF_WEIGHTS_DELTA_MAX_MB`` gets them; a larger one streams."""
    bound = WeightTransferSettings(delta_max_mb=2)
    assert publisher(bus, bound, 2 << 20).encoder.deltas
    assert publisher(bus, bound, (2 << 20) + 1).encoder.streams
    assert publisher(bus, WeightTransferSettings(delta_max_mb=0), 64).encoder.streams
    assert publisher(bus, WeightTransferSettings(deltas=False), 64).encoder.streams


def in_thread(
    publisher: WeightPublisher,
    version: int,
    layout: list[TensorSpec],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Callable[[BucketSink], Awaitable[WeightManifest]]:
    """The encoding ``publish_streamed`` runs, in a worker thread as the trainer's."""
    return lambda sink: asyncio.to_thread(
        publisher.encoder.encode_buckets, version, layout, tensors, sink
    )


def failing_after(
    tensors: Iterator[tuple[str, torch.Tensor]], count: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The first ``count`` tensors, then the error a lost rank gives."""
    for _ in range(count):
        yield next(tensors)
    raise RuntimeError("gather failed")


async def engine_weights(worker: EngineService) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in worker.engine._params.items()}  # type: ignore[attr-defined]


async def wait_for_version(worker: EngineService, version: int) -> None:
    async with asyncio.timeout(60):
        while worker.engine.version < version:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def stepped(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """Move a small part of the model, so most bf16 words stay bit-identical."""
    changed = dict(state)
    name = "model.norm.weight"
    changed[name] = state[name] + 0.25 * version
    return changed


async def test_engines_follow_deltas_join_late_and_refuse_corrupted_payloads(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    from tests.support import InProcessMesh, announce_weights

    base = AutoModelForCausalLM.from_pretrained(str(base_model_dir)).state_dict()
    publisher = WeightPublisher(
        ObjectStorePayloads(bus),
        WeightEncoder(bucket_bytes=256 * 1024, deltas=True, full_every=10),
        dtype=torch.bfloat16,
    )

    async def publish(version: int, state: dict[str, torch.Tensor]) -> None:
        await announce_weights(bus, await publisher.publish(version, state))

    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        weight_sync = await mesh.start(WeightSyncService())
        early = await mesh.start(EngineService(EngineSettings(engine_id="engine-early")))
        async with asyncio.timeout(60):
            await early.ready.wait()

        states = {}
        for version in (1, 2, 3):
            states[version] = stepped(base, version)
            await publish(version, states[version])
            await wait_for_version(early, version)
        kinds = [m.kind for m in weight_sync.chain.manifests]
        assert kinds == ["full", "delta", "delta"]
        want = {k: v.bfloat16().float() for k, v in states[3].items()}
        got = await engine_weights(early)
        assert all(torch.equal(got[name], want[name]) for name in want)

        late = await mesh.start(EngineService(EngineSettings(engine_id="engine-late")))
        async with asyncio.timeout(60):
            await late.ready.wait()
        assert late.engine.version == 3
        late_weights = await engine_weights(late)
        assert all(torch.equal(late_weights[name], want[name]) for name in want)

        # a payload whose bytes do not match its manifest is never loaded
        states[4] = stepped(base, 4)
        honest = publisher.encoder.encode(4, {k: v.bfloat16() for k, v in states[4].items()})
        damaged = bytearray(honest.payload)
        damaged[-1] ^= 0xFF
        await announce_weights(
            bus, await publisher.store.put(EncodedWeights(honest.manifest, memoryview(damaged)))
        )
        async with asyncio.timeout(30):
            while weight_sync.chain.version < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # time enough to fetch, check and (wrongly) load
        assert early.engine.version == 3
        assert early.receiver.mirror.version == 3  # refused before anything was applied
        assert all(torch.equal(early.engine._params[n], want[n]) for n in want)  # type: ignore[attr-defined]

        # the next full version repairs everything
        publisher.encoder.full_every = 1
        states[5] = stepped(base, 5)
        await publish(5, states[5])
        await wait_for_version(early, 5)
        await wait_for_version(late, 5)
    finally:
        await mesh.stop()


async def test_weight_sync_rebuilds_the_chain_after_a_restart(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    from tests.support import InProcessMesh, announce_weights

    publisher = WeightPublisher(
        ObjectStorePayloads(bus), WeightEncoder(bucket_bytes=1 << 20, deltas=True, full_every=3)
    )
    state = small_state(3)
    for version in range(1, 6):  # full 1, deltas 2-3, full 4, delta 5
        state = {"a": state["a"], "b": state["b"] + 1.0}
        await announce_weights(bus, await publisher.publish(version, state))
    mesh = InProcessMesh(nats_url, run_id, None)
    try:
        first = await mesh.start(WeightSyncService())
        async with asyncio.timeout(30):
            while first.chain.version < 5:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await mesh.stop()
        restarted = await mesh.start(WeightSyncService())
        await asyncio.wait_for(restarted.ready.wait(), 30)
        current: CurrentVersion = await bus.request(
            bus.subjects.weights_current(), CurrentVersionQuery(engine_id="e"), CurrentVersion
        )
    finally:
        await mesh.stop()
    assert current.version == 5
    assert [(m.version, m.kind) for m in current.chain] == [(4, "full"), (5, "delta")]
    mirror = WeightMirror()
    store = ObjectStorePayloads(bus)
    for manifest in current.chain:
        mirror.apply(manifest, await store.fetch(manifest))
    assert torch.equal(mirror.tensors()["b"], state["b"])


async def test_a_version_announced_with_its_fallback_pending_is_completed_in_place(
    nats_url: str, run_id: str, bus: Bus, tmp_path: Path
) -> None:
    """``cuda_ipc`` packed on the trainer's device: weight-sync broadcasts the held
    version at once, then its completed manifest (for engines that could not map the
    buckets), and a restarted weight-sync's chain ends with the completed one."""
    from seamlessflow.protocol import LoadWeights
    from seamlessflow.weights.device import SharedMemoryBuffers
    from seamlessflow.weights.ipc import DevicePayloads, HeldVersions
    from seamlessflow.weights.layout import layout_of
    from tests.support import InProcessMesh, announce_weights

    stores = {"shm": SharedMemoryPayloads(run_id, tmp_path)}
    buffers = SharedMemoryBuffers(tmp_path, f"seamlessflow-{run_id}-policy-")
    trainer = DevicePayloads(stores, "shm", buffers, HeldVersions(2, 60.0))
    state = small_state(4)
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    manifest, buckets = WeightEncoder(bucket_bytes=10_000).pack_buckets(
        1, layout, iter(state.items()), torch.device("cpu")
    )
    broadcast: list[WeightManifest] = []

    async def on_load(load: LoadWeights) -> None:
        broadcast.append(load.manifest)

    await bus.subscribe(bus.subjects.engine_load(), LoadWeights, on_load)
    mesh = InProcessMesh(nats_url, run_id, None)
    try:
        weight_sync = await mesh.start(WeightSyncService())
        await asyncio.wait_for(weight_sync.ready.wait(), 30)
        held = await trainer.hold_packed(manifest, buckets)
        assert held is not None
        await announce_weights(bus, held)
        async with asyncio.timeout(30):
            while not broadcast:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert broadcast[0].fallback_pending and weight_sync.chain.manifests == [held]
        completed = await trainer.store_fallback(held, buckets)
        await announce_weights(bus, completed, completed=True)
        async with asyncio.timeout(30):
            while len(broadcast) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert broadcast == [held, completed] and weight_sync.chain.manifests == [completed]
        await mesh.stop()
        restarted = await mesh.start(WeightSyncService())
        await asyncio.wait_for(restarted.ready.wait(), 30)
        assert restarted.chain.manifests == [completed]
    finally:
        await mesh.stop()
        await trainer.close()
