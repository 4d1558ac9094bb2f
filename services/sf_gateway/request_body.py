"""Reading a request's JSON body within the gateway's size limit.

A body over ``MAX_BODY_BYTES`` is a 413, whether its ``content-length`` says so or a
chunked body crosses the limit while it is read; an empty body, broken JSON or JSON
that is not an object is a 400. Nothing is stored for any of them.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from sf_gateway.openai_api import ApiError

MAX_BODY_BYTES = 4 * 1024 * 1024


async def read_json(request: Request, *, allow_empty: bool = False) -> Any:
    """The request's body as a JSON object (``allow_empty``: no body is ``{}``)."""
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
