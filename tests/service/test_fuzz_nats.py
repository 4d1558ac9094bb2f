"""Property-based fuzzing of every NATS subject the services consume (docs/architecture.md,
invariant 6: a typed ErrorReply, no state change, no crash).

One mesh per module (tag-scheduler, weight-sync, trajectory, a real engine worker).
Hypothesis generates malformed payloads (random bytes, arbitrary JSON, a valid message of
another type, the right type with a field of the wrong type or missing, a newer schema)
and well-typed messages with out-of-range values. Properties:

- request/reply subjects answer ``ErrorReply(code="bad_request")`` to anything the
  protocol module refuses; every service keeps running and nothing changed: stream
  message counts, the scheduler's resources and KV bucket, the trajectory dispatcher's
  next group and open sessions, weight-sync's version, the engine's version;
- broadcast subjects survive junk (engine.abort, engine.load, sched.heartbeat.*,
  weights.loaded): the consumers keep running and nothing changes;
- durable subjects (traj.event.*, weights.published, train.metrics): JetStream stores
  the junk, the live consumers skip it: malformed trajectory events are counted and not
  applied, weight-sync terminates the message and keeps its version;
- afterwards a valid request on each consumer still succeeds.

The bugs this fuzzing found are fixed; the tests at the end keep the inputs that found
them.

Subjects enumerated from the services' module docstrings. ``weights.group`` is served
only by a trainer forming an NCCL push group (GPU) and is not started here; it is
served by the same ``Bus.serve`` as every request subject below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from seamlessflow import protocol
from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus, connect
from seamlessflow.protocol import (
    SCHEMA_VERSION,
    WEIGHT_SYNC_DURABLE,
    AbortGeneration,
    AnyMessage,
    CurrentVersion,
    CurrentVersionQuery,
    ErrorReply,
    GenerateReply,
    GenerateRequest,
    Heartbeat,
    LoadWeights,
    Message,
    NoTask,
    PhaseChanged,
    ProtocolError,
    ResourceRegister,
    RewardReported,
    RoleAssignment,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    SlotsClaim,
    SlotsFreed,
    SlotsReleased,
    Subjects,
    TaskAssignment,
    TaskClaim,
    TrainStepMetrics,
    TrajectoryEvent,
    TurnRecorded,
    WeightsLoaded,
    WeightsPublished,
    check_token,
    decode,
    encode,
)
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from sf_weight_sync.service import WeightSyncService
from tests.support import eventually

ENGINE_ID = "engine-nz"
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


@dataclass
class Mesh:
    bus: Bus
    scheduler: TagSchedulerService
    weight_sync: WeightSyncService
    trajectory: TrajectoryService
    engine: EngineService
    tasks: list[asyncio.Task[None]]

    @property
    def s(self) -> Subjects:
        return self.bus.subjects

    def assert_running(self) -> None:
        for task in self.tasks:
            assert not task.done(), f"a service stopped: {task!r}"

    async def stream_counts(self) -> dict[str, int]:
        return {
            name: (await self.bus.js.stream_info(name)).state.messages for name in self.s.streams()
        }

    async def settled(self) -> None:
        """Wait until the engine has nothing in flight and the scheduler has its current
        phase: heartbeats are periodic, so a phase change of the engine's own (a request
        of an earlier example) may reach the scheduler, and its bucket, at any moment."""
        async with asyncio.timeout(10):
            while True:
                view = self.scheduler.resources.get(ENGINE_ID)
                own = self.engine.membership
                if own.in_flight == 0 and view is not None and view.phase == own.phase:
                    return
                await asyncio.sleep(0.05)

    async def state(self) -> dict[str, Any]:
        """Everything a refused message could have changed (once settled)."""
        await self.settled()
        trajectory = self.trajectory
        return {
            "streams": await self.stream_counts(),
            # every put to the scheduler's bucket is a message of its stream
            "kv": (await self.bus.js.stream_info(f"KV_{self.s.kv_resources()}")).state.last_seq,
            "resources": sorted(
                (rid, r.role, r.phase, r.alive, r.view)
                for rid, r in self.scheduler.resources.items()
            ),
            "trainer_versions": dict(self.scheduler.trainer_versions),
            "next_group": trajectory.dispatcher.next_group,
            "sessions": sorted(trajectory.grouper.sessions),
            "groups": sorted(trajectory.grouper.groups),
            "batches": trajectory.next_batch_index,
            "weights": self.weight_sync.chain.version,
            "engine_versions": dict(self.weight_sync.engine_versions),
            "engine": (
                self.engine.requests_served,
                self.engine.engine.version,
                self.engine.membership.role,
            ),
        }


@pytest.fixture(scope="module")
async def nz(nats_url: str, base_model_dir: Path) -> AsyncIterator[Mesh]:
    from tests.support import InProcessMesh

    run_id = "n" + uuid.uuid4().hex[:12]
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    bus = await connect(nats_url, Subjects(run_id), name="fuzz")
    try:
        await bus.ensure_streams()
        scheduler = await mesh.start(TagSchedulerService())
        weight_sync = await mesh.start(WeightSyncService())
        trajectory = await mesh.start(
            TrajectoryService(TrajectorySettings(group_size=2, groups_per_batch=1))
        )
        engine = await mesh.start(
            EngineService(EngineSettings(engine_id=ENGINE_ID, max_batch_size=8, max_context=64))
        )
        async with asyncio.timeout(60):
            for service in (scheduler, weight_sync, trajectory, engine):
                await service.ready.wait()
        tasks = [task for _, _, task in mesh.running]
        yield Mesh(bus, scheduler, weight_sync, trajectory, engine, tasks)  # type: ignore[arg-type]
    finally:
        await stop_even_crashed(mesh)
        await bus.drain()


async def stop_even_crashed(mesh: Any) -> None:
    """Stop a mesh whose services may have crashed (a test saw it and failed already)."""
    for _, ctx, task in mesh.running:
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved"
            await ctx.bus.drain()
    mesh.running = [r for r in mesh.running if not r[2].done()]
    await mesh.stop()


@contextlib.asynccontextmanager
async def own_run(nats_url: str, model_dir: Path | None) -> AsyncIterator[tuple[Bus, Any]]:
    """A fresh run: its own streams, services started by the caller, always stopped."""
    from tests.support import InProcessMesh

    run_id = "r" + uuid.uuid4().hex[:12]
    bus = await connect(nats_url, Subjects(run_id), name="fuzz")
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    try:
        await bus.ensure_streams()
        yield bus, mesh
    finally:
        await stop_even_crashed(mesh)
        await bus.drain()


# ------------------------------------------------------------------ strategies

MESSAGE_TYPES: list[type[Message]] = list(typing.get_args(AnyMessage))
TOKENS = st.lists(st.integers(0, 600), max_size=4)


@st.composite
def consistent_turn(draw: st.DrawFn) -> TurnRecorded:
    """A TurnRecorded refuses lists of different lengths when it is made."""
    completion = draw(TOKENS)
    return TurnRecorded(
        session_id="s" + draw(st.text("abc0123", min_size=1, max_size=6)),
        turn_index=draw(st.integers(0, 3)),
        request_id="r",
        engine_id=ENGINE_ID,
        prompt_ids=draw(TOKENS),
        completion_ids=completion,
        logprobs=[-1.0] * len(completion),
        versions=[0] * len(completion),
        finish_reason="stop",
        completion_text=draw(st.text(max_size=8)),
    )


def buildable(kind: type[Message]) -> st.SearchStrategy[Message]:
    return consistent_turn() if kind is TurnRecorded else st.builds(kind)


def _register_nested_structs() -> None:
    """hypothesis builds a struct nested in a message (a TrainBatch's samples) with its
    optional fields too, and passes msgspec's default-factory marker itself as the value
    of a field defaulted by a factory: such structs are built from their required
    fields, as messages are."""
    for value in vars(protocol).values():
        nested = isinstance(value, type) and issubclass(value, msgspec.Struct)
        if not nested or issubclass(value, Message):
            continue
        fields = msgspec.structs.fields(value)
        if any(f.default_factory is not msgspec.NODEFAULT for f in fields):
            st.register_type_strategy(value, st.builds(value))


_register_nested_structs()


ANY_MESSAGE = st.sampled_from(MESSAGE_TYPES).flatmap(buildable)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def refused(payload: bytes, expected: Any) -> bool:
    try:
        decode(payload, expected)
    except ProtocolError:
        return True
    return False


def as_dict(message: Message) -> dict[str, Any]:
    return msgspec.to_builtins(message)  # type: ignore[no-any-return]


@st.composite
def wrong_field(draw: st.DrawFn, expected: type[Message]) -> bytes:
    """The expected message with one field replaced by junk, or removed."""
    fields = as_dict(draw(buildable(expected)))
    key = draw(st.sampled_from(sorted(fields)))
    if draw(st.booleans()):
        del fields[key]
    else:
        fields[key] = draw(JSON_VALUES)
    return json.dumps(fields).encode()


@st.composite
def newer_schema(draw: st.DrawFn, expected: type[Message]) -> bytes:
    fields = as_dict(draw(buildable(expected)))
    fields["schema"] = SCHEMA_VERSION + draw(st.integers(1, 2**62))
    return json.dumps(fields).encode()


def malformed(expected: type[Message]) -> st.SearchStrategy[bytes]:
    """Payloads the protocol module refuses as ``expected`` (checked, not guessed)."""
    return st.one_of(
        st.binary(max_size=64),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        ANY_MESSAGE.map(encode),
        wrong_field(expected),
        newer_schema(expected),
    ).filter(lambda payload: refused(payload, expected))


RequestSubject = tuple[str, Callable[[Subjects], str], type[Message]]
REQUEST_SUBJECTS: list[RequestSubject] = [
    ("trajectory: task.claim", Subjects.task_claim, TaskClaim),
    ("trajectory: traj.export", Subjects.trajectory_export, SessionExportQuery),
    ("weight-sync: weights.current", Subjects.weights_current, CurrentVersionQuery),
    ("tag-scheduler: sched.register", Subjects.sched_register, ResourceRegister),
    ("tag-scheduler: sched.claim", Subjects.sched_claim, SlotsClaim),
    ("tag-scheduler: sched.release", Subjects.sched_release, SlotsReleased),
    ("tag-scheduler: sched.freed", Subjects.sched_freed, SlotsFreed),
    ("engine: engine.generate", Subjects.engine_generate, GenerateRequest),
    (
        "engine: sched.assign.<engine>",
        lambda s: s.sched_assignment(ENGINE_ID),
        RoleAssignment,
    ),
]


@st.composite
def bad_request(draw: st.DrawFn) -> tuple[RequestSubject, bytes]:
    target = draw(st.sampled_from(REQUEST_SUBJECTS))
    return target, draw(malformed(target[2]))


async def ask(nz: Mesh, subject: str, payload: bytes, expected: Any) -> Any:
    """A raw request; the reply must decode as ``expected`` (a type or a union)."""
    msg = await nz.bus.nc.request(subject, payload, timeout=10)
    return decode(msg.data, expected)


# ------------------------------------------------------------------ request/reply


@settings(FUZZ, max_examples=300)
@given(case=bad_request())
async def test_malformed_requests_get_bad_request_and_change_nothing(
    nz: Mesh, case: tuple[RequestSubject, bytes]
) -> None:
    (what, subject_of, _), payload = case
    before = await nz.state()
    reply = await ask(nz, subject_of(nz.s), payload, ErrorReply)
    assert reply.code == "bad_request", (what, reply)
    assert reply.message
    nz.assert_running()
    assert await nz.state() == before, what


STREAM_SUBJECTS = st.one_of(
    st.just(""),
    st.sampled_from(["a b", "a\tb", "a.>", "a.*", "*", ">", "a..b", ".a", "a.", "_INBOX.x y"]),
    st.text(max_size=10),
)


def _generate(**fields: Any) -> GenerateRequest:
    return GenerateRequest(
        **{"request_id": "x1", "session_id": "s", "prompt_ids": [1, 2], "max_tokens": 2, **fields}
    )


VALID_GENERATE: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.from_regex(r"\A[a-z0-9]{1,8}\Z"),
    "session_id": st.text(max_size=8),  # informational: any string will do
    "prompt_ids": st.lists(st.integers(0, 300), min_size=1, max_size=4),
    "max_tokens": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=2),
    "seed": st.none() | st.integers(0, 9),
    "top_logprobs": st.integers(0, 2),
    "stream_subject": st.just(""),
}
JUNK_GENERATE: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.text(max_size=4),
    "prompt_ids": st.lists(st.integers(-2, 2**64), max_size=3) | st.just([1] * 70),
    "max_tokens": st.integers(-1, 0) | st.sampled_from([64, 2**63]),
    # not 0 < t < 1e-5: the engine bug of test_a_tiny_temperature_gets_a_decodable_reply
    "temperature": (st.floats(allow_nan=False) | st.sampled_from([1e-5, 1e300])).filter(
        lambda t: not 0 < t < 1e-5
    ),
    "top_p": st.floats(allow_nan=False) | st.just(1e-300),
    "stop_token_ids": st.lists(st.integers(-2, 2**64), max_size=3),
    "seed": st.integers() | st.sampled_from([2**64 - 1, 2**64, -(2**63) - 1]),
    "top_logprobs": st.integers(-1, 21) | st.just(2**63),
    "stream_subject": STREAM_SUBJECTS,
}


@st.composite
def generate_requests(draw: st.DrawFn) -> GenerateRequest:
    """A valid request with none, one or two fields out of range: most get as far as
    the engine, and each value is checked on its own."""
    fields = {key: draw(strategy) for key, strategy in VALID_GENERATE.items()}
    for key in draw(st.lists(st.sampled_from(sorted(JUNK_GENERATE)), max_size=2, unique=True)):
        fields[key] = draw(JUNK_GENERATE[key])
    return GenerateRequest(**fields)


@settings(FUZZ, max_examples=60)
@given(request=generate_requests())
@example(request=_generate(stream_subject="a b"))
@example(request=_generate(stream_subject="a.>"))
@example(request=_generate(stream_subject="a\r\nPUB x 1"))
@example(request=_generate(seed=2**64))
async def test_generate_requests_with_any_values_are_answered_or_refused(
    nz: Mesh, request: GenerateRequest
) -> None:
    """Well-typed requests with out-of-range values: a reply or a bad_request, never an
    internal error; the engine keeps serving and nothing stays in flight."""
    served = nz.engine.requests_served
    reply = await ask(nz, nz.s.engine_generate(), encode(request), GenerateReply | ErrorReply)
    if isinstance(reply, ErrorReply):
        assert reply.code == "bad_request", reply
        assert nz.engine.requests_served == served
    else:
        assert len(reply.token_ids) == len(reply.logprobs) == len(reply.versions)
    assert nz.engine.membership.in_flight == 0
    nz.assert_running()


@settings(FUZZ, max_examples=60)
@given(
    target=st.sampled_from(["register", "export"]),
    identifier=st.text(max_size=12) | st.sampled_from(["a.b", "*", ">", "A", "-a", "a" * 129]),
    slot=st.none() | st.text(max_size=6),
)
async def test_identifiers_outside_the_protocol_are_refused(
    nz: Mesh, target: str, identifier: str, slot: str | None
) -> None:
    """Ids become subject tokens and KV keys: one outside the alphabet is a bad_request
    (a registration) or not found (an export), and changes nothing."""
    before = await nz.state()
    if target == "register":
        slots = [] if slot is None else [slot]
        assume(refused_token(identifier) or any(refused_token(s) for s in slots))
        message: Message = ResourceRegister(
            resource_id=identifier, kind="engine", tags=["fuzz"], slots=slots
        )
        subject = nz.s.sched_register()
    else:
        message = SessionExportQuery(session_id=identifier)
        subject = nz.s.trajectory_export()
    reply = await ask(nz, subject, encode(message), ErrorReply)
    assert reply.code in ("bad_request", "not_found"), reply
    if target == "register" or refused_token(identifier):
        assert reply.code == "bad_request", reply
    nz.assert_running()
    assert await nz.state() == before


def refused_token(value: str) -> bool:
    try:
        check_token(value)
    except ProtocolError:
        return True
    return False


# ------------------------------------------------------------------ broadcasts and streams


Broadcast = tuple[str, Callable[[Subjects], str], type[Message]]
BROADCASTS: list[Broadcast] = [
    ("engine: engine.abort", Subjects.engine_abort, AbortGeneration),
    ("engine: engine.load", Subjects.engine_load, LoadWeights),
    ("tag-scheduler: sched.heartbeat.<engine>", lambda s: s.sched_heartbeat(ENGINE_ID), Heartbeat),
    ("tag-scheduler: sched.heartbeat.<other>", lambda s: s.sched_heartbeat("fuzz"), Heartbeat),
    ("weight-sync: weights.loaded", Subjects.weights_loaded, WeightsLoaded),
    ("weight-sync: sched.phase", Subjects.sched_phase, PhaseChanged),
]


@st.composite
def junk_broadcast(draw: st.DrawFn) -> tuple[Broadcast, bytes]:
    target = draw(st.sampled_from(BROADCASTS))
    return target, draw(malformed(target[2]))


@settings(FUZZ, max_examples=100)
@given(case=junk_broadcast(), with_reply=st.booleans())
async def test_junk_broadcasts_change_nothing(
    nz: Mesh, case: tuple[Broadcast, bytes], with_reply: bool
) -> None:
    """Junk on the core subjects the services listen to: nobody crashes, nothing changes;
    a junk *request* on a broadcast served by ``Bus.serve`` is answered bad_request."""
    (what, subject_of, _), payload = case
    subject = subject_of(nz.s)
    before = await nz.state()
    if with_reply and what.startswith("engine:"):
        reply = await ask(nz, subject, payload, ErrorReply)
        assert reply.code == "bad_request", reply
    else:
        await nz.bus.nc.publish(subject, payload)
        await nz.bus.nc.flush()
        await asyncio.sleep(0.01)  # let the subscribers run
    nz.assert_running()
    assert await nz.state() == before, what


DURABLE_SUBJECTS: list[Broadcast] = [
    (
        "weight-sync: weights.published (durable consumer)",
        Subjects.weights_published,
        WeightsPublished,
    ),
    ("trajectory: train.metrics", Subjects.train_metrics, TrainStepMetrics),
]


@settings(FUZZ, max_examples=30)
@given(target=st.sampled_from(DURABLE_SUBJECTS), data=st.data())
async def test_junk_on_durable_subjects_is_skipped_by_the_live_consumers(
    nz: Mesh, target: Broadcast, data: st.DataObject
) -> None:
    """JetStream stores the junk (nothing can refuse it there); the consumers skip it:
    weight-sync terminates it and keeps its version, trajectory keeps its pace."""
    what, subject_of, expected = target
    payload = data.draw(malformed(expected), label="payload")
    before = await nz.state()
    trained = nz.trajectory.trained_batches
    await nz.bus.js.publish(subject_of(nz.s), payload)

    async def consumed() -> bool:
        info = await nz.bus.js.consumer_info(nz.s.stream_weights(), WEIGHT_SYNC_DURABLE)
        return info.num_pending == 0 and info.num_ack_pending == 0

    async with asyncio.timeout(10):
        while not await consumed():  # noqa: ASYNC110 (polling the server)
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.01)  # the trajectory's core subscription
    nz.assert_running()
    after = await nz.state()
    stream = await nz.bus.js.find_stream_name_by_subject(subject_of(nz.s))
    assert after["streams"][stream] == before["streams"][stream] + 1, what
    after["streams"][stream] = before["streams"][stream]
    assert after == before, what
    assert nz.trajectory.trained_batches == trained


TRAJECTORY_JUNK = st.one_of(
    st.binary(max_size=64),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    ANY_MESSAGE.map(encode),
    st.sampled_from(typing.get_args(TrajectoryEvent)).flatmap(wrong_field),
    st.sampled_from(typing.get_args(TrajectoryEvent)).flatmap(newer_schema),
).filter(lambda payload: refused(payload, TrajectoryEvent))


@settings(FUZZ, max_examples=60)
@given(payloads=st.lists(TRAJECTORY_JUNK, min_size=1, max_size=4))
async def test_malformed_trajectory_events_are_counted_not_applied(
    nz: Mesh, payloads: list[bytes]
) -> None:
    trajectory = nz.trajectory
    before = await nz.state()
    malformed_before = trajectory.malformed_events
    session_id = "s" + uuid.uuid4().hex
    for payload in payloads:
        await nz.bus.js.publish(nz.s.trajectory_event(session_id), payload)
    await eventually(
        lambda: trajectory.malformed_events == malformed_before + len(payloads),
        10,
        "the trajectory service counts every malformed event",
    )
    nz.assert_running()
    after = await nz.state()
    stored = nz.s.stream_trajectory()
    assert after["streams"][stored] == before["streams"][stored] + len(payloads)  # JetStream's
    after["streams"][stored] = before["streams"][stored]
    assert after == before, "a malformed event changed the trajectory service"


async def test_the_services_still_answer_after_the_fuzzing(nz: Mesh) -> None:
    """A valid request on each consumer still works, and a valid event still applies."""
    s, bus = nz.s, nz.bus
    claim = await bus.request(s.task_claim(), TaskClaim(runner_id="r"), TaskAssignment | NoTask)
    assert isinstance(claim, TaskAssignment | NoTask)
    current = await bus.request(
        s.weights_current(), CurrentVersionQuery(engine_id=ENGINE_ID), CurrentVersion
    )
    assert current.version == nz.engine.engine.version == 0
    reply = await bus.request(
        s.engine_generate(),
        GenerateRequest(request_id="ok", session_id="s", prompt_ids=[1, 2], max_tokens=2),
        GenerateReply,
        timeout=30,
    )
    assert 1 <= len(reply.token_ids) <= 2
    session_id = "s" + uuid.uuid4().hex
    await bus.js_publish(
        s.trajectory_event(session_id),
        SessionOpened(
            session_id=session_id, task_id="t", group_id=session_id, sample_index=0, group_size=2
        ),
    )
    await eventually(
        lambda: session_id in nz.trajectory.grouper.sessions, 10, "the trajectory holds the session"
    )
    nz.assert_running()
    assert nz.scheduler.resources[ENGINE_ID].alive


# ------------------------------------------------------------------ inputs that found bugs


@pytest.mark.parametrize("temperature", [5e-324, 1e-40])
async def test_a_tiny_temperature_gets_a_decodable_reply(nz: Mesh, temperature: float) -> None:
    request = _generate(temperature=temperature, top_logprobs=2)
    reply = await ask(nz, nz.s.engine_generate(), encode(request), GenerateReply | ErrorReply)
    if isinstance(reply, ErrorReply):
        assert reply.code == "bad_request", reply


@settings(FUZZ, max_examples=10, phases=[Phase.explicit, Phase.generate])
@given(
    prompt_ids=st.lists(st.integers(-3, 600), min_size=1, max_size=4),
    completion_ids=st.lists(st.integers(-3, 600), max_size=4),
    logprobs=st.lists(st.floats(-5, 0), max_size=4),
    versions=st.lists(st.integers(-1, 2), max_size=4),
)
@example(prompt_ids=[3, 4], completion_ids=[], logprobs=[-1.0], versions=[0])
async def test_inconsistent_turns_never_reach_a_batch(
    nats_url: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float],
    versions: list[int],
) -> None:
    """A turn whose completion, logprobs and versions do not line up, or whose ids are
    negative, is malformed: the trajectory service survives it and never batches it
    misaligned (each example on a run of its own: a crash must not spill over)."""
    assume(
        not (
            len(completion_ids) == len(logprobs) == len(versions)
            and min(prompt_ids + completion_ids) >= 0
        )
    )
    async with own_run(nats_url, None) as (bus, mesh):
        s = bus.subjects
        trajectory = await mesh.start(TrajectoryService(TrajectorySettings(groups_per_batch=1)))
        await asyncio.wait_for(trajectory.ready.wait(), 20)
        session_id = "s" + uuid.uuid4().hex
        events: list[Message] = [
            SessionOpened(
                session_id=session_id,
                task_id="fuzz",
                group_id=session_id,
                sample_index=0,
                group_size=1,
            ),
            RewardReported(session_id=session_id, reward=1.0),
            SessionFinished(session_id=session_id),
        ]
        # the turn as raw JSON: a TurnRecorded whose lists disagree cannot even be made
        turn = {
            "type": "traj.turn",
            "session_id": session_id,
            "turn_index": 0,
            "request_id": "r",
            "engine_id": ENGINE_ID,
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "versions": versions,
            "finish_reason": "stop",
            "completion_text": "",
        }
        consistent = (
            len(completion_ids) == len(logprobs) == len(versions)
            and min(prompt_ids + completion_ids) >= 0
        )
        malformed_before = trajectory.malformed_events
        subject = s.trajectory_event(session_id)
        await bus.js_publish(subject, events[0])
        await bus.js.publish(subject, json.dumps(turn).encode())
        for event in events[1:]:
            await bus.js_publish(subject, event)
        task = mesh.running[0][2]
        await eventually(
            lambda: task.done() or session_id not in trajectory.grouper.sessions,
            10,
            "the session is grouped (or the service stopped)",
        )
        await asyncio.sleep(0.1)  # a batch, if any, is published
        assert not task.done(), f"the trajectory service stopped: {task!r}"
        assert trajectory.malformed_events == malformed_before + (0 if consistent else 1)
        for batch in await stored_batches(bus):
            for group in batch.groups:
                for sample in group.samples:
                    n = len(sample.token_ids)
                    assert len(sample.loss_mask) == len(sample.behaviour_logprobs) == n, sample
                    assert len(sample.versions) == n, sample
                    assert min(sample.token_ids) >= 0, sample


@pytest.mark.parametrize("stream_subject", ["weights_published", "train_metrics", "batch_ready"])
async def test_a_junk_message_in_a_durable_stream_does_not_stop_a_restart(
    nats_url: str, base_model_dir: Path, stream_subject: str
) -> None:
    """JetStream stores whatever is published on a stream's subjects, junk included; a
    service that replays the stream when it starts must skip what it cannot decode (as
    the live consumers do), not fail to start."""
    async with own_run(nats_url, base_model_dir) as (bus, mesh):
        await bus.js.publish(getattr(bus.subjects, stream_subject)(), b"\x00 not a message")
        services = [
            await mesh.start(WeightSyncService()),
            await mesh.start(TrajectoryService(TrajectorySettings(group_size=2))),
        ]
        tasks = [task for _, _, task in mesh.running]
        async with asyncio.timeout(20):
            for service in services:
                ready = asyncio.ensure_future(service.ready.wait())
                await asyncio.wait([ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                for task in tasks:
                    assert not task.done(), f"{stream_subject}: a service stopped: {task!r}"
