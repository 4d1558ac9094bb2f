"""Lending in the other direction: idle rollout engines' cores lent to the training
trainer (``CoresLent``), taken back by the engine's next request. A real tag-scheduler
and a real engine worker on a real nats-server, with the trainer played through the
scheduler's own subjects as ``sf_trainer`` does. The rule
(``idle_cores.cores_for_training``) and the trainer's side (``ThreadBudget``) on their
own are tests/unit/test_cores_lending_rule.py.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    DEFAULT_POLICY,
    CoresLent,
    GenerateReply,
    GenerateRequest,
    LendReport,
    SlotsClaim,
    SlotsGranted,
    SlotsReleased,
)
from seamlessflow.resources import ResourceMembership
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_tag_scheduler.settings import TagSchedulerSettings
from sf_weight_sync.service import WeightSyncService


async def test_an_idle_engine_lends_its_core_and_its_next_request_takes_it_back(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus
) -> None:
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        scheduler = await mesh.start(TagSchedulerService(TagSchedulerSettings()))
        await mesh.start(WeightSyncService())
        worker = await mesh.start(EngineService(EngineSettings(engine_id="engine-d")))
        async with asyncio.timeout(60):
            await worker.ready.wait()
        trainer_id = "trainer-policy-test"
        offers: asyncio.Queue[CoresLent] = asyncio.Queue()

        async def on_offer(offer: CoresLent) -> None:
            offers.put_nowait(offer)

        await bus.subscribe(bus.subjects.sched_cores(trainer_id), CoresLent, on_offer)
        trainer = ResourceMembership(bus, trainer_id, "trainer", ["train"], slots=["slot-1"])
        await trainer.register()
        assert scheduler.resources[trainer_id].process[0] == socket.gethostname()

        async def next_offer() -> CoresLent:
            async with asyncio.timeout(30):
                return await offers.get()

        # training starts while the engine has nothing to do: its core is lent
        await bus.request(
            bus.subjects.sched_claim(), SlotsClaim(trainer_id=trainer_id, batch_index=0),
            SlotsGranted,
        )  # fmt: skip
        offer = await next_offer()
        assert (offer.threads, offer.engines) == (1, ["engine-d"])

        # a request reaches the engine: the core goes back while it generates
        reply_task = asyncio.create_task(
            bus.request(
                bus.subjects.engine_generate(),
                GenerateRequest(
                    request_id="r1", session_id="s", prompt_ids=[1, 2, 3], max_tokens=64
                ),
                GenerateReply,
                timeout=60,
            )
        )
        offer = await next_offer()
        assert (offer.threads, offer.engines) == (0, [])
        reply = await reply_task
        assert reply.engine_id == "engine-d" and reply.token_ids
        # done: lent again (the trainer still trains)
        offer = await next_offer()
        assert offer.threads == 1

        # the trainer releases its slots: nothing lent while it does not train
        await bus.request(
            bus.subjects.sched_release(), SlotsReleased(trainer_id=trainer_id, version=1),
            LendReport,
        )  # fmt: skip
        offer = await next_offer()
        assert offer.threads == 0
        assert DEFAULT_POLICY not in scheduler.training
    finally:
        await mesh.stop()


async def test_no_cores_lent_when_lending_to_training_is_off(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus
) -> None:
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        settings = TagSchedulerSettings(lend_cores_to_training=False)
        scheduler = await mesh.start(TagSchedulerService(settings))
        await mesh.start(WeightSyncService())
        worker = await mesh.start(EngineService(EngineSettings(engine_id="engine-d")))
        async with asyncio.timeout(60):
            await worker.ready.wait()
        trainer_id = "trainer-policy-off"
        offers: list[CoresLent] = []

        async def on_offer(offer: CoresLent) -> None:
            offers.append(offer)

        await bus.subscribe(bus.subjects.sched_cores(trainer_id), CoresLent, on_offer)
        trainer = ResourceMembership(bus, trainer_id, "trainer", ["train"], slots=["slot-1"])
        await trainer.register()
        granted = await bus.request(
            bus.subjects.sched_claim(), SlotsClaim(trainer_id=trainer_id, batch_index=0),
            SlotsGranted,
        )  # fmt: skip
        assert granted.missed == []
        assert scheduler.cores_lent == {}
        await bus.request(
            bus.subjects.sched_release(), SlotsReleased(trainer_id=trainer_id, version=1),
            LendReport,
        )  # fmt: skip
        assert scheduler.training == {}
        # the release's reply comes after anything the claim or release sent on the
        # scheduler's connection
        assert offers == []
    finally:
        await mesh.stop()
