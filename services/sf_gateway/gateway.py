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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from seamlessflow import telemetry
from seamlessflow.assets.model_check import ModelNeeds, check_model, context_need
from seamlessflow.bus import Bus, NoResponder, RemoteError, Unrecoverable
from seamlessflow.protocol import (
    SEEDS,
    AbortGeneration,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
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
from sf_gateway.choice import Choice
from sf_gateway.config import GatewaySettings
from sf_gateway.conversation import Conversation, NodeKey
from sf_gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    RewardBody,
    SessionCreate,
    TokenizeRequest,
    TokenizeResponse,
    parse,
)
from sf_gateway.openapi import openapi_document
from sf_gateway.reasoning import reasoning_of, reasoning_parser_for
from sf_gateway.responses import ChatFormat, CompletionFormat, logprob_token
from sf_gateway.responses_api import create_response
from sf_gateway.templating import ChatTokenizer
from sf_gateway.tool_parsers import tool_parser_for

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024

PROGRESS_CHUNK_S = 0.05
"""How often an engine sends the tokens so far of an answer that is not streamed and
has no stop strings (``GenerateRequest.chunk_every_s``): they serve only to re-route a
dead engine's request, which then regenerates at most this much decoding. One chunk
per decode step would be a NATS message per token to publish, route and decode."""


@dataclass
class GatewaySession:
    opened: SessionOpened
    key_sha256: str
    """Digest of the session's key: its routes take only that key."""
    conversation: Conversation
    finished: bool = False
    turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


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
        # engine id -> {request id -> the pending engine reply}, learnt from chunks
        self._engine_calls: dict[str, dict[str, asyncio.Future[Any]]] = {}
        self._lost: dict[str, str] = {}
        self.reroutes = 0
        self.tool_parser = tool_parser_for(
            settings.tool_parser, tokenizer.chat_template, tokenizer.model_type
        )
        self.reasoning_parser = reasoning_parser_for(
            settings.reasoning_parser, tokenizer.chat_template
        )
        self._turns: set[asyncio.Task[None]] = set()
        self._operator_keys = [key_digest(k) for k in settings.operator_keys()]
        self._chunk_prefix = ""
        """``<inbox>`` of the one subscription (``<inbox>.*``) every engine call's chunks
        arrive on; a call's ``stream_subject`` is ``<inbox>.<request id>``."""
        self._chunk_subscribing = asyncio.Lock()
        self._followers: dict[str, ChunkFollower] = {}
        """Request id -> the engine call its chunks feed (only while the call runs)."""

    def _session(self, opened: SessionOpened) -> GatewaySession:
        reasoning = self.reasoning_parser
        conversation = Conversation(
            render=self.tokenizer.render,
            encode=self.tokenizer.encode_text,
            end_of_turn=self.tokenizer.end_of_turn,
            reasoning=(lambda text: reasoning_of(reasoning, text)) if reasoning else None,
        )
        return GatewaySession(
            opened=opened, key_sha256=opened.key_sha256, conversation=conversation
        )

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
                if msg.metadata.sequence.stream >= last_seq:
                    break
        finally:
            await events.unsubscribe()
        for session_id, session in list(self.sessions.items()):
            if session.opened.group_id in closed_groups:
                del self.sessions[session_id]
                continue
            for turn in turns.get(session_id, []):
                node = NodeKey(turn.node_depth, turn.node_digest)
                self._add_node(session, node, turn.prompt_ids, turn.completion_ids)
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
                self.sessions[event.session_id] = self._session(event)
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
        app = Starlette(routes=routes)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(ClientDisconnect, self._client_left)
        app.add_exception_handler(404, self._not_found)
        app.add_exception_handler(405, self._method_not_allowed)
        return app

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

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
        self._require_operator(request)
        return self._models()

    def _models(self) -> Response:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "seamlessflow"}
            for name in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def list_models_in_session(self, request: Request) -> Response:
        self._authorized(request)
        return self._models()

    async def create_session(self, request: Request) -> Response:
        self._require_operator(request)
        body = parse(SessionCreate, await self._json(request, allow_empty=True))
        policy = self._check_model(body.policy, param="policy") if body.policy else self.models[0]
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
        )
        await self.bus.js_publish(self.bus.subjects.trajectory_event(session_id), opened)
        self.sessions[session_id] = self._session(opened)
        return JSONResponse(
            {
                "session_id": session_id,
                "base_url": f"{self.public_url}/s/{session_id}/v1",
                "api_key": api_key,
            },
            status_code=201,
        )

    async def report_reward(self, request: Request) -> Response:
        session = self._open_session(request)
        body = parse(RewardBody, await self._json(request))
        if body.policy:
            self._check_model(body.policy, param="policy")
        event = RewardReported(
            session_id=session.opened.session_id, reward=body.reward, policy=body.policy
        )
        await self.bus.js_publish(self.bus.subjects.trajectory_event(event.session_id), event)
        answer: dict[str, Any] = {"session_id": event.session_id, "reward": body.reward}
        if body.policy:
            answer["policy"] = body.policy
        return JSONResponse(answer)

    async def finish_session(self, request: Request) -> Response:
        session = self._open_session(request)
        async with session.lock:  # a turn still running is recorded before the finish
            if session.finished:
                raise ApiError(409, "session already finished", code="session_finished")
            event = SessionFinished(session_id=session.opened.session_id)
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
        if not self._is_operator(request):
            self._authorized(request)
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
        session = self._open_session(request)
        body = parse(ChatCompletionRequest, await self._json(request))
        turn, view = self.chat_turn(session, body, "gateway.chat_completion")
        if body.stream:
            return self._stream(turn, view)
        await self._run_turn(turn)
        return JSONResponse(view.response(len(turn.plan.prompt_ids), turn.choices))

    async def responses(self, request: Request) -> Response:
        return await create_response(self, request)

    def chat_turn(
        self, session: GatewaySession, body: ChatCompletionRequest, span: str
    ) -> tuple[Turn, ChatFormat]:
        """A validated chat request as a turn to run (templated on the session's tree,
        recorded as a chat turn) and the view of its choices. Checks everything before
        anything is stored; shared by chat completions and the Responses API."""
        policy = self._check_model(body.model)
        body.check()
        messages, tools = body.template_messages(), body.template_tools()
        opening = self._forced_call_opening(body)
        prompt = session.conversation.prompt_for(messages, tools)
        prompt_ids = prompt.ids
        if opening:  # inserted, not sampled: part of the prompt, never trained
            prompt_ids = prompt_ids + self.tokenizer.encode_text(opening)
        parser = self.tool_parser if body.parses_tool_calls else None
        # what may still become reasoning or a tool call is held back by the view
        plan = self._plan(
            body,
            policy,
            prompt_ids,
            hold_from="",
            forced_text=opening,
            structured_output=body.structured_output,
        )
        view = ChatFormat(
            model=body.model,
            token_text=self.tokenizer.token_text,
            token_bytes=self.tokenizer.token_bytes,
            include_usage=body.include_usage,
            parser=parser,
            reasoning=self.reasoning_parser,
            reasoning_opened=self._opens_reasoning(prompt_ids),
            logprobs=body.logprobs,
        )

        def node_of(choice: Choice) -> NodeKey:
            # each choice is a sibling node of the session's tree (same messages)
            return Conversation.node_key(messages, tools, view.message(choice))

        turn = Turn(session, plan, self._choices(plan), node_of, span)
        turn.parent_digest = prompt.parent.digest if prompt.parent is not None else ""
        return turn, view

    async def completions(self, request: Request) -> Response:
        session = self._open_session(request)
        body = parse(CompletionRequest, await self._json(request))
        policy = self._check_model(body.model)
        body.check()
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode_text(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ApiError(
                    400, f"prompt has token ids outside the vocabulary: {bad[:5]}", param="prompt"
                )
        plan = self._plan(body, policy, prompt_ids, hold_from="")
        view = CompletionFormat(
            model=body.model,
            token_text=self.tokenizer.token_text,
            include_usage=body.include_usage,
            logprobs=body.logprobs,
        )
        turn = Turn(session, plan, self._choices(plan), lambda _: None, "gateway.completion")
        if body.stream:
            return self._stream(turn, view)
        await self._run_turn(turn)
        return JSONResponse(view.response(len(prompt_ids), turn.choices))

    async def tokenize(self, request: Request) -> Response:
        """Outside a session: a chat prompt is tokenized as a session's first turn."""
        self._require_operator(request)
        return await self._tokenize(request, None)

    async def tokenize_in_session(self, request: Request) -> Response:
        """In a session: a chat prompt's ids are the ones its next turn would record
        (the stored ids of the history it continues, then its new messages)."""
        return await self._tokenize(request, self._open_session(request))

    async def detokenize(self, request: Request) -> Response:
        self._require_operator(request)
        return await self._detokenize(request)

    async def detokenize_in_session(self, request: Request) -> Response:
        self._open_session(request)
        return await self._detokenize(request)

    async def _tokenize(self, request: Request, session: GatewaySession | None) -> Response:
        body = parse(TokenizeRequest, await self._json(request))
        if body.model is not None:
            self._check_model(body.model)
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
        body = parse(DetokenizeRequest, await self._json(request))
        if body.model is not None:
            self._check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"tokens has ids outside the vocabulary: {bad[:5]}", param="tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=self.tokenizer.raw_text(body.tokens)).model_dump()
        )

    # ------------------------------------------------------------------ internals

    def _opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """The prompt ends inside an opened reasoning block (a template that opens it in
        the generation prompt): the answer starts with reasoning."""
        parser = self.reasoning_parser
        if parser is None:
            return False
        return self.tokenizer.raw_text(prompt_ids[-8:]).rstrip().endswith(parser.start)

    def _forced_call_opening(self, body: ChatCompletionRequest) -> str:
        """For tool_choice 'required' or a named function: the opening of a call in the
        tool parser's format, which the gateway appends to the prompt so that the model
        continues it (a named one up to its arguments). Those ids are inserted, not
        sampled: they are recorded as prompt ids (never trained), and every completion
        id is the engine's own sample of the unconstrained distribution, so its
        recorded logprob is exactly what the trainer recomputes."""
        if not body.forces_tool_call:
            return ""
        opening = getattr(self.tool_parser, "call_opening", None)
        if opening is None:
            raise ApiError(
                400,
                f"tool_choice {body.tool_choice!r} is not supported with the tool parser "
                f"{self.settings.tool_parser!r} (it cannot open a call)",
                param="tool_choice",
            )
        text = str(opening(body.forced_tool_name))
        # stop strings are searched in the answer's text, which starts with the opening
        inside = [stop for stop in body.stop_strings if stop in text]
        if inside:
            raise ApiError(
                400,
                f"stop string {inside[0]!r} occurs in the forced tool call's opening {text!r}",
                param="stop",
            )
        return text

    def _plan(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        policy: str,
        prompt_ids: list[int],
        hold_from: str,
        forced_text: str = "",
        structured_output: str = "",
    ) -> Plan:
        stop = body.stop_strings
        return Plan(
            policy=policy,
            prompt_ids=prompt_ids,
            max_tokens=self._check_budget(
                prompt_ids, body.token_budget(self.settings.default_max_tokens), body.budget_param
            ),
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            top_logprobs=body.k_top_logprobs,
            stop=stop,
            hold_from=hold_from if body.stream else "",
            engine_stream=body.stream or bool(stop),
            include_usage=body.include_usage,
            forced_text=forced_text,
            structured_output=structured_output,
        )

    def _choices(self, plan: Plan) -> list[Choice]:
        decode: Callable[[list[int]], str] = self.tokenizer.decode_completion
        if plan.forced_text:  # the agent's text: the inserted opening, then the samples
            decode = _after(plan.forced_text, decode)
        return [Choice(i, decode, plan.stop, plan.hold_from) for i in range(plan.n)]

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
        events = events or (lambda producer, updated: self._events(turn, view, producer, updated))
        return EventStream(events(producer, updated), on_close=producer.cancel)

    async def _events(
        self,
        turn: Turn,
        view: ChatFormat | CompletionFormat,
        producer: asyncio.Task[None],
        updated: asyncio.Event,
    ) -> AsyncIterator[bytes]:
        for chunk in view.opening(turn.choices):
            yield _sse(chunk)
        async for _ in turn_updates(producer, updated):
            for choice in turn.choices:
                progress = view.progress(choice)
                if progress is not None:
                    yield _sse(progress)
        try:
            producer.result()
        except ApiError as exc:  # the response has started: the error is an event
            yield _sse(exc.body())
            return
        for choice in turn.choices:
            for chunk in view.closing(choice):
                yield _sse(chunk)
        if turn.plan.include_usage:
            obj = "chat.completion.chunk" if isinstance(view, ChatFormat) else "text_completion"
            yield _sse(view.usage_chunk(obj, len(turn.plan.prompt_ids), turn.choices))
        yield b"data: [DONE]\n\n"

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
                            group.create_task(self._generate(turn, choice))
                except ExceptionGroup as errors:
                    api_errors = [e for e in errors.exceptions if isinstance(e, ApiError)]
                    if api_errors:
                        raise api_errors[0] from None
                    raise
                for choice in turn.choices:
                    node = turn.node_of(choice)
                    await self._record(session, plan, choice, node, turn.parent_digest)
                    if node is not None:  # stored first: a restart rebuilds the same tree
                        self._add_node(session, node, plan.prompt_ids, choice.token_ids)

    def _add_node(
        self, session: GatewaySession, node: NodeKey, prompt_ids: list[int], completion: list[int]
    ) -> None:
        ids = [*prompt_ids, *completion]
        raw = self.tokenizer.raw_text(completion)
        session.conversation.restore(node, ids, raw, prompt_length=len(prompt_ids))

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
        await self.bus.js_publish(self.bus.subjects.trajectory_event(turn.session_id), turn)
        session.turns += 1

    async def _generate(self, turn: Turn, choice: Choice) -> None:
        """Run one choice to completion, resuming across engine interruptions.

        The single place engine calls happen. An interrupted engine returns the tokens
        so far with finish_reason "abort"; we re-submit prompt + those exact ids for the
        remaining budget, to any engine, and (streaming) the choice simply continues.
        A matched stop string ends the choice (its engine request is aborted). Being
        cancelled (the client left) aborts the engine request and never re-submits.
        """
        plan = turn.plan
        engine_wait_deadline = time.monotonic() + self.settings.engine_wait_s
        resume_on = ""
        """The engine an interrupted request was handed over to (rebalance on lend)."""
        while True:
            request_id = uuid.uuid4().hex
            request = GenerateRequest(
                request_id=request_id,
                session_id=turn.session.opened.session_id,
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
                    prefix = self.bus.nc.new_inbox()
                    await self.bus.nc.subscribe(f"{prefix}.*", cb=self.on_chunk)
                    self._chunk_prefix = prefix
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
        instead of waiting for a reply that will never come."""
        if change.phase != "dead":
            return
        calls = self._engine_calls.pop(change.resource_id, {})
        # Requests not yet confirmed by any engine may have been on the dead one: abort
        # them everywhere (a live engine drops its copy) and re-submit them too.
        unconfirmed = self._engine_calls.pop(UNASSIGNED, {})
        if calls or unconfirmed:
            log.warning(
                "engine %s died; re-routing %d requests (+%d unconfirmed)",
                change.resource_id,
                len(calls),
                len(unconfirmed),
            )
        for request_id in unconfirmed:
            await self._abort(request_id, f"engine {change.resource_id} died")
        for request_id, reply_task in {**calls, **unconfirmed}.items():
            self._lost[request_id] = change.resource_id
            reply_task.cancel()

    def _forget_call(self, request_id: str) -> None:
        for calls in self._engine_calls.values():
            calls.pop(request_id, None)

    async def _abort(self, request_id: str, reason: str) -> None:
        """Free the engine slot of a request whose answer is no longer needed."""
        await self.bus.publish(
            self.bus.subjects.engine_abort(), AbortGeneration(request_id=request_id, reason=reason)
        )

    def _authorized(self, request: Request) -> GatewaySession | None:
        """The request's session if the request carries that session's key (None: it
        has finished and its conversation was dropped)."""
        session_id = request.path_params["session_id"]
        session = self.sessions.get(session_id)
        digest = session.key_sha256 if session is not None else self.finished.get(session_id)
        if digest is None:
            raise ApiError(404, f"session {session_id!r} does not exist", code="session_not_found")
        if not carries_key(request, [digest]):
            raise unauthorized(
                "this session's API key is required (the api_key POST /sessions returned)"
            )
        return session

    def _open_session(self, request: Request) -> GatewaySession:
        """The request's session, which must not have finished (409)."""
        session = self._authorized(request)
        if session is None or session.finished:
            session_id = request.path_params["session_id"]
            raise ApiError(409, f"session {session_id!r} has finished", code="session_finished")
        return session

    def _is_operator(self, request: Request) -> bool:
        return carries_key(request, self._operator_keys)

    def _require_operator(self, request: Request) -> None:
        """Opening sessions and listing models: open without operator keys configured."""
        if self._operator_keys and not self._is_operator(request):
            raise unauthorized("an operator API key is required (SF_GATEWAY_API_KEYS)")

    def _check_model(self, model: str, param: str = "model") -> str:
        """The policy a model name picks (they are the same name)."""
        if model not in self.models:
            raise ApiError(
                404,
                f"model {model!r} does not exist; served: {self.models}",
                param=param,
                code="model_not_found",
            )
        return model

    def _check_budget(self, prompt_ids: list[int], max_tokens: int, param: str | None) -> int:
        """The engine budget: the agent's (``param``), which must fit in the context
        with the prompt (a 400 naming it otherwise, as vLLM's server answers), or the
        default clipped to the room the prompt leaves."""
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        limit = self.settings.max_context
        if len(prompt_ids) >= limit:
            raise ApiError(
                400,
                f"prompt has {len(prompt_ids)} tokens; the context is {limit}",
                code="context_length_exceeded",
            )
        if param is not None and len(prompt_ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"{param}: the context is {limit} tokens; the prompt has {len(prompt_ids)}, "
                f"so at most {limit - len(prompt_ids)} can be generated, not {max_tokens}",
                param=param,
                code="context_length_exceeded",
            )
        return min(max_tokens, limit - len(prompt_ids))

    async def _json(self, request: Request, *, allow_empty: bool = False) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        # Read piece by piece: a chunked body (no length) is refused once it crosses the
        # limit instead of being buffered whole.
        received = bytearray()
        async for piece in request.stream():
            received += piece
            if len(received) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        raw = bytes(received)
        if not raw.strip():
            if allow_empty:
                return {}
            raise ApiError(400, "request body is empty; expected JSON")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def carries_key(request: Request, digests: list[str]) -> bool:
    """The request's bearer key is one of ``digests`` (compared in constant time)."""
    key = bearer_key(request)
    if key is None:
        return False
    digest = key_digest(key)
    return any(hmac.compare_digest(digest, known) for known in digests)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", type_="authentication_error")


def bearer_key(request: Request) -> str | None:
    """The key of ``Authorization: Bearer <key>`` (what OpenAI clients send)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


Events = Callable[[asyncio.Task[None], asyncio.Event], AsyncIterator[bytes]]
"""A streamed turn's SSE body, from its producer task and its update signal."""


async def turn_updates(producer: asyncio.Task[None], updated: asyncio.Event) -> AsyncIterator[None]:
    """Yields once now, after every update of a streamed turn, and once when it is done
    (then ends): what its choices hold may be read at each step."""
    while True:
        updated.clear()  # before reading: an update while the caller reads is not lost
        yield
        if producer.done():
            return
        waiter = asyncio.ensure_future(updated.wait())
        try:
            await asyncio.wait({waiter, producer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()


def _after(opening: str, decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    return lambda ids: opening + decode(ids)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass(frozen=True)
class Plan:
    """What every choice of one request asks the engines for."""

    policy: str
    """Whose engines answer (the request's ``model``)."""
    prompt_ids: list[int]
    max_tokens: int
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    top_logprobs: int
    stop: tuple[str, ...]
    hold_from: str
    """While streaming, text from this marker on (a tool call) is held until parsed."""
    engine_stream: bool
    """Engines stream chunks: for SSE, and to catch stop strings early."""
    include_usage: bool
    forced_text: str = ""
    """The opening of a forced tool call, whose ids end ``prompt_ids``: the start of
    every choice's text (the agent's answer), not of its engine-generated ids."""
    structured_output: str = ""
    """The engines' constraint for ``response_format`` (empty: none); its turns are
    recorded as ``constrained``."""

    def seed_for(self, index: int) -> int | None:
        """Choice i of a seeded request uses seed + i (modulo 2**64): n choices differ,
        and a repeat of the request (streamed or not) gives the same n answers."""
        if self.seed is None:
            return None
        seed = self.seed + index  # past the largest seed it wraps around
        return seed if seed in SEEDS else seed - 2**64


@dataclass
class Turn:
    """One request in flight: its session, plan, choices, and the tree node of each."""

    session: GatewaySession
    plan: Plan
    choices: list[Choice]
    node_of: Callable[[Choice], NodeKey | None]
    """The node of the session's tree a recorded choice becomes (None: no tree)."""
    span: str
    on_update: Callable[[], None] = lambda: None
    parent_digest: str = ""
    """The tree node whose messages this request continues (``Prompt.parent``)."""


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends (the client leaving too)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


UNASSIGNED = ""
"""Key of ``Gateway._engine_calls`` for requests whose engine is not known yet."""


@dataclass
class ChunkFollower:
    """One engine call's chunks as they arrive (``Gateway.on_chunk``)."""

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


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service skeleton owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """The gateway's bound socket; a port taken or a host not on this machine is a
    setting to change, not a fault to retry."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
        await ctx.bus.subscribe(ctx.subjects.sched_phase(), PhaseChanged, self.gateway.on_phase)
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
        listening = _listen(self.settings.host, self.settings.port)
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
