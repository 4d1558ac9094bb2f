"""Batches of real size from the trajectory service to the trainer (``seamlessflow.batches``)
through a real nats-server: a batch far above NATS' ``max_payload`` is published and
fetched whole, a payload gone or altered is reported, a 64 x 4k-token batch with a
16k-token sample goes from trajectory events to a trained step, and the transport
benchmark runs. The packed encoding on its own is tests/unit/test_batch_encoding.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats.errors
import numpy as np
import pytest

from seamlessflow import batches
from seamlessflow.bus import Bus, connect
from seamlessflow.protocol import (
    TRAINER_DURABLE,
    BatchReady,
    RewardReported,
    SessionFinished,
    SessionOpened,
    Subjects,
    TaskAssignment,
    TaskClaim,
    TrainingFinished,
    TrainStepMetrics,
    TurnRecorded,
    decode,
    encode,
)
from seamlessflow.resources import ResourceMembership
from seamlessflow.service import ServiceContext
from seamlessflow.settings import MeshSettings
from sf_trainer.service import TrainerService
from sf_trainer.settings import TrainerSettings
from sf_trainer.threads import usable_cpus
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from tests.support import REPO_ROOT, InProcessMesh
from tests.support.trainer_batches import big_batch

# --------------------------------------------------------------------------- delivery


async def test_a_batch_far_above_max_payload_is_published_in_chunks_and_fetched_whole(
    bus: Bus,
) -> None:
    """64 x 4k tokens: as one message (what the trajectory service published before)
    NATS refuses it; as a payload it arrives whole and exact, and the trajectory
    service's restart reads only the small BatchReady."""
    batch = big_batch(0, [[4096] * 8] * 8)
    assert len(encode(batch)) > bus.nc.max_payload
    with pytest.raises(nats.errors.MaxPayloadError):
        await bus.js_publish(bus.subjects.batch_ready(), batch, msg_id="batch-0-whole")

    ready = await batches.publish_batch(bus, batch)
    assert len(ready.payload.chunk_seqs) > 1
    assert ready.payload.payload_bytes < 11 * 64 * 4096
    assert [s.session_id for g in ready.groups for s in g.samples] == [
        s.session_id for g in batch.groups for s in g.samples
    ]
    [stored] = await batches.stored_announcements(bus)
    assert stored == ready and len(encode(stored)) < 16 * 1024
    assert await batches.stored_batches(bus) == [batch]
    # a re-publish (a restarted trajectory service) lands once, chunks included
    assert await batches.publish_batch(bus, batch) == ready
    info = await bus.js.stream_info(bus.subjects.stream_batch_payloads())
    assert info.state.messages == len(ready.payload.chunk_seqs)


async def test_a_payload_that_is_gone_or_altered_is_reported_as_missing(bus: Bus) -> None:
    ready = await batches.publish_batch(bus, big_batch(0, [[300] * 4]))
    chunk = ready.payload.chunk_seqs[0]
    altered = msgspec.structs.replace(
        ready, payload=msgspec.structs.replace(ready.payload, sha256="0" * 64)
    )
    with pytest.raises(batches.BatchPayloadMissing, match="not the one announced"):
        await batches.fetch_batch(bus, altered)
    other = await batches.publish_batch(bus, big_batch(1, [[10]]))
    swapped = msgspec.structs.replace(
        ready, payload=msgspec.structs.replace(ready.payload, chunk_seqs=other.payload.chunk_seqs)
    )
    with pytest.raises(batches.BatchPayloadMissing, match="is not its chunk"):
        await batches.fetch_batch(bus, swapped)
    await bus.js.delete_msg(bus.subjects.stream_batch_payloads(), chunk)
    with pytest.raises(batches.BatchPayloadMissing, match="no longer in"):
        await batches.fetch_batch(bus, ready)


# --------------------------------------------------------------------------- end to end

GROUP_SIZE = 4
GROUPS = 16
TOKENS = 4096
LONG_SAMPLE = 16_384


async def play_session(
    bus: Bus, task: TaskAssignment, length: int, rng: np.random.Generator
) -> int:
    """What the gateway records for one agent session of ``length`` tokens (one turn:
    a quarter prompt, the rest completion); returns the completion's length."""
    session = f"s{task.group_id}-{task.sample_index}"
    prompt = length // 4
    completion = length - prompt
    turn = TurnRecorded(
        session_id=session,
        turn_index=0,
        request_id=session,
        engine_id="e",
        prompt_ids=rng.integers(3, 400, prompt).tolist(),
        completion_ids=rng.integers(3, 400, completion).tolist(),
        logprobs=(-rng.uniform(0.5, 6, completion)).astype(np.float32).tolist(),
        versions=[0] * completion,
        finish_reason="length",
        completion_text="x",
    )
    events = [
        SessionOpened(
            session_id=session,
            task_id=task.task_id,
            group_id=task.group_id,
            sample_index=task.sample_index,
            group_size=task.group_size,
            reference=task.reference,
            reward_fn=task.reward_fn,
        ),
        turn,
        RewardReported(session_id=session, reward=float(task.sample_index % 2)),
        SessionFinished(session_id=session),
    ]
    for event in events:
        await bus.js_publish(bus.subjects.trajectory_event(session), event)
    return completion


@pytest.fixture(scope="module")
def narrow_model_dir(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base model's tokenizer and vocabulary with the narrowest layers that still
    are a Qwen2 (one layer, width 16): the attention over 262k tokens in 4-16k rows is
    what a step on CPU spends its time on, and it grows with the width."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("narrow")
    for name in base_model_dir.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    config = AutoConfig.from_pretrained(str(base_model_dir))
    config.update(
        {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "layer_types": config.layer_types[:1],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": LONG_SAMPLE,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


async def test_a_64_by_4k_token_batch_with_a_16k_sample_is_trained(
    mesh: InProcessMesh, bus: Bus, narrow_model_dir: Path, tmp_path: Path
) -> None:
    """Trajectory events of 64 sessions (63 of 4k tokens, one of 16k) -> the trajectory
    service's batch -> the real nats-server -> the trainer, which trains it in one step
    (micro-batches of ``micro_batch_tokens``). Fails on a build that publishes the batch
    as one message: NATS refuses it (``MaxPayloadError``)."""
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    trajectory = await mesh.start(
        TrajectoryService(
            TrajectorySettings(group_size=GROUP_SIZE, groups_per_batch=GROUPS, data_filters="")
        )
    )
    await asyncio.wait_for(trajectory.ready.wait(), 30)
    rng = np.random.default_rng(0)
    trained_tokens = 0
    for index in range(GROUP_SIZE * GROUPS):
        task = await bus.request(
            bus.subjects.task_claim(), TaskClaim(runner_id="test"), TaskAssignment
        )
        length = LONG_SAMPLE if index == 5 else TOKENS
        trained_tokens += await play_session(bus, task, length, rng)
    service_task = mesh.running[-1][2]
    async with asyncio.timeout(60):
        while trajectory.next_batch_index < 1 and not service_task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert not service_task.done(), f"the trajectory service stopped: {service_task!r}"
    [ready] = await batches.stored_announcements(bus)
    assert isinstance(ready, BatchReady)
    assert sorted(s.tokens for g in ready.groups for s in g.samples) == [TOKENS] * 63 + [
        LONG_SAMPLE
    ]

    run = MeshSettings(
        nats_url=mesh.mesh.nats_url, run_id=mesh.mesh.run_id, model_dir=narrow_model_dir,
        run_dir=tmp_path,
    )  # fmt: skip
    # an idle dedicated engine on this host: its core is lent to the training trainer
    idle_engine = ResourceMembership(bus, "engine-idle", "engine", ["rollout"], ["slot-0"])
    await idle_engine.register()
    beating = asyncio.create_task(idle_engine.heartbeat_loop())
    trainer_bus = await connect(run.nats_url, Subjects(run.run_id), name="trainer")
    try:
        trainer = TrainerService(TrainerSettings(steps=1, micro_batch_tokens=LONG_SAMPLE))
        await asyncio.wait_for(trainer.run(ServiceContext(mesh=run, bus=trainer_bus)), 300)
    finally:
        beating.cancel()
        await trainer_bus.drain()

    s = bus.subjects
    [metrics] = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(s.stream_metrics(), s.train_metrics())
    ]
    assert (metrics.step, metrics.version, metrics.batch_index) == (1, 1, 0)
    assert metrics.samples == GROUP_SIZE * GROUPS
    assert metrics.tokens_trained == trained_tokens
    assert np.isfinite(metrics.loss) and metrics.logprob_abs_diff > 0
    # the trainer trained on the lent core, where it may run on a second one
    assert (metrics.lent_thread_seconds > 0) == (usable_cpus() >= 2), metrics
    [finished] = [
        decode(m.data, TrainingFinished)
        for m in await bus.read_subject(s.stream_metrics(), s.train_finished())
    ]
    assert finished.final_version == 1
    consumer = await bus.js.consumer_info(s.stream_batches(), TRAINER_DURABLE)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0


@pytest.mark.integration  # nats-servers of its own
def test_the_transport_benchmark_runs_and_packed_is_the_smallest(tmp_path: Path) -> None:
    """loadtests/batch_transport.py with a tiny shape: every way delivers the batch
    intact (it asserts so) and the packed encoding is the smallest."""
    import importlib.util

    script = REPO_ROOT / "loadtests" / "batch_transport.py"
    spec = importlib.util.spec_from_file_location("batch_transport", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "figures.json"
    assert bench.main(["--shapes", "8x256", "--repeats", "1", "--json", str(out)]) == 0
    rows = {row["way"]: row for row in msgspec.json.decode(out.read_bytes())}
    assert set(rows) == {"json whole", "msgpack whole", "packed whole", "packed chunks"}
    sizes = [
        rows[way]["bytes_per_token"] for way in ("packed whole", "msgpack whole", "json whole")
    ]
    assert sizes == sorted(sizes) and sizes[0] < sizes[1]
    assert all(row["latency_s"] is not None for row in rows.values())


async def test_a_batch_left_unacked_is_fetched_whole_by_the_next_trainer(
    mesh: InProcessMesh, bus: Bus, narrow_model_dir: Path, tmp_path: Path
) -> None:
    """A trainer that stops after one step leaves the second batch in the consumer; the
    next trainer process fetches its payload and trains it (the payload outlives the
    process that did not ack it)."""
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    sent = [big_batch(0, [[300, 200], [250, 100]], 400), big_batch(1, [[400, 150], [120, 90]], 400)]
    for batch in sent:
        await batches.publish_batch(bus, batch)
    run = MeshSettings(
        nats_url=mesh.mesh.nats_url, run_id=mesh.mesh.run_id, model_dir=narrow_model_dir,
        run_dir=tmp_path,
    )  # fmt: skip
    for steps in (1, 2):
        trainer_bus = await connect(run.nats_url, Subjects(run.run_id), name="trainer")
        try:
            trainer = TrainerService(TrainerSettings(steps=steps, resume="latest"))
            await asyncio.wait_for(trainer.run(ServiceContext(mesh=run, bus=trainer_bus)), 60)
        finally:
            await trainer_bus.drain()

    s = bus.subjects
    metrics = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(s.stream_metrics(), s.train_metrics())
    ]
    assert [(m.step, m.batch_index) for m in metrics] == [(1, 0), (2, 1)]
    assert [m.tokens_trained for m in metrics] == [
        sum(sum(x.loss_mask) for g in b.groups for x in g.samples) for b in sent
    ]
    consumer = await bus.js.consumer_info(s.stream_batches(), TRAINER_DURABLE)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0


async def test_a_batch_whose_payload_is_gone_is_terminated_with_one_error(
    mesh: InProcessMesh,
    bus: Bus,
    narrow_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Retention dropped batch 0's payload: the trainer says so and terminates it (no
    retry can bring it back), then trains batch 1 once it stops waiting for batch 0."""
    import sf_trainer.delivery
    from sf_tag_scheduler.service import TagSchedulerService

    monkeypatch.setattr(sf_trainer.delivery, "IN_ORDER_WAIT_S", 0.0)
    await mesh.start(TagSchedulerService())
    lost = await batches.publish_batch(bus, big_batch(0, [[300, 200]], 400))
    await batches.publish_batch(bus, big_batch(1, [[250, 100]], 400))
    await bus.js.purge_stream(
        bus.subjects.stream_batch_payloads(), subject=bus.subjects.batch_payload(0)
    )
    run = MeshSettings(
        nats_url=mesh.mesh.nats_url, run_id=mesh.mesh.run_id, model_dir=narrow_model_dir,
        run_dir=tmp_path,
    )  # fmt: skip
    trainer_bus = await connect(run.nats_url, Subjects(run.run_id), name="trainer")
    try:
        trainer = TrainerService(TrainerSettings(steps=1))
        await asyncio.wait_for(trainer.run(ServiceContext(mesh=run, bus=trainer_bus)), 60)
    finally:
        await trainer_bus.drain()

    s = bus.subjects
    metrics = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(s.stream_metrics(), s.train_metrics())
    ]
    assert [(m.step, m.batch_index) for m in metrics] == [(1, 1)]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"terminating batch 0: batch 0: chunk {lost.payload.chunk_seqs[0]} is no longer in "
        f"{s.stream_batch_payloads()} (dropped by SF_RETENTION_BATCHES_*?)"
    ]
    consumer = await bus.js.consumer_info(s.stream_batches(), TRAINER_DURABLE)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0
