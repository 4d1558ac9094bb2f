"""How the gateway has engine workers generate a choice, over NATS.

A choice's engine request goes to its policy's engines
(``sf.<run>.engine.<policy>.generate``, queue group ``engines``), or to one engine
(``...engine.<policy>.direct.<engine>``) when an interrupted request was handed over
to a freshly lent engine (``GenerateReply.resume_on``). Engines always stream
GenerateChunks to the gateway's one chunk inbox: chunk 0 names the engine that took
the request, and every chunk carries the tokens so far into the choice; the
GenerateReply is authoritative. An interruption (finish_reason "abort", an engine
declared dead or reconnected to NATS by ``sf.<run>.sched.phase``, no engine confirming
the request) is resumed by re-submitting prompt + partial ids, never re-tokenized,
until the answer is complete. ``sf.<run>.engine.abort`` frees the slot of a request
whose answer is no longer needed (a stop string matched, the client left, the request is
re-routed).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from seamlessflow import telemetry
from seamlessflow.bus import Bus, Msg, NoResponder, RemoteError
from seamlessflow.protocol import (
    AbortGeneration,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
    PhaseChanged,
    decode,
)
from sf_gateway.choice import Choice
from sf_gateway.openai_api import ApiError
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer
from sf_gateway.turns import Turn

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

PROGRESS_CHUNK_S = 0.05
"""How often an engine sends the tokens so far of an answer that is not streamed and
has no stop strings (``GenerateRequest.chunk_every_s``): they serve only to re-route a
dead engine's request, which then regenerates at most this much decoding. One chunk
per decode step would be a NATS message per token to publish, route and decode."""

UNASSIGNED = ""
"""Key of ``EngineClient._engine_calls`` for requests whose engine is not known yet."""


class EngineClient:
    """The gateway's engine calls: each choice's requests until its answer is complete,
    and which engine holds each request (to re-route a dead engine's requests)."""

    def __init__(self, settings: GatewaySettings, bus: Bus, tokenizer: ChatTokenizer) -> None:
        self.settings = settings
        self.bus = bus
        self.tokenizer = tokenizer
        # engine id -> {request id -> the pending engine reply}, learnt from chunks
        self._engine_calls: dict[str, dict[str, asyncio.Future[Any]]] = {}
        self._lost: dict[str, str] = {}
        self.reroutes = 0
        self._chunk_prefix = ""
        """``<inbox>`` of the one subscription (``<inbox>.*``) every engine call's chunks
        arrive on; a call's ``stream_subject`` is ``<inbox>.<request id>``."""
        self._chunk_subscribing = asyncio.Lock()
        self._followers: dict[str, ChunkFollower] = {}
        """Request id -> the engine call its chunks feed (only while the call runs)."""

    async def generate(self, turn: Turn, choice: Choice) -> None:
        """Run one choice to completion, resuming across engine interruptions.

        The single place engine calls happen. An interrupted engine returns the tokens
        so far with finish_reason "abort"; we re-submit prompt + those exact ids for the
        remaining budget, to any engine, and (streaming) the choice simply continues.
        A matched stop string ends the choice (its engine request is aborted). Being
        cancelled (the client left) aborts the engine request and never re-submits.
        """
        plan = turn.plan
        opened = turn.session.opened
        engine_wait_deadline = time.monotonic() + self.settings.engine_wait_s
        resume_on = ""
        """The engine an interrupted request was handed over to (rebalance on lend)."""
        while True:
            request_id = uuid.uuid4().hex
            request = GenerateRequest(
                request_id=request_id,
                session_id=opened.session_id,
                prompt_ids=plan.prompt_ids + choice.token_ids,
                max_tokens=plan.max_tokens - len(choice.token_ids),
                temperature=plan.temperature,
                top_p=plan.top_p,
                top_k=plan.top_k,
                structured_output=plan.structured_output,
                stop_token_ids=list(self.tokenizer.stop_token_ids),
                seed=plan.seed_for(choice.index),
                top_logprobs=plan.top_logprobs,
                # Always streamed from the engine: chunks say which engine holds the request
                # and carry its tokens so far, so a dead engine's requests can be re-routed.
                stream_subject=f"{await self._chunk_inbox()}.{request_id}",
                chunk_every_s=0.0 if plan.engine_stream else PROGRESS_CHUNK_S,
                # the task's version floor binds its own policy's engines only
                min_version=opened.min_version if plan.policy == opened.policy else 0,
            )
            try:
                reply = await self._call_engine(
                    request, plan.policy, choice, turn.on_update, resume_on
                )
            except NoResponder as exc:
                if resume_on:  # that engine left meanwhile: any engine will do
                    resume_on = ""
                    continue
                if time.monotonic() < engine_wait_deadline:
                    await asyncio.sleep(0.2)
                    continue
                raise ApiError(
                    503,
                    f"no engine available: {exc}",
                    type_="server_error",
                    code="engine_unavailable",
                ) from None
            except RemoteError as exc:
                if exc.code == "context_length_exceeded":  # the engine's context is smaller
                    raise ApiError(400, exc.message, code="context_length_exceeded") from None
                if exc.code == "bad_request":  # e.g. an engine that cannot constrain
                    param = "response_format" if plan.structured_output else None
                    raise ApiError(400, exc.message, param=param) from None
                raise ApiError(503, f"engine error: {exc.message}", type_="server_error") from None
            except EngineLost as lost:
                # The tokens streamed so far are in ``choice``: re-submit the rest elsewhere.
                self.reroutes += 1
                with tracer.start_as_current_span(
                    "gateway.reroute",
                    attributes={
                        "engine.id": lost.engine_id,
                        "partial_tokens": len(choice.token_ids),
                    },
                ):
                    engine_wait_deadline = time.monotonic() + self.settings.engine_wait_s
                    resume_on = ""
                    continue
            choice.engine_id = reply.engine_id
            if choice.stopped:
                choice.finish_reason = "stop"
                return
            if reply.finish_reason != "abort" or len(choice.token_ids) >= plan.max_tokens:
                choice.finish_reason = (
                    "length" if reply.finish_reason == "abort" else reply.finish_reason
                )
                return
            resume_on = reply.resume_on
            with tracer.start_as_current_span(
                "gateway.resume",
                attributes={
                    "partial_tokens": len(choice.token_ids),
                    "engine.id": reply.engine_id,
                    "resume_on": resume_on,
                },
            ):
                pass

    async def _call_engine(
        self,
        request: GenerateRequest,
        policy: str,
        choice: Choice,
        on_update: Callable[[], None],
        engine_id: str = "",
    ) -> GenerateReply:
        """One request to an engine of ``policy`` (to ``engine_id`` if given, else to any
        of the queue group); its tokens go into ``choice`` as chunks arrive (``on_chunk``)
        and from the reply, which is authoritative."""
        subjects = self.bus.subjects.for_policy(policy)
        subject = (
            subjects.engine_generate_on(engine_id) if engine_id else subjects.engine_generate()
        )
        reply_task = asyncio.ensure_future(
            self.bus.request(
                subject,
                request,
                GenerateReply,
                timeout=self.settings.generate_timeout_s,
            )
        )
        follower = ChunkFollower(request.request_id, choice, on_update, reply_task)
        # registered before the request is sent (the task has not run yet): no chunk is missed
        self._followers[request.request_id] = follower
        # until its first chunk names the engine, a request could be on any engine
        self._engine_calls.setdefault(UNASSIGNED, {})[request.request_id] = reply_task
        try:
            # An engine names itself in chunk 0 as soon as it takes the request; without
            # it the request may be lost (an engine died or left the queue on receipt),
            # so after ``first_chunk_timeout_s`` it is aborted and re-submitted.
            await asyncio.wait(
                {follower.named, reply_task},
                timeout=self.settings.first_chunk_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not follower.named.done() and not reply_task.done():
                await self._abort(request.request_id, "no engine confirmed the request")
                raise EngineLost("")
            reply: GenerateReply = await reply_task
        except asyncio.CancelledError:
            lost_engine = self._lost.pop(request.request_id, None)
            task = asyncio.current_task()
            if lost_engine is not None and task is not None and not task.cancelling():
                raise EngineLost(lost_engine) from None  # only the engine call was cancelled
            await self._abort(request.request_id, "client disconnected")
            raise
        finally:
            # no await from here to the reply's tokens: a later chunk is not followed
            self._followers.pop(request.request_id, None)
            follower.named.cancel()
            reply_task.cancel()
            self._forget_call(request.request_id)
            self._lost.pop(request.request_id, None)  # a death reported after the reply
        seen = follower.seen
        tops = reply.top_logprobs[seen:] if reply.top_logprobs else []
        choice.extend(reply.token_ids[seen:], reply.logprobs[seen:], reply.versions[seen:], tops)
        on_update()
        return reply

    async def _chunk_inbox(self) -> str:
        """The chunk subscription's prefix, subscribed on first use (one per gateway:
        no subscribe/unsubscribe per engine call)."""
        if not self._chunk_prefix:
            async with self._chunk_subscribing:
                if not self._chunk_prefix:
                    self._chunk_prefix = await self.bus.subscribe_inbox(self.on_chunk)
        return self._chunk_prefix

    async def on_chunk(self, msg: Msg) -> None:
        """Feed a chunk into its engine call's choice. Chunks of a call arrive in order
        (one subscription); a missing one ends following (the reply fills in), and one
        of a call that has ended is dropped."""
        follower = self._followers.get(msg.subject.rpartition(".")[2])
        if follower is None or follower.broken:
            return
        try:
            chunk = decode(msg.data, GenerateChunk)
        except ValueError:
            follower.broken = True
            return
        if chunk.index != follower.index or chunk.request_id != follower.request_id:
            follower.broken = True
            return
        follower.index += 1
        follower.seen += len(chunk.token_ids)
        if not follower.named.done():
            follower.named.set_result(None)
        choice = follower.choice
        choice.engine_id = chunk.engine_id
        request_id = follower.request_id
        self._engine_calls.get(UNASSIGNED, {}).pop(request_id, None)
        self._engine_calls.setdefault(chunk.engine_id, {})[request_id] = follower.reply_task
        if choice.extend(chunk.token_ids, chunk.logprobs, chunk.versions, chunk.top_logprobs):
            await self._abort(request_id, "stop")
        follower.on_update()

    async def on_phase(self, change: PhaseChanged) -> None:
        """An engine declared dead by the tag-scheduler: re-route its requests now
        instead of waiting for a reply that will never come. An engine whose NATS
        connection came back likewise: a chunk or reply it sent while away may be lost
        (written to a server that died), and the abort makes it drop its copies."""
        if change.phase not in ("dead", "reconnected"):
            return
        calls = self._engine_calls.pop(change.resource_id, {})
        # Requests not yet confirmed by any engine may have been on that one (its
        # chunk 0 lost): abort them everywhere (a live engine drops its copy) and
        # re-submit them too.
        unconfirmed = self._engine_calls.pop(UNASSIGNED, {})
        what = "died" if change.phase == "dead" else "reconnected to NATS"
        if calls or unconfirmed:
            log.warning(
                "engine %s %s; re-routing %d requests (+%d unconfirmed)",
                change.resource_id,
                what,
                len(calls),
                len(unconfirmed),
            )
        for request_id, reply_task in {**calls, **unconfirmed}.items():
            await self._abort(request_id, f"engine {change.resource_id} {what}")
            self._lost[request_id] = change.resource_id
            reply_task.cancel()

    async def on_reconnect(self) -> None:
        """NATS came back: a reply or chunk an engine sent while it was away may be
        lost (published before this gateway's subscriptions were restored), and the call
        would wait ``generate_timeout_s`` for it. Re-route every call in flight, as for
        a dead engine: each keeps the tokens streamed so far and is re-submitted, and its
        engine drops its copy on the abort."""
        calls = {
            request_id: reply_task
            for engine_calls in self._engine_calls.values()
            for request_id, reply_task in engine_calls.items()
        }
        self._engine_calls.clear()
        if calls:
            log.warning("NATS reconnected; re-routing %d requests in flight", len(calls))
        for request_id, reply_task in calls.items():
            await self._abort(request_id, "NATS reconnected")
            self._lost[request_id] = "(reconnect)"
            reply_task.cancel()

    def _forget_call(self, request_id: str) -> None:
        for calls in self._engine_calls.values():
            calls.pop(request_id, None)

    async def _abort(self, request_id: str, reason: str) -> None:
        """Free the engine slot of a request whose answer is no longer needed."""
        await self.bus.publish(
            self.bus.subjects.engine_abort(), AbortGeneration(request_id=request_id, reason=reason)
        )


@dataclass
class ChunkFollower:
    """One engine call's chunks as they arrive (``EngineClient.on_chunk``)."""

    request_id: str
    choice: Choice
    on_update: Callable[[], None]
    reply_task: asyncio.Future[Any]
    named: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    """Done when chunk 0 names the engine that took the request."""
    index: int = 0
    """The index of the next chunk expected."""
    seen: int = 0
    """How many of the reply's tokens the chunks delivered."""
    broken: bool = False
    """A chunk was missing or malformed: the rest comes from the reply."""


class EngineLost(Exception):
    """The engine holding a request was declared dead; its request must be re-routed."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(f"engine {engine_id} died")
        self.engine_id = engine_id
