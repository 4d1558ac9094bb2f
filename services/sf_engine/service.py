"""engine worker: one inference engine each, reached by the gateway over NATS only.

An engine serves one policy (``SF_POLICY``, registered with the tag ``policy:<name>``);
``<policy>`` below is its own.

Consumes:
- ``sf.<run>.engine.<policy>.generate`` (queue group ``engines``; GenerateRequest ->
  GenerateReply) and, while serving, ``sf.<run>.engine.<policy>.direct.<engine>`` (the
  same, for requests rebalanced onto this engine)
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
import time
from collections.abc import Callable

import torch

from seamlessflow import telemetry, weights
from seamlessflow.assets.model_check import ModelNeeds, check_model, context_need
from seamlessflow.bus import DomainError, NoResponder, Subscription
from seamlessflow.plugins import Registry
from seamlessflow.protocol import (
    ENGINE_QUEUE,
    AbortGeneration,
    CurrentVersion,
    CurrentVersionQuery,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
    LoadWeights,
    RoleAssignment,
    ShedReport,
    ShedRequests,
    TopLogprob,
    WeightManifest,
    WeightsLoaded,
)
from seamlessflow.resources import ResourceMembership, RoleOutcome
from seamlessflow.retry import RetryPolicy, retry
from seamlessflow.service import ServiceContext, supervise
from seamlessflow.weights import VersionGap
from seamlessflow.weights.group import PushListener, join_as_engine
from seamlessflow.weights.settings import WeightTransferSettings, payload_stores
from sf_engine.backends import (
    GeneratedToken,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
    TopLogprobs,
    TransformersEngine,
)
from sf_engine.settings import EngineSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

CURRENT_VERSION_RETRY = RetryPolicy(
    retry_on=(NoResponder,), first_delay_s=0.1, backoff=2.0, max_delay_s=2.0
)
"""A current-version query nobody answers (weight-sync starts after the engine, or
restarts) is asked again after 0.1 s, doubling to 2 s, until weight-sync answers."""


def _top_logprobs(top: TopLogprobs) -> list[TopLogprob]:
    return [TopLogprob(token_id, logprob) for token_id, logprob in top]


ENGINE_BACKENDS: Registry[Callable[[EngineSettings, str], InferenceEngine]] = Registry(
    "engine backend", "SF_ENGINE_BACKEND"
)
"""Builders of the inference engine a worker wraps, from its settings and model."""


@ENGINE_BACKENDS.register("hf")
def _transformers(settings: EngineSettings, model_dir: str) -> InferenceEngine:
    return TransformersEngine(
        model_dir,
        dtype=getattr(torch, settings.dtype),
        device=settings.device,
        max_batch_size=settings.max_batch_size,
        max_context=settings.max_context,
        prefix_cache_bytes=settings.prefix_cache_mb * 2**20,
    )


@ENGINE_BACKENDS.register("vllm")
def _vllm(settings: EngineSettings, model_dir: str) -> InferenceEngine:
    from sf_engine.backends.vllm_engine import VllmEngine  # vLLM is an optional extra

    return VllmEngine(
        model_dir,
        dtype=settings.dtype,
        max_batch_size=settings.max_batch_size,
        max_context=settings.max_context,
        engine_kwargs={"enable_sleep_mode": True} if settings.vllm_sleep_mode else None,
    )


@ENGINE_BACKENDS.register("scripted")
def _scripted(settings: EngineSettings, model_dir: str) -> InferenceEngine:
    from sf_engine.backends.scripted_engine import ScriptedEngine  # no model compute

    return ScriptedEngine(
        model_dir, max_batch_size=settings.max_batch_size, max_context=settings.max_context
    )


def build_engine(settings: EngineSettings, model_dir: str) -> InferenceEngine:
    return ENGINE_BACKENDS.get(settings.backend)(settings, model_dir)


class InFlight:
    """The requests this engine is generating: which, whether none, and how long there
    has been at least one since ``reset`` (the yield of a lent engine)."""

    def __init__(self) -> None:
        self.ids: dict[str, None] = {}
        """In the order they started (a dict keeps insertion order)."""
        self.empty = asyncio.Event()
        self.empty.set()
        self._busy_total = 0.0
        self._busy_since: float | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, request_id: str) -> None:
        if not self.ids:
            self._busy_since = time.monotonic()
            self.empty.clear()
        self.ids[request_id] = None

    def youngest(self, count: int) -> list[str]:
        """Up to ``count`` requests, the most recently started first."""
        return list(reversed(self.ids))[: max(count, 0)]

    def discard(self, request_id: str) -> None:
        self.ids.pop(request_id, None)
        if not self.ids:
            if self._busy_since is not None:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None
            self.empty.set()

    def reset_busy(self) -> None:
        self._busy_total = 0.0
        self._busy_since = time.monotonic() if self.ids else None

    def busy_seconds(self) -> float:
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + running


class EngineService:
    name = "engine"

    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.engine_id = self.settings.engine_id or f"engine-{socket.gethostname()}-{os.getpid()}"
        self._load_lock = asyncio.Lock()
        self._floor_lock = asyncio.Lock()
        """Held while requests wait for their version floor (``min_version``)."""
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
        self._asleep = False
        """Lent out of rollout: weight broadcasts are skipped until it serves again."""
        self.receiver: weights.WeightReceiver

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the engine needs SF_MODEL_DIR")
        torch.set_num_threads(self.settings.torch_threads)
        self.ctx = ctx
        self.transfer = WeightTransferSettings()
        self.receiver = weights.WeightReceiver(payload_stores(ctx.bus, self.transfer))
        needs = ModelNeeds(
            tokenizer=False,
            chat=False,
            backend=self.settings.backend,
            **context_need(self.settings, "SF_ENGINE_MAX_CONTEXT"),
        )
        await asyncio.to_thread(check_model, ctx.mesh.model_dir, needs)
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
        try:
            await self._join(ctx)
            loops = [self.membership.heartbeat_loop(), self._version_poll_loop()]
            if self.transfer.group_backend:
                loops.append(self._join_push_group())
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
        await ctx.bus.serve(subjects.engine_load(), LoadWeights, self.on_load)
        await ctx.bus.serve(subjects.engine_abort(), AbortGeneration, self.on_abort)
        await ctx.bus.serve(subjects.engine_shed(self.engine_id), ShedRequests, self.on_shed)
        await self._catch_up()
        async with self.membership.transition():
            self._joined = True
            if self.membership.role == "rollout":
                await self._start_serving()
            else:
                await self.engine.sleep()
                self._asleep = True
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
            self._asleep = False
            await self._catch_up(self._min_version)
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
            async with self._load_lock:  # never in the middle of a weight swap
                handed_back = len(self._in_flight)
                await self.engine.pause("abort")
                try:  # their "abort" replies are on the way
                    await asyncio.wait_for(
                        self._in_flight.empty.wait(), self.settings.release_timeout_s
                    )
                except TimeoutError:
                    log.error(
                        "%s: %d requests still in flight after the release time-out",
                        self.engine_id,
                        len(self._in_flight),
                    )
                await self.engine.sleep()
                self._asleep = True
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
            if request.min_version > self.engine.version:
                # a synchronous run's request that came before this engine loaded the
                # version it belongs to: load it first (bounded by min_version_wait_s);
                # one catch-up at a time, so a batch of such requests asks weight-sync
                # once and the others find the version loaded
                async with self._floor_lock:
                    if request.min_version > self.engine.version:
                        await self._catch_up(request.min_version)
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
                async with self._load_lock:  # never in the middle of a weight swap
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

    async def on_load(self, message: LoadWeights) -> None:
        try:
            await self._load([message.manifest])
        except VersionGap as exc:
            # a delta on a version this engine does not hold: build from the whole chain
            log.info("%s: %s; catching up from the chain", self.engine_id, exc)
            await self._catch_up()

    async def _load(self, chain: list[WeightManifest]) -> None:
        """Bring the engine to the chain's last version; payloads are fetched and
        checked while the engine still serves, requests pause only for the swap."""
        if not chain:
            return
        target = chain[-1].version
        async with self._load_lock:
            if target <= self.engine.version:
                return  # already serving it (or newer): loads are idempotent
            if self._asleep:
                return  # lent out of rollout: it catches up when lent back
            try:
                held = await self.receiver.follow(chain)
            except (weights.WeightsCorrupted, weights.PayloadMissing) as exc:
                # nothing of it is loaded; the version poll tries the current chain again
                log.warning("%s: version %d not loaded: %s", self.engine_id, target, exc)
                return
            if held == target:
                await self._serve_held(chain[-1].kind)

    async def _pushed(self, manifest: WeightManifest, payload: memoryview) -> None:
        """A payload broadcast by the trainer's push group (``SF_WEIGHTS_GROUP_*``)."""
        async with self._load_lock:
            try:
                held = await self.receiver.accept(manifest, payload)
            except (VersionGap, weights.WeightsCorrupted) as exc:
                log.warning("%s: pushed version %d refused (%s); it will be pulled",
                            self.engine_id, manifest.version, exc)  # fmt: skip
                return
            if not self._asleep and held > self.engine.version:
                await self._serve_held(f"{manifest.kind}, pushed")

    async def _serve_held(self, how: str) -> None:
        """Swap the engine to the version the receiver holds and announce it (the caller
        holds the load lock)."""
        version = self.receiver.mirror.version
        await self._swap(self.receiver.mirror.tensors(), version)
        self.membership.version = version
        await self.ctx.bus.publish(
            self.ctx.subjects.weights_loaded(),
            WeightsLoaded(engine_id=self.engine_id, version=version),
        )
        log.info("%s loaded version %d (%s)", self.engine_id, version, how)

    async def _join_push_group(self) -> None:
        settings = self.transfer
        try:
            group = await join_as_engine(self.ctx.bus, settings)
        except Exception as exc:  # the store still serves every version
            log.warning("%s could not join the push group: %r", self.engine_id, exc)
            return
        listener = PushListener(group, self._pushed, asyncio.get_running_loop())
        listener.start()
        log.info("%s joined the %s push group as rank %d", self.engine_id,
                 settings.group_backend, settings.group_rank)  # fmt: skip

    async def _swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Partial rollout: interrupt requests in flight as configured, load, resume."""
        mode = self.settings.interrupt_mode
        self.membership.set_phase("sync")
        with tracer.start_as_current_span(
            "engine.interrupt",
            attributes={
                "engine.id": self.engine_id,
                "version": version,
                "mode": mode,
                "in_flight": len(self._in_flight),
            },
        ):
            if mode == "wait":
                await self.engine.load_weights(state_dict, version)  # waits for the batch
            else:
                await self.engine.pause(mode)
                try:
                    await self.engine.load_weights(state_dict, version)
                finally:
                    await self.engine.resume()
        self.membership.set_phase("rollout" if self._in_flight else "idle")

    async def _catch_up(self, min_version: int = 0) -> None:
        """Ask weight-sync for the current version until it answers, then load it.

        With ``min_version`` (an engine lent back right after a train step), also wait
        until weight-sync announces at least that version, for up to
        ``SF_ENGINE_MIN_VERSION_WAIT_S``: the trainer stored it before releasing its
        slots, so only weight-sync's announcement can lag."""

        async def ask() -> CurrentVersion:
            current: CurrentVersion = await self.ctx.bus.request(
                self.ctx.subjects.weights_current(),
                CurrentVersionQuery(engine_id=self.engine_id),
                CurrentVersion,
                timeout=2.0,
            )
            return current

        deadline = asyncio.get_running_loop().time() + self.settings.min_version_wait_s
        while True:
            current = await retry(ask, CURRENT_VERSION_RETRY)
            if current.version < min_version and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
                continue
            if current.version > self.engine.version:
                try:
                    await self._load(current.chain)
                except VersionGap as exc:  # a chain that does not start with a full payload
                    log.warning("%s: cannot build version %d: %s", self.engine_id,
                                current.version, exc)  # fmt: skip
            return

    async def _version_poll_loop(self) -> None:
        """A missed broadcast (reconnect, late start) must not leave an engine stale."""
        while True:
            await asyncio.sleep(self.settings.version_poll_s)
            await self._catch_up()
