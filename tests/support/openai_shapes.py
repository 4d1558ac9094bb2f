"""Every answer of the gateway checked against the types an OpenAI client parses.

``check_body`` validates one body with the ``openai`` package's own response types in
pydantic's strict JSON mode (no coercion: ``"1"`` is no int), and beyond what the SDK's
lenient models require: no field the type does not know (``ALLOWED_EXTRAS`` aside), and
the fields OpenAI's API always sends (required, possibly null) present. The gateway's
other answers are checked against the models of its OpenAPI document
(``sf_gateway.openapi``), and every error body against OpenAI's error format.

``ShapeChecker.wrap`` wraps the gateway's ASGI app so that every answer it gives in a
test (any client: httpx, the SDK, sync or async, streamed or not) is checked; the
``openai_shapes`` fixture (tests/conftest.py) fails the test on any mismatch.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from seamlessflow.protocol import SessionExport
from sf_gateway.openai_api import DetokenizeResponse, TokenizeResponse
from sf_gateway.openapi import (
    OPERATIONS,
    CompletionChunk,
    CompletionChunkChoice,
    ErrorBody,
    Health,
    ModelList,
    RewardRecorded,
    SessionClosed,
    SessionCreated,
)

ALLOWED_EXTRAS = frozenset({"reasoning_content", "tool_call_errors"})
"""Fields beyond the SDK's types that OpenAI-compatible servers send: vLLM's reasoning,
and the gateway's account of a choice's malformed tool calls (docs/environments.md,
"Malformed tool calls"), sent only when the model wrote one."""

ALWAYS_SENT: dict[type[BaseModel], frozenset[str]] = {
    ChatChoice: frozenset({"logprobs"}),
    ChunkChoice: frozenset({"logprobs", "finish_reason"}),
    ChatCompletionMessage: frozenset({"content"}),
    ChoiceLogprobs: frozenset({"content"}),
    ChatCompletionTokenLogprob: frozenset({"bytes"}),
    CompletionChoice: frozenset({"logprobs"}),
    CompletionChunkChoice: frozenset({"logprobs", "finish_reason"}),
}
"""Fields OpenAI's API reference lists as required (though nullable) that the SDK's
models would silently fill with None when missing."""


def problems_of(value: Any, path: str = "") -> list[str]:
    """What a validated SDK object has that the API would not send, or lacks."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        extras = set(value.__pydantic_extra__ or {}) - ALLOWED_EXTRAS
        if extras:
            found.append(f"{path or type(value).__name__}: fields unknown to the type {extras}")
        missing = ALWAYS_SENT.get(type(value), frozenset()) - value.model_fields_set
        if missing:
            found.append(f"{path or type(value).__name__}: missing {sorted(missing)}")
        for name in value.model_fields_set:
            found += problems_of(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += problems_of(item, f"{path}[{i}]")
    return found


def check_body(kind: Any, raw: bytes) -> list[str]:
    """Problems of ``raw`` (JSON) read as ``kind``; [] when it conforms."""
    try:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            value = kind.model_validate_json(raw, strict=True)
        else:
            value = TypeAdapter(kind).validate_json(raw, strict=True)
    except ValidationError as exc:
        return [f"not a {getattr(kind, '__name__', kind)}: {exc}"]
    return problems_of(value)


_SESSION = r"/s/[^/]+"
ANSWERS: list[tuple[re.Pattern[str], Any, Any]] = [
    (re.compile(rf"^{_SESSION}/v1/chat/completions$"), ChatCompletion, ChatCompletionChunk),
    (re.compile(rf"^{_SESSION}/v1/completions$"), Completion, CompletionChunk),
    (re.compile(rf"^{_SESSION}/v1/responses$"), Response, ResponseStreamEvent),
    (re.compile(rf"^({_SESSION})?/v1/models$"), ModelList, None),
    (re.compile(r"^/sessions$"), SessionCreated, None),
    (re.compile(r"^/sessions/[^/]+/reward$"), RewardRecorded, None),
    (re.compile(r"^/sessions/[^/]+/finish$"), SessionClosed, None),
    (re.compile(r"^/sessions/[^/]+/export$"), SessionExport, None),
    (re.compile(rf"^({_SESSION})?/tokenize$"), TokenizeResponse, None),
    (re.compile(rf"^({_SESSION})?/detokenize$"), DetokenizeResponse, None),
    (re.compile(r"^/healthz$"), Health, None),
    (re.compile(r"^/openapi.json$"), dict, None),
]
"""Each route's 2xx answer and (streamed) event type; the same types as the OpenAPI
document's (a test checks that every documented operation is listed here)."""


def kinds_for(path: str) -> tuple[Any, Any] | None:
    for pattern, answer, event in ANSWERS:
        if pattern.match(path):
            return answer, event
    return None


def check_answer(path: str, status: int, content_type: str, body: bytes) -> list[str]:
    """Problems of one HTTP answer of the gateway."""
    where = f"{status} {path}"
    if status == 499 and not body:
        return []  # the client left before its request was read: nobody reads an answer
    if status >= 400:
        return [f"{where}: {p}" for p in check_body(ErrorBody, body)]
    kinds = kinds_for(path)
    if kinds is None:
        return [f"{where}: no answer type known for this route"]
    answer, event = kinds
    if not content_type.startswith("text/event-stream"):
        return [f"{where}: {p}" for p in check_body(answer, body)]
    if event is None:
        return [f"{where}: streamed, but the route has no stream"]
    found = []
    for raw in body.split(b"\n\n"):
        if not raw.strip():
            continue
        if raw.startswith(b"event: "):  # the Responses API names each event first
            name, _, raw = raw.partition(b"\n")
            if not raw.startswith(b"data: "):
                found.append(f"{where}: an SSE event without data: {name[:80]!r}")
                continue
        if not raw.startswith(b"data: "):
            found.append(f"{where}: not an SSE data event: {raw[:80]!r}")
            continue
        data = raw.removeprefix(b"data: ")
        if data == b"[DONE]":
            continue
        kind = ErrorBody if data.startswith(b'{"error"') else event
        found += [f"{where}: {p}" for p in check_body(kind, data)]
    return found


class ShapeChecker:
    """Collects the problems of every answer an ASGI app gives."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.checked: Counter[str] = Counter()

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def checked_app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            status, content_type, body = 0, "", bytearray()

            async def watch(message: Message) -> None:
                nonlocal status, content_type
                if message["type"] == "http.response.start":
                    status = message["status"]
                    headers = dict(message.get("headers", []))
                    content_type = headers.get(b"content-type", b"").decode()
                elif message["type"] == "http.response.body":
                    body.extend(message.get("body", b""))
                await send(message)

            try:
                await app(scope, receive, watch)
            finally:
                if status:
                    # a stream cut short (the client left) is checked up to its last event
                    complete = bytes(body)
                    if content_type.startswith("text/event-stream"):
                        complete = complete[: max(complete.rfind(b"\n\n") + 2, 0)]
                    self.checked[scope["path"]] += 1
                    self.problems += check_answer(scope["path"], status, content_type, complete)

        checked_app.__wrapped__ = app  # type: ignore[attr-defined]
        return checked_app


def documented_paths() -> set[str]:
    return {op.path for op in OPERATIONS}
