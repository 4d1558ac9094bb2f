"""``Bus``'s JetStream and inbox methods on a real nats-server: what is missing comes back
as None, an empty list or ``NotFound``, never as a nats-py exception."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from seamlessflow.bus import Bus, NotFound, next_message
from seamlessflow.protocol import MessageIds, TrainingPlanned


async def test_stored_messages_are_read_by_subject_and_by_sequence(bus: Bus) -> None:
    s = bus.subjects
    assert await bus.last_stored(s.stream_metrics(), s.train_plan()) is None
    plan = TrainingPlanned(steps=3, seed=1, policy=s.policy)
    seq = await bus.js_publish(s.train_plan(), plan, msg_id=MessageIds.train_plan(s.policy, "t"))
    last = await bus.last_stored(s.stream_metrics(), s.train_plan())
    assert last is not None and (last.subject, last.seq) == (s.train_plan(), seq)
    at = await bus.stored_at(s.stream_metrics(), seq)
    assert at == last
    assert await bus.stored_at(s.stream_metrics(), seq + 1) is None


async def test_a_direct_read_a_lagging_replica_cannot_answer_asks_the_leader(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct get may be answered by a replica still catching up (a restarted node of
    a cluster), which says "not found" for a message its leader holds: the read asks the
    leader before the message counts as gone. The replica is played by the server
    answering every direct get "not found" (one server: there is no lagging one)."""
    import nats.js.errors

    s = bus.subjects
    plan = TrainingPlanned(steps=3, seed=1, policy=s.policy)
    seq = await bus.js_publish(s.train_plan(), plan, msg_id=MessageIds.train_plan(s.policy, "d"))
    real_get = bus.js.get_msg
    asked: list[bool] = []

    async def lagging_replica(stream: str, seq: int, **kwargs: object) -> object:
        asked.append(bool(kwargs.get("direct")))
        if kwargs.get("direct"):
            raise nats.js.errors.NotFoundError()
        return await real_get(stream, seq)

    monkeypatch.setattr(bus.js, "get_msg", lagging_replica)
    at = await bus.stored_at(s.stream_metrics(), seq, direct=True)
    assert at is not None and at.seq == seq and at.subject == s.train_plan()
    assert asked == [True, False]
    assert await bus.stored_at(s.stream_metrics(), seq + 1, direct=True) is None


async def test_a_last_message_read_while_jetstream_cannot_answer_is_asked_again(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster electing a stream's leader (its leader was just killed) lets a read time
    out; a service restoring its state at start reads the last message of a subject and
    must wait the election out, not exit. The election is played by the server's answer
    timing out twice (one server: it has no election)."""
    import nats.errors

    s = bus.subjects
    plan = TrainingPlanned(steps=3, seed=1, policy=s.policy)
    seq = await bus.js_publish(s.train_plan(), plan, msg_id=MessageIds.train_plan(s.policy, "e"))
    real_get_last = bus.js.get_last_msg
    calls: list[str] = []

    async def electing(stream: str, subject: str) -> object:
        calls.append(subject)
        if len(calls) <= 2:
            raise nats.errors.TimeoutError()
        return await real_get_last(stream, subject)

    monkeypatch.setattr(bus.js, "get_last_msg", electing)
    last = await bus.last_stored(s.stream_metrics(), s.train_plan())
    assert last is not None and (last.subject, last.seq) == (s.train_plan(), seq)
    assert calls == [s.train_plan()] * 3


async def test_a_stream_exists_once_created(bus: Bus) -> None:
    assert await bus.stream_exists(bus.subjects.stream_metrics())
    assert not await bus.stream_exists(bus.subjects.stream_metrics() + "_NOT_CREATED")


async def test_a_durable_consumer_hands_out_messages_and_none_on_a_quiet_stream(bus: Bus) -> None:
    s = bus.subjects
    async with bus.durable_consumer(s.stream_metrics(), s.train_plan(), "test-durable") as c:
        assert await c.next(timeout=0.2) is None
        plan = TrainingPlanned(steps=3, seed=1, policy=s.policy)
        await bus.js_publish(s.train_plan(), plan)
        msg = await c.next(timeout=5.0)
        assert msg is not None and msg.subject == s.train_plan()
        await msg.ack_sync()
    info = await bus.js.consumer_info(s.stream_metrics(), "test-durable")
    assert info.num_ack_pending == 0


async def test_a_key_value_bucket_is_empty_then_holds_what_was_put(bus: Bus) -> None:
    kv = await bus.key_value(bus.subjects.kv_resources())
    assert await kv.keys() == []
    assert await kv.get("engine-0") is None
    await kv.put("engine-0", b"{}")
    again = await bus.key_value(bus.subjects.kv_resources())  # created once: idempotent
    assert await again.keys() == ["engine-0"]
    assert await again.get("engine-0") == b"{}"


async def test_an_object_bucket_reads_removes_and_reports_what_is_missing(bus: Bus) -> None:
    objects = await bus.object_bucket(bus.subjects.object_store_weights())
    assert await objects.names() == []
    with pytest.raises(NotFound):
        await objects.size("absent")
    with pytest.raises(NotFound):
        await objects.read_into("absent", io.BytesIO())
    await objects.remove("absent")  # removing what is not there is not an error
    data = bytes(range(256)) * 40
    await objects.put("obj", data, chunk_bytes=1000)
    assert await objects.names() == ["obj"]
    assert await objects.size("obj") == len(data)
    into = io.BytesIO()
    await objects.read_into("obj", into)
    assert into.getvalue() == data
    await objects.remove("obj")
    assert await objects.names() == []
    with pytest.raises(NotFound):
        await objects.size("obj")
    stream = f"OBJ_{bus.subjects.object_store_weights()}"
    assert (await bus.js.stream_info(stream)).state.messages == 0  # no "deleted" marker left


async def test_an_inbox_delivers_every_subject_under_its_prefix(bus: Bus) -> None:
    got: list[tuple[str, bytes]] = []
    arrived = asyncio.Event()

    async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        got.append((msg.subject, msg.data))
        if len(got) == 2:
            arrived.set()

    prefix = await bus.subscribe_inbox(on_message)
    await bus.nc.publish(f"{prefix}.a", b"1")
    await bus.nc.publish(f"{prefix}.b", b"2")
    await asyncio.wait_for(arrived.wait(), 5.0)
    assert got == [(f"{prefix}.a", b"1"), (f"{prefix}.b", b"2")]


async def test_next_message_of_a_followed_stream_is_none_when_nothing_comes(bus: Bus) -> None:
    s = bus.subjects
    sub, last_seq = await bus.follow(s.stream_metrics(), s.train_all())
    try:
        assert last_seq == 0
        assert await next_message(sub, timeout=0.2) is None
        plan = TrainingPlanned(steps=3, seed=1, policy=s.policy)
        await bus.js_publish(s.train_plan(), plan)
        msg = await next_message(sub, timeout=5.0)
        assert msg is not None and msg.subject == s.train_plan()
    finally:
        await sub.unsubscribe()


async def test_a_bus_drains_at_once_past_a_follower_left_with_unread_messages(
    nats_url: str, run_id: str
) -> None:
    """A service's follower whose reader has stopped (the trajectory service's event
    loop, as the gateway finishes one more session) holds what was stored since, unread.
    nats-py's drain waits for every subscription's queue to empty: the drain waited out
    its whole timeout, was cancelled from outside, and asyncio logged "_GatheringFuture
    exception was never retrieved" (test_agents_gateway_lost under load). The bus now
    ends its followers first and lets nats-py time its own drain."""
    import gc

    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects

    s = Subjects(run_id)
    writer = await connect(nats_url, s, name="writer")
    service = await connect(nats_url, s, name="service")
    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        await writer.ensure_streams()
        follower, _ = await service.follow(s.stream_metrics(), s.train_all())
        for seed in range(3):  # stored after its reader stopped: never read
            await writer.js_publish(s.train_plan(), TrainingPlanned(steps=1, seed=seed))
        async with asyncio.timeout(5):
            while not follower._pending_queue.qsize():  # noqa: ASYNC110 (nats-py's queue)
                await asyncio.sleep(0.01)
        started = loop.time()
        await service.drain(timeout=4.0)
        drain_s = loop.time() - started
        gc.collect()  # an unretrieved future reports itself when it is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
        await writer.drain()
    assert not unretrieved, unretrieved
    assert service.nc.is_closed
    assert drain_s < 2.0, f"the drain waited {drain_s:.1f}s on an unread queue"


@pytest.mark.integration  # a nats-server of its own, restarted
async def test_reconnect_callbacks_run_once_the_broker_is_back(tmp_path: Path) -> None:
    """A broker restart is reported to whoever waits for core NATS replies (the
    gateway re-routes its engine calls then: a reply sent meanwhile may be lost)."""
    from seamlessflow.bus import connect
    from seamlessflow.natsserver import EmbeddedNats
    from seamlessflow.protocol import Subjects

    with EmbeddedNats(tmp_path / "nats") as server:
        bus = await connect(server.url, Subjects("r"), name="t")
        try:
            back = asyncio.Event()
            calls: list[bool] = []

            async def failing() -> None:
                raise RuntimeError("one callback's failure")

            async def noted() -> None:
                calls.append(bus.nc.is_connected)
                back.set()

            bus.on_reconnect(failing)
            bus.on_reconnect(noted)
            assert server.process is not None
            server.process.kill()
            server.process.wait()
            server.restart()
            await asyncio.wait_for(back.wait(), timeout=30)
            assert calls == [True]  # once, connected, despite the failing one before it
        finally:
            await bus.drain()


@pytest.mark.integration  # a nats-server of its own, restarted
async def test_an_object_stored_right_after_a_broker_restart_is_stored(tmp_path: Path) -> None:
    """The broker answers JetStream requests only once it recovered its streams; a put
    meanwhile waits for it (``OBJECT_PUT_RETRY``) instead of failing the publisher."""
    from seamlessflow.bus import connect
    from seamlessflow.natsserver import EmbeddedNats
    from seamlessflow.protocol import Subjects

    with EmbeddedNats(tmp_path / "nats") as server:
        bus = await connect(server.url, Subjects("r"), name="t")
        try:
            bucket = await bus.object_bucket("restart")
            await bucket.put("before", b"x" * 1000, chunk_bytes=256)
            back = asyncio.Event()

            async def reconnected() -> None:
                back.set()

            bus.on_reconnect(reconnected)
            assert server.process is not None
            server.process.kill()
            server.process.wait()
            server.restart()
            await asyncio.wait_for(back.wait(), timeout=30)
            await bucket.put("after", b"y" * 1000, chunk_bytes=256)
            for name, byte in (("before", b"x"), ("after", b"y")):
                into = io.BytesIO()
                await bucket.read_into(name, into)
                assert into.getvalue() == byte * 1000
        finally:
            await bus.drain()
