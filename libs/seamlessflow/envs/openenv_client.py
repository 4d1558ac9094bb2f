"""An async client for OpenEnv environment servers: one episode is one WebSocket session.

The protocol (OpenEnv's ``/ws`` endpoint; the same in openenv-core 0.2 and 0.3): the
client sends JSON text messages and gets one reply to each, in order::

    {"type": "reset", "data": {"seed": 3}}         -> {"type": "observation", "data": R}
    {"type": "step", "data": {"message": "500"}}   -> {"type": "observation", "data": R}
    {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/list", ...}}
                                                   -> {"type": "mcp", "data": JSON-RPC reply}
    {"type": "close"}                              (no reply: the server ends the session)

where ``R`` is ``{"observation": {...}, "reward": float | null, "done": bool}``; ``mcp``
(openenv-core 0.3 and openenv 0.10) reaches the MCP tools of the session's own
environment (``OpenEnvSession.mcp``). Anything
the server refuses is answered ``{"type": "error", "data": {"message": ..., "code":
...}}``, and the session stays open. Each session has its own environment instance on
the server, so an episode's state lives exactly as long as its connection.

Every way an episode can fail here is one exception, :class:`EnvFailed`, whose
``reason`` says which (``env_error``, ``env_timeout``, ``env_lost``,
``env_unreachable``): the caller (the agent runner) drops the episode with that reason
and goes on. Built on aiohttp; openenv-core is not needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

import aiohttp

EnvFailureReason = Literal["env_error", "env_timeout", "env_lost", "env_unreachable"]

WEBSOCKET_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
"""Base URL scheme -> the scheme of its ``/ws`` endpoint."""

OBSERVATION_TEXT_KEYS = ("prompt", "message", "text", "observation")
"""Where environments put the text a model reads, in the order they are looked for."""


class EnvFailed(Exception):
    """The environment could not play the episode on; ``reason`` is one of:

    - ``env_error``: the server answered an error (a refused action, a step after the
      episode ended); the session stays usable.
    - ``env_timeout``: no reply within the step (or reset) timeout.
    - ``env_lost``: the connection closed mid-episode (the server stopped or restarted).
    - ``env_unreachable``: no WebSocket session could be opened at all.

    After any reason but ``env_error`` the session is closed: every later call raises
    the same reason again.
    """

    def __init__(self, reason: EnvFailureReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: EnvFailureReason = reason
        self.detail = detail


class EnvUnreachable(EnvFailed):
    """No WebSocket session could be opened (``env_unreachable``): nothing of the episode
    happened yet, so a caller may try again (the server may be restarting)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("env_unreachable", detail)


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a reset or a step."""

    observation: dict[str, Any]
    reward: float | None
    """None after a reset (and from environments that reward only at the end)."""
    done: bool


def observation_text(observation: dict[str, Any]) -> str:
    """The text a model reads from an observation: the first string among the keys of
    ``OBSERVATION_TEXT_KEYS``, else the whole observation as compact JSON."""
    for key in OBSERVATION_TEXT_KEYS:
        value = observation.get(key)
        if isinstance(value, str):
            return value
    return json.dumps(observation, separators=(",", ":"), ensure_ascii=False, default=str)


def websocket_url(base_url: str) -> str:
    """The ``/ws`` endpoint of the server at ``base_url`` (http -> ws, https -> wss)."""
    url = urlsplit(base_url)
    scheme = WEBSOCKET_SCHEMES.get(url.scheme)
    if scheme is None or not url.hostname:
        raise ValueError(f"not an environment server URL (http[s]:// or ws[s]://): {base_url!r}")
    return urlunsplit((scheme, url.netloc, url.path.rstrip("/") + "/ws", url.query, ""))


class OpenEnvSession:
    """One episode on an OpenEnv server: ``async with`` opens the WebSocket session,
    ``reset`` and ``step`` play, leaving closes it (``close`` message, then the socket).

    ``http`` is the caller's aiohttp session. Each open session holds one of its
    connector's connections, so the connector's limit (aiohttp's default: 100) bounds
    how many episodes run at once on it; a session over the limit waits for a free
    connection and, past ``connect_timeout_s``, fails ``env_unreachable``. Requests are
    answered in order, so calls on one session are serialized; sessions are
    independent and run concurrently.
    """

    def __init__(
        self,
        url: str,
        *,
        http: aiohttp.ClientSession,
        step_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.url = websocket_url(url)
        self._http = http
        self._step_timeout_s = step_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._broken: EnvFailed | None = None
        # one request in flight per session: replies carry no id, only their order
        self._in_flight = asyncio.Lock()
        self._frames: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._mcp_calls = 0
        """JSON-RPC ids of this session's MCP requests."""

    async def __aenter__(self) -> Self:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                self._ws = await self._http.ws_connect(
                    self.url,
                    timeout=aiohttp.ClientWSTimeout(ws_close=self._connect_timeout_s),
                    # observations can be large (a rendered page, a file listing)
                    max_msg_size=64 * 1024 * 1024,
                )
        except TimeoutError:
            raise EnvUnreachable(
                f"{self.url}: no WebSocket session within {self._connect_timeout_s:g} s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EnvUnreachable(f"{self.url}: {exc}") from exc
        self._reader = asyncio.create_task(self._read(self._ws), name="openenv.reader")
        return self

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Receive every frame while the session is open, queued for the request that
        waits on it; the frame that ends the connection is queued too.

        aiohttp answers the server's pings only inside ``receive``: a session that reads
        only while a request is in flight misses every ping sent while its agent thinks,
        and a server with keepalive (uvicorn: a ping every 20 s, 20 s to answer) closes
        it. A slow model's turn on a CPU takes that long, and every episode then ends
        ``env_lost`` (seen with openenv 0.10's server)."""
        while True:
            frame = await ws.receive()
            self._frames.put_nowait(frame)
            if (
                frame.type is not aiohttp.WSMsgType.TEXT
                and frame.type is not aiohttp.WSMsgType.BINARY
            ):
                return

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the session on the server and closes the socket; safe to call twice."""
        ws, self._ws = self._ws, None
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if ws is None or ws.closed:
            return
        try:
            await ws.send_str('{"type":"close"}')
        except (aiohttp.ClientError, ConnectionError):
            pass  # already going away: closing the socket is all that is left to do
        await ws.close()

    async def reset(self, **kwargs: Any) -> EnvStep:
        """Start a new episode (``seed``, ``episode_id`` and whatever the environment's
        reset takes) and return its first observation."""
        return await self._request({"type": "reset", "data": kwargs})

    async def step(self, action: dict[str, Any]) -> EnvStep:
        """Play ``action`` (shaped as the environment's action schema says)."""
        return await self._request({"type": "step", "data": action})

    async def mcp(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A JSON-RPC request to the MCP server of this session's environment (openenv
        0.3+: ``{"type": "mcp", "data": request}``, answered ``{"type": "mcp", "data":
        response}``): the response, ``result`` or ``error`` as the server wrote it. The
        session's environment is the one ``reset`` and ``step`` play, whatever action
        class the server declares."""
        self._mcp_calls += 1
        request = {"jsonrpc": "2.0", "id": self._mcp_calls, "method": method, "params": params}
        reply = await self._send({"type": "mcp", "data": request})
        if reply.get("type") == "error":
            parse_observation_reply(reply)  # raises env_error with the server's message
        data = reply.get("data")
        if reply.get("type") != "mcp" or not isinstance(data, dict):
            raise EnvFailed("env_error", f"unexpected reply to mcp: {json.dumps(reply)[:200]}")
        return data

    async def _request(self, message: dict[str, Any]) -> EnvStep:
        return parse_observation_reply(await self._send(message))

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        async with self._in_flight:
            if self._broken is not None:
                raise EnvFailed(self._broken.reason, f"session closed after: {self._broken}")
            if self._ws is None:
                raise RuntimeError("OpenEnvSession is used inside `async with` only")
            try:
                reply = await self._exchange(self._ws, message)
            except EnvFailed as failure:
                if failure.reason != "env_error":
                    # a reply that arrives late would be taken for the next request's:
                    # the session cannot go on
                    self._broken = failure
                    await self.close()
                raise
        return reply

    async def _exchange(
        self, ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            await ws.send_str(json.dumps(message))
            async with asyncio.timeout(self._step_timeout_s):
                frame = await self._frames.get()
        except TimeoutError:
            raise EnvFailed(
                "env_timeout", f"no reply to {message['type']} within {self._step_timeout_s:g} s"
            ) from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EnvFailed("env_lost", f"{message['type']}: {exc}") from exc
        if frame.type is not aiohttp.WSMsgType.TEXT:
            # CLOSE / CLOSING / CLOSED / ERROR: the server went away (or sent what no
            # OpenEnv server sends)
            raise EnvFailed(
                "env_lost", f"connection ended during {message['type']} ({frame.type.name})"
            )
        try:
            reply = json.loads(frame.data)
        except ValueError:
            raise EnvFailed("env_error", f"reply is not JSON: {frame.data[:200]!r}") from None
        if not isinstance(reply, dict):
            raise EnvFailed("env_error", f"reply is not an object: {frame.data[:200]!r}")
        return reply


def parse_observation_reply(reply: dict[str, Any]) -> EnvStep:
    """An ``observation`` reply as an :class:`EnvStep`; an ``error`` reply (or anything
    else) as ``EnvFailed("env_error")`` with the server's message."""
    data = reply.get("data")
    if reply.get("type") == "error":
        details = data if isinstance(data, dict) else {}
        code = details.get("code", "")
        message = str(details.get("message", "(no message)"))
        errors = details.get("errors")
        if isinstance(errors, list) and errors:
            # pydantic's validation errors: the first says what was wrong with the action
            message += f": {json.dumps(errors[0], default=str)[:300]}"
        raise EnvFailed("env_error", f"{code}: {message}" if code else message)
    if reply.get("type") != "observation" or not isinstance(data, dict):
        raise EnvFailed("env_error", f"unexpected reply: {json.dumps(reply)[:200]}")
    observation = data.get("observation")
    reward = data.get("reward")
    if not isinstance(observation, dict) or not (reward is None or isinstance(reward, int | float)):
        raise EnvFailed("env_error", f"malformed observation reply: {json.dumps(data)[:200]}")
    return EnvStep(
        observation=observation,
        reward=None if reward is None else float(reward),
        done=bool(data.get("done", False)),
    )
