"""rollout-gateway: the agent-facing, OpenAI-compatible data plane.

HTTP (agents):
- ``POST /sessions`` -> ``{session_id, base_url}``; the agent's OpenAI client uses
  ``base_url`` (``.../s/<session>/v1``) and nothing else changes in the agent
- ``POST /s/<session>/v1/chat/completions``, ``POST /s/<session>/v1/completions``,
  ``GET /s/<session>/v1/models``, ``GET /v1/models``
- ``POST /sessions/<session>/reward``, ``POST /sessions/<session>/finish``
- ``GET /sessions/<session>/export``: every branch of the session as training samples
- ``GET /healthz``

Consumes:
- ``sf.<run>.engine.generate`` replies (GenerateReply) from engine workers
Produces:
- ``sf.<run>.engine.generate`` requests (GenerateRequest, queue group ``engines``)
- ``sf.<run>.traj.event.<session>`` (JetStream: SessionOpened, TurnRecorded,
  RewardReported, SessionFinished)

Invariants: the recorded TurnRecorded holds exactly the ids the engine consumed and
produced, with their logprobs and versions, and is durably stored before the agent
gets its answer. A request that fails validation stores nothing. An engine
interruption (finish_reason "abort") is resumed here: prompt + partial ids are
re-submitted (never re-tokenized) until the answer is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from seamlessflow import telemetry
from seamlessflow.bus import Bus, NoResponder, RemoteError
from seamlessflow.protocol import (
    GenerateReply,
    GenerateRequest,
    RewardReported,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    TurnRecorded,
    encode,
)
from seamlessflow.service import ServiceContext
from sf_gateway.config import GatewaySettings
from sf_gateway.conversation import Conversation
from sf_gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    RewardBody,
    SessionCreate,
    parse,
)
from sf_gateway.templating import ChatTokenizer

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class GatewaySession:
    opened: SessionOpened
    conversation: Conversation
    finished: bool = False
    turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    engine_id: str
    resumes: int


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, tokenizer: ChatTokenizer) -> None:
        self.settings = settings
        self.bus = bus
        self.tokenizer = tokenizer
        self.sessions: dict[str, GatewaySession] = {}
        self.models = [m.strip() for m in settings.served_models.split(",") if m.strip()]
        self.public_url = ""

    # ------------------------------------------------------------------ HTTP app

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/sessions", self.create_session, methods=["POST"]),
            Route("/sessions/{session_id}/reward", self.report_reward, methods=["POST"]),
            Route("/sessions/{session_id}/finish", self.finish_session, methods=["POST"]),
            Route("/sessions/{session_id}/export", self.export_session, methods=["GET"]),
            Route("/s/{session_id}/v1/models", self.list_models_in_session, methods=["GET"]),
            Route("/s/{session_id}/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/s/{session_id}/v1/completions", self.completions, methods=["POST"]),
        ]
        app = Starlette(routes=routes)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(404, self._not_found)
        app.add_exception_handler(405, self._method_not_allowed)
        return app

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    async def _method_not_allowed(self, request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} not allowed on {request.url.path}").response()

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(self.sessions)})

    async def list_models(self, request: Request) -> Response:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "seamlessflow"}
            for name in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def list_models_in_session(self, request: Request) -> Response:
        self._session(request)
        return await self.list_models(request)

    async def create_session(self, request: Request) -> Response:
        body = parse(SessionCreate, await self._json(request, allow_empty=True))
        session_id = "s" + uuid.uuid4().hex
        opened = SessionOpened(
            session_id=session_id,
            task_id=body.task_id,
            group_id=body.group_id or session_id,
            sample_index=body.sample_index,
            group_size=body.group_size,
            reference=body.reference,
            reward_fn=body.reward_fn,
            policy=body.policy,
        )
        await self.bus.js_publish(self.bus.subjects.trajectory_event(session_id), opened)
        conversation = Conversation(
            render=self.tokenizer.render,
            encode=self.tokenizer.encode_text,
            end_of_turn=self.tokenizer.end_of_turn,
        )
        self.sessions[session_id] = GatewaySession(opened=opened, conversation=conversation)
        return JSONResponse(
            {"session_id": session_id, "base_url": f"{self.public_url}/s/{session_id}/v1"},
            status_code=201,
        )

    async def report_reward(self, request: Request) -> Response:
        session = self._session(request, open_only=True)
        body = parse(RewardBody, await self._json(request))
        event = RewardReported(session_id=session.opened.session_id, reward=body.reward)
        await self.bus.js_publish(self.bus.subjects.trajectory_event(event.session_id), event)
        return JSONResponse({"session_id": event.session_id, "reward": body.reward})

    async def finish_session(self, request: Request) -> Response:
        session = self._session(request, open_only=True)
        async with session.lock:  # a turn still running is recorded before the finish
            if session.finished:
                raise ApiError(409, "session already finished", code="session_finished")
            event = SessionFinished(session_id=session.opened.session_id)
            await self.bus.js_publish(self.bus.subjects.trajectory_event(event.session_id), event)
            session.finished = True
        # The record lives in JetStream; the gateway only needs to refuse further turns.
        return JSONResponse({"session_id": event.session_id, "turns": session.turns})

    async def export_session(self, request: Request) -> Response:
        """Every branch of the session as training samples (served by trajectory)."""
        session_id = request.path_params["session_id"]
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
        session = self._session(request, open_only=True)
        body = parse(ChatCompletionRequest, await self._json(request))
        self._check_model(body.model)
        body.check_supported()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for message in messages:
            message.setdefault("content", "")
        prompt_ids = self._chat_prompt_ids(session, messages, None)
        max_tokens = self._check_budget(
            prompt_ids, body.token_budget(self.settings.default_max_tokens)
        )
        with tracer.start_as_current_span(
            "gateway.chat_completion", attributes={"session.id": session.opened.session_id}
        ):
            generation, text = await self._run_turn(session, prompt_ids, max_tokens, body)
        session.conversation.record(
            messages,
            None,
            {"role": "assistant", "content": text},
            prompt_ids,
            generation.token_ids,
            self.tokenizer.raw_text(generation.token_ids),
        )
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": _finish_reason(generation.finish_reason),
            "logprobs": None,
        }
        if body.logprobs:
            choice["logprobs"] = {"content": self._logprob_content(generation)}
        return JSONResponse(
            {
                "id": "chatcmpl-" + uuid.uuid4().hex,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [choice],
                "usage": _usage(prompt_ids, generation),
            }
        )

    async def completions(self, request: Request) -> Response:
        session = self._session(request, open_only=True)
        body = parse(CompletionRequest, await self._json(request))
        self._check_model(body.model)
        body.check_supported()
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode_text(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ApiError(400, f"prompt has token ids outside the vocabulary: {bad[:5]}",
                               param="prompt")  # fmt: skip
        max_tokens = self._check_budget(
            prompt_ids, body.token_budget(self.settings.default_max_tokens)
        )
        with tracer.start_as_current_span(
            "gateway.completion", attributes={"session.id": session.opened.session_id}
        ):
            generation, text = await self._run_turn(session, prompt_ids, max_tokens, body)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": _finish_reason(generation.finish_reason),
            "logprobs": None,
        }
        if body.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [self.tokenizer.token_text(t) for t in generation.token_ids],
                "token_logprobs": generation.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        return JSONResponse(
            {
                "id": "cmpl-" + uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [choice],
                "usage": _usage(prompt_ids, generation),
            }
        )

    # ------------------------------------------------------------------ internals

    def _chat_prompt_ids(
        self,
        session: GatewaySession,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        """The stored ids of the longest matching history + the new messages templated
        (the session's prefix tree; history is never re-tokenized)."""
        return session.conversation.prompt_for(messages, tools).ids

    async def _run_turn(
        self,
        session: GatewaySession,
        prompt_ids: list[int],
        max_tokens: int,
        body: ChatCompletionRequest | CompletionRequest,
    ) -> tuple[Generation, str]:
        async with session.lock:
            if session.finished:
                raise ApiError(409, "session already finished", code="session_finished")
            generation = await self._generate(session, prompt_ids, max_tokens, body)
            text = self.tokenizer.decode_completion(generation.token_ids)
            turn = TurnRecorded(
                session_id=session.opened.session_id,
                turn_index=session.turns,
                request_id=uuid.uuid4().hex,
                engine_id=generation.engine_id,
                prompt_ids=prompt_ids,
                completion_ids=generation.token_ids,
                logprobs=generation.logprobs,
                versions=generation.versions,
                finish_reason=generation.finish_reason,
                completion_text=text,
            )
            await self.bus.js_publish(self.bus.subjects.trajectory_event(turn.session_id), turn)
            session.turns += 1
        return generation, text

    async def _generate(
        self,
        session: GatewaySession,
        prompt_ids: list[int],
        max_tokens: int,
        body: ChatCompletionRequest | CompletionRequest,
    ) -> Generation:
        """Run one generation to completion, resuming across engine interruptions.

        An interrupted engine returns the tokens so far with finish_reason "abort"; we
        re-submit prompt + those exact ids for the remaining budget, to any engine.
        """
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumes = 0
        engine_wait_deadline = time.monotonic() + self.settings.engine_wait_s
        while True:
            request = GenerateRequest(
                request_id=uuid.uuid4().hex,
                session_id=session.opened.session_id,
                prompt_ids=prompt_ids + token_ids,
                max_tokens=max_tokens - len(token_ids),
                temperature=body.temperature,
                top_p=body.top_p,
                stop_token_ids=list(self.tokenizer.stop_token_ids),
                seed=body.seed,
            )
            try:
                reply = await self.bus.request(
                    self.bus.subjects.engine_generate(),
                    request,
                    GenerateReply,
                    timeout=self.settings.generate_timeout_s,
                )
            except NoResponder as exc:
                if time.monotonic() < engine_wait_deadline:
                    await asyncio.sleep(0.2)
                    continue
                raise ApiError(503, f"no engine available: {exc}", type_="server_error",
                               code="engine_unavailable") from None  # fmt: skip
            except RemoteError as exc:
                if exc.code == "bad_request":
                    raise ApiError(400, exc.message) from None
                raise ApiError(503, f"engine error: {exc.message}", type_="server_error") from None
            token_ids += reply.token_ids
            logprobs += reply.logprobs
            versions += reply.versions
            if reply.finish_reason != "abort" or len(token_ids) >= max_tokens:
                finish = reply.finish_reason if reply.finish_reason != "abort" else "length"
                return Generation(token_ids, logprobs, versions, finish, reply.engine_id, resumes)
            resumes += 1
            with tracer.start_as_current_span(
                "gateway.resume",
                attributes={"partial_tokens": len(token_ids), "engine.id": reply.engine_id},
            ):
                pass

    def _logprob_content(self, generation: Generation) -> list[dict[str, Any]]:
        content = []
        for token_id, logprob in zip(generation.token_ids, generation.logprobs, strict=True):
            text = self.tokenizer.token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                }
            )
        return content

    def _session(self, request: Request, *, open_only: bool = False) -> GatewaySession:
        session_id = request.path_params["session_id"]
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"session {session_id!r} does not exist", code="session_not_found")
        if open_only and session.finished:
            raise ApiError(409, f"session {session_id!r} has finished", code="session_finished")
        return session

    def _check_model(self, model: str) -> None:
        if model not in self.models:
            raise ApiError(404, f"model {model!r} does not exist; served: {self.models}",
                           param="model", code="model_not_found")  # fmt: skip

    def _check_budget(self, prompt_ids: list[int], max_tokens: int) -> int:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        limit = self.settings.max_context
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the context is {limit}",
                           code="context_length_exceeded")  # fmt: skip
        # Like vLLM: a budget that would overflow the context is clipped, not refused.
        return min(max_tokens, limit - len(prompt_ids))

    async def _json(self, request: Request, *, allow_empty: bool = False) -> Any:
        length = request.headers.get("content-length")
        if length is not None and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
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


def _finish_reason(reason: str) -> str:
    return "stop" if reason == "stop" else "length"


def _usage(prompt_ids: list[int], generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(generation.token_ids),
        "total_tokens": len(prompt_ids) + len(generation.token_ids),
    }


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service skeleton owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


class GatewayService:
    name = "gateway"

    def __init__(self, settings: GatewaySettings | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.bound_port: int | None = None
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the gateway needs SF_MODEL_DIR (the tokenizer lives there)")
        tokenizer = await asyncio.to_thread(ChatTokenizer, ctx.mesh.model_dir)
        self.gateway = Gateway(self.settings, ctx.bus, tokenizer)
        config = uvicorn.Config(
            self.gateway.app(),
            host=self.settings.host,
            port=self.settings.port,
            log_level="warning",
            lifespan="off",
            access_log=False,
        )
        server = _Server(config)

        async def exit_on_stop() -> None:
            # uvicorn finishes in-flight requests when asked to exit; cancelling it would not
            await ctx.stopping.wait()
            server.should_exit = True

        async def announce() -> None:
            while not server.started:  # noqa: ASYNC110 (uvicorn offers no started event)
                await asyncio.sleep(0.02)
            self.bound_port = server.servers[0].sockets[0].getsockname()[1]
            self.gateway.public_url = (
                self.settings.public_url.rstrip("/")
                or f"http://{self.settings.host}:{self.bound_port}"
            )
            log.info("gateway listening on %s", self.gateway.public_url)
            self.ready.set()

        async with asyncio.TaskGroup() as group:
            group.create_task(server.serve())
            group.create_task(announce())
            group.create_task(exit_on_stop())
