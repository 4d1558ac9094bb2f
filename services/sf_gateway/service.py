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
- ``sf.<run>.sched.phase`` (PhaseChanged): the requests of an engine declared dead, or
  whose NATS connection came back (its replies may be lost), are re-routed
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

The parts: ``routes`` (``Gateway``: the HTTP routes, over the parts it builds),
``session_table`` (open and finished sessions: restored, followed, caught up),
``turn_runner`` (a turn generated, recorded, or streamed: for every API that makes
turns), ``turns`` (a validated request as a turn: model, budget, plan, choices),
``engine_client`` (the engine calls, their chunks, re-routing and resuming), ``auth``
(session and operator keys), ``request_body`` (bounded JSON bodies), ``sse`` (streamed
answers), ``sessions`` (a session's state), ``responses_api`` (the Responses API); this
module is the service: it builds the gateway, restores its sessions and serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from seamlessflow.assets.model_check import (
    ModelNeeds,
    check_model,
    context_need,
    model_context,
)
from seamlessflow.bus import Unrecoverable
from seamlessflow.protocol import PhaseChanged
from seamlessflow.service import ServiceContext
from sf_gateway.routes import Gateway
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer

log = logging.getLogger(__name__)


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
        if not self.settings.max_context:  # the model's own, unless set
            context = model_context(ctx.mesh.model_dir, "SF_GATEWAY_MAX_CONTEXT")
            self.settings = self.settings.model_copy(update={"max_context": context})
            log.info("context: %d tokens (the model's config.json)", context)
        tokenizer = await asyncio.to_thread(ChatTokenizer, ctx.mesh.model_dir)
        self.gateway = Gateway(self.settings, ctx.bus, tokenizer, ctx.mesh.policy_names())
        await self.gateway.session_table.restore()
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
            group.create_task(self.gateway.session_table.follow(ctx.stopping))
