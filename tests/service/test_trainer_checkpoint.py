"""Checkpoint and resume: what a checkpoint holds, that a resumed trainer continues as
an uninterrupted one would, and that the service never trains a batch twice nor reuses a
version number. Choosing the checkpoint to resume from and pruning, from the files
alone, are tests/unit/test_checkpoint_resume_and_prune.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    TRAINER_DURABLE,
    TrainingFinished,
    TrainStepMetrics,
    WeightsPublished,
    decode,
)
from seamlessflow.settings import MeshSettings
from sf_trainer import checkpoint
from sf_trainer.checkpoint import TrainerState
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from tests.support import InProcessMesh
from tests.support.checkpoint_files import write_checkpoint_files
from tests.support.trainer_runs import BATCHES, SETTINGS, learner, run_trainer, trainer_mesh


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return learner.full_weights()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_restores_model_optimizer_step_version_and_data_position(
    base_model_dir: Path, tmp_path: Path
) -> None:
    trained = learner(base_model_dir)
    trained.step(BATCHES[0], version=0)
    saved = TrainerState(step=1, version=4, data_position=0)
    trained.save(tmp_path / "step-1", saved)

    # a restart may change hyperparameters: the settings win over the checkpoint's
    restored = learner(base_model_dir, TrainerSettings(lr=5e-4, micro_batch_tokens=48))
    assert restored.restore(tmp_path / "step-1") == saved
    assert_same_weights(weights(restored), weights(trained))
    before, after = trained.optimizer.state_dict(), restored.optimizer.state_dict()
    assert before["state"].keys() == after["state"].keys() and before["state"]
    for index, moments in before["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[key], after["state"][index][key]), (index, key)
    assert [g["lr"] for g in restored.optimizer.param_groups] == [5e-4]

    # still an HF model directory
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "step-1"))
    assert_same_weights({k: v for k, v in model.state_dict().items()}, weights(trained))
    AutoTokenizer.from_pretrained(str(tmp_path / "step-1"))


def test_a_resumed_learner_takes_the_step_an_uninterrupted_one_takes(
    base_model_dir: Path, tmp_path: Path
) -> None:
    uninterrupted = learner(base_model_dir)
    uninterrupted.step(BATCHES[0], version=0)
    uninterrupted.save(tmp_path / "step-1", TrainerState(step=1, version=1, data_position=0))
    expected = uninterrupted.step(BATCHES[1], version=1)

    resumed = learner(base_model_dir)
    resumed.restore(tmp_path / "step-1")
    got = resumed.step(BATCHES[1], version=1)
    assert got == expected
    assert_same_weights(weights(resumed), weights(uninterrupted))

    # the control: without the restored AdamW moments the same step lands elsewhere
    weights_only = learner(base_model_dir)
    weights_only.model.load_state_dict(checkpoint.load_model_state(tmp_path / "step-1"))
    weights_only.step(BATCHES[1], version=1)
    moved = weights(weights_only)
    assert any(not torch.equal(moved[k], v) for k, v in weights(uninterrupted).items())


def test_the_optimizer_kernel_is_the_settings_and_a_resume_keeps_it(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """``SF_TRAINER_FUSED_OPTIMIZER``: AdamW's fused kernel by default, torch's foreach one
    when off; a checkpoint saved with one restores under the other's settings with the
    settings' kernel, and the two kernels take the same step to float32 rounding."""
    multi_tensor = learner(base_model_dir, SETTINGS.model_copy(update={"fused_optimizer": False}))
    assert [(g["fused"], g["foreach"]) for g in multi_tensor.optimizer.param_groups] == [
        (None, True)
    ]
    multi_tensor.step(BATCHES[0], version=0)
    multi_tensor.save(tmp_path / "step-1", TrainerState(step=1, version=1, data_position=0))
    expected = multi_tensor.step(BATCHES[1], version=1)

    fused = learner(base_model_dir)
    fused.restore(tmp_path / "step-1")
    assert [(g["fused"], g["foreach"]) for g in fused.optimizer.param_groups] == [(True, None)]
    got = fused.step(BATCHES[1], version=1)
    assert got.loss == expected.loss  # computed before this step's update
    for name, tensor in weights(fused).items():
        torch.testing.assert_close(tensor, weights(multi_tensor)[name], rtol=1e-5, atol=1e-6)


def test_saving_again_under_a_name_replaces_the_checkpoint(
    base_model_dir: Path, tmp_path: Path
) -> None:
    policy = learner(base_model_dir)
    policy.save(tmp_path / "final", TrainerState(step=0, version=0, data_position=-1))
    policy.step(BATCHES[0], version=0)
    policy.save(tmp_path / "final", TrainerState(step=1, version=1, data_position=0))
    assert checkpoint.read_state(tmp_path / "final").step == 1
    assert_same_weights(checkpoint.load_model_state(tmp_path / "final"), weights(policy))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_save_never_replaces_a_checkpoint_holding_more_trained_steps(
    base_model_dir: Path, tmp_path: Path
) -> None:
    policy = learner(base_model_dir)
    policy.step(BATCHES[0], version=0)
    trained = TrainerState(step=1, version=1, data_position=0, trained_steps=1)
    policy.save(tmp_path / "final", trained)
    kept = weights(policy)
    base = learner(base_model_dir)
    # more steps counted (a resume lost one), fewer held: refused, nothing written
    lost_one = TrainerState(step=2, version=2, data_position=1, trained_steps=0)
    with pytest.raises(checkpoint.FewerTrainedSteps, match="holds 1 trained steps"):
        base.save(tmp_path / "final", lost_one)
    assert checkpoint.read_state(tmp_path / "final") == trained
    assert_same_weights(checkpoint.load_model_state(tmp_path / "final"), kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    # a checkpoint from before `trained_steps` counts its `step`
    write_checkpoint_files(tmp_path / "old", 3)
    with pytest.raises(checkpoint.FewerTrainedSteps):
        policy.save(tmp_path / "old", trained)
    # as many trained steps: replaced
    same = TrainerState(step=2, version=2, data_position=1, trained_steps=1)
    policy.save(tmp_path / "final", same)
    assert checkpoint.read_state(tmp_path / "final").step == 2


# the service against a real nats-server -------------------------------------------------


async def test_a_resumed_trainer_skips_trained_batches_and_keeps_versions_monotonic(
    mesh: InProcessMesh, bus: Bus, base_model_dir: Path, tmp_path: Path
) -> None:
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    subjects = bus.subjects
    run = trainer_mesh(mesh, base_model_dir, tmp_path)
    for batch in BATCHES[:2]:
        await bus.js_publish(subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}")
    first = SETTINGS.model_copy(update={"steps": 2, "checkpoint_every": 1})
    await run_trainer(run, first)
    step_1 = tmp_path / "checkpoints" / "step-1"
    assert checkpoint.read_state(step_1) == TrainerState(
        step=1, version=1, data_position=0, trained_steps=1
    )

    # Resume from step 1 while step 2 (batch 1, version 2) is recorded and announced: the
    # policy loses step 2, the trainer goes on after it (step 3). Batches 0 and 1 come
    # again (replays under new message ids, as a batch left unacked by a trainer killed
    # after its step record is redelivered): neither is trained again.
    await bus.js_publish(subjects.batch_ready(), BATCHES[0], msg_id="batch-0-replayed")
    await bus.js_publish(subjects.batch_ready(), BATCHES[1], msg_id="batch-1-replayed")
    await bus.js_publish(subjects.batch_ready(), BATCHES[2], msg_id="batch-2")
    await run_trainer(run, SETTINGS.model_copy(update={"steps": 3, "resume": str(step_1)}))

    published = [
        decode(m.data, WeightsPublished).version
        for m in await bus.read_subject(subjects.stream_weights(), subjects.weights_published())
    ]
    assert published == [1, 2, 3]
    metrics = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_metrics())
    ]
    trained = [(m.step, m.version, m.batch_index) for m in metrics]
    assert trained == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    finished = [
        decode(m.data, TrainingFinished)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_finished())
    ]
    assert [(f.steps, f.final_version) for f in finished] == [(2, 2), (3, 3)]
    consumer = await bus.js.consumer_info(subjects.stream_batches(), TRAINER_DURABLE)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0  # the replay was acked

    final = tmp_path / "checkpoints" / "final"
    # step 2 was lost to the policy: its weights hold two optimizer steps
    assert checkpoint.read_state(final) == TrainerState(
        step=3, version=3, data_position=2, trained_steps=2
    )
    expected = learner(base_model_dir)
    expected.restore(step_1)
    expected.step(BATCHES[2], version=2)
    assert_same_weights(checkpoint.load_model_state(final), weights(expected))


async def test_a_trainer_started_again_after_it_finished_keeps_the_trained_final(
    mesh: InProcessMesh, bus: Bus, base_model_dir: Path, tmp_path: Path
) -> None:
    """A restart after the last step (a container restart policy, a second run of the
    same command) finds the step budget reached at once. Without a resume it holds the
    base model, with ``latest`` the final policy: either way `final` keeps the trained
    weights, and no batch is trained."""
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    run = trainer_mesh(mesh, base_model_dir, tmp_path)
    for batch in BATCHES[:2]:
        await bus.js_publish(bus.subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}")
    settings = SETTINGS.model_copy(update={"steps": 2})
    await run_trainer(run, settings)
    final = tmp_path / "checkpoints" / "final"
    trained = TrainerState(step=2, version=2, data_position=1, trained_steps=2)
    assert checkpoint.read_state(final) == trained
    trained_weights = checkpoint.load_model_state(final)
    base_weights = weights(learner(base_model_dir))
    assert any(not torch.equal(trained_weights[k], v) for k, v in base_weights.items())

    for resume in ("", "latest"):
        await run_trainer(run, settings.model_copy(update={"resume": resume}))
        assert checkpoint.read_state(final) == trained, resume
        assert_same_weights(checkpoint.load_model_state(final), trained_weights)
    metrics = await bus.read_subject(bus.subjects.stream_metrics(), bus.subjects.train_metrics())
    assert len(metrics) == 2  # the restarts trained nothing
    finished = [
        decode(m.data, TrainingFinished)
        for m in await bus.read_subject(
            bus.subjects.stream_metrics(), bus.subjects.train_finished()
        )
    ]
    assert {(f.steps, f.final_version, f.checkpoint_dir) for f in finished} == {(2, 2, str(final))}


async def test_a_batch_that_comes_back_late_is_still_trained_in_order(
    mesh: InProcessMesh, bus: Bus, base_model_dir: Path, tmp_path: Path
) -> None:
    """A trainer killed while it held batch k unacked: batch k comes back after the
    consumer's ack wait, behind batch k + 1 (here: stored in that order). Training k + 1
    first would skip k for good (at or before the data position) and leave the run a
    step short forever; the trainer puts k + 1 back until k has come."""
    from sf_tag_scheduler.service import TagSchedulerService

    await mesh.start(TagSchedulerService())
    subjects = bus.subjects
    run = trainer_mesh(mesh, base_model_dir, tmp_path)
    await bus.js_publish(subjects.batch_ready(), BATCHES[1], msg_id="batch-1")
    await bus.js_publish(subjects.batch_ready(), BATCHES[0], msg_id="batch-0")
    await run_trainer(run, SETTINGS.model_copy(update={"steps": 2}))

    metrics = [
        decode(m.data, TrainStepMetrics)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_metrics())
    ]
    assert [(m.step, m.version, m.batch_index) for m in metrics] == [(1, 1, 0), (2, 2, 1)]
    consumer = await bus.js.consumer_info(subjects.stream_batches(), TRAINER_DURABLE)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0


async def test_a_trainer_that_cannot_resume_leaves_the_final_checkpoint_alone(
    nats_url: str, run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    final = tmp_path / "checkpoints" / "final"
    kept = TrainerState(step=7, version=7, data_position=6)
    learner(base_model_dir).save(final, kept)
    run = MeshSettings(nats_url=nats_url, run_id=run_id, model_dir=base_model_dir, run_dir=tmp_path)
    missing = SETTINGS.model_copy(update={"resume": str(tmp_path / "no-such-checkpoint")})
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        await run_trainer(run, missing)
    assert checkpoint.read_state(final) == kept


def other_uids_can_read(directory: Path) -> list[str]:
    """The paths under ``directory`` another uid could not read (or enter)."""
    unreadable = []
    for path in [directory, *directory.rglob("*")]:
        needed = 0o005 if path.is_dir() else 0o004
        if path.stat().st_mode & needed != needed:
            unreadable.append(f"{path.name} {oct(path.stat().st_mode & 0o777)}")
    return unreadable


def test_checkpoints_and_built_models_are_readable_by_other_uids(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """safetensors writes the weights 0600: a service in another container (another
    uid) reading a checkpoint got PermissionError (compose, issue 25)."""
    from seamlessflow.assets.families import build_family_model

    learner(base_model_dir).save(
        tmp_path / "final", TrainerState(step=0, version=0, data_position=-1)
    )
    assert other_uids_can_read(tmp_path / "final") == []
    assert other_uids_can_read(build_family_model("qwen2-tied", tmp_path / "family", seed=0)) == []
    fresh = tmp_path / "base"
    from sf_app.base_model import ensure_base_model

    assert other_uids_can_read(ensure_base_model(fresh, sft_steps=0)) == []
