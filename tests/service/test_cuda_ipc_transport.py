"""The ``cuda_ipc`` transport on a real nats-server, through the CPU stand-in of device
buffers: the trainer's publisher stores a version in device buffers and shared memory,
an engine's receiver (the stores every engine has) applies it from the buffers, and its
``WeightsLoaded`` frees them; a dead engine is not waited for. The protocol's parts on
their own are tests/unit/test_cuda_ipc_weights.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from seamlessflow.bus import Bus
from seamlessflow.protocol import PhaseChanged, WeightsLoaded
from seamlessflow.weights import WeightReceiver
from seamlessflow.weights.ipc import DevicePayloads
from seamlessflow.weights.settings import (
    WeightTransferSettings,
    payload_stores,
    publisher,
    stand_in_buffers,
)
from tests.support import eventually
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
