"""engine worker: one inference engine each, reached by the gateway over NATS only.

An engine serves one policy (``SF_POLICY``, registered with the tag ``policy:<name>``);
``<policy>`` below is its own. About 400 lines with this subject list; weight loading is
``weight_loading``, requests in flight ``in_flight``, the engines ``backends``.

Consumes:
- ``sf.<run>.engine.<policy>.generate`` (queue group ``engines``; GenerateRequest ->
  GenerateReply) and, while serving, ``sf.<run>.engine.<policy>.direct.<engine>`` (the
  same, for requests rebalanced onto this engine); a request refused is an ErrorReply,
  ``context_length_exceeded`` for a prompt and budget over the engine's context
- ``sf.<run>.engine.shed.<engine>`` (request ShedRequests -> ShedReport from the
  tag-scheduler: hand the youngest requests over to a freshly lent engine)
- ``sf.<run>.engine.abort`` (AbortGeneration broadcast to every engine of the run)
- ``sf.<run>.engine.<policy>.load`` (LoadWeights broadcast from weight-sync)
- ``sf.<run>.sched.assign.<engine>`` (request RoleAssignment -> RoleAck from the
  tag-scheduler: ``rollout`` joins the generate queue, ``idle`` leaves it)
Produces:
- ``GenerateChunk`` on a request's ``stream_subject`` (the gateway's inbox), while
  generating, when the request asks for streaming
- ``sf.<run>.weights.<policy>.loaded`` (WeightsLoaded: the version now served)
- ``sf.<run>.weights.<policy>.current`` requests (CurrentVersionQuery, to catch up)
- ``sf.<run>.weights.<policy>.group`` requests (WeightsGroupQuery, to join the trainer's NCCL
  push group when ``SF_WEIGHTS_GROUP_BACKEND=nccl``; payloads then also arrive by push)
- ``sf.<run>.sched.register`` / ``sf.<run>.sched.heartbeat.<engine>``

Invariants: the worker joins the generate queue only after it serves the current
weight version and the scheduler gave it the ``rollout`` role (a late joiner and an
engine lent back to rollout take the same path); weights are loaded between decode
steps only after every payload of the version arrived, each bucket's checksum matched
and, after a delta, the digest of the whole resulting set matched
(``seamlessflow.weights.WeightReceiver``).

Where the parts are: this module joins, serves generate requests and applies roles;
``sf_engine.weight_loading`` loads weights (the ``load`` broadcast, catch-up, pushes,
the swap and ``WeightsLoaded``); ``sf_engine.backends`` holds the engines, each declared
with its ``SF_ENGINE_BACKEND`` name in its own module (``backends.registry``).

Lending (an engine tagged ``train`` and ``rollout`` shares a training slot): on
``idle`` the worker leaves the generate queue, ends its requests in flight at a token
boundary (they return their partial tokens and the gateway re-submits them to another
engine: the transparent-resume path), releases its memory (``engine.sleep``) and only
then acks, so the trainer never computes next to a still-decoding engine.

Rebalance on lend (``ShedRequests``): the worker ends its most recently started
requests at a token boundary, the same partial-rollout path, and names the lent engine
in their ``abort`` replies (``resume_on``); the gateway re-submits prompt + partial
there. The youngest go first: they hold the fewest tokens, so prefilling them again
costs least, and requests still queued in the engine cost nothing to move.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import torch

from seamlessflow import telemetry, weights
from seamlessflow.assets.model_check import ModelNeeds, check_model, context_need
from seamlessflow.bus import ContextLengthExceeded, DomainError, Subscription
from seamlessflow.heap import compact_heap
from seamlessflow.protocol import (
    ENGINE_QUEUE,
    AbortGeneration,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
    LoadWeights,
    RoleAssignment,
    ShedReport,
    ShedRequests,
    TopLogprob,
)
from seamlessflow.resources import ResourceMembership, RoleOutcome
from seamlessflow.service import ServiceContext, supervise
from seamlessflow.weights.settings import WeightTransferSettings, payload_stores
from sf_engine.backends import (
    ENGINE_BACKENDS,
    ContextTooLong,
    GeneratedToken,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
    TopLogprobs,
)
from sf_engine.in_flight import InFlight
from sf_engine.settings import BACKEND_SETTINGS, EngineSettings
from sf_engine.weight_loading import WeightLoader

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


def _top_logprobs(top: TopLogprobs) -> list[TopLogprob]:
    return [TopLogprob(token_id, logprob) for token_id, logprob in top]


def build_engine(settings: EngineSettings, model_dir: str) -> InferenceEngine:
    """The engine ``SF_ENGINE_BACKEND`` names, built by its backend's declaration."""
    return ENGINE_BACKENDS.get(settings.backend).build(settings, model_dir)


class EngineService:
    name = "engine"

    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.engine_id = self.settings.engine_id or f"engine-{socket.gethostname()}-{os.getpid()}"
        self.requests_served = 0
        self.handed_back = 0
        self.ready = asyncio.Event()
        """Set once the worker first serves (joined the generate queue)."""
        self._joined = False
        self._generate_sub: Subscription | None = None
        self._direct_sub: Subscription | None = None
        self._shed_to: dict[str, str] = {}
        """Requests being handed over (rebalance on lend) -> the engine to resume on."""
        self.handed_over = 0
        self._in_flight = InFlight()
        self._min_version = 0
        """The version the tag-scheduler's last role assignment asks it to serve at least."""
        self.receiver: weights.WeightReceiver
        self.loader: WeightLoader

    def weights_device(self) -> torch.device | None:
        """Where this engine's model computes, when that is a CUDA device: versions in
        the trainer's device memory are copied there (``cuda_ipc``), not via the host."""
        own = BACKEND_SETTINGS.get(self.settings.backend)
        device = torch.device(own().model_device()) if own is not None else None
        return device if device is not None and device.type == "cuda" else None

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the engine needs SF_MODEL_DIR")
        torch.set_num_threads(self.settings.torch_threads)
        self.ctx = ctx
        self.transfer = WeightTransferSettings()
        self.receiver = weights.WeightReceiver(
            payload_stores(ctx.bus, self.transfer), device=self.weights_device()
        )
        needs = ModelNeeds(
            tokenizer=False,
            chat=False,
            architecture=ENGINE_BACKENDS.get(self.settings.backend).architecture,
            **context_need(self.settings, "SF_ENGINE_MAX_CONTEXT"),
        )
        await asyncio.to_thread(check_model, ctx.mesh.model_dir, needs)
        if self.settings.compact_heap and compact_heap():
            log.info("glibc heap: fixed mmap threshold, one arena (SF_ENGINE_COMPACT_HEAP)")
        self.engine = build_engine(self.settings, str(ctx.mesh.model_dir))
        await self.engine.start()
        self.membership = ResourceMembership(
            ctx.bus,
            self.engine_id,
            "engine",
            ctx.mesh.tags(["rollout"]),
            slots=ctx.mesh.slots(),
            on_role=self._on_role,
        )
        self.loader = WeightLoader(
            self.engine_id,
            self.engine,
            self.settings,
            ctx.bus,
            self.receiver,
            self.membership,
            self._in_flight,
        )
        try:
            await self._join(ctx)
            loops = [self.membership.heartbeat_loop(), self.loader.poll_loop()]
            if self.transfer.group_backend:
                loops.append(self.loader.join_push_group(self.transfer))
            await supervise(ctx.stopping, *loops)
        finally:
            # Stop taking requests and answer those in flight before the engine goes away.
            await ctx.bus.drain(timeout=ctx.mesh.drain_timeout_s)
            self.membership.end_phase()
            await self.engine.close()

    async def _join(self, ctx: ServiceContext) -> None:
        subjects = ctx.subjects
        await self.membership.register()
        self.membership.set_phase("sync")
        await ctx.bus.serve(subjects.engine_load(), LoadWeights, self.loader.on_load)
        await ctx.bus.serve(subjects.engine_abort(), AbortGeneration, self.on_abort)
        await ctx.bus.serve(subjects.engine_shed(self.engine_id), ShedRequests, self.on_shed)
        await self.loader.catch_up()
        async with self.membership.transition():
            self._joined = True
            if self.membership.role == "rollout":
                await self._start_serving()
            else:
                await self.engine.sleep()
                self.loader.asleep = True
                self.membership.set_phase("idle")
                log.info("%s waits for the rollout role (%s)", self.engine_id, self.membership.role)

    async def _on_role(self, assignment: RoleAssignment) -> RoleOutcome:
        """Put a role from the tag-scheduler into effect (before it is acked)."""
        self._min_version = max(self._min_version, assignment.min_version)
        if not self._joined:
            return RoleOutcome()  # the join applies the role once the engine caught up
        if assignment.role == "rollout":
            await self._start_serving()
            return RoleOutcome()
        return await self._stop_serving()

    async def _start_serving(self) -> None:
        """Wake, catch up to the current version, then (only then) join the queue."""
        if self._generate_sub is not None:
            return
        with tracer.start_as_current_span("engine.join", attributes={"engine.id": self.engine_id}):
            self.membership.set_phase("sync")
            await self.engine.wake()
            await self.engine.resume()
            self.loader.asleep = False
            await self.loader.catch_up(self._min_version)
            self._in_flight.reset_busy()
            self._generate_sub = await self.ctx.bus.serve(
                self.ctx.subjects.engine_generate(),
                GenerateRequest,
                self.on_generate,
                queue=ENGINE_QUEUE,
            )
            self._direct_sub = await self.ctx.bus.serve(
                self.ctx.subjects.engine_generate_on(self.engine_id),
                GenerateRequest,
                self.on_generate,
            )
        self.membership.set_phase("idle")
        log.info("%s serving version %d", self.engine_id, self.engine.version)
        self.ready.set()

    async def _stop_serving(self) -> RoleOutcome:
        """Leave the queue; hand requests in flight back (partial tokens) for re-submission
        elsewhere; release memory. Returns how many requests were handed back and how
        long the engine had requests in flight since it joined the queue."""
        sub, self._generate_sub = self._generate_sub, None
        if sub is None:
            return RoleOutcome()
        busy_s = self._in_flight.busy_seconds()
        with tracer.start_as_current_span(
            "engine.release", attributes={"engine.id": self.engine_id}
        ) as span:
            self.membership.set_phase("sync")
            # Requests already delivered are still handled (and bounced, see on_generate).
            await self.ctx.bus.unserve(sub)
            direct, self._direct_sub = self._direct_sub, None
            if direct is not None:
                await self.ctx.bus.unserve(direct)
            async with self.loader.lock:  # never in the middle of a weight swap
                handed_back = len(self._in_flight)
                await self.engine.pause("abort")
                try:  # their "abort" replies are on the way (timeout: see heartbeat_loop)
                    async with asyncio.timeout(self.settings.release_timeout_s):
                        await self._in_flight.empty.wait()
                except TimeoutError:
                    log.error(
                        "%s: %d requests still in flight after the release time-out",
                        self.engine_id,
                        len(self._in_flight),
                    )
                await self.engine.sleep()
                self.loader.asleep = True
            span.set_attribute("handed_back", handed_back)
        self.handed_back += handed_back
        self.membership.set_phase("idle")
        log.info(
            "%s released its slot (%d requests handed back, busy %.2fs while serving)",
            self.engine_id,
            handed_back,
            busy_s,
        )
        return RoleOutcome(handed_back, busy_s)

    async def on_generate(self, request: GenerateRequest) -> GenerateReply:
        try:
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                structured_output=request.structured_output,
                stop_token_ids=tuple(request.stop_token_ids),
                seed=request.seed,
                top_logprobs=request.top_logprobs,
            )
        except ValueError as exc:
            raise DomainError(str(exc)) from None
        if self._generate_sub is None:
            # Delivered just before this engine left the queue: hand it straight back,
            # the gateway re-submits it to an engine that serves.
            return GenerateReply(
                request_id=request.request_id,
                engine_id=self.engine_id,
                token_ids=[],
                logprobs=[],
                versions=[],
                finish_reason="abort",
            )
        self._in_flight.add(request.request_id)
        self.membership.in_flight = len(self._in_flight)
        self.membership.set_phase("rollout")
        try:
            await self.loader.reach(request.min_version)
            with tracer.start_as_current_span(
                "engine.generate",
                attributes={"engine.id": self.engine_id, "prompt_tokens": len(request.prompt_ids)},
            ) as span:
                result = await self._run(request, params)
                span.set_attribute("completion_tokens", len(result.token_ids))
                if self.settings.trace_token_ids:
                    span.set_attribute("prompt_ids", request.prompt_ids)
                    span.set_attribute("completion_ids", result.token_ids)
                    span.set_attribute("logprobs", result.logprobs)
                    span.set_attribute("versions", result.versions)
                span.set_attribute("finish_reason", result.finish_reason)
        finally:
            resume_on = self._shed_to.pop(request.request_id, "")
            self._in_flight.discard(request.request_id)
            self.membership.in_flight = len(self._in_flight)
            if not self._in_flight and self._generate_sub is not None:
                self.membership.set_phase("idle")
        self.requests_served += 1
        return GenerateReply(
            request_id=request.request_id,
            engine_id=self.engine_id,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=result.versions,
            finish_reason=result.finish_reason,
            top_logprobs=[_top_logprobs(top) for top in result.top_logprobs],
            resume_on=resume_on if result.finish_reason == "abort" else "",
        )

    async def _run(self, request: GenerateRequest, params: SamplingParams) -> GenerationResult:
        """Generate to the end; with ``stream_subject``, publish the tokens as they come.

        Chunk 0 carries no tokens and names this engine; then one chunk per decode step
        (every token that arrived since the last chunk), or at most one per
        ``chunk_every_s``. Chunks are fire-and-forget: the reply is authoritative.
        Leaving early (cancelled, e.g. on drain) aborts the engine request.
        """
        try:
            stream = self.engine.stream(request.request_id, request.prompt_ids, params)
        except ContextTooLong as exc:
            raise ContextLengthExceeded(str(exc)) from None
        except ValueError as exc:
            raise DomainError(str(exc)) from None
        async with stream:
            if request.stream_subject:
                # An empty first chunk tells the gateway at once which engine has the
                # request, so it can re-route it if this engine dies before its first token.
                await self.ctx.bus.publish(
                    request.stream_subject,
                    GenerateChunk(
                        request_id=request.request_id,
                        index=0,
                        token_ids=[],
                        logprobs=[],
                        versions=[],
                        engine_id=self.engine_id,
                    ),
                )
                index = 1
                clock = asyncio.get_running_loop().time
                sent_at = clock()
                held: list[GeneratedToken] = []  # tokens not sent yet (the reply carries them all)
                async for batch in stream.batches():
                    held.extend(batch)
                    if request.chunk_every_s > 0 and clock() - sent_at < request.chunk_every_s:
                        continue
                    chunk = GenerateChunk(
                        request_id=request.request_id,
                        index=index,
                        token_ids=[t.token_id for t in held],
                        logprobs=[t.logprob for t in held],
                        versions=[t.version for t in held],
                        top_logprobs=[_top_logprobs(t.top_logprobs) for t in held]
                        if params.top_logprobs
                        else [],
                        engine_id=self.engine_id,
                    )
                    await self.ctx.bus.publish(request.stream_subject, chunk)
                    index += 1
                    held = []
                    sent_at = clock()
            return await stream.result()

    async def on_shed(self, request: ShedRequests) -> ShedReport:
        """Rebalance on lend: end the youngest requests in flight at a token boundary;
        their replies name ``to_engine``, where the gateway resumes them."""
        handed_over = 0
        if self._generate_sub is not None and request.to_engine != self.engine_id:
            with tracer.start_as_current_span(
                "engine.shed",
                attributes={"engine.id": self.engine_id, "to_engine": request.to_engine},
            ) as span:
                async with self.loader.lock:  # never in the middle of a weight swap
                    for request_id in self._in_flight.youngest(request.count):
                        self._shed_to[request_id] = request.to_engine
                        if await self.engine.abort(request_id):
                            handed_over += 1
                        else:  # it finished meanwhile
                            self._shed_to.pop(request_id, None)
                span.set_attribute("handed_over", handed_over)
        self.handed_over += handed_over
        if handed_over:
            log.info("%s handed %d requests over to %s", self.engine_id, handed_over,
                     request.to_engine)  # fmt: skip
        return ShedReport(engine_id=self.engine_id, handed_over=handed_over)

    async def on_abort(self, message: AbortGeneration) -> None:
        await self.engine.abort(message.request_id)
