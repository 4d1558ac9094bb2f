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


async def test_a_trainer_packs_each_version_on_its_device_with_the_host_paths_bytes(
    mesh: InProcessMesh,
    bus: Bus,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer service with ``cuda_ipc`` (its device buffers the CPU stand-in):
    each version is packed where the trainer computes (``Learner.pack_weights``), and its
    manifest carries the device handles and the digests of exactly the bytes the host
    path gives for the same weights."""
    from sf_tag_scheduler.service import TagSchedulerService
    from sf_trainer import service as trainer_service
    from tests.support.trainer_runs import BATCHES, SETTINGS, learner, run_trainer, trainer_mesh

    monkeypatch.setenv("SF_WEIGHTS_TRANSPORT", "cuda_ipc")
    monkeypatch.setenv("SF_WEIGHTS_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SF_WEIGHTS_BUCKET_MB", "0.05")
    (tmp_path / "shm").mkdir()
    packed: list[int] = []

    def on_stand_in(
        bus: Bus, settings: WeightTransferSettings, version_bytes: int, device: str = "cpu"
    ) -> WeightPublisher:
        made = publisher(bus, settings, version_bytes, device, stand_in_buffers(bus, settings))
        publish_packed = made.publish_packed

        async def counted(pack: Any) -> WeightManifest:
            manifest = await publish_packed(pack)
            packed.append(manifest.version)
            return manifest

        made.publish_packed = counted  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(trainer_service, "publisher", on_stand_in)
    await mesh.start(TagSchedulerService())
    for batch in BATCHES[:2]:
        await bus.js_publish(bus.subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}")
    await run_trainer(
        trainer_mesh(mesh, base_model_dir, tmp_path), SETTINGS.model_copy(update={"steps": 2})
    )

    announced = [
        decode(m.data, WeightsPublished).manifest
        for m in await bus.read_subject(
            bus.subjects.stream_weights(), bus.subjects.weights_published()
        )
    ]
    assert packed == [m.version for m in announced] == [1, 2]
    last = announced[-1]
    assert last.transport == "cuda_ipc" and last.device is not None
    assert len(last.device.buckets) == len(last.device.checksums) == len(last.bucket_digests) > 1
    expected = learner(base_model_dir)
    for batch, version in zip(BATCHES[:2], range(2), strict=True):
        expected.step(batch, version)
    dtype = trainer_service.weight_transfer(SETTINGS).travel_dtype
    through_host = expected.encode_weights(
        WeightEncoder(bucket_bytes=last.bucket_bytes), 2, dtype
    ).manifest
    assert last.bucket_digests == through_host.bucket_digests
    assert last.state_digest == through_host.state_digest
