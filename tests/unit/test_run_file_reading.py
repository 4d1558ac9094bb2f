"""The run file (``seamlessflow.runfile``, ``sf_app.run.file``) read in process: each
process's settings read their section and the run keys they own (below the environment
and arguments in code), a key no class knows stops it with the file named, the whole
file is checked before a run starts, the example run files are valid, sections are named
after the variables' prefixes, every shared value has one default and is an ``up``
option, and ``up`` passes on only what was given. Processes started with a run file are
tests/mesh/test_run_file.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamlessflow.protocol import DEFAULT_POLICY
from seamlessflow.runfile import RunFileError, RunShared, section_of, shared_fields
from seamlessflow.settings import MeshSettings
from sf_app.run.config import RunConfig
from sf_app.run.file import read_run_file
from sf_app.service_table import settings_classes
from sf_tag_scheduler.settings import TagSchedulerSettings
from sf_trainer.settings import TrainerSettings
from tests.support import REPO_ROOT
from tests.support.run_files import write_run_file

ROOT = REPO_ROOT
EXAMPLES = sorted((ROOT / "examples" / "run_files").glob("*.toml"))


def test_a_process_reads_its_section_and_the_run_keys_it_owns(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    path = write_run_file(
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
    clean_environment.setenv("SF_CONFIG", str(write_run_file(tmp_path, text)))
    with pytest.raises(RunFileError) as caught:
        TrainerSettings()
    assert message in str(caught.value)
    assert str(tmp_path / "run.toml") in str(caught.value)


def test_each_process_checks_its_own_section(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    from sf_trajectory.settings import TrajectorySettings

    clean_environment.setenv(
        "SF_CONFIG", str(write_run_file(tmp_path, "[trajectory]\ngroup_size = 4\n"))
    )
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
        read_run_file(write_run_file(tmp_path, text), settings_classes())
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
