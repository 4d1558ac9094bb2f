"""The gateway's HTTP API as an OpenAPI 3.1 document (``GET /openapi.json``).

Built from the models the code itself uses, never written by hand: request bodies are
the pydantic models the routes validate with (``sf_gateway.openai_api``), the OpenAI
routes' answers are the ``openai`` package's own response types (what an OpenAI client
parses), the export is the protocol's ``SessionExport``, and the gateway's other
answers are the small models below. The test suite checks every answer the gateway
gives against these same types (tests/support/openai_shapes.py), and that every route the app
serves is in the document, so the document cannot drift from the code unnoticed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, ConfigDict, RootModel
from pydantic.json_schema import models_json_schema

from seamlessflow.protocol import SessionExport
from sf_gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    FinishBody,
    RewardBody,
    SessionCreate,
    TokenizeRequest,
    TokenizeResponse,
)
from sf_gateway.responses_api import ResponsesRequest

REF = "#/components/schemas/{model}"
STRUCT_REF = "#/components/schemas/{name}"


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionCreated(_Answer):
    """Answer of ``POST /sessions``."""

    session_id: str
    base_url: str
    """The agent's OpenAI ``base_url`` (``<gateway>/s/<session>/v1``)."""
    api_key: str
    """The session's key, returned only here; its routes take only this key."""


class RewardRecorded(_Answer):
    session_id: str
    reward: float
    policy: str | None = None
    """Present when the reward was given for one policy."""


class SessionClosed(_Answer):
    session_id: str
    turns: int


class Health(_Answer):
    status: Literal["ok"]
    sessions: int
    """Open sessions."""


class ModelList(_Answer):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Answer):
    """Every 4xx/5xx answer (OpenAI's error format); in a started SSE stream, an event."""

    error: ErrorDetail


class CompletionChunkChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]
    """None until the choice's last chunk."""


class CompletionChunk(Completion):
    """One event of a streamed completion: the SDK reads it as a ``Completion``, whose
    type (unlike OpenAI's and vLLM's streams) has no null ``finish_reason``."""

    choices: list[CompletionChunkChoice]  # type: ignore[assignment]


class ResponseEvent(RootModel[ResponseStreamEvent]):
    """One server-sent event of a streamed Responses API turn (the ``openai`` union)."""


Auth = Literal["none", "session", "operator", "session_or_operator"]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    auth: Auth
    answer: Any
    """The 2xx body's type (a pydantic model, an ``openai`` type or a msgspec Struct)."""
    request: type[BaseModel] | None = None
    status: int = 200
    stream: Any = None
    """With ``stream: true``: the type of each server-sent event's data."""
    errors: tuple[int, ...] = field(default=(400,))


_SESSION_ERRORS = (400, 401, 404, 409)
OPERATIONS = (
    Operation("get", "/healthz", "Liveness and the number of open sessions", "none", Health,
              errors=()),
    Operation("get", "/openapi.json", "This document", "none", dict, errors=()),
    Operation("get", "/v1/models", "The served models (the run's policies)", "operator",
              ModelList, errors=(401,)),
    Operation("post", "/sessions", "Open a session: its OpenAI base_url and key", "operator",
              SessionCreated, SessionCreate, status=201, errors=(400, 401, 404)),
    Operation("post", "/sessions/{session_id}/reward", "Report the session's reward",
              "session", RewardRecorded, RewardBody, errors=_SESSION_ERRORS),
    Operation("post", "/sessions/{session_id}/finish", "Finish the session", "session",
              SessionClosed, FinishBody, errors=_SESSION_ERRORS),
    Operation("get", "/sessions/{session_id}/export",
              "Every branch of the session as training samples", "session_or_operator",
              SessionExport, errors=(400, 401, 404, 503)),
    Operation("get", "/s/{session_id}/v1/models", "The served models", "session", ModelList,
              errors=(401, 404)),
    Operation("post", "/s/{session_id}/v1/chat/completions", "A chat turn, recorded",
              "session", ChatCompletion, ChatCompletionRequest, stream=ChatCompletionChunk,
              errors=(*_SESSION_ERRORS, 413, 503)),
    Operation("post", "/s/{session_id}/v1/completions", "A completion, recorded", "session",
              Completion, CompletionRequest, stream=CompletionChunk,
              errors=(*_SESSION_ERRORS, 413, 503)),
    Operation("post", "/s/{session_id}/v1/responses",
              "A Responses API turn, recorded as a chat turn", "session", Response,
              ResponsesRequest, stream=ResponseEvent, errors=(*_SESSION_ERRORS, 413, 503)),
    Operation("post", "/s/{session_id}/tokenize",
              "A prompt's ids exactly as the session's next turn would record them", "session",
              TokenizeResponse, TokenizeRequest, errors=_SESSION_ERRORS),
    Operation("post", "/s/{session_id}/detokenize", "Token ids to text", "session",
              DetokenizeResponse, DetokenizeRequest, errors=_SESSION_ERRORS),
    Operation("post", "/tokenize", "A prompt's ids as a session's first turn would record",
              "operator", TokenizeResponse, TokenizeRequest, errors=(400, 401, 404)),
    Operation("post", "/detokenize", "Token ids to text", "operator", DetokenizeResponse,
              DetokenizeRequest, errors=(400, 401, 404)),
)  # fmt: skip

_SECURITY: dict[str, list[dict[str, list[str]]]] = {
    "none": [],
    "session": [{"sessionKey": []}],
    "operator": [{}, {"operatorKey": []}],  # open unless SF_GATEWAY_API_KEYS is set
    "session_or_operator": [{"sessionKey": []}, {"operatorKey": []}],
}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once: it depends on the code only)."""
    pydantic_types: set[type[BaseModel]] = {ErrorBody}
    structs: set[type[msgspec.Struct]] = set()
    for op in OPERATIONS:
        for kind in (op.answer, op.stream, op.request):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                pydantic_types.add(kind)
            elif isinstance(kind, type) and issubclass(kind, msgspec.Struct):
                structs.add(kind)
    ordered = sorted(pydantic_types, key=lambda t: (t.__module__, t.__qualname__))
    # request bodies as validated; answers as an OpenAI client reads them
    requests = {op.request for op in OPERATIONS if op.request is not None}
    names, defs = models_json_schema(
        [(t, "validation" if t in requests else "serialization") for t in ordered],
        ref_template=REF,
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    refs: dict[Any, dict[str, Any]] = {t: names[(t, mode)] for (t, mode) in names}
    _, struct_schemas = msgspec.json.schema_components(
        sorted(structs, key=lambda t: t.__qualname__), ref_template=STRUCT_REF
    )
    for name, schema in struct_schemas.items():
        if name in schemas and schemas[name] != schema:
            raise ValueError(f"two different schemas named {name}")
        schemas[name] = schema
    for struct in structs:
        refs[struct] = {"$ref": STRUCT_REF.format(name=struct.__name__)}

    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        answer = refs[op.answer] if op.answer is not dict else {"type": "object"}
        content: dict[str, Any] = {"application/json": {"schema": answer}}
        if op.stream is not None:
            content["text/event-stream"] = {
                "schema": {
                    "type": "string",
                    "description": "With stream=true: server-sent events, each `data:` "
                    f"one {op.stream.__name__} (x-sse-data; an ErrorBody if the turn fails "
                    "after the stream started), then `data: [DONE]`",
                },
                "x-sse-data": refs[op.stream],
            }
        responses: dict[str, Any] = {str(op.status): {"description": "OK", "content": content}}
        for status in op.errors:
            responses[str(status)] = {
                "description": "OpenAI-style error",
                "content": {"application/json": {"schema": refs[ErrorBody]}},
            }
        operation: dict[str, Any] = {
            "summary": op.summary,
            "operationId": op.method
            + op.path.replace("/", "_").replace("{", "").replace("}", "").replace(".", "_"),
            "security": _SECURITY[op.auth],
            "responses": responses,
        }
        if "{session_id}" in op.path:
            operation["parameters"] = [
                {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        if op.request is not None:
            operation["requestBody"] = {
                # POST /sessions and /finish: {} or nothing
                "required": op.request not in (SessionCreate, FinishBody),
                "content": {"application/json": {"schema": refs[op.request]}},
            }
        paths.setdefault(op.path, {})[op.method] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "seamlessflow rollout-gateway",
            "version": "1",
            "description": "OpenAI-compatible gateway: each session's base_url serves the "
            "OpenAI routes; every answer is recorded for training.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "sessionKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The api_key POST /sessions returned",
                },
                "operatorKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "One of SF_GATEWAY_API_KEYS",
                },
            },
        },
    }
