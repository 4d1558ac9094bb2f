"""Bounded storage on a real nats-server: the weights object store gives deleted versions
back to the disk, the durable streams carry the retention settings, the pull stores
refuse a manifest whose sizes are not those of the stored payload, and weight-sync's set
of engines holds only engines heard from lately. The retention settings' own check and a
publisher's deletion that fails are tests/unit/test_retention_and_pruning.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from seamlessflow.bus import Bus, Unrecoverable, connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import (
    CurrentVersion,
    CurrentVersionQuery,
    PhaseChanged,
    Subjects,
    WeightManifest,
    WeightsLoaded,
)
from seamlessflow.settings import RetentionSettings
from seamlessflow.weights import (
    ObjectStorePayloads,
    PayloadMissing,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightPublisher,
    WeightsCorrupted,
)
from seamlessflow.weights.stores import OBJECT_CHUNK_BYTES
from sf_weight_sync.service import WeightSyncService
from sf_weight_sync.settings import WeightSyncSettings
from tests.support.weight_states import one_tensor_state

MiB = 1024 * 1024
GiB = 1024 * MiB


@pytest.fixture
async def own_server(tmp_path: Path, run_id: str) -> AsyncIterator[tuple[EmbeddedNats, Bus]]:
    """A nats-server of this test alone: its store directory holds only this test's data."""
    with EmbeddedNats(tmp_path / "nats") as server:
        bus = await connect(server.url, Subjects(run_id), name="test")
        try:
            yield server, bus
        finally:
            await bus.drain()


def bytes_on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


@pytest.mark.integration  # a nats-server of its own
async def test_the_weights_store_gives_deleted_versions_back_to_the_disk(
    own_server: tuple[EmbeddedNats, Bus],
) -> None:
    """100 versions of a 2.5 MiB model, each a full payload, two kept: the live content
    is two payloads. The server writes a stream in files (blocks) of at most 8 MiB and
    drops a file once none of its messages is live; the kept versions are the newest
    writes, so dead bytes can only share the file of the oldest live payload: on disk
    stays below live content plus one file, here under three times the live content
    (before the fix it grew by a payload per version: 250 MB after 100)."""
    server, bus = own_server
    store = ObjectStorePayloads(bus)
    publisher = WeightPublisher(store, WeightEncoder(bucket_bytes=64 * MiB), keep_chains=2)
    weights = torch.zeros(5 * MiB // 8, dtype=torch.float32)  # 2.5 MiB
    stream = f"OBJ_{bus.subjects.object_store_weights()}"
    live: list[int] = []
    largest = 0
    for version in range(1, 101):
        weights += 1.0  # every word changes: a delta would not pay, each version is full
        manifest = await publisher.publish(version, {"w": weights})
        assert manifest.kind == "full"
        live = [*live[-1:], manifest.payload_bytes]
        on_disk = bytes_on_disk(server.store_dir / "jetstream")
        largest = max(largest, on_disk)
        assert on_disk < 3 * sum(live), f"version {version}: {on_disk} bytes on disk"
    info = await bus.js.stream_info(stream)
    # what the stream holds: the two kept payloads and their two meta messages
    assert info.state.messages == 2 * (1 + -(-manifest.payload_bytes // OBJECT_CHUNK_BYTES))
    assert sum(live) <= info.state.bytes < sum(live) + 64 * 1024
    print(f"100 versions: live {sum(live)} bytes, at most {largest} on disk")


def lying(manifest: WeightManifest, **sizes: int) -> WeightManifest:
    return msgspec.structs.replace(manifest, **sizes)


async def test_a_fetch_refuses_a_manifest_whose_sizes_are_not_the_stored_ones(
    bus: Bus, tmp_path: Path
) -> None:
    """A manifest is input: sizes that do not match the stored payload (or each other)
    are refused before the payload is allocated, whatever they claim."""
    state = {"w": torch.arange(3000, dtype=torch.float32)}
    encoded = WeightEncoder(bucket_bytes=5000).encode(1, state)  # 3 buckets
    for store in (ObjectStorePayloads(bus), SharedMemoryPayloads("sizes", tmp_path)):
        manifest = await store.put(encoded)
        huge = 10**15  # far more than any machine has: allocating it cannot work
        for wrong in (
            lying(manifest, payload_bytes=manifest.payload_bytes + 1),
            lying(manifest, payload_bytes=manifest.payload_bytes - 1),
            lying(manifest, payload_bytes=huge, bucket_bytes=huge // 3 + 1),
            lying(manifest, payload_bytes=huge),
            lying(manifest, bucket_bytes=1),
            lying(manifest, bucket_bytes=0),
            lying(manifest, payload_bytes=-1),
        ):
            with pytest.raises(WeightsCorrupted, match=r"store holds|bucket digests"):
                await store.fetch(wrong)
        payload = await store.fetch(manifest)  # the true manifest still fetches
        assert bytes(payload) == bytes(encoded.payload)


async def test_weight_sync_knows_only_engines_it_heard_from_lately(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    """Any requester may name any engine id: an id stays known only while it keeps
    asking or reporting (engines ask every few seconds), and one the tag-scheduler
    declares dead is forgotten at once, so the set (and what a sync waits for) never
    grows from ids that come and go."""
    from tests.support import InProcessMesh

    expiry_s = 2.0
    mesh = InProcessMesh(nats_url, run_id, None)
    try:
        sync = await mesh.start(WeightSyncService(WeightSyncSettings(engine_expiry_s=expiry_s)))
        await asyncio.wait_for(sync.ready.wait(), 30)

        async def ask(engine_id: str) -> None:
            await bus.request(
                bus.subjects.weights_current(),
                CurrentVersionQuery(engine_id=engine_id),
                CurrentVersion,
            )

        await asyncio.gather(*(ask(f"passer-by-{n}") for n in range(50)))
        await bus.publish(
            bus.subjects.weights_loaded(), WeightsLoaded(engine_id="reporter", version=3)
        )
        await bus.nc.flush()
        await asyncio.sleep(expiry_s * 1.5)  # every id above is now silent for too long
        await ask("live")
        assert sync.engine_versions == {"live": 0}

        await bus.publish(
            bus.subjects.sched_phase(), PhaseChanged(resource_id="live", phase="dead")
        )
        async with asyncio.timeout(30):
            while sync.engine_versions:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    finally:
        await mesh.stop()


async def test_the_retention_settings_reach_the_streams(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stream gets its own limits, from the settings or the environment, also when
    it exists already (the ``bus`` fixture created them with the defaults)."""
    s = bus.subjects
    solver = s.for_policy("solver")
    retention = RetentionSettings(
        trajectory_max_age_h=2,
        trajectory_max_gb=0.5,
        batches_max_age_h=3,
        batches_max_gb=0.25,
        metrics_max_age_h=0,
        metrics_max_gb=0.125,
    )
    await bus.ensure_streams(["solver"], retention=retention)
    expected = {
        s.stream_trajectory(): (2 * 3600, GiB // 2),
        s.stream_batches(): (3 * 3600, GiB // 4),
        solver.stream_batches(): (3 * 3600, GiB // 4),
        s.stream_batch_payloads(): (3 * 3600, GiB // 4),  # a batch's payload lives as long
        solver.stream_batch_payloads(): (3 * 3600, GiB // 4),
        s.stream_metrics(): (0, GiB // 8),
        s.stream_weights(): (0, -1),  # announcements: weight-sync rebuilds its chain there
    }
    for stream, limits in expected.items():
        config = (await bus.js.stream_info(stream)).config
        assert (config.max_age, config.max_bytes) == limits, stream

    monkeypatch.setenv("SF_RETENTION_METRICS_MAX_AGE_H", "1.5")
    monkeypatch.setenv("SF_RETENTION_METRICS_MAX_GB", "0")
    await bus.ensure_streams()
    config = (await bus.js.stream_info(s.stream_metrics())).config
    assert (config.max_age, config.max_bytes) == (1.5 * 3600, -1)


async def test_a_stream_over_its_byte_limit_drops_its_oldest_messages(bus: Bus) -> None:
    limit = 64 * 1024
    await bus.ensure_streams(retention=RetentionSettings(trajectory_max_gb=limit / GiB))
    stream = bus.subjects.stream_trajectory()
    subject = bus.subjects.trajectory_event("s1")
    payloads = [bytes([n]) * 2048 for n in range(100)]  # 200 KiB in all
    for payload in payloads:
        await bus.js.publish(subject, payload)
    state = (await bus.js.stream_info(stream)).state
    assert state.bytes <= limit
    assert 1 < state.first_seq and state.last_seq == len(payloads)
    kept = await bus.read_all(stream, bus.subjects.trajectory_events_all())
    assert [m.data for m in kept] == payloads[state.first_seq - 1 :]  # the newest, in order


async def test_a_restarted_publisher_deletes_what_the_previous_process_stored(
    bus: Bus, tmp_path: Path
) -> None:
    """A publisher remembers only its own chains; what an earlier trainer process kept
    is deleted once the new one has its own chains, in both stores."""
    encoder = WeightEncoder(bucket_bytes=1 << 20)  # every version a full payload
    for store in (ObjectStorePayloads(bus), SharedMemoryPayloads("restart", tmp_path)):
        first = WeightPublisher(store, encoder, keep_chains=1)
        old = [await first.publish(v, one_tensor_state(v)) for v in (1, 2, 3)]
        for pruned in old[:2]:
            with pytest.raises(PayloadMissing):
                await store.fetch(pruned)
        restarted = WeightPublisher(store, encoder, keep_chains=1)  # the trainer again
        new = [await restarted.publish(v, one_tensor_state(v)) for v in (4, 5)]
        for gone in (old[2], new[0]):
            with pytest.raises(PayloadMissing):
                await store.fetch(gone)
        assert len(await store.fetch(new[1])) == new[1].payload_bytes


async def test_a_byte_limit_the_server_cannot_reserve_is_one_clear_error(bus: Bus) -> None:
    too_much = RetentionSettings(trajectory_max_gb=1024**3)  # an exabyte
    with pytest.raises(Unrecoverable, match=r"cannot reserve .* SF_RETENTION_\*_MAX_GB"):
        await bus.ensure_streams(retention=too_much)
    config = (await bus.js.stream_info(bus.subjects.stream_trajectory())).config
    assert config.max_bytes == -1  # the stream kept the limits it had
