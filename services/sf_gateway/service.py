"""rollout-gateway: the agent-facing, OpenAI-compatible data plane.

HTTP (agents):
- ``POST /sessions`` -> ``{session_id, base_url}``; the agent's OpenAI client uses
  ``base_url`` (``.../s/<session>/v1``) and nothing else changes in the agent
- ``POST /s/<session>/v1/chat/completions``, ``POST /s/<session>/v1/completions``,
  ``POST /s/<session>/v1/responses`` (the Responses API: chat turns, ``responses_api``),
  ``GET /s/<session>/v1/models``, ``GET /v1/models``
- ``POST /sessions/<session>/reward``, ``POST /sessions/<session>/finish``
- ``GET /sessions/<session>/export``: every branch of the session as training samples
- ``POST /s/<session>/tokenize``, ``POST /s/<session>/detokenize`` (the session's
  key; ``POST /tokenize``, ``/detokenize`` like ``/v1/models``): a chat request's prompt
  ids exactly as its turn would record them, and ids back to text
- ``GET /healthz``; ``GET /openapi.json``: this API as an OpenAPI 3.1 document

Multi-policy: the run's policies (``SF_POLICIES``) are served as models of the same
names; a request's ``model`` picks the policy whose engines answer it, and the turn is
recorded for that policy. One tokenizer (``SF_MODEL_DIR``) serves every policy.

Consumes:
- ``sf.<run>.engine.<policy>.generate`` replies (GenerateReply) from engine workers, and
  their GenerateChunks on a private inbox (which engine holds a request, tokens so far)
- ``sf.<run>.sched.phase`` (PhaseChanged): a dead engine's requests are re-routed
Produces:
- ``sf.<run>.engine.<policy>.generate`` requests (GenerateRequest, queue group
  ``engines``; ``...engine.<policy>.direct.<engine>`` to resume a request handed over
  to a lent engine) and ``sf.<run>.engine.abort`` broadcasts
- ``sf.<run>.traj.event.<session>`` (JetStream: SessionOpened, TurnRecorded,
  RewardReported, SessionFinished)

Access control: every session has its own key, returned once by ``POST /sessions``
(``api_key``); the session's routes (its OpenAI base URL, reward, finish, export) take
only that key as ``Authorization: Bearer <key>`` (what an OpenAI client sends as its
``api_key``), so an agent cannot read or write another session. With
``SF_GATEWAY_API_KEYS`` set, opening a session and listing models need one of those
operator keys, which also export any session. The gateway keeps only sha256 digests
of keys, and never logs them.

Restarts: before serving, the gateway replays the trajectory stream and rebuilds every
session not finished (key digest, task, turn count, conversation tree with its exact
ids), so an agent's next call with the same base URL and key continues its session.

Invariants: the recorded TurnRecorded holds exactly the ids the engine consumed and
produced, with their logprobs and versions and the temperature, top_p and top_k they
were sampled with (the trainer recomputes logprobs at that temperature; a turn sampled
under a constraint, ``response_format``, is marked ``constrained`` and not trained), and
is durably stored before the agent gets its answer. Ids the gateway inserts (a forced
tool call's opening) end ``prompt_ids``: they are never recorded as generated. A
request that fails validation stores nothing. An engine interruption (finish_reason
"abort") is resumed here: prompt + partial ids are re-submitted (never re-tokenized)
until the answer is complete; to the engine the reply names (``resume_on``: rebalanced
onto a freshly lent engine) if it still serves, else to any.

The parts: ``auth`` (session and operator keys), ``request_body`` (bounded JSON
bodies), ``turns`` (a validated request as a turn: model, budget, plan, choices),
``engine_client`` (the engine calls, their chunks, re-routing and resuming), ``sse``
(streamed answers), ``sessions`` (a session's state); this module routes HTTP to them,
keeps the sessions, runs and records turns, and is the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from seamlessflow import telemetry
from seamlessflow.assets.model_check import ModelNeeds, check_model, context_need
from seamlessflow.bus import BrokerUnavailable, Bus, NoResponder, RemoteError, Unrecoverable
from seamlessflow.protocol import (
    GroupClosed,
    PhaseChanged,
    ProtocolError,
    RewardReported,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    TrajectoryEvent,
    TurnRecorded,
    decode,
    encode,
)
from seamlessflow.service import ServiceContext
from sf_gateway.auth import Access, key_digest
from sf_gateway.choice import Choice
from sf_gateway.conversation import NodeKey
from sf_gateway.engine_client import EngineClient
from sf_gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    FinishBody,
    RewardBody,
    SessionCreate,
    TokenizeRequest,
    TokenizeResponse,
    parse,
)
from sf_gateway.openapi import openapi_document
from sf_gateway.reasoning import reasoning_parser_for
from sf_gateway.request_body import read_json
from sf_gateway.responses import ChatFormat, CompletionFormat, logprob_token
from sf_gateway.responses_api import create_response
from sf_gateway.sessions import GatewaySession, add_node, new_session
from sf_gateway.settings import GatewaySettings
from sf_gateway.sse import Events, EventStream, chunk_events
from sf_gateway.templating import ChatTokenizer
from sf_gateway.tool_parsers import tool_parser_for
from sf_gateway.turns import Plan, Turn, TurnPlanner

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

FOLLOW_POLL_S = 1.0
"""How often the live follower of shared sessions looks whether the service is stopping."""


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        bus: Bus,
        tokenizer: ChatTokenizer,
        policies: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.tokenizer = tokenizer
        self.sessions: dict[str, GatewaySession] = {}
        """Open sessions."""
        self.finished: OrderedDict[str, str] = OrderedDict()
        """Finished sessions, oldest first: id -> key digest."""
        self.models = policies or [bus.subjects.policy]
        """The run's policies, each served as the model of the same name; a request's
        ``model`` picks the engines (and so the weight version line) that answer it."""
        self.public_url = ""
        self.engines = EngineClient(settings, bus, tokenizer)
        tool_parser = tool_parser_for(
            settings.tool_parser, tokenizer.chat_template, tokenizer.model_type
        )
        self.reasoning_parser = reasoning_parser_for(
            settings.reasoning_parser, tokenizer.chat_template
        )
        self.planner = TurnPlanner(
            settings, tokenizer, self.models, tool_parser, self.reasoning_parser
        )
        self._turns: set[asyncio.Task[None]] = set()
        # reads self.sessions and self.finished in place: neither is ever rebound
        self.access = Access(self.sessions, self.finished, settings.operator_keys())
        # shared sessions (several gateway processes): the trajectory stream as read so far
        self._events: Any = None
        """The ordered consumer the restore read with, kept to follow the stream live."""
        self.applied_seq = 0
        """Stream sequence of the last trajectory event applied to the tables."""
        self._applied = asyncio.Condition()
        self._recorded_here: set[str] = set()
        """Request ids of turns this process recorded and has not read back yet: it
        applied them itself (reading them back would add their node twice)."""

    async def restore_sessions(self) -> None:
        """Rebuild the sessions that were open before a restart, from the trajectory
        stream (every event is stored before its agent gets an answer), before serving:
        each one's key digest, task, reference and reward function (SessionOpened), its
        turn count and its conversation tree with the exact ids (TurnRecorded). An
        agent's next call, with the same base URL and key, continues where it was.
        Finished sessions are remembered as such (409 to late calls). Sessions of a
        group the trajectory service closed are not rebuilt: whatever they do next is
        ignored (a 404 tells their agent so)."""
        subjects = self.bus.subjects
        events, last_seq = await self.bus.follow(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
        turns: dict[str, list[TurnRecorded]] = {}
        """Open session -> its chat turns; trees are built once the replay is done."""
        closed_groups: set[str] = set()
        replayed = 0
        keep_following = False
        try:
            while last_seq:
                msg = await events.next_msg(timeout=10.0)
                replayed += 1
                try:
                    event = decode(msg.data, TrajectoryEvent)
                except ProtocolError as exc:
                    log.warning("skipping an undecodable trajectory event: %s", exc)
                else:
                    self._replay(event, turns, closed_groups)
                self.applied_seq = msg.metadata.sequence.stream
                if self.applied_seq >= last_seq:
                    break
            keep_following = self.settings.shared_sessions
        finally:
            if keep_following:
                self._events = events  # follow_sessions reads on from here
            else:
                await events.unsubscribe()
        for session_id, session in list(self.sessions.items()):
            if session.opened.group_id in closed_groups:
                del self.sessions[session_id]
                continue
            for turn in turns.get(session_id, []):
                node = NodeKey(turn.node_depth, turn.node_digest)
                add_node(session, self.tokenizer, node, turn.prompt_ids, turn.completion_ids)
        if replayed:
            log.info(
                "replayed %d trajectory events: %d sessions open, %d finished remembered",
                replayed,
                len(self.sessions),
                len(self.finished),
            )

    def _replay(
        self,
        event: TrajectoryEvent,
        turns: dict[str, list[TurnRecorded]],
        closed_groups: set[str],
    ) -> None:
        if isinstance(event, GroupClosed):
            closed_groups.add(event.group_id)
            return
        if isinstance(event, SessionOpened):
            if event.session_id not in self.sessions and event.session_id not in self.finished:
                self.sessions[event.session_id] = new_session(
                    event, self.tokenizer, self.reasoning_parser
                )
            return
        session = self.sessions.get(event.session_id)
        if session is None:
            return
        if isinstance(event, TurnRecorded):
            session.turns = max(session.turns, event.turn_index + 1)
            if event.node_digest:
                turns.setdefault(event.session_id, []).append(event)
        elif isinstance(event, SessionFinished):
            session.finished = True
            self._retire(session)
            turns.pop(event.session_id, None)

    async def follow_sessions(self, stopping: asyncio.Event) -> None:
        """With shared sessions: apply what every gateway process stores, as it is stored
        (sessions opened, turns recorded, sessions finished by the others), until
        ``stopping``. ``restore_sessions`` read the stream up to here."""
        events = self._events
        if events is None:
            return
        try:
            while not stopping.is_set():
                try:
                    msg = await events.next_msg(timeout=FOLLOW_POLL_S)
                except TimeoutError:
                    continue
                try:
                    event = decode(msg.data, TrajectoryEvent)
                except ProtocolError as exc:
                    log.warning("skipping an undecodable trajectory event: %s", exc)
                else:
                    self._apply(event)
                async with self._applied:
                    self.applied_seq = msg.metadata.sequence.stream
                    self._applied.notify_all()
        finally:
            self._events = None
            with contextlib.suppress(Exception):  # the connection may be draining
                await events.unsubscribe()

    def _apply(self, event: TrajectoryEvent) -> None:
        """One event of the live stream (another process's, or this one's read back)."""
        if isinstance(event, SessionOpened):
            if event.session_id not in self.sessions and event.session_id not in self.finished:
                self.sessions[event.session_id] = new_session(
                    event, self.tokenizer, self.reasoning_parser
                )
            return
        if isinstance(event, GroupClosed | RewardReported):
            return  # nothing of the gateway's (a closed group's sessions end by themselves)
        session = self.sessions.get(event.session_id)
        if isinstance(event, TurnRecorded):
            if event.request_id in self._recorded_here:
                self._recorded_here.discard(event.request_id)
                return
            if session is None:
                return
            session.turns = max(session.turns, event.turn_index + 1)
            if event.node_digest:
                node = NodeKey(event.node_depth, event.node_digest)
                add_node(session, self.tokenizer, node, event.prompt_ids, event.completion_ids)
        elif isinstance(event, SessionFinished) and session is not None:
            session.finished = True
            self._retire(session)

    async def _caught_up(self, request: Request) -> None:
        """With shared sessions: wait until this process has applied the last event
        stored for the request's session (another process may have recorded it), so a
        turn continues from the exact ids the previous one stored, wherever it ran."""
        if not self.settings.shared_sessions:
            return
        subjects = self.bus.subjects
        try:
            subject = subjects.trajectory_event(request.path_params["session_id"])
        except ProtocolError:
            return  # no such session anywhere: the access check answers 404
        last = await self.bus.last_sequence(subjects.stream_trajectory(), subject)
        if last <= self.applied_seq:
            return
        try:
            async with asyncio.timeout(self.settings.catch_up_timeout_s), self._applied:
                await self._applied.wait_for(lambda: self.applied_seq >= last)
        except TimeoutError:
            raise ApiError(
                503,
                "this gateway process has not read the session's record yet: send the "
                "request again",
                type_="server_error",
                code="catching_up",
            ) from None

    async def session(self, request: Request) -> GatewaySession | None:
        """The request's session (``Access.session_of``), caught up first."""
        await self._caught_up(request)
        return self.access.session_of(request)

    async def open_session(self, request: Request) -> GatewaySession:
        """The request's open session (``Access.open_session_of``), caught up first."""
        await self._caught_up(request)
        return self.access.open_session_of(request)

    # ------------------------------------------------------------------ HTTP app

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/sessions", self.create_session, methods=["POST"]),
            Route("/sessions/{session_id}/reward", self.report_reward, methods=["POST"]),
            Route("/sessions/{session_id}/finish", self.finish_session, methods=["POST"]),
            Route("/sessions/{session_id}/export", self.export_session, methods=["GET"]),
            Route("/s/{session_id}/v1/models", self.list_models_in_session, methods=["GET"]),
            Route("/s/{session_id}/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/s/{session_id}/v1/completions", self.completions, methods=["POST"]),
            Route("/s/{session_id}/v1/responses", self.responses, methods=["POST"]),
            Route("/s/{session_id}/tokenize", self.tokenize_in_session, methods=["POST"]),
            Route("/s/{session_id}/detokenize", self.detokenize_in_session, methods=["POST"]),
        ]
        app = Starlette(routes=routes, middleware=[Middleware(telemetry.TraceContextMiddleware)])
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(BrokerUnavailable, self._broker_unavailable)
        app.add_exception_handler(ClientDisconnect, self._client_left)
        app.add_exception_handler(404, self._not_found)
        app.add_exception_handler(405, self._method_not_allowed)
        return app

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def _broker_unavailable(self, request: Request, exc: Exception) -> Response:
        """JetStream did not take what this request had to record (a NATS cluster
        electing a leader, a broker restarting): nothing was stored, so the client may
        send it again; OpenAI clients retry a 503 by themselves."""
        log.warning("%s %s: %s (503)", request.method, request.url.path, exc)
        message = "the message broker is unavailable for a moment: send the request again"
        return ApiError(503, message, type_="server_error", code="broker_unavailable").response()

    async def _client_left(self, request: Request, exc: Exception) -> Response:
        """The client went away before its request was read (an agent stopped): nothing
        was stored and nobody reads the answer; 499 as in nginx's logs."""
        log.debug("client left before %s %s was read", request.method, request.url.path)
        return Response(status_code=499)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    async def _method_not_allowed(self, request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} not allowed on {request.url.path}").response()

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(self.sessions)})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def list_models(self, request: Request) -> Response:
        self.access.require_operator(request)
        return self._models()

    def _models(self) -> Response:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "seamlessflow"}
            for name in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def list_models_in_session(self, request: Request) -> Response:
        await self.session(request)
        return self._models()

    async def create_session(self, request: Request) -> Response:
        self.access.require_operator(request)
        body = parse(SessionCreate, await read_json(request, allow_empty=True))
        policy = (
            self.planner.check_model(body.policy, param="policy") if body.policy else self.models[0]
        )
        session_id = "s" + uuid.uuid4().hex
        api_key = "sk-sf-" + secrets.token_urlsafe(32)
        opened = SessionOpened(
            session_id=session_id,
            task_id=body.task_id,
            group_id=body.group_id or session_id,
            sample_index=body.sample_index,
            group_size=body.group_size,
            reference=body.reference,
            reward_fn=body.reward_fn,
            policy=policy,
            key_sha256=key_digest(api_key),
            min_version=body.min_version,
        )
        await self.bus.js_publish(self.bus.subjects.trajectory_event(session_id), opened)
        self.sessions[session_id] = new_session(opened, self.tokenizer, self.reasoning_parser)
        return JSONResponse(
            {
                "session_id": session_id,
                "base_url": f"{self.public_url}/s/{session_id}/v1",
                "api_key": api_key,
            },
            status_code=201,
        )

    async def report_reward(self, request: Request) -> Response:
        session = await self.open_session(request)
        body = parse(RewardBody, await read_json(request))
        if body.policy:
            self.planner.check_model(body.policy, param="policy")
        event = RewardReported(
            session_id=session.opened.session_id,
            reward=body.reward,
            policy=body.policy,
            step_rewards=body.step_rewards,
        )
        await self.bus.js_publish(self.bus.subjects.trajectory_event(event.session_id), event)
        answer: dict[str, Any] = {"session_id": event.session_id, "reward": body.reward}
        if body.policy:
            answer["policy"] = body.policy
        return JSONResponse(answer)

    async def finish_session(self, request: Request) -> Response:
        session = await self.open_session(request)
        body = parse(FinishBody, await read_json(request, allow_empty=True))
        async with session.lock:  # a turn still running is recorded before the finish
            if session.finished:
                raise ApiError(409, "session already finished", code="session_finished")
            event = SessionFinished(session_id=session.opened.session_id, failure=body.failure)
            await self.bus.js_publish(self.bus.subjects.trajectory_event(event.session_id), event)
            session.finished = True
            self._retire(session)
        return JSONResponse({"session_id": event.session_id, "turns": session.turns})

    def _retire(self, session: GatewaySession) -> None:
        """A finished session's record lives in JetStream: the gateway drops its
        conversation and keeps only its id and key digest, to answer 409 to late calls
        (bounded: ``finished_sessions_kept``)."""
        session_id = session.opened.session_id
        self.sessions.pop(session_id, None)
        self.finished[session_id] = session.key_sha256
        while len(self.finished) > self.settings.finished_sessions_kept:
            self.finished.popitem(last=False)

    async def export_session(self, request: Request) -> Response:
        """Every branch of the session as training samples (served by trajectory). With
        the session's key, or an operator key for any session (also after a restart)."""
        session_id = request.path_params["session_id"]
        if not self.access.is_operator(request):
            await self.session(request)
        try:
            export = await self.bus.request(
                self.bus.subjects.trajectory_export(),
                SessionExportQuery(session_id=session_id),
                SessionExport,
                timeout=30.0,
            )
        except RemoteError as exc:
            status = {"not_found": 404, "bad_request": 400}.get(exc.code, 503)
            raise ApiError(status, exc.message, code=exc.code) from None
        except NoResponder as exc:
            raise ApiError(
                503, f"trajectory service unavailable: {exc}", type_="server_error"
            ) from None
        return Response(encode(export), media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        session = await self.open_session(request)
        body = parse(ChatCompletionRequest, await read_json(request))
        turn, view = self.planner.chat_turn(session, body, "gateway.chat_completion")
        if body.stream:
            return self._stream(turn, view)
        await self._run_turn(turn)
        return JSONResponse(view.response(len(turn.plan.prompt_ids), turn.choices))

    async def responses(self, request: Request) -> Response:
        return await create_response(self, request)

    async def completions(self, request: Request) -> Response:
        session = await self.open_session(request)
        body = parse(CompletionRequest, await read_json(request))
        turn, view = self.planner.completion_turn(session, body)
        if body.stream:
            return self._stream(turn, view)
        await self._run_turn(turn)
        return JSONResponse(view.response(len(turn.plan.prompt_ids), turn.choices))

    async def tokenize(self, request: Request) -> Response:
        """Outside a session: a chat prompt is tokenized as a session's first turn."""
        self.access.require_operator(request)
        return await self._tokenize(request, None)

    async def tokenize_in_session(self, request: Request) -> Response:
        """In a session: a chat prompt's ids are the ones its next turn would record
        (the stored ids of the history it continues, then its new messages)."""
        return await self._tokenize(request, await self.open_session(request))

    async def detokenize(self, request: Request) -> Response:
        self.access.require_operator(request)
        return await self._detokenize(request)

    async def detokenize_in_session(self, request: Request) -> Response:
        await self.open_session(request)
        return await self._detokenize(request)

    async def _tokenize(self, request: Request, session: GatewaySession | None) -> Response:
        body = parse(TokenizeRequest, await read_json(request))
        if body.model is not None:
            self.planner.check_model(body.model)
        if body.messages is not None:
            # the chat route's own request model: the same messages and tools for the template
            chat = parse(
                ChatCompletionRequest,
                {"model": body.model or self.models[0], "messages": body.messages,
                 "tools": body.tools},
            )  # fmt: skip
            messages, tools = chat.template_messages(), chat.template_tools()
            if session is None:
                ids = self.tokenizer.encode_text(self.tokenizer.render(messages, tools, True))
            else:
                forks = session.conversation.forks  # a look, not a turn: no fork is counted
                ids = session.conversation.prompt_for(messages, tools).ids
                session.conversation.forks = forks
        else:
            ids = self.tokenizer.encode_text(body.prompt or "")
        answer = TokenizeResponse(
            count=len(ids),
            max_model_len=self.settings.max_context,
            tokens=ids,
            token_strs=[logprob_token(self.tokenizer.token_bytes(t)) for t in ids]
            if body.return_token_strs
            else None,
        )
        return JSONResponse(answer.model_dump(exclude_none=True))

    async def _detokenize(self, request: Request) -> Response:
        body = parse(DetokenizeRequest, await read_json(request))
        if body.model is not None:
            self.planner.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"tokens has ids outside the vocabulary: {bad[:5]}", param="tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=self.tokenizer.raw_text(body.tokens)).model_dump()
        )

    # ------------------------------------------------------------------ turns

    def _stream(
        self, turn: Turn, view: ChatFormat | CompletionFormat, events: Events | None = None
    ) -> Response:
        """Server-sent events of ``turn``, generated by a task of its own (``events``:
        what they are, by default chat or completion chunks of ``view``).

        The client going away (or the response ending for any other reason before the
        turn did) cancels that task: its engine requests are aborted, nothing is
        resubmitted and nothing is recorded.
        """
        updated = asyncio.Event()
        turn.on_update = updated.set
        producer = asyncio.create_task(self._run_turn(turn), name="gateway.turn")
        self._turns.add(producer)
        producer.add_done_callback(self._turn_done)
        events = events or (lambda producer, updated: chunk_events(turn, view, producer, updated))
        return EventStream(events(producer, updated), on_close=producer.cancel)

    def _turn_done(self, task: asyncio.Task[None]) -> None:
        self._turns.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # also read when the client left before the end
        if exc is not None and not isinstance(exc, ApiError):
            log.error("turn failed", exc_info=exc)

    async def _run_turn(self, turn: Turn) -> None:
        """Generate every choice (concurrently), then record each as a TurnRecorded."""
        session, plan = turn.session, turn.plan
        with tracer.start_as_current_span(
            turn.span, attributes={"session.id": session.opened.session_id, "n": plan.n}
        ):
            async with session.lock:
                if session.finished:
                    raise ApiError(409, "session already finished", code="session_finished")
                try:
                    async with asyncio.TaskGroup() as group:
                        for choice in turn.choices:
                            group.create_task(self.engines.generate(turn, choice))
                except ExceptionGroup as errors:
                    api_errors = [e for e in errors.exceptions if isinstance(e, ApiError)]
                    if api_errors:
                        raise api_errors[0] from None
                    raise
                for choice in turn.choices:
                    node = turn.node_of(choice)
                    await self._record(session, plan, choice, node, turn.parent_digest)
                    if node is not None:  # stored first: a restart rebuilds the same tree
                        add_node(session, self.tokenizer, node, plan.prompt_ids, choice.token_ids)

    async def _record(
        self,
        session: GatewaySession,
        plan: Plan,
        choice: Choice,
        node: NodeKey | None,
        parent_digest: str = "",
    ) -> None:
        turn = TurnRecorded(
            session_id=session.opened.session_id,
            turn_index=session.turns,
            request_id=uuid.uuid4().hex,
            engine_id=choice.engine_id,
            prompt_ids=plan.prompt_ids,
            completion_ids=choice.token_ids,
            logprobs=choice.logprobs,
            versions=choice.versions,
            finish_reason=choice.finish_reason,
            completion_text=choice.text,
            policy=plan.policy,
            node_depth=node.depth if node is not None else 0,
            node_digest=node.digest if node is not None else "",
            # what every engine call of the choice applied: the request's validation
            # made tiny temperatures 0 by the engines' own greedy rule (``GREEDY_BELOW``)
            temperature=plan.temperature,
            top_p=plan.top_p,
            parent_digest=parent_digest,
            top_k=plan.top_k,
            constrained=bool(plan.structured_output),
        )
        if self.settings.shared_sessions:
            self._recorded_here.add(turn.request_id)
        try:
            await self.bus.js_publish(self.bus.subjects.trajectory_event(turn.session_id), turn)
        except BaseException:
            self._recorded_here.discard(turn.request_id)
            raise
        session.turns += 1


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service skeleton owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The gateway's bound socket; a port taken or a host not on this machine is a
    setting to change, not a fault to retry. ``reuse_port``: other processes may bind
    the same address (SO_REUSEPORT) and the kernel spreads connections among them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Unrecoverable(
            f"cannot listen on {host}:{port} ({exc.strerror}): set SF_GATEWAY_HOST/SF_GATEWAY_PORT"
        ) from exc
    sock.set_inheritable(True)
    return sock


class GatewayService:
    name = "gateway"

    def __init__(self, settings: GatewaySettings | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.bound_port: int | None = None
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the gateway needs SF_MODEL_DIR (the tokenizer lives there)")
        await asyncio.to_thread(
            check_model,
            ctx.mesh.model_dir,
            ModelNeeds(weights=False, **context_need(self.settings, "SF_GATEWAY_MAX_CONTEXT")),
        )
        tokenizer = await asyncio.to_thread(ChatTokenizer, ctx.mesh.model_dir)
        self.gateway = Gateway(self.settings, ctx.bus, tokenizer, ctx.mesh.policy_names())
        await self.gateway.restore_sessions()
        await ctx.bus.subscribe(
            ctx.subjects.sched_phase(), PhaseChanged, self.gateway.engines.on_phase
        )
        ctx.bus.on_reconnect(self.gateway.engines.on_reconnect)
        config = uvicorn.Config(
            self.gateway.app(),
            host=self.settings.host,
            port=self.settings.port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=int(self.settings.keep_alive_s),
        )
        server = _Server(config)
        # Bound before serving, so that the public URL (port 0 picks one) is known before
        # the first request: a session opened at once must get a callable base_url.
        listening = _listen(self.settings.host, self.settings.port, self.settings.reuse_port)
        self.bound_port = listening.getsockname()[1]
        self.gateway.public_url = (
            self.settings.public_url.rstrip("/") or f"http://{self.settings.host}:{self.bound_port}"
        )

        async def exit_on_stop() -> None:
            # uvicorn finishes in-flight requests when asked to exit; cancelling it would not
            await ctx.stopping.wait()
            server.should_exit = True

        async def announce() -> None:
            while not server.started:  # noqa: ASYNC110 (uvicorn offers no started event)
                await asyncio.sleep(0.02)
            log.info("gateway listening on %s", self.gateway.public_url)
            self.ready.set()

        async with asyncio.TaskGroup() as group:
            group.create_task(server.serve(sockets=[listening]))
            group.create_task(announce())
            group.create_task(exit_on_stop())
            group.create_task(self.gateway.follow_sessions(ctx.stopping))
