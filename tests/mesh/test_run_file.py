"""The run file (``seamlessflow.runfile``, ``sf_app.run.file``): one TOML description of a
run that the embedded run and each process started alone (``SF_CONFIG``) read alike."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from seamlessflow.bus import EXIT_UNRECOVERABLE
from seamlessflow.protocol import DEFAULT_POLICY
from seamlessflow.runfile import RunFileError, RunShared, section_of, shared_fields
from seamlessflow.settings import MeshSettings
from sf_app.run.config import RunConfig
from sf_app.run.file import read_run_file
from sf_app.service_table import settings_classes
from sf_tag_scheduler.settings import TagSchedulerSettings
from sf_trainer.settings import TrainerSettings
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLES = sorted((ROOT / "examples" / "run_files").glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SF_* variable of the caller's shell reaches the settings under test."""
    import os

    for name in list(os.environ):
        if name.startswith("SF_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_a_process_reads_its_section_and_the_run_keys_it_owns(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        """
[run]
steps = 7
lr = 0.5
seed = 3
policies = ["solver", "verifier"]
mode = "multiplexed"
engines = 4            # the embedded run's alone: no process reads it

[trainer]
loss = "dr_grpo"
eval_items = 5

[tag-scheduler]
lend_margin = 0.25

[mesh]
log_level = "DEBUG"
""",
    )
    clean_environment.setenv("SF_CONFIG", str(path))
    trainer = TrainerSettings()
    assert (trainer.steps, trainer.lr, trainer.loss.name, trainer.eval_items) == (
        7,
        0.5,
        "dr_grpo",
        5,
    )
    mesh = MeshSettings()
    assert (mesh.seed, mesh.policies, mesh.log_level) == (3, "solver,verifier", "DEBUG")
    scheduler = TagSchedulerSettings()
    assert (scheduler.mode, scheduler.lend_margin) == ("multiplexed", 0.25)
    # the environment wins over the file, and arguments in code over both
    clean_environment.setenv("SF_STEPS", "9")
    assert TrainerSettings().steps == 9
    assert TrainerSettings(steps=11).steps == 11
    # without SF_CONFIG, defaults
    clean_environment.delenv("SF_CONFIG")
    assert TrainerSettings().loss == TrainerSettings.model_fields["loss"].default


def test_every_shared_value_is_an_up_option_and_a_field_some_process_uses(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    """Each key of the shared section (``RunShared``) is a ``[run]`` key of
    ``seamlessflow up`` and sets at least one field of a settings class."""
    used = {key for cls in settings_classes() for key in shared_fields(cls).values()}
    for key in RunShared.model_fields:
        assert key in RunConfig.model_fields, key
        assert key in used, f"no process uses the shared value {key}"


def test_every_shared_value_has_one_default(clean_environment: pytest.MonkeyPatch) -> None:
    """A shared value's default is declared once (``RunShared``): ``RunConfig`` inherits
    it, and every settings field that is that value has it (``shared``). The one
    exception is ``up``'s policies, a list that holds the default policy."""
    for cls in settings_classes():
        for field, key in shared_fields(cls).items():
            expected = RunShared.model_fields[key].default
            assert cls.model_fields[field].default == expected, (cls.__name__, field)
    for key, info in RunShared.model_fields.items():
        run_value = RunConfig.model_fields[key].get_default(call_default_factory=True)
        assert run_value == ([DEFAULT_POLICY] if key == "policies" else info.default), key


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[trainer]\nlsos = 'grpo'\n", "unknown key trainer.lsos (did you mean 'loss'?)"),
        ("[trainer]\nlr = 0.1\n", "trainer.lr is a run setting: set it as [run] lr"),
        ("steps = 3\n", "'steps' is outside any section"),
        ("[trainer\n", "is not valid TOML"),
    ],
)
def test_a_process_stops_on_a_key_no_class_knows(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch, text: str, message: str
) -> None:
    clean_environment.setenv("SF_CONFIG", str(write(tmp_path, text)))
    with pytest.raises(RunFileError) as caught:
        TrainerSettings()
    assert message in str(caught.value)
    assert str(tmp_path / "run.toml") in str(caught.value)


def test_each_process_checks_its_own_section(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    from sf_trajectory.settings import TrajectorySettings

    clean_environment.setenv("SF_CONFIG", str(write(tmp_path, "[trajectory]\ngroup_size = 4\n")))
    assert TrainerSettings().steps == TrainerSettings.model_fields["steps"].default
    with pytest.raises(
        RunFileError, match=r"trajectory.group_size is a run setting: set it as \[run\] group_size"
    ):
        TrajectorySettings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[trainr]\nloss = 'grpo'\n", "unknown section [trainr] (did you mean 'trainer'?)"),
        ("[run]\nstepz = 3\n", "unknown key run.stepz (did you mean 'steps'?)"),
        ("[trainer]\neval_items = 'many'\n", "trainer.eval_items = 'many'"),
        ("[gateway]\nprot = 9000\n", "unknown key gateway.prot (did you mean 'port'?)"),
    ],
)
def test_the_whole_file_is_checked_before_a_run_starts(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(RunFileError) as caught:
        read_run_file(write(tmp_path, text), settings_classes())
    assert message in str(caught.value)


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_the_example_run_files_are_valid(example: Path) -> None:
    run = read_run_file(example, settings_classes())
    config = RunConfig(**run)
    assert config.steps == run["steps"]


def test_sections_are_named_after_the_variable_prefix() -> None:
    assert section_of("SF_TRAINER_") == "trainer"
    assert section_of("SF_TAG_SCHEDULER_") == "tag_scheduler"
    assert section_of("SF_") == "mesh"
    sections = [section_of(cls.model_config.get("env_prefix", "")) for cls in settings_classes()]
    assert len(sections) == len(set(sections)), sections


@pytest.mark.integration  # starts processes
def test_a_service_and_the_cli_stop_with_one_line_on_a_bad_run_file(tmp_path: Path) -> None:
    bad = write(tmp_path, "[trainer]\nlsos = 'grpo'\n")
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    service = subprocess.run(
        [sys.executable, "-m", "sf_trainer"],
        env={**env, "SF_CONFIG": str(bad)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert service.returncode == EXIT_UNRECOVERABLE, service.stderr
    [line] = service.stderr.strip().splitlines()
    assert line.startswith("trainer: run file ") and "did you mean 'loss'" in line
    cli = subprocess.run(
        [sys.executable, "-m", "sf_app", "up", "--config", str(bad), "--no-live"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().splitlines() == [line.removeprefix("trainer: ")]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_a_run_started_from_a_file_reports_to_tensorboard_and_wandb(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """The file sets the run and a service's own setting ([trainer] eval_*), the command
    line overrides one key (--steps), and both trackers get every step."""
    import json
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.support.wandb_records import logged

    run_file = write(
        tmp_path,
        """
[run]
steps = 50                 # overridden on the command line
group_size = 4
groups_per_batch = 2
agent_concurrency = 8
engine_batch_size = 8
report_to = ["tensorboard", "wandb"]
eval_every = 2

[trainer]
eval_items = 4
""",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    env |= {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [
        sys.executable, "-m", "sf_app", "up", "--config", str(run_file), "--steps", "2",
        "--no-live", "--model-dir", str(base_model_dir), "--runs-dir", str(tmp_path / "runs"),
        "--run-id", "from-file",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "from-file"
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "run-file.toml").read_text() == run_file.read_text()
    # the resolved file every process read: the command line's steps, the file's rest
    resolved = tomllib.loads((run_dir / "run.toml").read_text())
    assert (resolved["run"]["steps"], resolved["trainer"]["steps"]) == (2, 2)
    assert (resolved["trainer"]["eval_items"], resolved["trainer"]["eval_every"]) == (4, 2)
    config = json.loads((run_dir / "summary.json").read_text())["config"]
    assert (config["steps"], config["group_size"], config["report_to"]) == (
        2, 4, ["tensorboard", "wandb"],
    )  # fmt: skip
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["type"] == "train.metrics"]
    evals = [line for line in lines if line["type"] == "train.eval"]
    assert [m["step"] for m in steps] == [1, 2]
    # [run] eval_every and [trainer] eval_items reached the trainer: the base model, step 2
    assert [(e["step"], e["samples"]) for e in evals] == [(0, 4), (2, 4)]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("train/mean_reward")]
    assert [step for step, _ in curve] == [1, 2]
    for (_, value), step in zip(curve, steps, strict=True):
        assert value == pytest.approx(step["mean_reward"], rel=1e-6, abs=1e-7)  # float32
    assert [e.value for e in events.Scalars("eval/samples")] == [4.0, 4.0]

    history = [row for row in logged(run_dir)["history"] if "train/step" in row]
    assert [row["train/step"] for row in history] == [1, 2]
    assert [row["train/mean_reward"] for row in history] == [m["mean_reward"] for m in steps]


class _Captured(Exception):
    def __init__(self, config: RunConfig) -> None:
        self.config = config


def test_up_takes_every_run_config_field_and_only_what_was_given(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    """``up``'s options are generated from ``RunConfig``: one per field, and a value not
    given on the command line keeps the field's default (or the run file's value, or
    the environment's shared variable: below the command line)."""
    monkeypatch = clean_environment
    monkeypatch.setenv("SF_STEPS", "9")  # the command line wins
    monkeypatch.setenv("SF_LR", "0.25")
    from typer.testing import CliRunner

    import sf_app.run.embedded
    from sf_app.cli import app

    def capture(config: RunConfig) -> None:
        raise _Captured(config)

    monkeypatch.setattr(sf_app.run.embedded, "run_embedded", capture)
    args = ["up", "--steps", "5", "--policies", "a, b", "--report-to", "tensorboard"]
    args += ["--no-live", "--engine-batch-size", "8", "--mode", "colocated"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, _Captured), result.output
    config = result.exception.config
    assert (config.steps, config.policies, config.report_to) == (5, ["a", "b"], ["tensorboard"])
    assert (config.live, config.engine_batch_size, config.mode) == (False, 8, "colocated")
    assert config.max_batches_ahead == 0  # colocated's pacing: not given, so not passed
    assert config.group_size == RunShared.model_fields["group_size"].default
    assert config.lr == 0.25
    # what was given, and what colocated sets; nothing else was passed on
    assert config.model_fields_set == {
        "steps", "policies", "report_to", "live", "engine_batch_size", "mode",
        "max_batches_ahead", "lr",
    }  # fmt: skip

    help_text = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"}).output
    for name in RunConfig.model_fields:
        if name != "run_file":
            assert f"--{name.replace('_', '-')}" in help_text, name
    bad = CliRunner().invoke(app, ["up", "--steps", "many"], env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "Invalid value for '--steps'" in bad.output
