"""trainer: pulls batches, takes GRPO steps, checkpoints and publishes weight versions.

Consumes:
- ``sf.<run>.batch.ready`` (JetStream ``SF_<RUN>_BATCH``, durable consumer ``trainer``:
  TrainBatch; acked only after the step's weights are published)
- ``sf.<run>.sched.assign.<trainer>`` (RoleAssignment)
Produces:
- object store ``sf_<run>_weights``: ``weights-v<version>`` (complete before announced)
- ``sf.<run>.weights.published`` (JetStream: WeightsPublished)
- ``sf.<run>.train.metrics`` / ``sf.<run>.train.finished`` (JetStream)
- ``sf.<run>.sched.register`` / ``sf.<run>.sched.heartbeat.<trainer>``
- ``sf.<run>.sched.claim`` (SlotsClaim: a batch is here, reclaim engines lent from my
  slots) before each step; ``sf.<run>.sched.release`` (SlotsReleased: I wait, my
  slots may be lent) after each publish and at start
- ``<run_dir>/checkpoints/final`` (HF layout: safetensors + tokenizer) and
  ``<run_dir>/checkpoints/step-<n>``

Version v is the policy after v optimizer steps; version 0 is the base model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TypeVar

import nats.errors
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seamlessflow import telemetry, weights
from seamlessflow.bus import NoResponder, RemoteError
from seamlessflow.protocol import (
    TRAINER_DURABLE,
    LendReport,
    Message,
    SlotsClaim,
    SlotsGranted,
    SlotsReleased,
    TrainBatch,
    TrainingFinished,
    TrainStepMetrics,
    WeightsPublished,
    decode,
)
from seamlessflow.resources import ResourceMembership
from seamlessflow.service import ServiceContext
from sf_trainer.config import TrainerSettings
from sf_trainer.step import StepResult, train_step

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)
R = TypeVar("R", bound=Message)


class Trainer:
    name = "trainer"

    def __init__(self, settings: TrainerSettings | None = None) -> None:
        self.settings = settings or TrainerSettings()
        self.trainer_id = f"trainer-{socket.gethostname()}-{os.getpid()}"
        self.step = 0
        self.version = 0

    async def run(self, ctx: ServiceContext) -> None:
        if ctx.mesh.model_dir is None:
            raise RuntimeError("the trainer needs SF_MODEL_DIR")
        torch.set_num_threads(self.settings.torch_threads)
        torch.manual_seed(self.settings.seed)
        self.ctx = ctx
        self.model_dir = ctx.mesh.model_dir
        self.model = await asyncio.to_thread(
            AutoModelForCausalLM.from_pretrained, str(self.model_dir), dtype=torch.float32
        )
        self.model.to(self.settings.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.settings.lr,
            betas=self.settings.betas,
            weight_decay=self.settings.weight_decay,
        )
        self.membership = ResourceMembership(
            ctx.bus, self.trainer_id, "trainer", ctx.mesh.tags(["train"]), slots=ctx.mesh.slots()
        )
        await self.membership.register()
        heartbeat = asyncio.create_task(self.membership.heartbeat_loop())
        try:
            await self.membership.wait_for_role("train")
            await self._release_slots()
            batches = await ctx.bus.js.pull_subscribe(
                ctx.subjects.batch_ready(),
                durable=TRAINER_DURABLE,
                stream=ctx.subjects.stream_batches(),
            )
            try:
                await self._train_loop(batches)
            finally:
                # a pull subscription left open makes the connection's drain wait forever
                await batches.unsubscribe()
        finally:
            heartbeat.cancel()
            self.membership.end_phase()
            # Ctrl-C or SIGTERM still leaves a loadable checkpoint of the latest policy.
            if ctx.mesh.run_dir is not None:
                await asyncio.to_thread(self.save_checkpoint, "final")

    async def _train_loop(self, batches) -> None:  # type: ignore[no-untyped-def]
        while self.step < self.settings.steps and not self.ctx.stopping.is_set():
            self.membership.set_phase("idle")
            wait_started = time.monotonic()
            msg = await self._next_batch(batches)
            if msg is None:
                continue
            wait_seconds = time.monotonic() - wait_started
            try:
                batch = decode(msg.data, TrainBatch)
            except ValueError as exc:
                log.error("terminating malformed batch: %s", exc)
                await msg.term()
                continue
            with telemetry.extracted_context(msg.headers):
                await self._claim_slots(batch.batch_index)
                await self._step(batch, wait_seconds)
            await msg.ack_sync()
            if self.step < self.settings.steps:
                await self._release_slots()
        if self.step >= self.settings.steps:
            checkpoint = await asyncio.to_thread(self.save_checkpoint, "final")
            await self.ctx.bus.js_publish(
                self.ctx.subjects.train_finished(),
                TrainingFinished(
                    steps=self.step, final_version=self.version, checkpoint_dir=str(checkpoint)
                ),
                msg_id=f"finished-{self.step}",
            )
            log.info("training finished after %d steps (version %d)", self.step, self.version)

    async def _next_batch(self, batches):  # type: ignore[no-untyped-def]
        stop = asyncio.create_task(self.ctx.stopping.wait())
        try:
            while not self.ctx.stopping.is_set():
                fetch = asyncio.create_task(batches.fetch(1, timeout=1.0))
                await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    return None
                try:
                    return fetch.result()[0]
                except nats.errors.TimeoutError:
                    continue
            return None
        finally:
            stop.cancel()

    async def _claim_slots(self, batch_index: int) -> None:
        """Take back the slots lent to rollout; train only once they are free."""
        claim = SlotsClaim(trainer_id=self.trainer_id, batch_index=batch_index)
        granted = await self._ask_scheduler(self.ctx.subjects.sched_claim(), claim, SlotsGranted)
        if granted is not None and granted.missed:
            log.warning("engines %s did not release their slots in time", granted.missed)

    async def _release_slots(self) -> None:
        """Waiting for a batch: the scheduler may lend my slots to rollout meanwhile."""
        release = SlotsReleased(trainer_id=self.trainer_id, version=self.version)
        report = await self._ask_scheduler(self.ctx.subjects.sched_release(), release, LendReport)
        if report is not None and report.lent:
            log.debug("slots lent to %s: %s", report.lent, report.reason)

    async def _ask_scheduler(self, subject: str, request: Message, reply_type: type[R]) -> R | None:
        """A scheduler that does not answer never blocks training: logged, then None."""
        try:
            reply: R = await self.ctx.bus.request(
                subject, request, reply_type, timeout=self.settings.claim_timeout_s
            )
        except (NoResponder, RemoteError) as exc:
            log.warning("tag-scheduler did not answer on %s (%s); training goes on", subject, exc)
            return None
        return reply

    async def _step(self, batch: TrainBatch, wait_seconds: float) -> None:
        self.membership.set_phase("train")
        with tracer.start_as_current_span(
            "trainer.step", attributes={"step": self.step + 1, "batch.index": batch.batch_index}
        ) as span:
            started = time.monotonic()
            result: StepResult = await asyncio.to_thread(
                train_step, self.model, self.optimizer, batch, self.settings, self.version
            )
            step_seconds = time.monotonic() - started
            span.set_attribute("loss", result.loss)
            span.set_attribute("tokens", result.tokens_trained)
        self.step += 1
        self.version += 1
        self.membership.set_phase("sync")
        started = time.monotonic()
        with tracer.start_as_current_span(
            "trainer.publish_weights", attributes={"version": self.version}
        ):
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            name, digest, size = await weights.put_weights(self.ctx.bus, self.version, state)
            await self.ctx.bus.js_publish(
                self.ctx.subjects.weights_published(),
                WeightsPublished(
                    version=self.version,
                    object_name=name,
                    sha256=digest,
                    num_bytes=size,
                    step=self.step,
                ),
                msg_id=f"weights-v{self.version}",
            )
        publish_seconds = time.monotonic() - started
        self.membership.version = self.version
        metrics = TrainStepMetrics(
            step=self.step,
            version=self.version,
            batch_index=batch.batch_index,
            mean_reward=result.mean_reward,
            loss=result.loss,
            clip_fraction=result.clip_fraction,
            samples=result.samples,
            tokens_generated=result.tokens_generated,
            tokens_trained=result.tokens_trained,
            max_staleness=result.max_staleness,
            staleness_histogram=result.staleness_histogram,
            logprob_abs_diff=result.logprob_abs_diff,
            truncated_fraction=result.truncated_fraction,
            step_seconds=step_seconds,
            wait_seconds=wait_seconds,
            publish_seconds=publish_seconds,
        )
        await self.ctx.bus.js_publish(
            self.ctx.subjects.train_metrics(), metrics, msg_id=f"metrics-{self.step}"
        )
        every = self.settings.checkpoint_every
        if every and self.step % every == 0 and self.ctx.mesh.run_dir is not None:
            await asyncio.to_thread(self.save_checkpoint, f"step-{self.step}")

    def save_checkpoint(self, name: str) -> Path:
        """HF layout (safetensors + tokenizer), loadable with ``from_pretrained``."""
        assert self.ctx.mesh.run_dir is not None
        out = self.ctx.mesh.run_dir / "checkpoints" / name
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(self.model_dir)).save_pretrained(out)
        (out / "trainer_state.json").write_text(
            json.dumps({"step": self.step, "version": self.version}, indent=2)
        )
        return out
