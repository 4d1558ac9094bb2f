"""The ``cuda_ipc`` weight transport on CPU, through the shared-memory stand-in of
device buffers: what ``auto`` chooses, how long a version's buffers are held (until
every engine acknowledged it, a timeout, an engine's death or the bound), and engines
that read the device buffers or, when those are gone or changed, the fallback store.
Through a real nats-server (acknowledgements as ``WeightsLoaded``) is
tests/service/test_cuda_ipc_transport.py; the CUDA layer itself is
tests/unit/test_cuda_ipc_device.py (skipped without a GPU)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import torch

from seamlessflow.protocol import WeightManifest
from seamlessflow.weights import (
    PayloadMissing,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightMirror,
    WeightPublisher,
    WeightReceiver,
)
from seamlessflow.weights.codec import WeightsCorrupted
from seamlessflow.weights.device import BufferGone, SharedMemoryBuffers
from seamlessflow.weights.ipc import DevicePayloads, HeldVersion, HeldVersions, choose_transport
from seamlessflow.weights.layout import layout_of
from tests.support.weight_states import publish_three, small_state

RUN = "seamlessflow-ipc-policy-"


@pytest.mark.parametrize(
    ("trainer_device", "engines", "chosen"),
    [
        ("cuda", "this-host-cuda", "cuda_ipc"),
        ("cuda:1", "this-host-cuda", "cuda_ipc"),
        ("cpu", "this-host-cuda", "shm"),
        ("cuda", "this-host", "shm"),
        ("cpu", "this-host", "shm"),
        ("cuda", "other-hosts", "object"),
        ("cpu", "other-hosts", "object"),
    ],
)
def test_auto_chooses_device_memory_only_for_a_cuda_trainer_with_cuda_engines_beside_it(
    trainer_device: str, engines: str, chosen: str
) -> None:
    assert choose_transport(trainer_device, engines) == chosen


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def versions(released: list[HeldVersion]) -> list[int]:
    return [held.version for held in released]


def test_a_version_is_held_until_every_known_engine_acknowledged_it_or_a_newer_one() -> None:
    held = HeldVersions(max_versions=4, hold_s=60.0)
    assert held.hold(1, ["b1"]) == []
    assert versions(held.ack("e1", 1)) == [1]  # the only engine known
    held.hold(2, ["b2"])
    held.hold(3, ["b3"])
    held.ack("e2", 1)  # a second engine, still on version 1
    assert versions(held.ack("e1", 3)) == []
    assert versions(held.ack("e2", 3)) == [2, 3]  # an ack of 3 settles 2 as well
    assert held.held == {}


def test_expected_engines_must_all_acknowledge_and_a_dead_one_is_not_waited_for() -> None:
    held = HeldVersions(max_versions=4, hold_s=60.0, expect_engines=2)
    held.hold(1, ["b1"])
    assert held.ack("e1", 1) == []  # one of two expected engines
    assert versions(held.ack("e2", 1)) == [1]
    held.hold(2, ["b2"])
    held.ack("e1", 2)
    held.ack("e3", 2)
    assert held.ack("e2", 1) == []  # e2 lags
    assert versions(held.gone("e2")) == [2]  # declared dead: e1 and e3 are two engines


def test_without_acknowledgements_a_version_is_freed_after_the_hold_time() -> None:
    clock = Clock()
    held = HeldVersions(max_versions=4, hold_s=10.0, clock=clock)
    held.hold(1, ["b1"])
    clock.now = 5.0
    held.hold(2, ["b2"])
    assert held.expire() == []
    clock.now = 10.0
    assert versions(held.expire()) == [1]
    clock.now = 15.0
    assert versions(held.expire()) == [2]


def test_the_bound_frees_the_oldest_version_at_once() -> None:
    held = HeldVersions(max_versions=2, hold_s=60.0)
    held.hold(1, ["b1"])
    held.hold(2, ["b2"])
    assert versions(held.hold(3, ["b3"])) == [1]  # never waits for a lagging engine
    assert list(held.held) == [2, 3]
    with pytest.raises(ValueError):
        HeldVersions(max_versions=0, hold_s=1.0)


def trainer_and_engine(
    tmp_path: Path, max_versions: int = 4
) -> tuple[DevicePayloads, DevicePayloads, SharedMemoryBuffers]:
    """The trainer's store and an engine's, each with its own shm store and stand-in."""
    buffers = SharedMemoryBuffers(tmp_path, RUN)

    def stores() -> dict[str, SharedMemoryPayloads]:
        return {"shm": SharedMemoryPayloads("ipc", tmp_path)}

    trainer = DevicePayloads(stores(), "shm", buffers, HeldVersions(max_versions, 60.0))
    engine = DevicePayloads(
        stores(), "shm", None, HeldVersions(1, 60.0), {"shm": SharedMemoryBuffers(tmp_path, RUN)}
    )
    return trainer, engine, buffers


def buffer_files(tmp_path: Path) -> list[str]:
    return sorted(name for name in os.listdir(tmp_path) if "-buffer-" in name)


async def apply(engine: DevicePayloads, manifest: WeightManifest) -> dict[str, torch.Tensor]:
    mirror = WeightMirror()
    mirror.apply(manifest, await engine.fetch(manifest))
    return mirror.tensors()


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


async def test_an_engine_reads_the_device_buffers_and_the_acknowledgement_frees_them(
    tmp_path: Path,
) -> None:
    trainer, engine, _ = trainer_and_engine(tmp_path)
    state = small_state(1)
    encoded = WeightEncoder(bucket_bytes=10_000).encode(1, state)
    manifest = await trainer.put(encoded)
    assert manifest.transport == "cuda_ipc"
    assert manifest.device is not None and manifest.device.fallback == "shm"
    assert len(manifest.device.buckets) == len(manifest.bucket_digests) == 7
    assert len(buffer_files(tmp_path)) == 7
    (tmp_path / manifest.location).unlink()  # only the device buffers are read
    assert same(await apply(engine, manifest), state)
    await trainer.release(trainer.held.ack("engine-1", 1))
    assert buffer_files(tmp_path) == []


async def test_an_engine_reads_the_fallback_when_the_buffers_are_gone_or_changed(
    tmp_path: Path,
) -> None:
    trainer, engine, _ = trainer_and_engine(tmp_path, max_versions=1)
    states = [small_state(seed) for seed in (1, 2, 3)]
    encoder = WeightEncoder(bucket_bytes=10_000)
    first = await trainer.put(encoder.encode(1, states[0]))
    second = await trainer.put(encoder.encode(2, states[1]))  # the bound frees version 1
    assert len(buffer_files(tmp_path)) == len(second.bucket_digests)
    assert same(await apply(engine, first), states[0])  # a lagging engine: from shm
    assert same(await apply(engine, second), states[1])
    # a freed allocation reused by other data: the digests send the engine to the store
    assert second.device is not None
    victim = tmp_path / second.device.buckets[0].name.decode()
    victim.write_bytes(bytes(victim.stat().st_size))
    assert same(await apply(engine, second), states[1])
    # gone from both: the engine catches up from the chain later, as with any store
    await trainer.delete(second)
    with pytest.raises(PayloadMissing):
        await engine.fetch(second)
    assert buffer_files(tmp_path) == []


async def test_a_mapping_opened_before_the_free_stays_readable(tmp_path: Path) -> None:
    buffers = SharedMemoryBuffers(tmp_path, RUN)
    buffer = buffers.allocate(memoryview(b"weights!"))
    handle = buffers.export(buffer)
    mapping = buffers.open(handle)
    buffers.free(buffer)
    into = memoryview(bytearray(8))
    torch.frombuffer(into, dtype=torch.uint8).copy_(buffers.tensor(mapping))
    buffers.close(mapping)
    assert bytes(into) == b"weights!"
    with pytest.raises(BufferGone):  # opened after the free
        buffers.open(handle)
    other_run = SharedMemoryBuffers(tmp_path, "seamlessflow-other-policy-")
    with pytest.raises(BufferGone):  # a handle is input: only this run's names
        other_run.open(handle)


async def test_an_engine_without_the_fallback_store_or_the_device_kind_gets_payload_missing(
    tmp_path: Path,
) -> None:
    trainer, _, _ = trainer_and_engine(tmp_path)
    manifest = await trainer.put(WeightEncoder(bucket_bytes=10_000).encode(1, small_state(1)))
    no_device = DevicePayloads(
        {"shm": SharedMemoryPayloads("ipc", tmp_path)}, "shm", None, HeldVersions(1, 1.0)
    )
    assert len(await no_device.fetch(manifest)) == manifest.payload_bytes  # from shm
    elsewhere = DevicePayloads(
        {"shm": SharedMemoryPayloads("another-run", tmp_path)}, "shm", None, HeldVersions(1, 1.0)
    )
    with pytest.raises(PayloadMissing):
        await elsewhere.fetch(manifest)


async def test_the_publisher_keeps_chains_in_both_and_frees_every_buffer_on_close(
    tmp_path: Path,
) -> None:
    trainer, engine, _ = trainer_and_engine(tmp_path)
    encoder = WeightEncoder(bucket_bytes=1 << 20, deltas=True, full_every=2)
    publisher = WeightPublisher(trainer, encoder, keep_chains=1)
    manifests, state = await publish_three(publisher)
    assert [m.kind for m in manifests] == ["full", "delta", "full"]
    assert list(trainer.held.held) == [3]  # the dropped chain's buffers went with it
    assert same(await apply(engine, manifests[2]), state)
    await publisher.close()
    assert buffer_files(tmp_path) == []
    assert not [name for name in os.listdir(tmp_path) if "weights-v" in name]


async def test_an_engine_on_a_device_copies_a_full_version_there_without_the_host_mirror(
    tmp_path: Path,
) -> None:
    trainer, engine, _ = trainer_and_engine(tmp_path)
    state = small_state(3)
    manifest = await trainer.put(WeightEncoder(bucket_bytes=10_000).encode(1, state))
    assert manifest.device is not None
    assert len(manifest.device.checksums) == len(manifest.device.buckets)
    (tmp_path / manifest.location).unlink()  # nothing is read through the host store
    receiver = WeightReceiver({"cuda_ipc": engine}, device=torch.device("cpu"))
    assert await receiver.follow([manifest]) == receiver.version == 1
    assert receiver.mirror.version == 0 and receiver.mirror.flat is None
    assert same(receiver.tensors(), state)
    # the version held is not fetched again
    assert await receiver.follow([manifest]) == 1
    # once the engine has it, the device copy goes: the receiver holds the mirror's
    assert receiver.release_device_copy() == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    assert receiver.version == 0 and receiver.release_device_copy() == 0
    assert await receiver.follow([manifest]) == 1  # copied again if asked again
    assert same(receiver.tensors(), state)


async def test_a_changed_bucket_or_a_delta_goes_through_the_host_instead(tmp_path: Path) -> None:
    trainer, engine, _ = trainer_and_engine(tmp_path)
    base = small_state(4)
    # the next version changes one tensor: small enough to go as a delta
    states = [base, {k: v + 1 if k == "b" else v for k, v in base.items()}]
    encoder = WeightEncoder(bucket_bytes=10_000)
    first = await trainer.put(encoder.encode(1, states[0]))
    assert first.device is not None
    # the bucket's memory reused by other data after a free: its byte sum differs
    victim = tmp_path / first.device.buckets[2].name.decode()
    victim.write_bytes(bytes(victim.stat().st_size))
    receiver = WeightReceiver({"cuda_ipc": engine}, device=torch.device("cpu"))
    assert await receiver.follow([first]) == 1
    assert receiver.mirror.version == 1  # the host path: fallback store, digests, mirror
    assert same(receiver.tensors(), states[0])
    # without checksums (an older trainer's manifest) the device path is not taken
    bare = msgspec.structs.replace(
        first, device=msgspec.structs.replace(first.device, checksums=[])
    )
    with pytest.raises(BufferGone, match="no checksums"):
        await engine.fetch_tensors(bare, torch.device("cpu"))
    delta = WeightEncoder(bucket_bytes=10_000, deltas=True, full_every=5)
    delta.encode(1, states[0])
    second = await trainer.put(delta.encode(2, states[1]))
    assert second.kind == "delta"
    with pytest.raises(BufferGone, match="only a full version"):
        await engine.fetch_tensors(second, torch.device("cpu"))
    assert await receiver.follow([first, second]) == 2
    assert same(receiver.tensors(), states[1])


def test_a_cuda_ipc_publisher_sends_every_version_in_full(tmp_path: Path) -> None:
    from seamlessflow.protocol.subjects import Subjects
    from seamlessflow.weights.settings import WeightTransferSettings, publisher

    class FakeBus:  # publisher() only names stores; nothing is sent
        subjects = Subjects("ipc")

    settings = WeightTransferSettings(transport="cuda_ipc", shm_dir=tmp_path, deltas=True)
    stand_in = SharedMemoryBuffers(tmp_path, RUN)
    made = publisher(FakeBus(), settings, 1 << 20, "cpu", device_buffers=stand_in)  # type: ignore[arg-type]
    assert not made.encoder.deltas
    shm = WeightTransferSettings(transport="shm", shm_dir=tmp_path, deltas=True)
    assert publisher(FakeBus(), shm, 1 << 20).encoder.deltas  # type: ignore[arg-type]


def packed(
    version: int, state: dict[str, torch.Tensor]
) -> tuple[WeightManifest, list[torch.Tensor]]:
    """``state`` packed where it lives (the trainer's device: here the host)."""
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    return WeightEncoder(bucket_bytes=10_000).pack_buckets(
        version, layout, iter(state.items()), torch.device("cpu")
    )


async def test_a_version_packed_on_the_trainers_device_is_held_as_is_and_hashed_for_the_host(
    tmp_path: Path,
) -> None:
    """``put_packed``: the packed buckets become the device buffers, the fallback gets
    the same bytes with the digests the host path would give, and an engine reads the
    version from either."""
    trainer, engine, _ = trainer_and_engine(tmp_path)
    state = small_state(5)
    through_host = WeightEncoder(bucket_bytes=10_000).encode(1, state).manifest
    manifest, buckets = packed(1, state)
    stored = await trainer.put_packed(manifest, buckets)
    assert stored.transport == "cuda_ipc" and stored.device is not None
    assert stored.bucket_digests == through_host.bucket_digests
    assert stored.state_digest == through_host.state_digest
    assert len(buffer_files(tmp_path)) == len(stored.device.checksums) == len(buckets)
    receiver = WeightReceiver({"cuda_ipc": engine}, device=torch.device("cpu"))
    assert await receiver.follow([stored]) == 1
    assert receiver.mirror.version == 0  # device to device, no host mirror
    assert same(receiver.tensors(), state)
    # the buffers gone, the fallback store alone serves the version
    await trainer.release(trainer.held.drop(1))
    assert buffer_files(tmp_path) == []
    assert same(await apply(engine, stored), state)


async def test_a_device_that_refuses_the_packed_buckets_leaves_the_version_to_the_fallback(
    tmp_path: Path,
) -> None:
    class Refusing(SharedMemoryBuffers):
        def adopt(self, bucket: object) -> Path:
            if len(os.listdir(tmp_path)) > 3:
                raise RuntimeError("CUDA out of memory")
            return super().adopt(bucket)

    stores = {"shm": SharedMemoryPayloads("ipc", tmp_path)}
    trainer = DevicePayloads(stores, "shm", Refusing(tmp_path, RUN), HeldVersions(4, 60.0))
    state = small_state(6)
    stored = await trainer.put_packed(*packed(1, state))
    assert stored.transport == "shm" and stored.device is None
    assert buffer_files(tmp_path) == []  # what it had adopted was freed
    _, engine, _ = trainer_and_engine(tmp_path)
    assert same(await apply(engine, stored), state)


async def test_a_packed_version_is_announced_held_and_completed_once_its_fallback_is_stored(
    tmp_path: Path,
) -> None:
    """``hold_packed``: loadable device to device at once, its fallback pending (the host
    path refuses it: catch up later); ``store_fallback``: the same version completed, with
    the host path's digests."""
    trainer, engine, _ = trainer_and_engine(tmp_path)
    state = small_state(8)
    manifest, buckets = packed(1, state)
    held = await trainer.hold_packed(manifest, buckets)
    assert held is not None and held.fallback_pending
    assert held.bucket_digests == [] and held.location == "" and held.state_digest == ""
    assert not [name for name in os.listdir(tmp_path) if "weights-v" in name]  # not stored
    on_device = WeightReceiver({"cuda_ipc": engine}, device=torch.device("cpu"))
    assert await on_device.follow([held]) == 1 and same(on_device.tensors(), state)
    through_host = WeightReceiver({"cuda_ipc": engine})
    with pytest.raises(PayloadMissing, match="until its fallback is stored"):
        await through_host.follow([held])
    completed = await trainer.store_fallback(held, buckets)
    assert not completed.fallback_pending and completed.device is not None
    assert completed.device.buckets == held.device.buckets  # the same buffers
    assert (
        completed.bucket_digests == WeightEncoder(10_000).encode(1, state).manifest.bucket_digests
    )
    assert await through_host.follow([completed]) == 1 and same(through_host.tensors(), state)
    # a pending manifest whose handles do not make its buckets is refused before a copy
    short = msgspec.structs.replace(
        held, device=msgspec.structs.replace(held.device, buckets=held.device.buckets[:-1])
    )
    with pytest.raises(WeightsCorrupted, match="device buckets"):
        await engine.fetch_tensors(short, torch.device("cpu"))


async def test_the_publisher_packs_on_the_device_only_full_versions_without_a_push_group(
    tmp_path: Path,
) -> None:
    """``publish_packed`` returns the manifest to announce now and the task that stores
    its fallback; the fallbacks are stored in version order and kept in the chains."""
    trainer, engine, _ = trainer_and_engine(tmp_path)
    publisher = WeightPublisher(trainer, WeightEncoder(bucket_bytes=10_000), keep_chains=1)
    assert publisher.packs_on_device
    states = [small_state(7), small_state(9)]

    def pack(version: int) -> Callable[[], Awaitable[tuple[WeightManifest, list[torch.Tensor]]]]:
        async def packing() -> tuple[WeightManifest, list[torch.Tensor]]:
            return packed(version, states[version - 1])

        return packing

    first, storing_first = await publisher.publish_packed(pack(1))
    second, storing_second = await publisher.publish_packed(pack(2))
    assert first.fallback_pending and second.fallback_pending
    assert storing_first is not None and storing_second is not None
    completed = [await storing_first, await storing_second]
    assert [m.version for m in completed] == [1, 2]
    assert not any(m.fallback_pending for m in completed)
    # the chains keep the completed manifests: the first chain dropped, its fallback gone
    assert [m.version for chain in publisher._chains for m in chain] == [2]
    assert same(await apply(engine, completed[1]), states[1])
    assert [name for name in os.listdir(tmp_path) if "weights-v" in name] == [completed[1].location]
    await publisher.close()
    assert buffer_files(tmp_path) == []
    with_deltas = WeightPublisher(trainer, WeightEncoder(bucket_bytes=10_000, deltas=True))
    shm_only = WeightPublisher(
        SharedMemoryPayloads("ipc", tmp_path), WeightEncoder(bucket_bytes=10_000)
    )
    for refused in (with_deltas, shm_only):
        assert not refused.packs_on_device
        with pytest.raises(ValueError, match="cuda_ipc store"):
            await refused.publish_packed(pack(1))
