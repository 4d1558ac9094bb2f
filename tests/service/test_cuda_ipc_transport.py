"""The ``cuda_ipc`` transport on a real nats-server, through the CPU stand-in of device
buffers: the trainer's publisher stores a version in device buffers and shared memory,
an engine's receiver (the stores every engine has) applies it from the buffers, and its
``WeightsLoaded`` frees them; a dead engine is not waited for. The protocol's parts on
their own are tests/unit/test_cuda_ipc_weights.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from seamlessflow.bus import Bus, decode
from seamlessflow.protocol import PhaseChanged, WeightManifest, WeightsLoaded, WeightsPublished
from seamlessflow.weights import WeightEncoder, WeightPublisher, WeightReceiver
from seamlessflow.weights.ipc import DevicePayloads
from seamlessflow.weights.settings import (
    WeightTransferSettings,
    payload_stores,
    publisher,
    stand_in_buffers,
)
from tests.support import InProcessMesh, eventually
from tests.support.weight_states import small_state


async def test_engines_apply_from_device_buffers_and_their_acknowledgements_free_them(
    bus: Bus, tmp_path: Path
) -> None:
    settings = WeightTransferSettings(
        transport="cuda_ipc", shm_dir=tmp_path, bucket_mb=0.01, ipc_expect_engines=2
    )
    trainer = publisher(bus, settings, 1 << 20, device_buffers=stand_in_buffers(bus, settings))
    store = trainer.store
    assert isinstance(store, DevicePayloads)
    await store.watch(bus, tick_s=0.05)

    def buffers() -> list[str]:
        return [name for name in os.listdir(tmp_path) if "-buffer-" in name]

    try:
        state = small_state(1)
        manifest = await trainer.publish(1, state)
        assert manifest.transport == "cuda_ipc" and len(buffers()) == 7
        engines = [WeightReceiver(payload_stores(bus, settings)) for _ in range(2)]
        for engine in engines:
            assert await engine.follow([manifest]) == 1
            got = engine.mirror.tensors()
            assert all(torch.equal(got[name], state[name]) for name in state)
        loaded = bus.subjects.weights_loaded()
        await bus.publish(loaded, WeightsLoaded(engine_id="engine-1", version=1))
        await asyncio.sleep(0.2)
        assert len(buffers()) == 7  # two engines are expected
        await bus.publish(loaded, WeightsLoaded(engine_id="engine-2", version=1))
        await eventually(lambda: not buffers(), 5.0, "the buffers freed")

        second = await trainer.publish(2, small_state(2))
        await bus.publish(loaded, WeightsLoaded(engine_id="engine-3", version=2))
        await bus.publish(loaded, WeightsLoaded(engine_id="engine-1", version=2))
        await asyncio.sleep(0.2)
        assert len(buffers()) == len(second.bucket_digests)  # engine-2 lags
        dead = PhaseChanged(resource_id="engine-2", phase="dead")
        await bus.publish(bus.subjects.sched_phase(), dead)
        await eventually(lambda: not buffers(), 5.0, "the dead engine not waited for")
        assert await engines[1].follow([second]) == 2  # a lagging engine: from shm
    finally:
        await trainer.close()
    assert not os.listdir(tmp_path)


async def two_steps_on_a_cuda_ipc_trainer(
    mesh: InProcessMesh,
    bus: Bus,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> list[WeightManifest]:
    """The trainer service with ``cuda_ipc``, its device buffers the CPU stand-in, for
    two steps: every manifest it announced, in order."""
    from sf_tag_scheduler.service import TagSchedulerService
    from sf_trainer import service as trainer_service
    from tests.support.trainer_runs import BATCHES, SETTINGS, run_trainer, trainer_mesh

    monkeypatch.setenv("SF_WEIGHTS_TRANSPORT", "cuda_ipc")
    monkeypatch.setenv("SF_WEIGHTS_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SF_WEIGHTS_BUCKET_MB", "0.05")
    (tmp_path / "shm").mkdir()

    def on_stand_in(
        bus: Bus, settings: WeightTransferSettings, version_bytes: int, device: str = "cpu"
    ) -> WeightPublisher:
        return publisher(bus, settings, version_bytes, device, stand_in_buffers(bus, settings))

    monkeypatch.setattr(trainer_service, "publisher", on_stand_in)
    await mesh.start(TagSchedulerService())
    for batch in BATCHES[:2]:
        await bus.js_publish(bus.subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}")
    steps = SETTINGS.model_copy(update={"steps": 2})
    await run_trainer(trainer_mesh(mesh, base_model_dir, tmp_path), steps)
    return [
        decode(m.data, WeightsPublished).manifest
        for m in await bus.read_subject(
            bus.subjects.stream_weights(), bus.subjects.weights_published()
        )
    ]


async def test_a_trainer_packs_each_version_on_its_device_and_announces_it_twice(
    mesh: InProcessMesh,
    bus: Bus,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each version is packed where the trainer computes (``Learner.pack_weights``) and
    announced held, its fallback pending, then again once the fallback holds it, with
    the digests of exactly the bytes the host path gives for the same weights."""
    from sf_trainer.service import weight_transfer
    from tests.support.trainer_runs import BATCHES, SETTINGS, learner

    announced = await two_steps_on_a_cuda_ipc_trainer(
        mesh, bus, base_model_dir, tmp_path, monkeypatch
    )
    for version in (1, 2):
        held, completed = [m for m in announced if m.version == version]  # in this order
        assert held.fallback_pending and held.bucket_digests == [] and held.device is not None
        assert not completed.fallback_pending and completed.device is not None
        assert completed.device.buckets == held.device.buckets  # the same device buffers
        assert len(completed.bucket_digests) == len(held.device.checksums) > 1
    expected = learner(base_model_dir)
    for batch, version in zip(BATCHES[:2], range(2), strict=True):
        expected.step(batch, version)
    dtype = weight_transfer(SETTINGS).travel_dtype
    through_host = expected.encode_weights(
        WeightEncoder(bucket_bytes=completed.bucket_bytes), 2, dtype
    ).manifest
    assert completed.bucket_digests == through_host.bucket_digests
    assert completed.state_digest == through_host.state_digest


async def test_a_version_that_does_not_fit_the_device_goes_through_host_memory(
    mesh: InProcessMesh,
    bus: Bus,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packing needs one more copy of the weights on the device: when it does not fit,
    the trainer publishes that version the host path's way (announced once, complete)
    and goes on training."""
    from sf_trainer.learner import Learner

    pack_weights = Learner.pack_weights

    def out_of_memory_at_first(self: Learner, *args: Any) -> Any:
        if args[1] == 1:  # the version
            for _ in self.group.host_tensors(self.model):
                pass  # as a failed pack leaves the gathers: finished
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.55 GiB")
        return pack_weights(self, *args)

    monkeypatch.setattr(Learner, "pack_weights", out_of_memory_at_first)
    announced = await two_steps_on_a_cuda_ipc_trainer(
        mesh, bus, base_model_dir, tmp_path, monkeypatch
    )
    first = [m for m in announced if m.version == 1]
    assert len(first) == 1 and not first[0].fallback_pending and first[0].bucket_digests
    assert [m.fallback_pending for m in announced if m.version == 2] == [True, False]
