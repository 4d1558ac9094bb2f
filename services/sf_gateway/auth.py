"""Who may call what: each session's own API key, and the operators' keys.

A session's routes take only that session's key, as ``Authorization: Bearer <key>``
(what an OpenAI client sends as its ``api_key``). Opening sessions and listing models
take an operator key (``SF_GATEWAY_API_KEYS``) when any is configured; an operator key
also exports any session. Only sha256 digests of keys are kept, compared in constant
time, and keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from starlette.requests import Request

from sf_gateway.openai_api import ApiError
from sf_gateway.sessions import GatewaySession


class Access:
    """The key checks on the gateway's requests, against its sessions as they are now."""

    def __init__(
        self,
        sessions: Mapping[str, GatewaySession],
        finished: Mapping[str, str],
        operator_keys: list[str],
    ) -> None:
        # the gateway's own tables, read in place: it only ever changes their contents
        self._sessions = sessions
        """Open sessions."""
        self._finished = finished
        """Finished sessions: id -> key digest."""
        self._operator_keys = [key_digest(k) for k in operator_keys]

    def session_of(self, request: Request) -> GatewaySession | None:
        """The request's session if the request carries that session's key (None: it
        has finished and its conversation was dropped)."""
        session_id = request.path_params["session_id"]
        session = self._sessions.get(session_id)
        digest = session.key_sha256 if session is not None else self._finished.get(session_id)
        if digest is None:
            raise ApiError(404, f"session {session_id!r} does not exist", code="session_not_found")
        if not carries_key(request, [digest]):
            raise unauthorized(
                "this session's API key is required (the api_key POST /sessions returned)"
            )
        return session

    def open_session_of(self, request: Request) -> GatewaySession:
        """The request's session, which must not have finished (409)."""
        session = self.session_of(request)
        if session is None or session.finished:
            session_id = request.path_params["session_id"]
            raise ApiError(409, f"session {session_id!r} has finished", code="session_finished")
        return session

    def is_operator(self, request: Request) -> bool:
        return carries_key(request, self._operator_keys)

    def require_operator(self, request: Request) -> None:
        """Opening sessions and listing models: open without operator keys configured."""
        if self._operator_keys and not self.is_operator(request):
            raise unauthorized("an operator API key is required (SF_GATEWAY_API_KEYS)")


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
