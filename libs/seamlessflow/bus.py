"""The NATS layer every service uses: connection, typed request/reply, JetStream helpers.

:class:`Bus` is the only way into NATS for services and the library: each thing they
do with NATS is one typed method here (or on what it returns: a
:class:`DurableConsumer`, a :class:`KeyValueBucket`, an :class:`ObjectBucket`), so
nats-py's client, its JetStream context and its exceptions stay in this module.

Errors are handled here, at the boundary: a handler registered with :meth:`Bus.serve`
receives a decoded, typed message; a payload that fails to decode, and a handler that
raises :class:`DomainError`, turn into an :class:`~seamlessflow.protocol.ErrorReply`
to the requester. Anything else propagates into the log once and becomes an
``internal`` error reply, so a requester never waits for a reply that will not come.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    DeliverPolicy,
    DiscardPolicy,
    ObjectMeta,
    ObjectMetaOptions,
    ObjectStoreConfig,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

from seamlessflow import telemetry
from seamlessflow.protocol import ErrorReply, Message, ProtocolError, Subjects, decode, encode
from seamlessflow.retry import RetryPolicy, retry
from seamlessflow.settings import RetentionSettings, StreamLimits

log = logging.getLogger(__name__)


class DomainError(Exception):
    """A request that a service refuses for a reason the requester can act on."""

    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(DomainError):
    code = "not_found"


class ContextLengthExceeded(DomainError):
    """A prompt and its token budget that do not fit the engine's context."""

    code = "context_length_exceeded"


class RemoteError(Exception):
    """The service we asked replied with a typed error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Unrecoverable(Exception):
    """A failure that restarting the process with the same settings cannot fix (a wrong
    URL, refused credentials, a run that makes no progress). The process exits with
    :data:`EXIT_UNRECOVERABLE` and this message as its one line on stderr; supervisors
    (``seamlessflow up``, compose's ``on-failure``) report it instead of restarting."""


EXIT_UNRECOVERABLE = 78
"""Exit code of an :class:`Unrecoverable` failure (``EX_CONFIG`` of sysexits.h)."""


class ConnectFailed(Unrecoverable):
    """The first connection to NATS failed (see :func:`connect`)."""


class NoResponder(Exception):
    """Nobody answered the request in time (the service is down or overloaded)."""


Handler = Callable[[Any], Awaitable[Message | None]]

JS_PUBLISH_RETRY = RetryPolicy(
    retry_on=(nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError),
    first_delay_s=0.5,
    deadline_s=30.0,
)
"""A publish with a message id that the broker does not ack (a time-out, or no stream
answering: a broker restarting) is tried again every 0.5 s for up to 30 s."""

JETSTREAM_UNAVAILABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
"""What JetStream answers while it cannot serve: a cluster electing a leader after a node
was lost, a broker restarting. Transient: seconds."""

NO_SUITABLE_PEERS = 10005
"""JetStream's error code for a stream whose replicas it has no servers to place on."""


class ReplicaPeersMissing(Unrecoverable):
    """JetStream has fewer servers than a stream's replicas. While a cluster forms, its
    servers join the meta group one by one (its leader answers before the last has
    joined): retried during set-up, then this one line (the cluster is smaller than
    ``SF_NATS_REPLICAS``)."""


def _raise_if_no_peers(exc: nats.js.errors.BadRequestError, stream: str, replicas: int) -> None:
    if exc.err_code == NO_SUITABLE_PEERS:
        raise ReplicaPeersMissing(
            f"stream {stream}: JetStream has no {replicas} servers to place its replicas on "
            "(SF_NATS_REPLICAS is more than the cluster's servers, or they have not joined)"
        ) from exc


PLACEMENT_RETRY = RetryPolicy(retry_on=(ReplicaPeersMissing,), first_delay_s=0.5, deadline_s=60.0)
"""A bucket's creation waits up to 60 s for the servers its replicas need."""

JETSTREAM_SETUP_RETRY = RetryPolicy(
    retry_on=(*JETSTREAM_UNAVAILABLE, ReplicaPeersMissing), first_delay_s=0.5, deadline_s=60.0
)
"""Creating or checking the run's streams at start is tried again for up to 60 s while
JetStream is unavailable (a cluster electing its leader, or still gathering the servers
for its replicas), then the service fails."""


class BrokerUnavailable(Exception):
    """JetStream did not take a message it was given (unavailable for now): the caller
    may answer "try again" (the gateway: HTTP 503) instead of failing."""


OBJECT_PUT_RETRY = RetryPolicy(
    retry_on=(
        nats.errors.TimeoutError,
        nats.js.errors.NoStreamResponseError,
        nats.js.errors.ServiceUnavailableError,
    ),
    first_delay_s=0.5,
    deadline_s=30.0,
)
"""Storing an object the broker does not answer for (a broker restarting: JetStream
takes a few seconds to recover its streams after the connection is back) is tried again
every 0.5 s for up to 30 s; storing it again replaces what a failed try left."""

BROKER_ERRORS = (nats.errors.Error, asyncio.TimeoutError)
"""What a call through the bus raises while the broker is away (restarting, out of
reach): the same call may work later."""

INSUFFICIENT_STORAGE = 10047
"""JetStream's error code for a stream whose byte limit the server cannot reserve."""

FOLLOW_HEARTBEAT_S = 1.0
"""Idle heartbeat of the consumers that follow a stream. An ordered consumer lives in the
server's memory: after a server restart the client only notices it is gone when two
heartbeats are missed, then recreates it from the next sequence. nats.py's default (5 s)
left a follower deaf for 10-20 s after a broker restart; with 1 s it is 2-4 s."""


class StoredMessage(NamedTuple):
    """One message as a stream stores it, read by sequence or as a subject's last."""

    subject: str
    seq: int
    data: bytes
    """The payload (empty for a message without one)."""


class Bus:
    """One NATS connection of one service, with the run's subjects.

    ``nc`` and ``js`` (nats-py's client and JetStream context) are this module's own:
    code outside it uses the methods (tests may reach past them to inspect or break
    the broker)."""

    def __init__(self, nc: Client, subjects: Subjects, replicas: int | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = subjects
        self.replicas = replicas
        """Replicas of every stream and bucket this bus creates (``SF_NATS_REPLICAS``);
        an existing one with another count stops the service with one line. None (tools,
        tests): create with 1, take existing ones as they are."""
        self._subscriptions: list[Subscription] = []
        self._followers: weakref.WeakSet[Subscription] = weakref.WeakSet()
        """The ordered consumers of :meth:`follow`, which their readers may leave with
        messages unread: :meth:`drain` ends them first (see there)."""
        self._handlers: set[asyncio.Task[None]] = set()
        self._reconnect_callbacks: list[Callable[[], Awaitable[None]]] = []
        self.reconnects = 0
        """How many times the connection came back after the broker went away (a
        resource's heartbeats carry it: the gateway re-routes the calls an engine held
        across a reconnect, whose replies may have been lost)."""

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Call ``callback`` each time the connection is back after the broker went
        away. Core NATS messages sent meanwhile may be lost, replies included: a reply
        published before the requester's subscription was restored on the new
        connection reaches no one. A caller waiting for such a reply re-asks here."""
        self._reconnect_callbacks.append(callback)

    async def _reconnected(self) -> None:
        self.reconnects += 1
        log.warning("nats: connection restored")
        for callback in list(self._reconnect_callbacks):
            try:
                await callback()
            except Exception:  # one callback's failure must not skip the others
                log.exception("a reconnect callback failed")

    # ------------------------------------------------------------------ core NATS

    async def publish(self, subject: str, message: Message) -> None:
        try:
            await self.nc.publish(subject, encode(message), headers=telemetry.inject_headers())
        except nats.errors.BadSubjectError:
            # Subjects from ``Subjects`` are always valid: a malformed one came in a message
            # (a GenerateRequest's ``stream_subject``), so the request is refused as such.
            raise ProtocolError(f"invalid subject {subject!r}") from None

    async def subscribe(
        self, subject: str, message_type: Any, handler: Callable[[Any], Awaitable[None]]
    ) -> Subscription:
        """Receive broadcasts on ``subject`` (wildcards allowed) as ``message_type``.

        ``handler`` runs in the connection's dispatcher, one message at a time in the
        order they arrived, so it must be quick (it may hand work to a task). A message
        that does not decode is logged and dropped: a broadcast has no one to refuse it
        to, and a malformed one must not stop the ones after it."""

        async def on_message(msg: Msg) -> None:
            try:
                message = decode(msg.data, message_type)
            except ProtocolError as exc:
                log.warning("dropping a malformed message on %s: %s", msg.subject, exc)
                return
            with telemetry.extracted_context(msg.headers):
                await handler(message)

        sub = await self.nc.subscribe(subject, cb=on_message)
        self._subscriptions.append(sub)
        return sub

    async def request(
        self, subject: str, message: Message, reply_type: Any, *, timeout: float = 5.0
    ) -> Any:
        """Send a request and decode a reply of ``reply_type``; typed errors raise."""
        try:
            msg = await self.nc.request(
                subject, encode(message), timeout=timeout, headers=telemetry.inject_headers()
            )
        except nats.errors.NoRespondersError:
            raise NoResponder(f"no responder on {subject}") from None
        except nats.errors.TimeoutError:
            raise NoResponder(f"no reply on {subject} within {timeout}s") from None
        reply = decode(msg.data, reply_type | ErrorReply)
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.code, reply.message)
        return reply

    async def serve(
        self,
        subject: str,
        request_type: Any,
        handler: Handler,
        *,
        queue: str = "",
    ) -> Subscription:
        """Answer requests on ``subject``; each request runs in its own task.

        ``handler`` gets the decoded message and returns the reply (or None: no reply,
        for broadcasts). The subscription callback never blocks the connection's
        dispatcher: handlers may be slow (an engine generating for seconds).
        """

        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(self._answer(msg, request_type, handler))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_message)
        # A round trip: when serve returns, the server routes requests here (an engine
        # that says it serves must already be in the queue group).
        await self.nc.flush()
        self._subscriptions.append(sub)
        return sub

    def lost_to_the_server(self, exc: BaseException) -> bool:
        """``exc`` (every error of a group) is a NATS error or a broken socket, raised
        while this connection has no server: what the server's absence explains."""
        if self.nc.is_connected:
            return False
        if isinstance(exc, BaseExceptionGroup):
            return all(self.lost_to_the_server(inner) for inner in exc.exceptions)
        return isinstance(exc, (nats.errors.Error, OSError))

    @property
    def max_payload(self) -> int:
        """The largest message (bytes) the server takes, as it announced on connecting."""
        return self.nc.max_payload

    async def subscribe_inbox(self, on_message: Callable[[Msg], Awaitable[None]]) -> str:
        """A new inbox prefix ``p``, with every subject ``p.<token>`` delivered to
        ``on_message`` undecoded, in arrival order, on the connection's dispatcher (so
        ``on_message`` must be quick). For a stream of replies to many requests of one
        process (the gateway's generation chunks, ``<prefix>.<request id>``): one
        subscription for all of them, none made per request. It lasts as long as the
        connection and is not stopped by :meth:`drain`'s first step: a call still in
        flight gets its messages until the connection itself drains."""
        prefix = self.nc.new_inbox()
        await self.nc.subscribe(f"{prefix}.*", cb=on_message)
        return prefix

    async def unserve(self, sub: Subscription) -> None:
        """Stop taking requests on ``sub``; those already delivered are still handled."""
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)
        with contextlib.suppress(nats.errors.Error):
            await sub.drain()

    async def _answer(self, msg: Msg, request_type: Any, handler: Handler) -> None:
        reply: Message | None
        try:
            request = decode(msg.data, request_type)
        except ProtocolError as exc:
            reply = ErrorReply(code="bad_request", message=str(exc))
        else:
            with telemetry.extracted_context(msg.headers):
                try:
                    reply = await handler(request)
                except DomainError as exc:
                    reply = ErrorReply(code=exc.code, message=exc.message)  # type: ignore[arg-type]
                except ProtocolError as exc:  # an identifier or value outside the protocol
                    reply = ErrorReply(code="bad_request", message=str(exc))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.exception("handler for %s failed", msg.subject)
                    reply = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
        if reply is not None and msg.reply:
            try:
                await msg.respond(encode(reply))
            except nats.errors.ConnectionClosedError:
                log.warning("connection closed before replying on %s", msg.subject)

    # ------------------------------------------------------------------ JetStream

    async def ensure_streams(
        self, policies: Sequence[str] = (), retention: RetentionSettings | None = None
    ) -> None:
        """Create the run's streams and those of ``policies`` (and of this bus's own
        policy) if missing, with the limits of ``retention`` (default: from the
        environment); a stream whose limits differ is updated to them. Idempotent,
        every service may call it."""
        retention = retention or RetentionSettings()
        limits = {
            self.subjects.stream_trajectory(): retention.trajectory(),
            self.subjects.stream_metrics(): retention.metrics(),
        }
        streams = self.subjects.streams()
        direct = {self.subjects.stream_batch_payloads()}
        for policy in (self.subjects.policy, *policies):
            policy_subjects = self.subjects.for_policy(policy)
            streams.update(policy_subjects.policy_streams())
            # a batch and its payload live as long as each other
            limits[policy_subjects.stream_batches()] = retention.batches()
            limits[policy_subjects.stream_batch_payloads()] = retention.batches()
            direct.add(policy_subjects.stream_batch_payloads())
        for name, subjects in streams.items():
            ensure = functools.partial(
                self._ensure_stream, name, subjects, limits.get(name), direct=name in direct
            )
            await retry(ensure, JETSTREAM_SETUP_RETRY)

    async def wait_for_jetstream(self, timeout_s: float) -> None:
        """Until JetStream answers (a new cluster elects its meta leader first); raises
        ``Unrecoverable`` with one line after ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await self.js.account_info()
                return
            except (nats.js.errors.APIError, *JETSTREAM_UNAVAILABLE) as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise Unrecoverable(
                        f"NATS has no JetStream after {timeout_s:.0f}s ({exc}): see the "
                        "servers' logs"
                    ) from None
                await asyncio.sleep(0.5)

    async def _ensure_stream(
        self, name: str, subjects: list[str], limits: StreamLimits | None, *, direct: bool = False
    ) -> None:
        """``direct``: messages are read by sequence with direct get (raw bytes, no JSON
        envelope), e.g. batch payload chunks."""
        wanted = StreamConfig(
            name=name,
            subjects=subjects,
            duplicate_window=600.0,
            allow_direct=direct or None,
            num_replicas=self.replicas or 1,
        )
        if limits is not None:
            wanted.max_age = limits.max_age_s
            wanted.max_bytes = limits.max_bytes or -1
            wanted.discard = DiscardPolicy.OLD
        try:
            try:
                info = await self.js.stream_info(name)
            except nats.js.errors.NotFoundError:
                try:
                    await self.js.add_stream(wanted)
                    return
                except nats.js.errors.BadRequestError as exc:
                    _raise_if_no_peers(exc, name, wanted.num_replicas or 1)
                    # another service created it between our lookup and our add
                    info = await self.js.stream_info(name)
            have = info.config
            self._check_replicas(name, have.num_replicas)
            if limits is None or (have.max_age, have.max_bytes) == (
                wanted.max_age,
                wanted.max_bytes,
            ):
                return
            log.info("stream %s: retention now max age %.0fs, max bytes %d",
                     name, wanted.max_age, wanted.max_bytes)  # fmt: skip
            have.max_age, have.max_bytes, have.discard = (
                wanted.max_age,
                wanted.max_bytes,
                wanted.discard,
            )
            await self.js.update_stream(have)
        except nats.js.errors.APIError as exc:
            if exc.err_code == INSUFFICIENT_STORAGE:
                raise Unrecoverable(
                    f"the NATS server cannot reserve {wanted.max_bytes} bytes for stream "
                    f"{name}: lower SF_RETENTION_*_MAX_GB (0 = no byte limit) or give "
                    "JetStream more storage"
                ) from exc
            raise

    async def js_publish(self, subject: str, message: Message, *, msg_id: str = "") -> int:
        """Publish durably; ``msg_id`` makes a retried publish land once. Returns the seq.

        With a ``msg_id``, a publish the broker did not acknowledge (a time-out, or no
        stream answering: a broker restarting, whose connection silently swallowed what
        was written just before the client noticed) is retried as ``JS_PUBLISH_RETRY``
        says, so a broker restart does not fail the publisher. Without one it raises at
        once: a retry could store the message twice."""
        return await self.js_publish_bytes(subject, encode(message), msg_id=msg_id)

    async def js_publish_bytes(self, subject: str, data: bytes, *, msg_id: str = "") -> int:
        """``js_publish`` of a payload that is not a message (batch payload chunks)."""
        headers = telemetry.inject_headers()
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id

        async def publish() -> int:
            ack = await self.js.publish(subject, data, headers=headers)
            return ack.seq

        if not msg_id:
            try:
                return await publish()
            except JETSTREAM_UNAVAILABLE as exc:  # a retry could store it twice: the caller's
                raise BrokerUnavailable(f"JetStream did not take {subject}: {exc!r}") from exc

        async def log_retry(exc: BaseException) -> None:
            log.warning("no ack for %s on %s (%r): retrying", msg_id, subject, exc)

        return await retry(publish, JS_PUBLISH_RETRY, on_retry=log_retry)

    async def stream_exists(self, stream: str) -> bool:
        """Whether ``stream`` exists (a service created the run's streams). False while
        JetStream cannot answer (a cluster electing a leader): callers ask again."""
        try:
            await self.js.stream_info(stream)
        except (nats.js.errors.NotFoundError, *JETSTREAM_UNAVAILABLE):
            return False
        return True

    async def last_stored(self, stream: str, subject: str) -> StoredMessage | None:
        """The last message the stream holds on ``subject`` (None: none). A read, so it is
        asked again while JetStream cannot answer (``JETSTREAM_SETUP_RETRY``): a service
        restoring its state at start would otherwise exit on a cluster electing the
        stream's leader (a fresh CI run saw the trajectory service restart for exactly
        that, its ``get_last_msg`` timing out right after the leader was killed)."""

        async def read() -> StoredMessage | None:
            try:
                raw = await self.js.get_last_msg(stream, subject)
            except nats.js.errors.NotFoundError:
                return None
            return _stored(raw.subject, raw.seq, raw.data)

        async def log_retry(exc: BaseException) -> None:
            log.warning("no answer reading %s on %s (%r): retrying", subject, stream, exc)

        return await retry(read, JETSTREAM_SETUP_RETRY, on_retry=log_retry)

    async def last_sequence(self, stream: str, subject: str) -> int:
        """The stream sequence of the last message on ``subject`` (0: none). Raises
        ``BrokerUnavailable`` while JetStream cannot answer (the caller may say "again")."""
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        except JETSTREAM_UNAVAILABLE as exc:
            raise BrokerUnavailable(f"JetStream did not answer for {subject}: {exc!r}") from exc
        return int(raw.seq or 0)

    async def stored_at(
        self, stream: str, seq: int, *, direct: bool = False
    ) -> StoredMessage | None:
        """The stream's message with sequence ``seq`` (None: none, or no longer).

        ``direct``: read with direct get, from any replica, for a stream created with
        direct reads allowed (``ensure_streams``' ``direct`` streams). A replica may be
        behind its leader (a node just restarted, catching up): what it does not hold is
        asked of the stream's leader before it counts as gone. Without that, a cluster
        that lost a node had the trainer drop a batch whose chunk its restarted replica
        had not caught up with yet (the compose cluster check, 2026-11-26)."""
        try:
            raw = await self.js.get_msg(stream, seq, direct=direct)
        except nats.js.errors.NotFoundError:
            if not direct:
                return None
            try:
                raw = await self.js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                return None
        return _stored(raw.subject, raw.seq, raw.data)

    @contextlib.asynccontextmanager
    async def durable_consumer(
        self, stream: str, subject: str, durable: str
    ) -> AsyncIterator[DurableConsumer]:
        """The durable pull consumer ``durable`` of ``subject`` on ``stream`` (created
        if missing), for as long as the ``async with`` lasts.

        It is unsubscribed on leaving, however that happens: a pull subscription left
        open makes the connection's drain wait forever."""
        sub = await self.js.pull_subscribe(subject, durable=durable, stream=stream)
        try:
            yield DurableConsumer(sub)
        finally:
            await sub.unsubscribe()

    def _check_replicas(self, stream: str, have: int | None) -> None:
        """One clear line where an existing stream's replicas are not the setting's."""
        if self.replicas is not None and (have or 1) != self.replicas:
            raise Unrecoverable(
                f"stream {stream} has {have or 1} replica(s) but SF_NATS_REPLICAS="
                f"{self.replicas}: set SF_NATS_REPLICAS={have or 1} to use it, or start a "
                "new run (another SF_RUN_ID)"
            )

    async def key_value(self, bucket: str) -> KeyValueBucket:
        """The key-value bucket ``bucket``, created if missing (idempotent)."""
        try:
            self._check_replicas(
                f"KV_{bucket}", (await self.js.stream_info(f"KV_{bucket}")).config.num_replicas
            )
        except nats.js.errors.NotFoundError:
            pass
        replicas = self.replicas or 1

        async def create() -> KeyValue:
            try:
                return await self.js.create_key_value(bucket=bucket, replicas=replicas)
            except nats.js.errors.BadRequestError as exc:
                _raise_if_no_peers(exc, f"KV_{bucket}", replicas)
                raise

        return KeyValueBucket(await retry(create, PLACEMENT_RETRY))

    async def object_bucket(self, bucket: str) -> ObjectBucket:
        """The object store ``bucket``, created if missing."""
        try:
            store = await self.js.object_store(bucket)
            info = await self.js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=bucket))
            self._check_replicas(info.config.name or bucket, info.config.num_replicas)
        except nats.js.errors.BucketNotFoundError:
            config = ObjectStoreConfig(bucket=bucket, replicas=self.replicas or 1)

            async def create() -> ObjectStore:
                try:
                    return await self.js.create_object_store(bucket, config=config)
                except nats.js.errors.BadRequestError as exc:
                    _raise_if_no_peers(exc, bucket, config.replicas)
                    raise

            store = await retry(create, PLACEMENT_RETRY)
        return ObjectBucket(self.js, store, bucket)

    async def follow(self, stream: str, subject: str) -> tuple[Subscription, int]:
        """An ordered consumer over ``subject`` from the stream's start.

        ``subject`` must cover every subject of the stream. Returns the subscription and
        the stream sequence of the last message stored when it was created: history has
        been replayed once a message with that sequence was read (0: nothing stored).
        """
        info = await self.js.stream_info(stream)
        last_seq = info.state.last_seq if info.state.messages else 0
        sub = await self.js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            idle_heartbeat=FOLLOW_HEARTBEAT_S,
        )
        self._followers.add(sub)
        return sub, last_seq

    async def read_all(self, stream: str, subject: str) -> list[Msg]:
        """Every message stored on the stream right now, in order."""
        sub, last_seq = await self.follow(stream, subject)
        messages: list[Msg] = []
        try:
            while last_seq and (not messages or messages[-1].metadata.sequence.stream < last_seq):
                messages.append(await sub.next_msg(timeout=10.0))
        finally:
            await sub.unsubscribe()
        return messages

    async def read_subject(self, stream: str, subject: str) -> list[Msg]:
        """Every message stored on one subject of a stream right now, in order."""
        last = await self.last_stored(stream, subject)
        if last is None:
            return []
        sub = await self.js.subscribe(
            subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        messages: list[Msg] = []
        try:
            last_seq = last.seq
            while not messages or messages[-1].metadata.sequence.stream < last_seq:
                messages.append(await sub.next_msg(timeout=10.0))
        finally:
            await sub.unsubscribe()
        return messages

    async def read_decoded(self, stream: str, subject: str, kind: Any) -> list[Any]:
        """Every message of ``kind`` stored on one subject, in order. JetStream stores
        whatever is published: what does not decode is logged and skipped, so one junk
        message cannot stop a service's start-up replay."""
        decoded = []
        for msg in await self.read_subject(stream, subject):
            try:
                decoded.append(decode(msg.data, kind))
            except ProtocolError as exc:
                log.warning("skipping an undecodable message on %s: %s", subject, exc)
        return decoded

    async def close(self) -> None:
        """Close the connection at once, without draining (a reader with nothing to
        finish or hand over). Safe to call twice."""
        if not self.nc.is_closed:
            await self.nc.close()

    async def drain(self, timeout: float = 5.0) -> None:
        """Stop taking requests, let handlers in flight finish on an open connection, then
        drain and close, all within about ``timeout``. Safe to call twice."""
        if self.nc.is_closed:
            return
        if not self.nc.is_connected:
            # the server is gone (the client is reconnecting): nothing can be drained or
            # flushed, and closing writes to a dead transport (uvloop raises)
            log.warning("NATS is unreachable: stopping without a drain")
            with contextlib.suppress(RuntimeError, OSError, nats.errors.Error):
                await self.nc.close()
            return
        for sub in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subscriptions.clear()
        # A follower whose reader has stopped (the service's loop is done) keeps the
        # messages stored since in its queue, unread: nats-py's drain waits for every
        # queue to empty, so it would wait out its whole timeout. The stream keeps them.
        for sub in list(self._followers):
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._followers.clear()
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        # nats-py times its own drain out: cancelling it from outside instead (wait_for)
        # left its gathered subscription drains cancelled with nobody to read them, and
        # asyncio logged "_GatheringFuture exception was never retrieved".
        self.nc.options["drain_timeout"] = timeout
        try:
            await self.nc.drain()
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            pass  # the server went while draining: what is left cannot reach it
        except nats.errors.TimeoutError:
            pass  # its last flush went unanswered: closed below all the same
        finally:
            if not self.nc.is_closed:
                with contextlib.suppress(RuntimeError, OSError, nats.errors.Error):
                    await self.nc.close()


def _stored(subject: str | None, seq: int | None, data: bytes | None) -> StoredMessage:
    # nats-py types every field of a stored message optional; the server always sends
    # a subject and a sequence, and leaves the payload out when it is empty.
    return StoredMessage(subject=subject or "", seq=seq or 0, data=data or b"")


async def next_message(sub: Subscription, timeout: float) -> Msg | None:
    """The next message of a subscription (e.g. one :meth:`Bus.follow` returned), or
    None if none came within ``timeout`` seconds."""
    try:
        return await sub.next_msg(timeout=timeout)
    except nats.errors.TimeoutError:
        return None


class DurableConsumer:
    """A durable pull consumer (:meth:`Bus.durable_consumer`): messages one at a time,
    each acked, nak'ed or terminated by the caller (``msg.ack_sync()``, ...)."""

    def __init__(self, sub: JetStreamContext.PullSubscription) -> None:
        self._sub = sub

    async def next(self, timeout: float) -> Msg | None:
        """The next message, or None if none came within ``timeout`` seconds."""
        try:
            messages = await self._sub.fetch(1, timeout=timeout)
        except nats.errors.TimeoutError:
            return None
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            # the consumer's leader is being elected (a cluster lost a node): nothing now
            await asyncio.sleep(min(timeout, 0.5))
            return None
        return messages[0] if messages else None


KV_PUT_RETRY = RetryPolicy(retry_on=JETSTREAM_UNAVAILABLE, first_delay_s=0.5, deadline_s=30.0)
"""A key-value put is retried for up to 30 s (fresh CI: the tag-scheduler's registry
write met "no response from stream" as an external cluster lost a node, and the
service fell over)."""


class KeyValueBucket:
    """A JetStream key-value bucket (:meth:`Bus.key_value`); values are bytes, encoded
    by the caller."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def keys(self) -> list[str]:
        """Every key with a value (empty list: none)."""
        try:
            return await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []

    async def get(self, key: str) -> bytes | None:
        """The value of ``key`` (None: no such key, or deleted)."""
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value

    async def put(self, key: str, value: bytes) -> None:
        """Set ``key``; tried again while JetStream cannot serve (a cluster electing the
        bucket's leader after a node is lost): a put of the same value twice is one put."""

        async def put_once() -> None:
            await self._kv.put(key, value)

        await retry(put_once, KV_PUT_RETRY)


class ObjectBucket:
    """A JetStream object store (:meth:`Bus.object_bucket`). A name that is not there
    raises :class:`NotFound`."""

    def __init__(self, js: JetStreamContext, store: ObjectStore, bucket: str) -> None:
        self._js = js
        self._store = store
        self._bucket = bucket

    async def put(self, name: str, data: bytes, *, chunk_bytes: int) -> None:
        """Store ``data`` as object ``name``, in messages of ``chunk_bytes`` (under the
        server's ``max_payload``); complete when this returns."""
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk_bytes))

        async def store() -> None:
            await self._store.put(name, data, meta=meta)

        await retry(store, OBJECT_PUT_RETRY)

    async def size(self, name: str) -> int:
        """The size (bytes) of object ``name``."""
        try:
            info = await self._store.get_info(name)
        except nats.js.errors.ObjectNotFoundError:
            raise NotFound(f"no object {name!r} in {self._bucket}") from None
        return info.size or 0

    async def read_into(self, name: str, into: io.BufferedIOBase) -> None:
        """Write object ``name``'s bytes into ``into``, chunk by chunk (no copy of the
        whole object is built)."""
        try:
            await self._store.get(name, writeinto=into)
        except nats.js.errors.ObjectNotFoundError:
            raise NotFound(f"no object {name!r} in {self._bucket}") from None

    async def names(self) -> list[str]:
        """The names of the objects stored now (not the deleted ones)."""
        try:
            stored = await self._store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []  # an empty store
        return [info.name for info in stored if info.name is not None]

    async def remove(self, name: str) -> None:
        """Remove every message of object ``name`` from the bucket's stream; one
        already removed is not an error.

        The object store's own delete purges an object's chunks but leaves a "deleted"
        meta message behind, forever (a marker for watchers; nothing here watches).
        Those markers are spread over the stream's files, so the server could never drop
        a file and disk grew by an object per delete. Purging the marker as well leaves
        an old file with no live message, and the server removes it whole."""
        try:
            await self._store.delete(name)
        except nats.js.errors.ObjectNotFoundError:
            pass  # deleted before: its marker may still be there
        encoded = base64.urlsafe_b64encode(name.encode()).decode()
        # the subject of an object's meta messages, in the object store's own naming
        meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=self._bucket, obj=encoded)
        await self._js.purge_stream(
            OBJ_STREAM_TEMPLATE.format(bucket=self._bucket), subject=meta_subject
        )


async def ack_redeliverable(msg: Msg) -> None:
    """Ack a durable consumer's message whose redelivery the consumer handles (it
    recognises what it already did). An ack the broker does not confirm (lost with a
    broker restart) is logged, not raised: the message comes again after the consumer's
    ack wait and is recognised then."""
    try:
        await msg.ack_sync()
    except JETSTREAM_UNAVAILABLE as exc:  # a restart, or a cluster electing a leader
        log.warning("ack of %s not confirmed (%r): it will be redelivered", msg.subject, exc)


NATS_CONNECT_WAIT_S = 15.0
"""How long a process retries its first connection to an unreachable NATS server."""

NATS_CONNECT_RETRY = RetryPolicy(
    retry_on=(OSError, TimeoutError, nats.errors.Error), first_delay_s=0.5
)
"""The first connection to NATS is tried again every 0.5 s, for ``connect``'s ``wait_s``
(its deadline); refused credentials are not retried."""


def _refused_credentials(exc: BaseException) -> bool:
    """The server answered, and refused us: retrying with the same token cannot help."""
    return isinstance(exc, nats.errors.AuthorizationError) or (
        "authorization violation" in str(exc).lower()
    )


async def connect(
    url: str,
    subjects: Subjects,
    *,
    name: str,
    token: str = "",
    wait_s: float = NATS_CONNECT_WAIT_S,
    replicas: int | None = None,
) -> Bus:
    """Connect to NATS; the first connection is bounded, reconnects are not.

    ``url`` may list several servers of one cluster, comma-separated: the client
    connects to any of them and moves to another when its server goes away.
    ``replicas``: see :attr:`Bus.replicas`.

    A server that refuses the credentials fails at once, one that cannot be reached
    within ``wait_s`` fails then: both raise :class:`ConnectFailed`, whose message says
    what to fix. Once connected, a broker that goes away is waited for without limit
    (a broker restart must not kill a service).
    """
    connected = False
    failures: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        if connected:
            log.warning("nats: %s", exc)
        else:  # reported once, below, if the first connection never comes
            failures.append(exc)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    made: list[Bus] = []
    """The Bus of the attempt that connects (made once it has)."""

    async def on_reconnected() -> None:
        for bus in made:
            await bus._reconnected()

    async def attempt() -> Client:
        nc = Client()
        try:
            await nc.connect(
                servers=server_list(url),
                name=name,
                # one attempt per call (nats.py retries a refused connection inside
                # connect() as many times as max_reconnect_attempts, -1 = forever)
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,  # NATS_CONNECT_RETRY waits between attempts
                error_cb=on_error,
                reconnected_cb=on_reconnected,
                connect_timeout=int(max(1, min(5, deadline - loop.time()))),
                token=token or None,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            await nc.close()  # a refused attempt leaves its socket open otherwise
            failures.append(exc)
            if any(_refused_credentials(failure) for failure in failures):
                given = "the token given" if token else "no token"
                raise ConnectFailed(
                    f"NATS at {url} refused {given} (Authorization Violation): set "
                    "SF_NATS_TOKEN to the server's token"
                ) from None
            raise
        return nc

    # no attempt starts after the deadline: the last one starts a wait earlier
    policy = dataclasses.replace(
        NATS_CONNECT_RETRY, deadline_s=wait_s - NATS_CONNECT_RETRY.first_delay_s
    )
    try:
        nc = await retry(attempt, policy, clock=loop.time)
    except NATS_CONNECT_RETRY.retry_on as exc:
        cause = next((f for f in failures if not isinstance(f, nats.errors.NoServersError)), exc)
        reason = str(cause) or type(cause).__name__
        raise ConnectFailed(
            f"cannot reach NATS at {url} within {wait_s:.0f}s ({reason}): is "
            "nats-server running there? check SF_NATS_URL"
        ) from None
    # From here on the client reconnects by itself, forever (nats.py reads these at
    # each disconnect).
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 0.5
    connected = True
    bus = Bus(nc, subjects, replicas)
    made.append(bus)
    return bus


def server_list(url: str) -> list[str]:
    """The servers of ``SF_NATS_URL``: one URL, or several comma-separated."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ConnectFailed("no NATS server given: set SF_NATS_URL")
    return servers
