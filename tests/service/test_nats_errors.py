"""Malformed or invalid NATS requests get a typed ErrorReply and change no state."""

from __future__ import annotations

import asyncio

import pytest

from seamlessflow.bus import Bus, RemoteError
from seamlessflow.protocol import (
    CurrentVersion,
    CurrentVersionQuery,
    ErrorReply,
    GenerateReply,
    GenerateRequest,
    ResourceRegister,
    RoleAssignment,
    TaskAssignment,
    TaskClaim,
    decode,
    encode,
)
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from sf_weight_sync.service import WeightSyncService

GARBAGE = [b"", b"not json", b'{"type": "task.claim"}', b'{"type": "no.such.type"}', b"[1,2,3]"]


async def raw_request(bus: Bus, subject: str, payload: bytes) -> ErrorReply:
    msg = await bus.nc.request(subject, payload, timeout=10)
    reply = decode(msg.data, ErrorReply)
    assert isinstance(reply, ErrorReply)
    return reply


@pytest.fixture
async def services(mesh):  # type: ignore[no-untyped-def]
    scheduler = await mesh.start(TagSchedulerService())
    weight_sync = await mesh.start(WeightSyncService())
    trajectory = await mesh.start(
        TrajectoryService(TrajectorySettings(group_size=2, groups_per_batch=1))
    )
    engine = await mesh.start(EngineService(EngineSettings(engine_id="engine-e", max_batch_size=4)))
    async with asyncio.timeout(60):
        for service in (scheduler, weight_sync, trajectory, engine):
            await service.ready.wait()
    return scheduler, weight_sync, trajectory, engine


async def test_garbage_on_every_request_subject_gets_bad_request(services, bus: Bus) -> None:  # type: ignore[no-untyped-def]
    scheduler, _, trajectory, engine = services
    s = bus.subjects
    resources_before = dict(scheduler.resources)
    next_group_before = trajectory.dispatcher.next_group
    for subject in (s.task_claim(), s.sched_register(), s.weights_current(), s.engine_generate()):
        for payload in GARBAGE:
            reply = await raw_request(bus, subject, payload)
            assert reply.code == "bad_request", (subject, payload)
            assert "invalid message" in reply.message
    # a valid message of the wrong type is refused too
    reply = await raw_request(bus, s.task_claim(), encode(CurrentVersionQuery(engine_id="x")))
    assert reply.code == "bad_request"
    assert scheduler.resources == resources_before
    assert trajectory.dispatcher.next_group == next_group_before
    assert engine.requests_served == 0


async def test_invalid_values_are_refused_with_typed_errors(services, bus: Bus) -> None:  # type: ignore[no-untyped-def]
    scheduler, _, _, engine = services
    s = bus.subjects
    bad_generations = [
        GenerateRequest(request_id="r1", session_id="s", prompt_ids=[1, 2], max_tokens=0),
        GenerateRequest(request_id="r2", session_id="s", prompt_ids=[1], max_tokens=4, top_p=0),
        GenerateRequest(request_id="r3", session_id="s", prompt_ids=[10**9], max_tokens=4),
        GenerateRequest(request_id="r4", session_id="s", prompt_ids=[1] * 5000, max_tokens=4),
    ]
    # a prompt over the engine's context has its own code (the gateway answers it as
    # OpenAI's context_length_exceeded); the others are plain bad requests
    codes = ["bad_request"] * 3 + ["context_length_exceeded"]
    for request, code in zip(bad_generations, codes, strict=True):
        with pytest.raises(RemoteError) as error:
            await bus.request(s.engine_generate(), request, GenerateReply, timeout=10)
        assert error.value.code == code, request.request_id
    assert engine.requests_served == 0
    with pytest.raises(RemoteError) as error:
        await bus.request(
            s.sched_register(),
            ResourceRegister(resource_id="Bad.Id", kind="engine", tags=["rollout"]),
            RoleAssignment,
        )
    assert error.value.code == "bad_request"
    assert "Bad.Id" not in scheduler.resources


async def test_valid_requests_are_answered(services, bus: Bus) -> None:  # type: ignore[no-untyped-def]
    s = bus.subjects
    current = await bus.request(
        s.weights_current(), CurrentVersionQuery(engine_id="x"), CurrentVersion
    )
    assert current.version == 0
    claim = await bus.request(s.task_claim(), TaskClaim(runner_id="r"), TaskAssignment)
    assert claim.group_id == "g0000000" and claim.messages
    reply = await bus.request(
        s.engine_generate(),
        GenerateRequest(request_id="ok", session_id="s", prompt_ids=[1, 2, 3], max_tokens=3),
        GenerateReply,
        timeout=30,
    )
    assert 1 <= len(reply.token_ids) <= 3 and reply.engine_id == "engine-e"
    assert len(reply.logprobs) == len(reply.versions) == len(reply.token_ids)
