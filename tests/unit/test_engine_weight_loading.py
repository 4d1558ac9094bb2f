"""The engine worker's weight loading (`sf_engine.weight_loading.WeightLoader`) on its own:
real payloads (encoded by the trainer's `WeightEncoder`, checked by the engine's
`WeightReceiver`) from an in-memory store, against a recording engine, bus and
membership; no NATS, no model.

What it holds: a version reaches the engine whole and only once, and is announced;
a corrupted or missing payload changes nothing; a delta after a gap is built from the
current chain; a lent (asleep) engine loads nothing; the swap pauses and resumes as
``SF_ENGINE_INTERRUPT_MODE`` says; a version floor waits for weight-sync's announcement.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch

from seamlessflow.bus import NoResponder
from seamlessflow.protocol import (
    CurrentVersion,
    CurrentVersionQuery,
    LoadWeights,
    Subjects,
    WeightManifest,
    WeightsLoaded,
)
from seamlessflow.weights import WeightReceiver
from seamlessflow.weights.codec import EncodedWeights, WeightEncoder
from seamlessflow.weights.collective import Received
from seamlessflow.weights.device import SharedMemoryBuffers
from seamlessflow.weights.ipc import DevicePayloads, HeldVersions
from seamlessflow.weights.layout import bucket_digests
from seamlessflow.weights.stores import PayloadMissing, SharedMemoryPayloads
from sf_engine.in_flight import InFlight
from sf_engine.settings import EngineSettings
from sf_engine.weight_loading import WeightLoader

BUCKET_BYTES = 64


class MemoryStore:
    """A pull store in a dict (what ``ObjectStorePayloads`` is over NATS)."""

    name = "memory"
    ephemeral = True

    def __init__(self) -> None:
        self.payloads: dict[str, bytes] = {}

    async def put(self, encoded: EncodedWeights) -> WeightManifest:
        location = f"v{encoded.manifest.version}"
        self.payloads[location] = bytes(encoded.payload)
        return msgspec.structs.replace(encoded.manifest, transport=self.name, location=location)

    async def fetch(self, manifest: WeightManifest) -> memoryview:
        if manifest.location not in self.payloads:
            raise PayloadMissing(manifest.location)
        return memoryview(self.payloads[manifest.location])

    async def delete(self, manifest: WeightManifest) -> None:
        self.payloads.pop(manifest.location, None)

    async def delete_before(self, version: int) -> None:
        self.payloads = {k: v for k, v in self.payloads.items() if int(k[1:]) >= version}


class RecordingEngine:
    """What the loader asks of an ``InferenceEngine``, recorded."""

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.calls: list[str] = []

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.calls.append(f"load {version}")
        self.loaded.append((version, {k: v.clone() for k, v in state_dict.items()}))
        self.version = version

    async def pause(self, mode: str) -> None:
        self.calls.append(f"pause {mode}")

    async def resume(self) -> None:
        self.calls.append("resume")


class RecordingBus:
    """Publishes recorded; current-version queries answered from ``answers`` in order
    (the last one repeats), none answered while ``silent`` > 0."""

    def __init__(self) -> None:
        self.subjects = Subjects("run", "policy")
        self.published: list[tuple[str, Any]] = []
        self.answers: list[CurrentVersion] = [CurrentVersion(version=0)]
        self.asked = 0
        self.silent = 0

    async def publish(self, subject: str, message: Any) -> None:
        self.published.append((subject, message))

    async def request(self, subject: str, message: Any, reply_type: Any, *, timeout: float) -> Any:
        assert subject == self.subjects.weights_current()
        assert isinstance(message, CurrentVersionQuery) and reply_type is CurrentVersion
        if self.silent:
            self.silent -= 1
            raise NoResponder(subject)
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class RecordingMembership:
    def __init__(self) -> None:
        self.version = 0
        self.phases: list[str] = []

    def set_phase(self, phase: str) -> None:
        self.phases.append(phase)


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(4, 6, generator=generator),
        "layer.bias": torch.randn(6, generator=generator),
    }


class Rig:
    """A loader with its store, encoder and recorders."""

    def __init__(self, receiver: WeightReceiver | None = None, **settings: Any) -> None:
        self.store = MemoryStore()
        self.encoder = WeightEncoder(BUCKET_BYTES, deltas=True)
        self.engine = RecordingEngine()
        self.bus = RecordingBus()
        self.membership = RecordingMembership()
        self.in_flight = InFlight()
        self.loader = WeightLoader(
            "engine-1",
            cast(Any, self.engine),
            EngineSettings(**settings),
            cast(Any, self.bus),
            receiver or WeightReceiver({self.store.name: self.store}),
            cast(Any, self.membership),
            self.in_flight,
        )

    async def publish(self, version: int, weights: dict[str, torch.Tensor]) -> WeightManifest:
        return await self.store.put(self.encoder.encode(version, weights))

    def announced(self) -> list[int]:
        loaded = [m for s, m in self.bus.published if s == self.bus.subjects.weights_loaded()]
        assert all(isinstance(m, WeightsLoaded) and m.engine_id == "engine-1" for m in loaded)
        return [m.version for m in loaded]


def assert_serves(rig: Rig, version: int, weights: dict[str, torch.Tensor]) -> None:
    served_version, served = rig.engine.loaded[-1]
    assert served_version == rig.engine.version == rig.membership.version == version
    assert served.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(served[name], tensor), name


async def test_a_broadcast_version_is_loaded_whole_once_and_announced() -> None:
    rig = Rig()
    weights = state(1)
    manifest = await rig.publish(1, weights)
    await rig.loader.on_load(LoadWeights(manifest=manifest))
    await rig.loader.on_load(LoadWeights(manifest=manifest))  # loads are idempotent
    assert_serves(rig, 1, weights)
    assert len(rig.engine.loaded) == 1 and rig.announced() == [1]
    # "keep": requests in flight are frozen at a token boundary for the swap only
    assert rig.engine.calls == ["pause keep", "load 1", "resume"]
    assert rig.membership.phases == ["sync", "idle"]


async def test_a_delta_on_the_held_version_applies_and_a_gap_catches_up_from_the_chain() -> None:
    rig = Rig()
    full = await rig.publish(1, state(1))
    second = {**state(1), "layer.bias": state(2)["layer.bias"]}  # a small change: a delta
    delta = await rig.publish(2, second)
    assert delta.kind == "delta" and delta.base_version == 1
    # the engine never saw version 1: the delta alone is a gap, so it asks for the chain
    rig.bus.answers = [CurrentVersion(version=2, chain=[full, delta])]
    await rig.loader.on_load(LoadWeights(manifest=delta))
    assert rig.bus.asked == 1
    assert_serves(rig, 2, second)
    third = {**second, "layer.bias": state(3)["layer.bias"]}
    await rig.loader.on_load(LoadWeights(manifest=await rig.publish(3, third)))
    assert_serves(rig, 3, third)
    assert rig.announced() == [2, 3] and rig.bus.asked == 1


async def test_a_corrupted_or_missing_payload_loads_nothing() -> None:
    rig = Rig()
    manifest = await rig.publish(1, state(1))
    payload = bytearray(rig.store.payloads[manifest.location])
    payload[0] ^= 0xFF
    rig.store.payloads[manifest.location] = bytes(payload)
    await rig.loader.load([manifest])
    rig.store.payloads.clear()
    await rig.loader.load([manifest])
    assert rig.engine.loaded == [] and rig.engine.version == 0 and rig.announced() == []


def off_the_wire(manifest: WeightManifest, payload: bytes) -> Received:
    """``payload`` as the push group's receiver hands it over: with the digests of the
    bytes that arrived."""
    return Received(manifest, memoryview(payload), bucket_digests(payload, manifest.bucket_bytes))


async def test_an_asleep_engine_skips_broadcasts_and_pushes_until_it_catches_up() -> None:
    rig = Rig()
    weights = state(1)
    manifest = await rig.publish(1, weights)
    rig.loader.asleep = True
    await rig.loader.on_load(LoadWeights(manifest=manifest))
    await rig.loader.pushed(off_the_wire(manifest, rig.store.payloads[manifest.location]))
    assert rig.engine.loaded == []
    rig.loader.asleep = False  # lent back: it asks weight-sync and loads the current one
    rig.bus.answers = [CurrentVersion(version=1, chain=[manifest])]
    await rig.loader.catch_up()
    assert_serves(rig, 1, weights)


async def test_a_pushed_payload_is_served_and_a_refused_one_is_left_to_the_pull() -> None:
    rig = Rig()
    weights = state(1)
    manifest = await rig.publish(1, weights)
    good = rig.store.payloads[manifest.location]
    await rig.loader.pushed(off_the_wire(manifest, bytes(len(good))))  # wrong bytes
    assert rig.engine.loaded == []
    await rig.loader.pushed(off_the_wire(manifest, good))
    assert_serves(rig, 1, weights)
    assert rig.announced() == [1]


@pytest.mark.parametrize(
    ("mode", "calls"),
    [
        ("keep", ["pause keep", "load 1", "resume"]),
        ("abort", ["pause abort", "load 1", "resume"]),
        ("wait", ["load 1"]),  # the engine's own load waits for the running batch
    ],
)
async def test_the_swap_interrupts_requests_as_the_interrupt_mode_says(
    mode: str, calls: list[str]
) -> None:
    rig = Rig(interrupt_mode=mode)
    rig.in_flight.add("r1")  # a request runs on across the swap
    await rig.loader.load([await rig.publish(1, state(1))])
    assert rig.engine.calls == calls
    assert rig.membership.phases == ["sync", "rollout"]


async def test_catch_up_asks_until_weight_sync_answers_and_waits_for_a_version_floor() -> None:
    rig = Rig(min_version_wait_s=5.0)
    weights = state(1)
    manifest = await rig.publish(1, weights)
    rig.bus.silent = 2  # weight-sync not up yet: asked again after 0.1 s, then 0.2 s
    # weight-sync announces version 1 only on the third answer
    rig.bus.answers = [CurrentVersion(version=0), CurrentVersion(version=0)]
    rig.bus.answers.append(CurrentVersion(version=1, chain=[manifest]))
    async with asyncio.timeout(5):
        await asyncio.gather(rig.loader.reach(1), rig.loader.reach(1))
    assert_serves(rig, 1, weights)
    # the two requests waited for one catch-up: the second found the version loaded
    assert rig.bus.asked == 3 and len(rig.engine.loaded) == 1
    await rig.loader.reach(1)  # already served: nothing asked
    assert rig.bus.asked == 3


async def test_a_version_floor_weight_sync_never_announces_ends_after_the_wait() -> None:
    rig = Rig(min_version_wait_s=0.1)
    async with asyncio.timeout(5):
        await rig.loader.reach(3)
    assert rig.engine.loaded == [] and rig.bus.asked > 1


async def test_a_version_copied_onto_the_device_is_released_once_the_engine_loaded_it(
    tmp_path: Path,
) -> None:
    """``cuda_ipc`` with its shared-memory stand-in for device memory: the receiver's
    copy of a version on the engine's device is a whole set of weights beyond the
    engine's own; once the engine has loaded it, the card gets it back."""
    run = "seamlessflow-loader-policy-"

    def shm() -> dict[str, SharedMemoryPayloads]:
        return {"shm": SharedMemoryPayloads("ipc", tmp_path)}

    trainer = DevicePayloads(shm(), "shm", SharedMemoryBuffers(tmp_path, run), HeldVersions(4, 60))
    engine_store = DevicePayloads(
        shm(), "shm", None, HeldVersions(1, 60), {"shm": SharedMemoryBuffers(tmp_path, run)}
    )
    receiver = WeightReceiver({"cuda_ipc": engine_store}, device=torch.device("cpu"))
    rig = Rig(receiver=receiver)
    for version in (1, 2):
        weights = state(version)
        manifest = await trainer.put(WeightEncoder(BUCKET_BYTES).encode(version, weights))
        assert manifest.device is not None
        await rig.loader.on_load(LoadWeights(manifest=manifest))
        assert_serves(rig, version, weights)
        # device to device: the host mirror never held it, and no copy stays
        assert receiver.mirror.version == 0 and receiver.version == 0
        assert receiver.release_device_copy() == 0
    await rig.loader.on_load(LoadWeights(manifest=manifest))  # served: not loaded again
    assert [v for v, _ in rig.engine.loaded] == [1, 2] and rig.announced() == [1, 2]
