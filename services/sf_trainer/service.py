# Over 400 lines: start, loop, resume and checkpoints share the trainer's counters.
"""trainer: pulls batches, takes GRPO steps, checkpoints and publishes weight versions.

A trainer trains one policy (``SF_POLICY``); a multi-policy run has one per policy, and
the ``<policy>`` in the names below is its own.

Consumes:
- ``sf.<run>.batch.<policy>.ready`` (JetStream ``SF_<RUN>_BATCH-<policy>``, durable
  consumer ``trainer``: BatchReady, whose TrainBatch it reads from
  ``SF_<RUN>_BATCHDATA-<policy>`` (``seamlessflow.batches``), or a TrainBatch published
  whole, in ``batch_index`` order (``sf_trainer.delivery``); acked only after the
  step's weights are published)
- ``sf.<run>.sched.assign.<trainer>`` (RoleAssignment)
- ``sf.<run>.sched.cores.<trainer>`` (CoresLent: idle rollout engines' cores it may
  train on now; ``sf_trainer.threads``)
Produces:
- weight payloads (``seamlessflow.weights``: full or delta, in the NATS Object Store or
  shared memory, complete before announced; the trainer deletes chains it no longer keeps;
  with ``cuda_ipc`` on a CUDA device, packed there and announced once held, the fallback
  store's copy written after)
- ``sf.<run>.weights.<policy>.published`` (JetStream: WeightsPublished; a ``cuda_ipc``
  version packed on the device twice: held, its fallback pending, then completed)
- with a push group (``SF_WEIGHTS_GROUP_*``): each payload broadcast to the group's
  engines; with ``nccl`` it answers ``sf.<run>.weights.<policy>.group`` (the NCCL id)
- ``sf.<run>.train.<policy>.metrics`` / ``.finished`` (JetStream ``SF_<RUN>_METRICS``),
  and ``.eval`` (TrainEvalMetrics, every ``SF_EVAL_EVERY`` steps, of the base
  model before the first step and after the last)
- ``sf.<run>.sched.register`` / ``sf.<run>.sched.heartbeat.<trainer>``
- ``sf.<run>.sched.claim`` (SlotsClaim: a batch is here, reclaim engines lent from my
  slots) before each step; ``sf.<run>.sched.release`` (SlotsReleased: I wait, my
  slots may be lent) after each publish and at start (``sf_trainer.slots``); with
  ``SF_TRAINER_OFFLOAD_WHEN_LENT`` in effect and engines lent, ``sf.<run>.sched.freed``
  (SlotsFreed) once every rank moved its state to host memory (spans
  ``trainer.offload``, and ``trainer.reload`` after the claim)
- ``<run_dir>/checkpoints/final`` and ``<run_dir>/checkpoints/step-<n>`` (another
  policy than the default: ``checkpoints/<policy>/...``; ``sf_trainer.checkpoint``: HF
  layout, optimizer state, step / version / data position); a save never replaces a
  checkpoint whose weights hold more trained steps (``checkpoint.FewerTrainedSteps``)

Version 0 is the base model and each optimizer step publishes the next version.
Versions only go up: at start the trainer numbers its versions after the newest one in
the weights stream (a restart, with or without ``SF_TRAINER_RESUME``, never reuses a
version number that engines may already serve).

A step's TrainStepMetrics is its durable record, published before its version is
announced and before its batch is acked. A restarted trainer continues after the last
recorded step (step count and data position), whatever checkpoint it resumes the
policy from: a batch is never trained twice, and the step budget counts the steps a
resume lost, so the trainer needs exactly the batches the trajectory service makes.

Several ranks (``sf_trainer.launch``): this service runs on rank 0 only and drives the
other ranks through ``sf_trainer.learner``; every step, weight gather and checkpoint
involves all ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch

from seamlessflow import telemetry
from seamlessflow.bus import DurableConsumer, ack_redeliverable
from seamlessflow.protocol import (
    TRAINER_DURABLE,
    CoresLent,
    MessageIds,
    TrainBatch,
    TrainEvalMetrics,
    TrainingFinished,
    TrainingPlanned,
    WeightManifest,
    WeightsPublished,
)
from seamlessflow.resources import ResourceMembership
from seamlessflow.service import ServiceContext
from seamlessflow.settings import checkpoints_dir
from seamlessflow.weights.group import form_as_trainer, how_buckets_travel
from seamlessflow.weights.ipc import DevicePayloads
from seamlessflow.weights.settings import WeightTransferSettings, publisher
from sf_trainer import checkpoint, history
from sf_trainer.checkpoint import TrainerState
from sf_trainer.delivery import BatchDelivery
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from sf_trainer.slots import TrainingSlots
from sf_trainer.step import StepResult, metrics_of

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

T = TypeVar("T")


def weight_transfer(settings: TrainerSettings) -> WeightTransferSettings:
    """How this trainer's weights travel (``SF_WEIGHTS_*``). Unless ``SF_WEIGHTS_DTYPE``
    says otherwise, in the precision the trainer computes in: a bf16-mixed trainer's
    forward already rounds every matmul weight to bfloat16, so engines given bfloat16
    weights compute what it computes (measured on SmolLM2: the trainer-engine logprob gap
    0.030 nats against 0.033 with float32 weights), half the bytes travel, and most
    words survive a step, so deltas carry the versions (13x fewer bytes, publish 0.3 s
    instead of 2.3 s: docs/benchmarks.md). ``SF_WEIGHTS_DTYPE=float32`` keeps float32."""
    transfer = WeightTransferSettings()
    if not transfer.dtype and settings.precision == "bf16-mixed":
        transfer = transfer.model_copy(update={"dtype": "bfloat16"})
    return transfer


class TrainerService:
    name = "trainer"

    def __init__(
        self, settings: TrainerSettings | None = None, group: TrainGroup | None = None
    ) -> None:
        self.settings = settings or TrainerSettings()
        self.group = group or TrainGroup(device=torch.device(self.settings.device))
        self.trainer_id = ""
        """``trainer-<policy>-<host>-<pid>``: unique in the run (set when it starts)."""
        self.step = 0
        self.version = 0
        self._announcing: set[asyncio.Task[None]] = set()
        """Second announcements waiting for their versions' fallbacks to be stored."""
        self.data_position = -1
        """``batch_index`` of the last trained batch: a batch at or before it is not trained."""
        self.trained_steps = 0
        """Optimizer steps the policy's weights hold (``step`` less the steps a resume
        lost): what decides whether a checkpoint may be replaced."""
        self._lent_thread_s = 0.0
        """Thread-seconds the last step ran on lent cores (``sf_trainer.threads``)."""
        self.unsaved_steps = 0
        """Steps since ``checkpoints/final`` was written: a trainer that trained nothing
        (e.g. a bad ``SF_TRAINER_RESUME``) never overwrites it on the way out."""

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the trainer needs SF_MODEL_DIR")
        self.ctx = ctx
        self.policy = ctx.subjects.policy
        self.trainer_id = f"trainer-{self.policy}-{socket.gethostname()}-{os.getpid()}"
        self.model_dir = ctx.mesh.model_dir
        log.info("%s; weights travel as %s", self.settings.precision_choice.line(),
                 weight_transfer(self.settings).dtype or "float32")  # fmt: skip
        # Every Learner call runs on this one thread, in call order: the collectives are
        # issued in the order the other ranks replay them, even when a stop comes while
        # a step is still running.
        self._learner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self.learner = await self._on_learner(
            Learner, self.settings, self.group, self.model_dir, ctx.mesh.seed
        )
        try:
            await self._resume()
            # the budget the trajectory service dispatches for, and the seed it must share
            await ctx.bus.js_publish(
                ctx.subjects.train_plan(),
                TrainingPlanned(steps=self.settings.steps, seed=ctx.mesh.seed, policy=self.policy),
                msg_id=MessageIds.train_plan(self.policy, self.trainer_id),
            )
            transfer = weight_transfer(self.settings)
            version_bytes = self.learner.version_bytes(transfer.travel_dtype)
            self.publisher = publisher(ctx.bus, transfer, version_bytes, self.settings.device)
            if isinstance(self.publisher.store, DevicePayloads):
                # device buffers are freed as the engines acknowledge each version
                await self.publisher.store.watch(ctx.bus)
            log.info("a version is %.3f GB: %s", version_bytes / 1e9,
                     "sent as deltas where smaller" if self.publisher.encoder.deltas else
                     "streamed bucket by bucket as it is gathered, in full"
                     + (f" (over SF_WEIGHTS_DELTA_MAX_MB={transfer.delta_max_mb:g})"
                        if transfer.deltas else ""))  # fmt: skip
            if transfer.group_backend:
                # blocks until every engine of the group joined (SF_WEIGHTS_GROUP_TIMEOUT_S)
                self.publisher.push = await form_as_trainer(ctx.bus, transfer)
                log.info("formed the %s push group of %d (%s)", transfer.group_backend,
                         transfer.group_size,
                         how_buckets_travel(self.publisher.push))  # fmt: skip
            self.slots = TrainingSlots(
                ctx.bus, self.trainer_id, self.policy, self.settings.claim_timeout_s
            )
            self.membership = ResourceMembership(
                ctx.bus,
                self.trainer_id,
                "trainer",
                ctx.mesh.tags(["train"]),
                slots=ctx.mesh.slots(),
            )
            self.membership.version = self.version
            await self.membership.register()
            await ctx.bus.subscribe(
                ctx.subjects.sched_cores(self.trainer_id), CoresLent, self.on_cores_lent
            )
            heartbeat = asyncio.create_task(self.membership.heartbeat_loop())
            try:
                await self.membership.wait_for_role("train")
                if self.settings.eval_every and self.step == 0:
                    await self._evaluate()  # the base model: what training is measured from
                await self._release_slots()
                async with ctx.bus.durable_consumer(
                    ctx.subjects.stream_batches(), ctx.subjects.batch_ready(), TRAINER_DURABLE
                ) as batches:
                    await self._train_loop(batches)
            finally:
                heartbeat.cancel()
                self.membership.end_phase()
                await self.membership.leave()
                # the last versions' second announcements (their fallbacks stored) first
                await asyncio.gather(*self._announcing, return_exceptions=True)
                await self.publisher.close()
        finally:
            # Ctrl-C or SIGTERM still leaves a loadable checkpoint of the latest policy.
            # One job: the other ranks are stopped even if this await is cancelled.
            await self._on_learner(self._final_checkpoint_and_stop)
            self._learner_thread.shutdown(wait=False)

    async def _on_learner(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._learner_thread, fn, *args)

    async def _resume(self) -> None:
        """Start from ``SF_TRAINER_RESUME`` if set, and number versions after every
        version already announced (engines never go back; JetStream would also drop a
        reused ``MessageIds.weights`` id as a duplicate)."""
        path = checkpoint.resolve_resume(self.settings.resume, self.ctx.mesh.run_dir, self.policy)
        if path is not None:
            state = await self._on_learner(self.learner.restore, path)
            self.step, self.version = state.step, state.version
            self.data_position = state.data_position
            self.trained_steps = state.trained
        elif self.settings.resume:
            log.info("no checkpoint to resume from (%s): starting from the base model",
                     self.settings.resume)  # fmt: skip
        recorded = await history.last_recorded_step(self.ctx.bus)
        if recorded is not None and recorded.step > self.step:
            log.warning(
                "steps %d-%d were recorded after %s: the policy loses them; their batches "
                "(up to %d) are not trained again", self.step + 1, recorded.step,
                path or "the base model", recorded.batch_index,
            )  # fmt: skip
            self.step = recorded.step
            self.data_position = max(self.data_position, recorded.batch_index)
        announced = max(await history.announced_version(self.ctx.bus),
                        recorded.version if recorded else 0)  # fmt: skip
        if announced > self.version:
            log.info("version %d is already announced: the next version is %d",
                     announced, announced + 1)  # fmt: skip
            self.version = announced

    async def _train_loop(self, batches: DurableConsumer) -> None:
        delivery = BatchDelivery(self.ctx.bus, batches, self.policy, self.ctx.stopping)
        while self.step < self.settings.steps and not self.ctx.stopping.is_set():
            self.membership.set_phase("idle")
            delivered = await delivery.next(self.data_position)
            if delivered is None:
                continue
            with telemetry.extracted_context(delivered.msg.headers):
                await self.slots.claim(delivered.batch.batch_index)
                await self._reload()
                await self._step(delivered.batch, delivered.wait_seconds)
            # a redelivery is skipped by the data position, which the step record holds
            await ack_redeliverable(delivered.msg)
            if self.step < self.settings.steps:
                await self._release_slots()
        if self.step >= self.settings.steps:
            await self._finish()

    async def _finish(self) -> None:
        """``checkpoints/final`` and the TrainingFinished record. A trainer started again
        after its run finished (a restart policy, a second `up`) arrives here at once:
        the guarded save keeps the trained ``final``."""
        final, kept = await self._on_learner(self._save_final)
        await self.ctx.bus.js_publish(
            self.ctx.subjects.train_finished(),
            TrainingFinished(
                steps=self.step,
                final_version=kept.version,
                checkpoint_dir=str(final),
                policy=self.policy,
            ),
            msg_id=MessageIds.train_finished(self.policy, kept.version),
        )
        log.info("training finished after %d steps: %s holds %d trained steps "
                 "(version %d)", self.step, final, kept.trained, kept.version)  # fmt: skip

    async def on_cores_lent(self, lent: CoresLent) -> None:
        """The learner takes the offer at its next layer (``ThreadBudget.apply``)."""
        if self.learner.threads is not None:
            self.learner.threads.lend(lent.threads)

    async def _release_slots(self) -> None:
        """Waiting for a batch: the scheduler may lend my slots to rollout meanwhile.
        Lent cores go back first (the engines get work with the version just published)."""
        if self.learner.threads is not None:
            self.learner.threads.lend(0)
        lent = await self.slots.release(self.version, frees_memory=self.learner.offloads)
        if lent and self.learner.offloads:
            with tracer.start_as_current_span("trainer.offload", attributes={"lent": lent}) as span:
                offload = await self._on_learner(self.learner.offload)
                if offload is not None:
                    span.set_attribute("seconds", offload.seconds)
                    span.set_attribute("bytes", offload.device_bytes_moved)
            await self.slots.freed(
                offload.device_bytes_moved if offload else 0, offload.seconds if offload else 0.0
            )

    async def _reload(self) -> None:
        """The slots are claimed back: the state offloaded while lent returns to the
        device before anything else runs on it (the step would reload it anyway)."""
        if not self.learner.offloaded:
            return
        with tracer.start_as_current_span("trainer.reload") as span:
            reload = await self._on_learner(self.learner.reload)
            if reload is not None:
                span.set_attribute("seconds", reload.seconds)
                span.set_attribute("bytes", reload.device_bytes_moved)

    async def _step(self, batch: TrainBatch, wait_seconds: float) -> None:
        """One step of training end to end, the page to read first. The learner's part,
        ``sf_trainer.step.train_step``: shaped rewards -> advantages -> per micro-batch
        logprobs -> loss -> backward -> optimizer step."""
        self.membership.set_phase("train")
        with tracer.start_as_current_span(
            "trainer.step", attributes={"step": self.step + 1, "batch.index": batch.batch_index}
        ) as span:
            started = time.monotonic()
            result = await self._on_learner(self._train, batch)
            step_seconds = time.monotonic() - started
            span.set_attribute("loss", result.loss)
            span.set_attribute("tokens", result.tokens_trained)
            span.set_attribute("grad_norm", result.grad_norm)
        self.membership.set_phase("sync")
        started = time.monotonic()
        manifest, storing = await self._publish_weights()
        publish_seconds = time.monotonic() - started
        self.membership.version = self.version
        metrics = metrics_of(
            result,
            policy=self.policy,
            step=self.step,
            version=self.version,
            batch_index=batch.batch_index,
            manifest=manifest,
            wait_seconds=wait_seconds,
            step_seconds=step_seconds,
            publish_seconds=publish_seconds,
            lent_thread_seconds=self._lent_thread_s,
        )
        # The step's record first: a restart resumes after it (``_resume``), so a version
        # is never announced for a step that could be trained again.
        await self.ctx.bus.js_publish(
            self.ctx.subjects.train_metrics(),
            metrics,
            msg_id=MessageIds.train_metrics(self.policy, self.version),
        )
        await self.ctx.bus.js_publish(
            self.ctx.subjects.weights_published(),
            WeightsPublished(manifest=manifest, step=self.step),
            msg_id=MessageIds.weights(self.policy, self.version),
        )
        if storing is not None:  # after the first announcement: the stream keeps the order
            self._announce_when_stored(storing, self.version, self.step)
        await self._checkpoint_if_due()
        last = self.step == self.settings.steps
        if self.settings.eval_every and (self.step % self.settings.eval_every == 0 or last):
            await self._evaluate()

    def _announce_when_stored(
        self, storing: asyncio.Task[WeightManifest], version: int, step: int
    ) -> None:
        """Announce ``version`` a second time once its fallback is stored (it was first
        announced with the fallback pending: ``DevicePayload.fallback_pending``); the
        span ``trainer.store_fallback`` lasts from the first announcement to then."""

        async def announce() -> None:
            with tracer.start_as_current_span(
                "trainer.store_fallback", attributes={"version": version}
            ):
                try:
                    manifest = await storing
                except Exception as exc:  # engines that map the buckets still have it
                    log.error("version %d: its fallback was not stored: %r", version, exc)
                    return
            await self.ctx.bus.js_publish(
                self.ctx.subjects.weights_published(),
                WeightsPublished(manifest=manifest, step=step),
                msg_id=MessageIds.weights_stored(self.policy, manifest.version),
            )

        task = asyncio.create_task(announce())
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    async def _publish_weights(self) -> tuple[WeightManifest, asyncio.Task[WeightManifest] | None]:
        """The version just trained, stored completely (not yet announced), or held in
        device memory with its fallback being stored (the task: announce its result
        too)."""
        with tracer.start_as_current_span(
            "trainer.publish_weights", attributes={"version": self.version}
        ):
            # gathered tensor by tensor, each cast to the travel dtype where it lives;
            # bucket by bucket to the store and the push group as it is gathered, or,
            # with deltas (which need the whole version), into one payload first
            encoder, dtype = self.publisher.encoder, self.publisher.dtype
            if self.publisher.packs_on_device:  # cuda_ipc: packed on the device
                try:
                    return await self.publisher.publish_packed(
                        lambda: self._on_learner(
                            self.learner.pack_weights, encoder, self.version, dtype
                        )
                    )
                except torch.OutOfMemoryError as exc:  # the device cannot take a copy
                    log.warning("version %d not packed on the device (%r): through host "
                                "memory", self.version, exc)  # fmt: skip
            if encoder.streams:
                streamed = await self.publisher.publish_streamed(
                    self.version,
                    lambda sink: self._on_learner(
                        self.learner.stream_weights, encoder, self.version, dtype, sink
                    ),
                )
                return streamed, None
            encoded = await self._on_learner(
                self.learner.encode_weights, encoder, self.version, dtype
            )
            return await self.publisher.publish_encoded(encoded), None

    async def _checkpoint_if_due(self) -> None:
        """``checkpoints/step-<n>`` every ``SF_CHECKPOINT_EVERY`` steps, keeping
        the newest ``SF_TRAINER_KEEP_CHECKPOINTS``."""
        every = self.settings.checkpoint_every
        if every and self.step % every == 0 and self.ctx.mesh.run_dir is not None:
            await self._on_learner(self.save_checkpoint, f"step-{self.step}")
            if self.settings.keep_checkpoints:
                root = checkpoints_dir(self.ctx.mesh.run_dir, self.policy)
                await asyncio.to_thread(checkpoint.prune, root, self.settings.keep_checkpoints)

    async def _evaluate(self) -> None:
        """The version just announced on the held-out split (``sf_trainer.evaluation``),
        recorded as a TrainEvalMetrics."""
        started = time.monotonic()
        with tracer.start_as_current_span("trainer.evaluate", attributes={"version": self.version}):
            result = await self._on_learner(self.learner.evaluate)
        assert self.learner.eval_set is not None  # eval_every > 0 built it
        record = TrainEvalMetrics(
            policy=self.policy,
            step=self.step,
            version=self.version,
            task=self.learner.eval_set.task,
            split="eval",
            samples=result.samples,
            mean_reward=result.mean_reward,
            max_tokens=self.settings.eval_max_tokens,
            eval_seconds=time.monotonic() - started,
            by_task=result.by_task,
        )
        by_task = "".join(f"; {task} {score:.4f}" for task, score in result.by_task.items())
        log.info("eval at step %d (version %d): mean reward %.4f over %d %s prompts%s",
                 self.step, self.version, result.mean_reward, result.samples,
                 record.task, by_task)  # fmt: skip
        await self.ctx.bus.js_publish(
            self.ctx.subjects.train_eval(),
            record,
            msg_id=MessageIds.train_eval(self.policy, self.version),
        )

    def _train(self, batch: TrainBatch) -> StepResult:
        """One step, on the learner thread. The counters move with the weights: a
        checkpoint queued behind a step that outlived a stop describes what it saves
        (the batch, never acked, is redelivered and then skipped, not trained twice)."""
        threads = self.learner.threads
        lent_before = threads.extra_thread_seconds() if threads else 0.0
        result = self.learner.step(batch, self.version, step=self.step)
        self._lent_thread_s = threads.extra_thread_seconds() - lent_before if threads else 0.0
        self.step += 1
        self.version += 1
        self.data_position = batch.batch_index
        self.trained_steps += 1
        self.unsaved_steps += 1
        return result

    def save_checkpoint(self, name: str) -> tuple[Path, TrainerState]:
        """``<checkpoints>/<name>`` (``sf_trainer.checkpoint``) and the state it holds
        afterwards: this policy's, or, if the checkpoint there holds more trained steps,
        that one's (kept, not replaced); learner thread."""
        assert self.ctx.mesh.run_dir is not None
        state = TrainerState(
            step=self.step,
            version=self.version,
            data_position=self.data_position,
            trained_steps=self.trained_steps,
        )
        out = checkpoints_dir(self.ctx.mesh.run_dir, self.policy) / name
        with contextlib.suppress(OSError, msgspec.DecodeError):
            if checkpoint.read_state(out) == state:
                # the same published version, as many trained steps: this very policy
                # (e.g. resumed from it and finished at once)
                log.info("checkpoint %s already holds this policy", out)
                return out, state
        try:
            # checked before the (collective) gather too, which is then skipped
            checkpoint.check_replaceable(out, state)
            return self.learner.save(out, state), state
        except checkpoint.FewerTrainedSteps as exc:
            log.warning("checkpoint not saved: %s", exc)
            return out, checkpoint.read_state(out)

    def _save_final(self) -> tuple[Path, TrainerState]:
        saved = self.save_checkpoint("final")
        self.unsaved_steps = 0
        return saved

    def _final_checkpoint_and_stop(self) -> None:
        try:
            if self.ctx.mesh.run_dir is not None and self.unsaved_steps:
                self._save_final()
        finally:
            self.learner.stop()
