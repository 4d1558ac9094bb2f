"""Spatiotemporal multiplexing on a real mesh: lend a training slot's engine to rollout,
reclaim it mid-answer, and lose no request and no token; late engines catch up first.

A real tag-scheduler (multiplexed), weight-sync, gateway and two engine workers on a
real nats-server: ``engine-d`` is a dedicated rollout engine, ``engine-l`` sits on the
trainer's slot (tags ``train,rollout``). The test plays the trainer through the
scheduler's own subjects (SlotsReleased / SlotsClaim), as ``sf_trainer`` does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from transformers import AutoModelForCausalLM

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    BatchProgress,
    GenerateReply,
    GenerateRequest,
    LendReport,
    ShedReport,
    ShedRequests,
    SlotsClaim,
    SlotsGranted,
    SlotsReleased,
)
from seamlessflow.settings import MeshSettings
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_tag_scheduler.settings import TagSchedulerSettings
from sf_weight_sync.service import WeightSyncService
from tests.support import session_auth

AGENTS = 8
MAX_TOKENS = 160


async def start_engine(
    mesh, engine_id: str, tags: str, slot: str, backend: str = "hf"
) -> EngineService:  # type: ignore[no-untyped-def]
    """An engine worker with its own resource tags (SF_RESOURCE_TAGS in production)."""
    worker = EngineService(
        EngineSettings(engine_id=engine_id, max_batch_size=AGENTS, backend=backend)
    )
    saved = mesh.mesh
    mesh.mesh = MeshSettings(
        nats_url=saved.nats_url,
        run_id=saved.run_id,
        model_dir=saved.model_dir,
        resource_tags=tags,
        resource_slots=slot,
    )
    try:
        return await mesh.start(worker)  # type: ignore[no-any-return]
    finally:
        mesh.mesh = saved


async def start_lending_mesh(  # type: ignore[no-untyped-def]
    mesh, settings: TagSchedulerSettings, backend: str = "hf"
) -> tuple[TagSchedulerService, EngineService, EngineService, GatewayService]:
    """A multiplexed mesh: the tag-scheduler, weight-sync, a dedicated engine
    (``engine-d``), a lendable one on the trainer's slot (``engine-l``) and the gateway,
    all up and registered."""
    scheduler = await mesh.start(TagSchedulerService(settings))
    await mesh.start(WeightSyncService())
    dedicated = await start_engine(mesh, "engine-d", "rollout", "slot-0", backend)
    lendable = await start_engine(mesh, "engine-l", "train,rollout", "slot-1", backend)
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
    async with asyncio.timeout(60):
        await dedicated.ready.wait()
        await gateway.ready.wait()
        while "engine-l" not in scheduler.resources:  # noqa: ASYNC110 (another service)
            await asyncio.sleep(0.05)
    return scheduler, dedicated, lendable, gateway


async def test_reclaim_during_generation_loses_no_request_and_no_token(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus
) -> None:
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    # Every service here shares this test's event loop, and a stall of that loop reads
    # as a silent engine. Making an OpenAI client loads the CA bundle: 8 of them held the
    # loop 0.47 s on a quiet core (54 ms each), several seconds at the load averages of
    # 4-12 where this test failed. The scheduler then found no heartbeat within
    # ``dead_after_s`` (5 s), declared the engines dead, and engine-l was no longer lent:
    # the claim had nothing to reclaim (TimeoutError). The clients are made once, before
    # the mesh runs (one pool for every agent, as in sf_agents), and death detection,
    # which this test does not check, gets room for the stalls of one shared loop.
    http = httpx.AsyncClient(timeout=120)
    openai_http = DefaultAsyncHttpxClient()
    try:
        scheduler, _dedicated, lendable, gateway = await start_lending_mesh(
            mesh, TagSchedulerSettings(mode="multiplexed", dead_after_s=60.0)
        )
        # The trainer waits for its first batch. No wait was measured yet, so the policy
        # lends (here already when engine-l registered: no trainer was training).
        report: LendReport = await bus.request(
            bus.subjects.sched_release(),
            SlotsReleased(trainer_id="trainer-t", version=0),
            LendReport,
        )
        assert scheduler.decisions().role_of("engine-l").role == "rollout", report.reason
        async with asyncio.timeout(60):
            await lendable.ready.wait()  # woke, caught up, joined the queue

        url = f"http://127.0.0.1:{gateway.bound_port}"

        async def agent(index: int) -> str:
            session = (await http.post(f"{url}/sessions", json={})).json()
            client = AsyncOpenAI(
                base_url=session["base_url"],
                api_key=session["api_key"],
                max_retries=0,
                http_client=openai_http,
            )
            messages = [{"role": "user", "content": f"Count to {index}"}]
            if index % 2:
                stream = await client.chat.completions.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                    stream=True,
                )
                parts, finishes = [], []
                async for chunk in stream:
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                        if chunk.choices[0].finish_reason:
                            finishes.append(chunk.choices[0].finish_reason)
                assert len(finishes) == 1, "one answer, one finish"
                text = "".join(parts)
            else:
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                )
                text = reply.choices[0].message.content or ""
            await http.post(
                f"{url}/sessions/{session['session_id']}/finish", headers=session_auth(session)
            )
            return text

        agents = [asyncio.create_task(agent(i)) for i in range(AGENTS)]
        # wait until the lent engine holds answers that have started streaming
        async with asyncio.timeout(60):
            while not any(  # noqa: ASYNC110 (the gateway's own bookkeeping)
                gateway.gateway.engines._engine_calls.get("engine-l", {})
            ):
                await asyncio.sleep(0.01)
        on_lent_engine = set(gateway.gateway.engines._engine_calls["engine-l"])
        # a batch is ready: the trainer claims its slot back
        granted: SlotsGranted = await bus.request(
            bus.subjects.sched_claim(),
            SlotsClaim(trainer_id="trainer-t", batch_index=0),
            SlotsGranted,
            timeout=30,
        )
        # the slot is free when the claim returns: nothing runs on the lent engine
        assert granted.reclaimed == ["engine-l"] and granted.missed == []
        assert lendable._generate_sub is None and not lendable._in_flight
        assert lendable.handed_back >= 1
        async with asyncio.timeout(120):
            texts = await asyncio.gather(*agents)
    finally:
        await http.aclose()
        await openai_http.aclose()
        await mesh.stop()

    assert on_lent_engine
    from tests.support import recorded_turns

    turns = await recorded_turns(bus)
    # every agent got one complete answer, recorded once, exactly as it read it
    assert len(turns) == AGENTS
    assert sorted(t.completion_text for t in turns) == sorted(texts)
    for turn in turns:
        assert len(turn.completion_ids) == len(turn.logprobs) == len(turn.versions)
        assert turn.finish_reason in ("stop", "length")
        if turn.finish_reason == "length":
            assert len(turn.completion_ids) == MAX_TOKENS  # no token lost in the handover
    # the handed-back answers finished on the dedicated engine
    assert any(t.engine_id == "engine-d" for t in turns)
    assert all(t.engine_id == "engine-d" for t in turns if t.engine_id != "engine-l")


async def test_a_late_engine_serves_only_after_catching_up(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    """Versions 1 and 2 are published before the engine exists; its very first answer
    must already come from version 2."""
    from tests.support import InProcessMesh, publish_perturbed_version

    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        weight_sync = await mesh.start(WeightSyncService())
        base = AutoModelForCausalLM.from_pretrained(str(base_model_dir)).state_dict()
        for version in (1, 2):
            await publish_perturbed_version(bus, version, base)
        async with asyncio.timeout(30):
            while weight_sync.chain.version < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)

        late = await mesh.start(EngineService(EngineSettings(engine_id="engine-late")))
        async with asyncio.timeout(60):
            await late.ready.wait()
        assert late.engine.version == 2
        reply: GenerateReply = await bus.request(
            bus.subjects.engine_generate(),
            GenerateRequest(request_id="first", session_id="s", prompt_ids=[1, 2, 3], max_tokens=4),
            GenerateReply,
            timeout=30,
        )
        assert reply.engine_id == "engine-late"
        assert reply.versions and set(reply.versions) == {2}
    finally:
        await mesh.stop()


async def ask(http: httpx.AsyncClient, index: int, max_tokens: int) -> str:
    """One agent session, one answer (streamed for odd ``index``)."""
    session = (await http.post("/sessions", json={})).json()
    async with AsyncOpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0
    ) as client:
        messages = [{"role": "user", "content": f"Count to {index}"}]
        if index % 2:
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                stream=True,
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            text = "".join(parts)
        else:
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
            )
            text = reply.choices[0].message.content or ""
    await http.post(f"/sessions/{session['session_id']}/finish", headers=session_auth(session))
    return text


async def test_a_freshly_lent_engine_takes_over_requests_in_flight(
    nats_url: str,
    run_id: str,
    chatty_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rebalance on lend: every request of the step is already on the dedicated engine
    when the trainer's slot is lent. The scheduler has the dedicated engine hand its
    youngest requests over (partial tokens kept) and the gateway resumes them on the
    lent engine, so it does work at once; no answer loses or repeats a token.

    Scripted engines at 20 ms per token: every answer takes its whole budget (~10 s),
    so it is still in flight, on any machine, when the lent engine joins."""
    from tests.support import InProcessMesh, recorded_turns

    monkeypatch.setenv("SF_ENGINE_SCRIPTED_STEP_S", "0.02")
    max_tokens = 480
    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        scheduler, dedicated, lendable, gateway = await start_lending_mesh(
            mesh, TagSchedulerSettings(mode="multiplexed"), "scripted"
        )
        # the first wait fills the pipeline (lent); then the trainer trains (reclaimed)
        await bus.request(
            bus.subjects.sched_release(), SlotsReleased(trainer_id="t", version=0), LendReport
        )
        await bus.request(
            bus.subjects.sched_claim(), SlotsClaim(trainer_id="t", batch_index=0), SlotsGranted
        )
        assert lendable._generate_sub is None
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            agents = [asyncio.create_task(ask(http, i, max_tokens)) for i in range(AGENTS)]
            # the requests are on the dedicated engine, and its heartbeat says so
            async with asyncio.timeout(60):
                while scheduler.resources["engine-d"].in_flight < AGENTS:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            # the step is published: the trainer waits, and the policy lends (to measure)
            report: LendReport = await bus.request(
                bus.subjects.sched_release(), SlotsReleased(trainer_id="t", version=0), LendReport
            )
            assert report.lent == ["engine-l"], report.reason
            async with asyncio.timeout(60):
                while not dedicated.handed_over:  # noqa: ASYNC110 (the engine's own count)
                    await asyncio.sleep(0.02)
            async with asyncio.timeout(180):
                texts = await asyncio.gather(*agents)
    finally:
        await mesh.stop()

    # the lent engine's share: half of what the dedicated engine held
    assert dedicated.handed_over == AGENTS // 2
    turns = await recorded_turns(bus)
    assert len(turns) == AGENTS
    assert sorted(t.completion_text for t in turns) == sorted(texts)
    on_lent = [t for t in turns if t.engine_id == "engine-l"]
    assert len(on_lent) == dedicated.handed_over  # resumed there, finished there
    for turn in turns:  # scripted answers run to their budget, across the hand-over
        assert turn.finish_reason == "length"
        assert len(turn.completion_ids) == len(turn.logprobs) == len(turn.versions)
        assert len(turn.completion_ids) == max_tokens  # no token lost or repeated


async def test_a_request_handed_to_an_engine_that_left_resumes_on_any_engine(
    nats_url: str,
    run_id: str,
    chatty_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine hands requests over to an engine that no longer serves (reclaimed or
    gone before the gateway re-submits): its direct subject has no responder, so the
    gateway resumes them through the queue group; nothing is lost."""
    from tests.support import InProcessMesh, recorded_turns

    monkeypatch.setenv("SF_ENGINE_SCRIPTED_STEP_S", "0.02")  # ~10 s per answer
    max_tokens = 480
    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        engine = await start_engine(mesh, "engine-d", "rollout", "slot-0", "scripted")
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(60):
            await engine.ready.wait()
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            agents = [asyncio.create_task(ask(http, i, max_tokens)) for i in range(4)]
            async with asyncio.timeout(60):
                while len(engine._in_flight) < 4:  # noqa: ASYNC110 (the engine's own count)
                    await asyncio.sleep(0.02)
            report: ShedReport = await bus.request(
                bus.subjects.engine_shed("engine-d"),
                ShedRequests(to_engine="engine-gone", count=2),
                ShedReport,
            )
            async with asyncio.timeout(180):
                texts = await asyncio.gather(*agents)
    finally:
        await mesh.stop()

    assert report.handed_over == engine.handed_over == 2
    turns = await recorded_turns(bus)
    assert sorted(t.completion_text for t in turns) == sorted(texts)
    assert len(turns) == 4 and all(t.engine_id == "engine-d" for t in turns)
    for turn in turns:  # scripted answers run to their budget, across the hand-over
        assert turn.finish_reason == "length"
        assert len(turn.completion_ids) == len(turn.logprobs) == len(turn.versions)
        assert len(turn.completion_ids) == max_tokens  # no token lost or repeated


async def test_an_early_reclaim_frees_the_slot_before_the_trainer_claims_it(
    nats_url: str,
    run_id: str,
    chatty_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reclaim_early_at`` 0.5: once half the groups of the next batch are ready (the
    trajectory service's BatchProgress), the lent engine hands its requests back and
    leaves while the trainer still waits; the claim then has nothing to take back, and
    no answer loses or repeats a token. Scripted engines at 20 ms per token keep every
    answer in flight (~10 s) while this happens."""
    from tests.support import InProcessMesh, recorded_turns

    monkeypatch.setenv("SF_ENGINE_SCRIPTED_STEP_S", "0.02")
    max_tokens = 480
    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    settings = TagSchedulerSettings(mode="multiplexed", reclaim_early_at=0.5)
    try:
        scheduler, _dedicated, lendable, gateway = await start_lending_mesh(
            mesh, settings, "scripted"
        )
        await bus.request(
            bus.subjects.sched_release(), SlotsReleased(trainer_id="t", version=0), LendReport
        )
        async with asyncio.timeout(60):
            await lendable.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            agents = [asyncio.create_task(ask(http, i, max_tokens)) for i in range(AGENTS)]
            async with asyncio.timeout(60):
                while not lendable._in_flight:  # noqa: ASYNC110 (the engine's own bookkeeping)
                    await asyncio.sleep(0.02)
            # one group of four ready: below the share; two of four: take it back now
            for ready in (1, 2):
                await bus.publish(
                    bus.subjects.batch_progress(),
                    BatchProgress(batch_index=0, groups_ready=ready, groups_per_batch=4),
                )
            async with asyncio.timeout(60):
                while lendable._generate_sub is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            decisions = scheduler.decisions().stats.decisions
            assert [d for d in decisions if d.startswith("prepare")] == ["prepare: reclaim 1 early"]
            # once over, nothing is left for the claim to wait for (nor to hold back the
            # next wait's early reclaim)
            async with asyncio.timeout(30):
                while scheduler._early_reclaims:  # noqa: ASYNC110 (the scheduler's own)
                    await asyncio.sleep(0.02)
            granted: SlotsGranted = await bus.request(
                bus.subjects.sched_claim(), SlotsClaim(trainer_id="t", batch_index=0), SlotsGranted
            )
            assert granted.reclaimed == [] and granted.missed == []
            assert scheduler.decisions().role_of("engine-l").role == "idle"
            async with asyncio.timeout(180):
                texts = await asyncio.gather(*agents)
    finally:
        await mesh.stop()

    assert lendable.handed_back >= 1
    turns = await recorded_turns(bus)
    assert len(turns) == AGENTS
    assert sorted(t.completion_text for t in turns) == sorted(texts)
    for turn in turns:  # scripted answers run to their budget, across the hand-back
        assert turn.finish_reason == "length"
        assert len(turn.completion_ids) == len(turn.logprobs) == max_tokens


async def test_a_lend_decided_before_a_claim_is_not_carried_out_after_it(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    """Lends run one plan at a time, in the background. Here a plan's slow engine
    (``engine-slow``: 3 s to take rollout once registered) holds the lending while the
    trainer claims, releases again and claims again; the next plan waits behind it with
    its engines already taken back. Carried out late, it would put ``engine-fast`` in
    rollout while its slot trains (a fresh CI run saw a lent engine serve 0.12 s into a
    train step). Both engines are the product's own resource clients; the test plays
    the trainer on the scheduler's subjects, as ``sf_trainer`` does."""
    from seamlessflow.protocol import RoleAssignment
    from seamlessflow.resources import ResourceMembership, RoleOutcome
    from tests.support import InProcessMesh

    roles: dict[str, list[str]] = {"engine-slow": [], "engine-fast": []}
    take_rollout_s = {"engine-slow": 0.0, "engine-fast": 0.0}

    def engine(resource_id: str) -> ResourceMembership:
        async def on_role(assignment: RoleAssignment) -> RoleOutcome:
            if assignment.role == "rollout":
                await asyncio.sleep(take_rollout_s[resource_id])
            roles[resource_id].append(assignment.role)
            return RoleOutcome()

        return ResourceMembership(
            bus, resource_id, "engine", ["train", "rollout"], ["slot-1"], on_role=on_role
        )

    mesh = InProcessMesh(nats_url, run_id, None)
    beats: list[asyncio.Task[None]] = []
    try:
        settings = TagSchedulerSettings(
            mode="colocated", reclaim_timeout_s=0.5, rebalance_on_lend=False
        )
        scheduler = await mesh.start(TagSchedulerService(settings))
        members = [ResourceMembership(bus, "t", "trainer", ["train"], slots=["slot-1"])]
        members += [engine(resource_id) for resource_id in roles]
        for member in members:  # colocated: the engines are lent as they register
            await member.register()
            beats.append(asyncio.create_task(member.heartbeat_loop()))
        take_rollout_s["engine-slow"] = 3.0
        release = SlotsReleased(trainer_id="t", version=0)
        claim = SlotsClaim(trainer_id="t", batch_index=0)
        await bus.request(bus.subjects.sched_claim(), claim, SlotsGranted)
        for _ in range(2):  # the first lend holds the lending 3 s; the second waits
            report = await bus.request(bus.subjects.sched_release(), release, LendReport)
            assert sorted(report.lent) == ["engine-fast", "engine-slow"], report.reason
            granted = await bus.request(bus.subjects.sched_claim(), claim, SlotsGranted)
            assert granted.missed == ["engine-slow"]  # still taking rollout
        taken_back = len(roles["engine-fast"])
        assert roles["engine-fast"][-1] == "idle", roles
        # the first lend ends once engine-slow took rollout (then the two reclaims); a
        # late lend would run then
        async with asyncio.timeout(30):
            while len(roles["engine-slow"]) < 5:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # a late lend, had one been sent, has been taken
        assert roles["engine-fast"][taken_back:] == [], roles
        assert roles["engine-slow"] == ["rollout", "idle", "rollout", "idle", "idle"]
        assert scheduler.registry.decisions().lent == set()
    finally:
        for beat in beats:
            beat.cancel()
        await mesh.stop()


async def test_a_trainer_that_frees_its_memory_has_its_slots_lent_only_once_it_has(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    """``SF_TRAINER_OFFLOAD_WHEN_LENT``: a release with ``frees_memory`` decides the lend
    but holds it until the trainer's SlotsFreed (its state is then off the device); a
    claim before that drops it. The engine is the product's resource client."""
    from seamlessflow.protocol import RoleAssignment, SlotsFreed
    from seamlessflow.resources import ResourceMembership, RoleOutcome
    from tests.support import InProcessMesh

    roles: list[str] = []

    async def on_role(assignment: RoleAssignment) -> RoleOutcome:
        roles.append(assignment.role)
        return RoleOutcome()

    mesh = InProcessMesh(nats_url, run_id, None)
    beats: list[asyncio.Task[None]] = []
    try:
        settings = TagSchedulerSettings(mode="colocated", rebalance_on_lend=False)
        scheduler = await mesh.start(TagSchedulerService(settings))
        members = [
            ResourceMembership(bus, "t", "trainer", ["train"], slots=["slot-1"]),
            ResourceMembership(
                bus, "engine-a", "engine", ["train", "rollout"], ["slot-1"], on_role=on_role
            ),
        ]
        for member in members:
            await member.register()
            beats.append(asyncio.create_task(member.heartbeat_loop()))
        release = SlotsReleased(trainer_id="t", version=0, frees_memory=True)
        claim = SlotsClaim(trainer_id="t", batch_index=0)
        freed = SlotsFreed(trainer_id="t", offloaded_bytes=10**9, seconds=0.5)
        await bus.request(bus.subjects.sched_claim(), claim, SlotsGranted)
        assert roles[-1] == "idle"
        taken = len(roles)
        lending = scheduler.lending  # set up by then: the scheduler answered

        report = await bus.request(bus.subjects.sched_release(), release, LendReport)
        assert report.lent == ["engine-a"], report.reason
        # decided, not carried out: held, nothing queued, the engine still idle
        assert list(lending.held_lends) == [release.policy] and lending._lends.empty()
        assert len(roles) == taken
        report = await bus.request(bus.subjects.sched_freed(), freed, LendReport)
        assert report.lent == ["engine-a"]
        async with asyncio.timeout(10):
            while roles[-1] != "rollout":  # noqa: ASYNC110 (the engine's own record)
                await asyncio.sleep(0.02)
        await bus.request(bus.subjects.sched_claim(), claim, SlotsGranted)
        assert roles[-1] == "idle"

        # a claim before the trainer freed its memory: the held lend is dropped
        await bus.request(bus.subjects.sched_release(), release, LendReport)
        await bus.request(bus.subjects.sched_claim(), claim, SlotsGranted)
        report = await bus.request(bus.subjects.sched_freed(), freed, LendReport)
        assert report.lent == [] and report.reason == "nothing held to lend"
        assert not lending.held_lends and lending._lends.empty()
        assert "rollout" not in roles[-2:], roles
    finally:
        for beat in beats:
            beat.cancel()
        await mesh.stop()
