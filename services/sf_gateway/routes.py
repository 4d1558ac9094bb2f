"""The gateway's HTTP routes: each request checked (keys, body), then handed to the part
that owns it; ``Gateway`` builds those parts and the Starlette app.

The parts: ``session_table`` (open and finished sessions, rebuilt from and followed on
the trajectory stream), ``auth`` (session and operator keys), ``request_body`` (bounded
JSON bodies), ``turns`` (a validated request as a turn: model, budget, plan, choices),
``turn_runner`` (a turn run on the engines and recorded, or streamed), ``engine_client``
(the engine calls, their chunks, re-routing and resuming), ``responses_api`` (the
Responses API as chat turns). The subjects and the HTTP API are listed in
``sf_gateway.service``.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from seamlessflow import telemetry
from seamlessflow.bus import BrokerUnavailable, Bus, NoResponder, RemoteError
from seamlessflow.protocol import (
    RewardReported,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    encode,
)
from sf_gateway.auth import Access, key_digest
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
from sf_gateway.responses import logprob_token
from sf_gateway.responses_api import create_response
from sf_gateway.session_table import SessionTable
from sf_gateway.sessions import GatewaySession
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer
from sf_gateway.tool_parsers import tool_parser_for
from sf_gateway.turn_runner import TurnRunner
from sf_gateway.turns import TurnPlanner

log = logging.getLogger(__name__)


class Gateway:
    """The HTTP side of the gateway: its routes, over the parts it builds."""

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
        self.models = policies or [bus.subjects.policy]
        """The run's policies, each served as the model of the same name; a request's
        ``model`` picks the engines (and so the weight version line) that answer it."""
        self.public_url = ""
        self.engines = EngineClient(settings, bus, tokenizer)
        tool_parser = tool_parser_for(
            settings.tool_parser, tokenizer.chat_template, tokenizer.model_type
        )
        reasoning_parser = reasoning_parser_for(settings.reasoning_parser, tokenizer.chat_template)
        self.planner = TurnPlanner(settings, tokenizer, self.models, tool_parser, reasoning_parser)
        self.session_table = SessionTable(settings, bus, tokenizer, reasoning_parser)
        self.sessions = self.session_table.sessions
        """Open sessions (the table's own dict)."""
        self.finished = self.session_table.finished
        """Finished sessions, oldest first: id -> key digest (the table's own dict)."""
        self.access = Access(self.sessions, self.finished, settings.operator_keys())
        self.runner = TurnRunner(bus, self.engines, tokenizer, self.session_table)

    async def session(self, request: Request) -> GatewaySession | None:
        """The request's session (``Access.session_of``), caught up first."""
        await self.session_table.catch_up(request.path_params["session_id"])
        return self.access.session_of(request)

    async def open_session(self, request: Request) -> GatewaySession:
        """The request's open session (``Access.open_session_of``), caught up first."""
        await self.session_table.catch_up(request.path_params["session_id"])
        return self.access.open_session_of(request)

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
        self.session_table.open(opened)
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
            self.session_table.retire(session)
        return JSONResponse({"session_id": event.session_id, "turns": session.turns})

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
            return self.runner.stream(turn, view)
        await self.runner.run(turn)
        return JSONResponse(view.response(len(turn.plan.prompt_ids), turn.choices))

    async def responses(self, request: Request) -> Response:
        session = await self.open_session(request)
        return await create_response(request, session, self.planner, self.runner)

    async def completions(self, request: Request) -> Response:
        session = await self.open_session(request)
        body = parse(CompletionRequest, await read_json(request))
        turn, view = self.planner.completion_turn(session, body)
        if body.stream:
            return self.runner.stream(turn, view)
        await self.runner.run(turn)
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
