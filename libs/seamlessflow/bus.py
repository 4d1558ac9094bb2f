"""The NATS layer every service uses: connection, typed request/reply, JetStream helpers.

Errors are handled here, at the boundary: a handler registered with :meth:`Bus.serve`
receives a decoded, typed message; a payload that fails to decode, and a handler that
raises :class:`DomainError`, turn into an :class:`~seamlessflow.protocol.ErrorReply`
to the requester. Anything else propagates into the log once and becomes an
``internal`` error reply, so a requester never waits for a reply that will not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, StreamConfig

from seamlessflow import telemetry
from seamlessflow.protocol import ErrorReply, Message, ProtocolError, Subjects, decode, encode
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

JS_PUBLISH_RETRY_S = 30.0
"""How long a publish with a message id is retried while the broker does not ack it."""

INSUFFICIENT_STORAGE = 10047
"""JetStream's error code for a stream whose byte limit the server cannot reserve."""

FOLLOW_HEARTBEAT_S = 1.0
"""Idle heartbeat of the consumers that follow a stream. An ordered consumer lives in the
server's memory: after a server restart the client only notices it is gone when two
heartbeats are missed, then recreates it from the next sequence. nats.py's default (5 s)
left a follower deaf for 10-20 s after a broker restart; with 1 s it is 2-4 s."""


class Bus:
    """One NATS connection of one service, with the run's subjects."""

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = subjects
        self._subscriptions: list[Subscription] = []
        self._handlers: set[asyncio.Task[None]] = set()

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
            await self._ensure_stream(name, subjects, limits.get(name), direct=name in direct)

    async def _ensure_stream(
        self, name: str, subjects: list[str], limits: StreamLimits | None, *, direct: bool = False
    ) -> None:
        """``direct``: messages are read by sequence with direct get (raw bytes, no JSON
        envelope), e.g. batch payload chunks."""
        wanted = StreamConfig(
            name=name, subjects=subjects, duplicate_window=600.0, allow_direct=direct or None
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
                except nats.js.errors.BadRequestError:
                    # another service created it between our lookup and our add
                    info = await self.js.stream_info(name)
            have = info.config
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
        was written just before the client noticed) is retried for up to
        ``JS_PUBLISH_RETRY_S``, so a broker restart does not fail the publisher. Without
        one it raises at once: a retry could store the message twice."""
        return await self.js_publish_bytes(subject, encode(message), msg_id=msg_id)

    async def js_publish_bytes(self, subject: str, data: bytes, *, msg_id: str = "") -> int:
        """``js_publish`` of a payload that is not a message (batch payload chunks)."""
        headers = telemetry.inject_headers()
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        deadline = asyncio.get_running_loop().time() + (JS_PUBLISH_RETRY_S if msg_id else 0)
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=headers)
                return ack.seq
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                log.warning("no ack for %s on %s (%r): retrying", msg_id, subject, exc)
                await asyncio.sleep(0.5)

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
        try:
            last = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return []
        sub = await self.js.subscribe(
            subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        messages: list[Msg] = []
        try:
            last_seq = last.seq or 0
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

    async def drain(self, timeout: float = 5.0) -> None:
        """Stop taking requests, let handlers in flight finish on an open connection, then
        drain and close, all within about ``timeout``. Safe to call twice."""
        if self.nc.is_closed:
            return
        for sub in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subscriptions.clear()
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except (nats.errors.ConnectionClosedError, TimeoutError):
            pass
        finally:
            if not self.nc.is_closed:
                await self.nc.close()


async def ack_redeliverable(msg: Msg) -> None:
    """Ack a durable consumer's message whose redelivery the consumer handles (it
    recognises what it already did). An ack the broker does not confirm (lost with a
    broker restart) is logged, not raised: the message comes again after the consumer's
    ack wait and is recognised then."""
    try:
        await msg.ack_sync()
    except nats.errors.TimeoutError:
        log.warning("ack of %s not confirmed: it will be redelivered", msg.subject)


NATS_CONNECT_WAIT_S = 15.0
"""How long a process retries its first connection to an unreachable NATS server."""


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
) -> Bus:
    """Connect to NATS; the first connection is bounded, reconnects are not.

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
    while True:
        remaining = deadline - loop.time()
        nc = Client()
        try:
            await nc.connect(
                servers=[url],
                name=name,
                # one attempt per call (nats.py retries a refused connection inside
                # connect() as many times as max_reconnect_attempts, -1 = forever)
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,  # the loop below waits between attempts
                error_cb=on_error,
                connect_timeout=int(max(1, min(5, remaining))),
                token=token or None,
            )
            break
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            await nc.close()  # a refused attempt leaves its socket open otherwise
            failures.append(exc)
            if any(_refused_credentials(failure) for failure in failures):
                given = "the token given" if token else "no token"
                raise ConnectFailed(
                    f"NATS at {url} refused {given} (Authorization Violation): set "
                    "SF_NATS_TOKEN to the server's token"
                ) from None
            if loop.time() + 0.5 >= deadline:
                cause = next(
                    (f for f in failures if not isinstance(f, nats.errors.NoServersError)), exc
                )
                reason = str(cause) or type(cause).__name__
                raise ConnectFailed(
                    f"cannot reach NATS at {url} within {wait_s:.0f}s ({reason}): is "
                    "nats-server running there? check SF_NATS_URL"
                ) from None
            await asyncio.sleep(0.5)
    # From here on the client reconnects by itself, forever (nats.py reads these at
    # each disconnect).
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 0.5
    connected = True
    return Bus(nc, subjects)
