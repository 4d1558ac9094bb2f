"""One value, given once, reaches every process that uses it, whichever way the run
starts (``sf_app.run.spec``): ``seamlessflow up`` (its options, the environment's
shared variables, a run file), compose (the one-shot ``resolve`` and each container's
environment as the compose file gives it) and a service started alone (a run file, or
its environment). Each process's settings are built as that process builds them: its
settings class, under its own environment."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from seamlessflow.runfile import RunShared, section_of, shared_fields, shared_variable
from sf_app.cli import app
from sf_app.run.config import RunConfig
from sf_app.run.embedded import RESOLVED_FILE, EmbeddedRun
from sf_app.service_table import settings_classes
from tests.support import REPO_ROOT, main_job_model
from tests.support.compose_render import render

# a value unlike every default, of each shared key's type
GIVEN: dict[str, Any] = {
    "seed": 7,
    "policies": ["solver", "verifier"],
    "mode": "colocated",
    "task": "counting",
    "group_size": 3,
    "groups_per_batch": 5,
    "max_batches_ahead": 2,
    "group_timeout_s": 42.5,
    "steps": 11,
    "checkpoint_every": 4,
    "lr": 2.5e-5,
    "eval_every": 3,
    "precision": "fp32",
    "max_tokens": 17,
    "engine_batch_size": 12,
    "agent": "multi_turn",
    "agent_concurrency": 9,
    "env_step_latency_ms": 25.0,
    "env_latency_sigma": 0.25,
}


def test_every_shared_value_is_tried() -> None:
    assert set(GIVEN) == set(RunShared.model_fields)
    for key, value in GIVEN.items():
        assert value != RunShared.model_fields[key].default, key


def as_text(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """The process's whole environment is ``env`` while its settings are read."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def caller_environment() -> dict[str, str]:
    """This process's environment without any SF_ variable (the suite sets some)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SF_")}


def seen_by_every_process(env: Mapping[str, str], key: str) -> dict[str, Any]:
    """Each settings field that is the shared value ``key``, as its process reads it."""
    seen: dict[str, Any] = {}
    with environment(env):
        for cls in settings_classes():
            fields = [f for f, k in shared_fields(cls).items() if k == key]
            if not fields:
                continue
            settings = cls()
            section = section_of(str(cls.model_config.get("env_prefix", "")))
            for field in fields:
                seen[f"{section}.{field}"] = getattr(settings, field)
    assert seen, f"no process uses {key}"
    return seen


def assert_everywhere(seen: Mapping[str, Any], key: str) -> None:
    expected = as_text(GIVEN[key]) if key == "policies" else GIVEN[key]
    wrong = {where: value for where, value in seen.items() if value != expected}
    assert not wrong, f"{key}={expected!r} did not reach {wrong}"


def embedded_process_env(tmp_path: Path, config: RunConfig) -> dict[str, str]:
    """The environment ``seamlessflow up`` gives its processes, with the resolved file it
    writes (``EmbeddedRun.write_spec``, ``service_env``)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    with environment(caller_environment()):
        run = EmbeddedRun(config)
        return run.service_env(run.write_spec("nats://127.0.0.1:4222", model_dir, 8000))


@pytest.mark.parametrize("key", sorted(GIVEN))
def test_up_s_option_reaches_every_process(tmp_path: Path, key: str) -> None:
    config = RunConfig(runs_dir=tmp_path, run_id="given", **{key: GIVEN[key]})
    env = embedded_process_env(tmp_path, config)
    assert env["SF_CONFIG"] == str(tmp_path / "given" / RESOLVED_FILE)
    assert_everywhere(seen_by_every_process(env, key), key)


@pytest.mark.parametrize("key", sorted(GIVEN))
def test_a_run_file_reaches_every_process_of_up_and_every_service_alone(
    tmp_path: Path, key: str
) -> None:
    run_file = tmp_path / "given.toml"
    value = GIVEN[key]
    run_file.write_text(f"[run]\n{key} = {tomllib_value(value)}\n")
    # a service started alone on the user's file
    alone = {**caller_environment(), "SF_CONFIG": str(run_file)}
    assert_everywhere(seen_by_every_process(alone, key), key)
    # seamlessflow up --config: the file's [run] table, resolved, then each process
    config = up_config(["--config", str(run_file)])
    assert getattr(config, key) == value
    env = embedded_process_env(tmp_path, config.model_copy(update={"runs_dir": tmp_path}))
    assert_everywhere(seen_by_every_process(env, key), key)


@pytest.mark.parametrize("key", sorted(GIVEN))
def test_an_environment_variable_reaches_every_process_of_up_and_every_service_alone(
    tmp_path: Path, key: str
) -> None:
    variable = {shared_variable(key): as_text(GIVEN[key])}
    alone = {**caller_environment(), **variable}
    assert_everywhere(seen_by_every_process(alone, key), key)
    config = up_config([], env=variable)
    env = embedded_process_env(tmp_path, config.model_copy(update={"runs_dir": tmp_path}))
    # up's processes read it from the resolved file: the variable itself is not passed on
    assert shared_variable(key) not in env
    assert_everywhere(seen_by_every_process(env, key), key)


COMPOSE_FILE = REPO_ROOT / "compose" / "docker-compose.yml"
COMPOSE_SECRETS = {"SF_NATS_TOKEN": "token", "SF_GATEWAY_API_KEYS": "key"}


@pytest.mark.parametrize("key", sorted(set(GIVEN) - {"policies"}))
def test_a_compose_variable_reaches_every_container(tmp_path: Path, key: str) -> None:
    """Compose: the variable in .env or the shell, as the file interpolates it into the
    ``resolve`` container; its resolved file read by each container under its own
    environment (the runs volume's path mapped to a folder here)."""
    variables = {**COMPOSE_SECRETS, shared_variable(key): as_text(GIVEN[key])}
    services = render(COMPOSE_FILE, variables, profiles=["env"])["services"]
    out, host_out = compose_resolve(services, tmp_path)
    seen: dict[str, Any] = {}
    for name, service in services.items():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        if env.get("SF_CONFIG") != out:
            continue
        env["SF_CONFIG"] = str(host_out)
        for where, value in seen_by_every_process({**caller_environment(), **env}, key).items():
            seen[f"{name}:{where}"] = value
    assert {name.split(":")[0] for name in seen} >= {"trainer", "agents", "trajectory"} & {
        name for name, svc in services.items() if svc.get("environment", {}).get("SF_CONFIG")
    }
    assert_everywhere(seen, key)


def compose_resolve(services: Mapping[str, Any], tmp_path: Path) -> tuple[str, Path]:
    """Run compose's one-shot ``resolve`` as its container would (its rendered command
    and environment), the runs volume's path mapped into ``tmp_path``: the file's path
    in the containers, and here."""
    resolve = services["resolve"]
    command = [str(part) for part in resolve["command"]]
    out = command[command.index("--out") + 1]
    host_out = tmp_path / Path(out).relative_to("/")
    command[command.index("--out") + 1] = str(host_out)
    resolve_env = {k: str(v) for k, v in resolve["environment"].items()}
    result = CliRunner().invoke(app, command, env={**clear_sf(), **resolve_env})
    assert result.exit_code == 0, result.output
    return out, host_out


@pytest.mark.parametrize("model", ["", "built-in"])
def test_compose_up_resolves_the_main_job_and_the_toy_one_variable_away(
    tmp_path: Path, model: str
) -> None:
    """With nothing set, ``docker compose up`` resolves the run ``just up`` runs (the
    main job: its pretrained model's measured defaults, its task's budget); with
    ``SF_MODEL=built-in`` the one ``just up-toy`` runs. Every shared value is compared."""
    variables = {**COMPOSE_SECRETS, **({"SF_MODEL": model} if model else {})}
    services = render(COMPOSE_FILE, variables)["services"]
    _, host_out = compose_resolve(services, tmp_path)
    resolved = tomllib.loads(host_out.read_text())["run"]
    expected = up_config(["--model", main_job_model()] if not model else [])
    assert resolved == {key: getattr(expected, key) for key in RunShared.model_fields}
    if not model:  # the main job's values, not the toy's
        assert (resolved["task"], resolved["lr"]) != (RunConfig().task, RunConfig().lr)
    build = [str(part) for part in services["build-model"]["command"]]
    assert build[build.index("--from") + 1] == (model or main_job_model())


def clear_sf() -> dict[str, str | None]:
    """CliRunner's env: every SF_ variable of this process unset while it runs."""
    return {name: None for name in os.environ if name.startswith("SF_")}


def up_config(args: list[str], env: Mapping[str, str] | None = None) -> RunConfig:
    """The ``RunConfig`` ``seamlessflow up ARGS`` would run, read through the CLI."""
    import sf_app.run.embedded

    captured: list[RunConfig] = []

    def capture(config: RunConfig) -> None:
        captured.append(config)
        raise SystemExit(0)

    saved = sf_app.run.embedded.run_embedded
    sf_app.run.embedded.run_embedded = capture  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(app, ["up", *args], env={**clear_sf(), **(env or {})})
    finally:
        sf_app.run.embedded.run_embedded = saved  # type: ignore[assignment]
    assert captured, result.output
    return captured[0]


def tomllib_value(value: Any) -> str:
    """``value`` as TOML (what a user writes in a run file)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(f'"{item}"' for item in value) + "]"
    return repr(value)


def test_the_resolved_file_is_toml_that_up_itself_accepts(tmp_path: Path) -> None:
    config = RunConfig(runs_dir=tmp_path, run_id="again", steps=5, task="counting")
    env = embedded_process_env(tmp_path, config)
    resolved = Path(env["SF_CONFIG"])
    table = tomllib.loads(resolved.read_text())
    assert table["run"]["steps"] == 5 and table["trainer"]["steps"] == 5
    assert table["mesh"]["run_id"] == "again"
    # the task's own completion budget, applied once, in every section that uses it
    again = up_config(["--config", str(resolved)])
    assert (again.steps, again.task, again.max_tokens) == (5, "counting", config.max_tokens)


@pytest.mark.parametrize(
    ("trainer", "engines", "room", "expected"),
    [
        ("cpu", "cpu", True, {"transport": "shm", "engine_placement": "this-host"}),
        ("cpu", "cpu", False, {"transport": "object", "engine_placement": "this-host"}),
        ("cuda", "cpu", True, {"transport": "shm", "engine_placement": "this-host"}),
        (
            "cuda",
            "cuda",
            True,
            {"transport": "cuda_ipc", "ipc_fallback": "shm", "engine_placement": "this-host-cuda"},
        ),
        (
            "cuda:0",
            "cuda",
            False,
            {
                "transport": "cuda_ipc",
                "ipc_fallback": "object",
                "engine_placement": "this-host-cuda",
            },
        ),
    ],
)
def test_up_sends_weights_through_the_fastest_way_this_host_allows(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    trainer: str,
    engines: str,
    room: bool,
    expected: dict[str, str],
) -> None:
    """``seamlessflow up``'s weights defaults: the trainer's device memory when it and
    the engines compute on CUDA, with shared memory as its fallback where /dev/shm has
    room for the weights (else the object store)."""
    from sf_app.run import embedded

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(1000))
    monkeypatch.setattr(embedded, "SHM_DIR", tmp_path if room else tmp_path / "missing")
    assert embedded.local_weight_transport(model, trainer, engines) == expected


def test_the_engines_device_is_their_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    from sf_app.run import embedded

    monkeypatch.setenv("SF_ENGINE_BACKEND", "hf")
    monkeypatch.setenv("SF_ENGINE_HF_DEVICE", "cuda:1")
    assert embedded.engine_device() == "cuda:1"
    monkeypatch.setenv("SF_ENGINE_BACKEND", "some-plugin")
    assert embedded.engine_device() == "cpu"  # a backend with no device setting
