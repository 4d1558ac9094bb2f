"""Server-sent events: a turn's answer streamed while its choices are generated.

Chat and completion streams are ``data: <chunk>`` events, then ``data: [DONE]``; the
Responses API writes its own events (``sf_gateway.responses_api``) on the same
``turn_updates``. An ``EventStream`` calls its ``on_close`` however the response ends,
so a client that leaves stops the turn that feeds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sf_gateway.openai_api import ApiError
from sf_gateway.responses import ChatFormat, CompletionFormat
from sf_gateway.turns import Turn

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


async def chunk_events(
    turn: Turn,
    view: ChatFormat | CompletionFormat,
    producer: asyncio.Task[None],
    updated: asyncio.Event,
) -> AsyncIterator[bytes]:
    """The chat or completion chunks of ``turn`` (by ``view``) as its ``producer``
    generates it, ending with the usage chunk if asked for and ``[DONE]``."""
    for chunk in view.opening(turn.choices):
        yield sse_event(chunk)
    async for _ in turn_updates(producer, updated):
        for choice in turn.choices:
            progress = view.progress(choice)
            if progress is not None:
                yield sse_event(progress)
    try:
        producer.result()
    except ApiError as exc:  # the response has started: the error is an event
        yield sse_event(exc.body())
        return
    for choice in turn.choices:
        for chunk in view.closing(choice):
            yield sse_event(chunk)
    if turn.plan.include_usage:
        obj = "chat.completion.chunk" if isinstance(view, ChatFormat) else "text_completion"
        yield sse_event(view.usage_chunk(obj, len(turn.plan.prompt_ids), turn.choices))
    yield b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


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
