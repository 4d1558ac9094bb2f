"""compose/docker-compose.yml run as host processes: no container engine runs in CI.

The file is rendered as Compose would render it (``compose_render``: anchors, merge
keys, ``${VAR...}`` interpolation, the default profile) with the variables a user sets
(credentials, a small run). Then each service's entrypoint and command run with its
rendered environment and nothing of the test's own settings (no ``SF_*`` / ``OTEL_*``
leak in), in dependency order, with what a container engine would provide emulated:

- a compose host name (``nats``, ``gateway``, ``jaeger``) is a service's container;
  each service's published or internal port gets a free port on 127.0.0.1, and every
  URL in an environment that names a service is pointed there. A URL naming any other
  host fails the test (in a container ``localhost`` is the container itself);
- a named volume is a temporary directory, mounted at the container paths the service
  lists (``/models``, ``/runs``, ``/data``); the image's ``HOME`` is one too;
- ``nats`` runs its entrypoint script with the ``nats-server`` of this environment;
  ``jaeger`` is an OTLP/HTTP sink that counts the span exports it receives;
- ``depends_on`` conditions and healthchecks are waited for as Compose waits.

The run trains the built-in toy (``SF_MODEL=built-in``) on its task for a few steps and
must leave ``final`` with those
steps; then the trainer is started again as ``docker compose up`` would start it after
it exited 0, and ``final`` must stay as it was.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from urllib.request import urlopen

import pytest
import torch
import yaml

from seamlessflow.natsserver import server_binary
from sf_gateway.settings import GatewaySettings
from sf_trainer import checkpoint
from tests.support import REPO_ROOT, free_port
from tests.support.compose_render import (
    MissingVariable,
    environment,
    interpolate,
    render,
    restarts_after,
)

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

ROOT = REPO_ROOT
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"

STEPS = 3
# What a user puts in compose/.env for a small run. The token starts with "-" on
# purpose: a nats config reading it unquoted would fail to parse it.
VARIABLES = {
    "SF_NATS_TOKEN": "-" + secrets.token_urlsafe(16),
    "SF_GATEWAY_API_KEYS": secrets.token_urlsafe(16),
    "SF_STEPS": str(STEPS),
    # plumbing, not learning: the built-in toy (`just compose-test` runs compose's
    # default, the main job's real model, in containers), warmed up 30 steps (the
    # suite's), not the recipe's 500
    "SF_MODEL": "built-in",
    "SF_BASE_MODEL_SFT_STEPS": "30",
    "SF_GROUP_SIZE": "4",
    "SF_GROUPS_PER_BATCH": "2",
}
# Ports the services listen on inside their containers, published or not.
SERVICE_PORTS = {"nats": (4222, 8222), "gateway": (8000,), "jaeger": (4318,)}
WILDCARD = "0.0.0.0"
# deadlines against a hang, not speed targets
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------------------
# interpolation and rendering
# --------------------------------------------------------------------------------------


def test_interpolation_follows_the_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("$$SET $${SET}", env) == "$SET ${SET}"
    assert interpolate("a${SET}b $SET ${UNSET}.", env) == "avb v ."
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d}", env) == "v d d"
    assert interpolate("${SET-d} ${EMPTY-d} ${UNSET-d}", env) == "v  d"
    assert interpolate("${SET:+a} ${EMPTY:+a} ${EMPTY+a} ${UNSET+a}.", env) == "a  a ."
    assert interpolate("${SET:?no} ${EMPTY?no}", env) == "v "
    with pytest.raises(MissingVariable, match="EMPTY: set it"):
        interpolate("${EMPTY:?set it}", env)
    with pytest.raises(MissingVariable, match="UNSET"):
        interpolate("${UNSET?}", env)
    with pytest.raises(ValueError, match="nested"):
        interpolate("${UNSET:-${SET}}", env)


@pytest.mark.parametrize("missing", ["SF_NATS_TOKEN", "SF_GATEWAY_API_KEYS"])
def test_the_file_does_not_render_without_a_credential(missing: str) -> None:
    env = {k: v for k, v in VARIABLES.items() if k != missing}
    with pytest.raises(MissingVariable, match=rf"{missing}: set {missing}"):
        render(COMPOSE_FILE, env)


def test_the_gpu_profile_renders_a_resuming_trainer_on_every_gpu_with_pinned_packages() -> None:
    gpu = render(COMPOSE_FILE, VARIABLES, profiles=["gpu"])["services"]
    default = render(COMPOSE_FILE, VARIABLES)["services"]
    assert {"engine-gpu", "trainer-gpu"} <= gpu.keys()
    assert not {"engine-gpu", "trainer-gpu", "engine-lend"} & default.keys()
    trainer, cpu_trainer = environment(gpu["trainer-gpu"]), environment(default["trainer"])
    # the same run: the resolved file (steps, checkpoints), resuming from the latest
    for key in ("SF_CONFIG", "SF_TRAINER_RESUME"):
        assert trainer[key] == cpu_trainer[key], key
    assert "resolve" in gpu["trainer-gpu"]["depends_on"]
    assert trainer["SF_TRAINER_RESUME"] == "latest"
    assert not restarts_after(gpu["trainer-gpu"]["restart"], 0)
    assert restarts_after(gpu["trainer-gpu"]["restart"], 1)
    [devices] = gpu["trainer-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices["count"] == "all" and "device_ids" not in devices
    assert gpu["trainer-gpu"]["entrypoint"][:2] == ["torchrun", "--nproc-per-node=1"]
    # every extra the GPU image installs is pinned: vLLM to the release that requires
    # torch 2.13.0, CuPy to a minor release
    extras = gpu["trainer-gpu"]["build"]["args"]["EXTRA_PIP_PACKAGES"].split()
    assert gpu["engine-gpu"]["build"]["args"]["EXTRA_PIP_PACKAGES"].split() == extras
    assert "vllm==0.32.0" in extras
    assert any(re.fullmatch(r"cupy-cuda12x==\d+\.\d+\.\*", e) for e in extras), extras
    assert all("==" in e for e in extras), extras
    assert environment(gpu["engine-gpu"])["SF_ENGINE_BACKEND"] == "vllm"


def test_a_gateway_on_every_interface_needs_a_public_url() -> None:
    """The bind address 0.0.0.0 is no address to call: a session's base_url built from
    it sends an agent in another container to its own loopback."""
    with pytest.raises(ValueError, match="SF_GATEWAY_PUBLIC_URL"):
        GatewaySettings(host=WILDCARD)
    settings = GatewaySettings(host=WILDCARD, public_url="http://gateway:8000")
    assert settings.public_url == "http://gateway:8000"
    assert GatewaySettings(host="127.0.0.1").public_url == ""  # the default is callable


# --------------------------------------------------------------------------------------
# emulating the container engine
# --------------------------------------------------------------------------------------


class OtlpSink(http.server.ThreadingHTTPServer):
    """Jaeger's OTLP/HTTP receiver, reduced to counting span exports."""

    def __init__(self) -> None:
        self.exports = 0
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    sink.exports += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def dockerfile_env() -> dict[str, str]:
    """The image's ENV lines (``ENV KEY=VALUE ...``, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            for item in shlex.split(line.strip()[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def dockerfile_entrypoint() -> list[str]:
    [line] = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    entrypoint: list[str] = yaml.safe_load(line.removeprefix("ENTRYPOINT"))
    return entrypoint


class Containers:
    """The rendered services as host processes (see the module docstring)."""

    def __init__(self, compose: dict[str, Any], tmp: Path) -> None:
        self.compose = compose
        self.services: dict[str, dict[str, Any]] = compose["services"]
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.volumes = {name: tmp / "volumes" / name for name in compose["volumes"]}
        for path in self.volumes.values():
            path.mkdir(parents=True)
        self.home = tmp / "home"
        self.home.mkdir()
        self.ports = {
            (service, port): free_port()
            for service, ports in SERVICE_PORTS.items()
            for port in ports
        }
        self.processes: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.image_env = dockerfile_env()
        self.entrypoint = dockerfile_entrypoint()

    # -- mapping container names to host ones --------------------------------------------

    def host_port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            raise AssertionError(f"nothing listens on {service}:{port} in the compose file")
        return self.ports[service, port]

    def mounts(self, name: str) -> dict[PurePosixPath, Path]:
        out: dict[PurePosixPath, Path] = {}
        for volume in self.services[name].get("volumes") or []:
            source, target = str(volume).split(":")[:2]
            assert source in self.volumes, f"{name}: volume {source} is not declared"
            out[PurePosixPath(target)] = self.volumes[source]
        return out

    def host_path(self, name: str, value: str) -> str:
        """A container path on one of the service's volumes -> its host directory."""
        if not value.startswith("/"):
            return value
        path = PurePosixPath(value)
        for target, source in self.mounts(name).items():
            if path == target or target in path.parents:
                return str(source / path.relative_to(target))
        return value

    def host_url(self, name: str, key: str, value: str) -> str:
        """A URL naming a compose service -> 127.0.0.1 and that port's host port."""
        parts = urlsplit(value)
        if not parts.scheme or not parts.netloc:
            return value
        host = parts.hostname or ""
        assert host in self.services, (
            f"{name}: {key}={value} names {host!r}, which is no compose service: "
            "from inside a container it cannot be reached"
        )
        default = {"nats": 4222, "http": 80, "https": 443}[parts.scheme]
        port = self.host_port(host, parts.port or default)
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))

    def env(self, name: str) -> dict[str, str]:
        """The process environment: the test's own less its seamlessflow and telemetry
        settings, the image's ENV, then the service's rendered environment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SF_", "OTEL_"))}
        env.update(self.image_env)
        env["HOME"] = str(self.home)
        for key, value in environment(self.services[name]).items():
            env[key] = self.host_url(name, key, self.host_path(name, value))
        if name == "gateway":
            # the container port, published on the host
            assert env["SF_GATEWAY_PORT"] == "8000", env["SF_GATEWAY_PORT"]
            env["SF_GATEWAY_PORT"] = str(self.host_port("gateway", 8000))
        return env

    def command(self, name: str) -> list[str]:
        service = self.services[name]
        entrypoint = service.get("entrypoint", self.entrypoint)
        command = [self.host_path(name, str(arg)) for arg in service.get("command") or []]
        assert entrypoint == ["seamlessflow"], f"{name}: entrypoint {entrypoint}"
        return [sys.executable, "-m", "sf_app", *command]

    # -- processes -------------------------------------------------------------------

    def start(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        index = len(self.processes.get(name, []))
        log = (self.logs / f"{name}-{index}.log").open("wb")
        process = subprocess.Popen(
            argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.processes.setdefault(name, []).append(process)

    def start_nats(self) -> None:
        service = self.services["nats"]
        env = environment(service)
        env["PATH"] = f"{Path(server_binary()).parent}{os.pathsep}{os.environ['PATH']}"
        env["TMPDIR"] = str(self.tmp)
        command = [self.host_path("nats", str(arg)) for arg in service["command"]]
        # the published client port and the monitoring port, on this host's loopback
        published = [
            "-a", "127.0.0.1",
            "-p", str(self.host_port("nats", 4222)),
            "-m", str(self.host_port("nats", 8222)),
        ]  # fmt: skip
        self.start("nats", [*service["entrypoint"], *command, *published], env)

    def start_service(self, name: str) -> None:
        replicas = int((self.services[name].get("deploy") or {}).get("replicas", 1))
        for _ in range(replicas):
            self.start(name, self.command(name), self.env(name))

    def healthy(self, name: str) -> bool:
        """The service's healthcheck, its container-local URL on the host port."""
        test = [str(arg) for arg in self.services[name]["healthcheck"]["test"]]
        assert test[0] == "CMD", test
        local = re.compile(r"(localhost|127\.0\.0\.1):(\d+)")
        test = [
            local.sub(lambda m: f"127.0.0.1:{self.host_port(name, int(m.group(2)))}", arg)
            for arg in test[1:]
        ]
        if test[0] == "wget":  # not on every host: the same GET
            try:
                with urlopen(test[-1], timeout=3) as response:
                    return bool(response.status == 200)
            except OSError:
                return False
        if test[0] == "python":
            test[0] = sys.executable
        return subprocess.run(test, capture_output=True, timeout=30).returncode == 0

    def wait(self, name: str, condition: str, deadline: float) -> None:
        """Block until ``name`` meets a ``depends_on`` condition."""
        while time.monotonic() < deadline:
            self.check_alive()
            if condition == "service_started":
                return
            if condition == "service_healthy" and self.healthy(name):
                return
            if condition == "service_completed_successfully":
                [process] = self.processes[name]
                if process.poll() == 0:
                    return
            time.sleep(0.2)
        raise AssertionError(f"{name} is not {condition} in time\n{self.tails()}")

    def check_alive(self) -> None:
        """Every process still runs, or has exited 0 (one-shot services, a finished
        trainer); a non-zero exit fails the test with the logs."""
        for name, processes in self.processes.items():
            for process in processes:
                code = process.poll()
                assert code in (None, 0), f"{name} exited with {code}\n{self.tails()}"

    def tails(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.logs.iterdir()):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        for processes in self.processes.values():
            for process in processes:
                if process.poll() is None:
                    process.terminate()
        for processes in self.processes.values():
            for process in processes:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def start_order(services: Mapping[str, dict[str, Any]]) -> list[str]:
    """Services in an order that starts each after what it depends on."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"dependency cycle: {[*path, name]}"
        if name in order:
            return
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency, (*path, name))
        order.append(name)

    for name in services:
        visit(name)
    return order


def conditions(service: Mapping[str, Any]) -> dict[str, str]:
    depends = service.get("depends_on") or {}
    if isinstance(depends, list):
        return dict.fromkeys(depends, "service_started")
    return {name: (cfg or {}).get("condition", "service_started") for name, cfg in depends.items()}


@pytest.fixture
def containers(tmp_path: Path) -> Iterator[Containers]:
    running = Containers(render(COMPOSE_FILE, VARIABLES), tmp_path)
    try:
        yield running
    finally:
        running.stop()


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def any_group_with_signal(env: Mapping[str, str]) -> bool:
    """Whether a trained batch of the run had a group whose rewards differ."""
    import asyncio

    from seamlessflow.batches import stored_batches
    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects, TrainBatch

    async def trained_batches() -> list[TrainBatch]:
        subjects = Subjects(env["SF_RUN_ID"])
        bus = await connect(env["SF_NATS_URL"], subjects, name="test", token=env["SF_NATS_TOKEN"])
        try:
            return await stored_batches(bus)
        finally:
            await bus.drain()

    batches = asyncio.run(trained_batches())
    assert len(batches) >= STEPS
    return any(len({s.reward for s in g.samples}) > 1 for b in batches for g in b.groups)


def test_compose_as_processes_trains_the_built_in_task_and_keeps_its_final(
    containers: Containers,
) -> None:
    services = containers.services
    jaeger = OtlpSink()
    containers.ports["jaeger", 4318] = jaeger.server_address[1]
    threading.Thread(target=jaeger.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in start_order(services):
            for dependency, condition in conditions(services[name]).items():
                containers.wait(dependency, condition, deadline)
            if name == "nats":
                containers.start_nats()
            elif name != "jaeger":
                containers.start_service(name)

        # the session URLs the gateway hands out are its public URL, which the agents
        # (another container) reach: http://gateway:8000 on the host's port
        gateway_url = f"http://127.0.0.1:{containers.host_port('gateway', 8000)}"
        gateway_log = containers.logs / "gateway-0.log"
        containers.wait("gateway", "service_healthy", deadline)
        assert f"gateway listening on {gateway_url}" in gateway_log.read_text()

        [trainer] = containers.processes["trainer"]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while trainer.poll() is None and time.monotonic() < deadline:
            containers.check_alive()
            time.sleep(0.5)
        assert trainer.returncode == 0, f"trainer: {trainer.returncode}\n{containers.tails()}"
        assert not restarts_after(services["trainer"].get("restart", "no"), 0)

        # the agents stop once the run has the batches the trainer announced, and
        # every session they opened worked (its base_url reached the gateway)
        [agents] = containers.processes["agents"]
        assert agents.wait(RUN_TIMEOUT_S) == 0, containers.tails()
        assert not restarts_after(services["agents"].get("restart", "no"), 0)
        done = re.search(
            r"agent runner done: (\d+) completed, (\d+) failed",
            (containers.logs / "agents-0.log").read_text(),
        )
        assert done, containers.tails()
        samples_per_batch = int(VARIABLES["SF_GROUP_SIZE"]) * int(VARIABLES["SF_GROUPS_PER_BATCH"])
        completed, failed = int(done[1]), int(done[2])
        assert failed == 0 and completed >= STEPS * samples_per_batch, done[0]

        run_dir = Path(containers.env("trainer")["SF_RUN_DIR"])
        final = run_dir / "checkpoints" / "final"
        state = checkpoint.read_state(final)
        assert (state.step, state.trained, state.version) == (STEPS, STEPS, STEPS), state
        trained = checkpoint.load_model_state(final)
        model_dir = Path(containers.env("trainer")["SF_MODEL_DIR"])
        base = checkpoint.load_model_state(model_dir)
        # the variable reached build-model's command line through its environment
        build_info = json.loads((model_dir / "build_info.json").read_text())
        assert build_info["sft_steps"] == int(VARIABLES["SF_BASE_MODEL_SFT_STEPS"])
        assert trained.keys() == base.keys()
        if any_group_with_signal(containers.env("trainer")):
            # some group's rewards differed, so some advantage was not 0: a step moved
            # the weights (groups whose samples all scored the same train nothing)
            assert any(not torch.equal(trained[k], base[k]) for k in base)

        # `docker compose up` again (or `restart trainer`) starts the finished trainer
        # with the same settings: it must leave the trained model alone
        containers.start_service("trainer")
        again = containers.processes["trainer"][-1]
        again.wait(RUN_TIMEOUT_S)
        assert again.returncode == 0, containers.tails()
        assert checkpoint.read_state(final) == state
        after = checkpoint.load_model_state(final)
        assert all(torch.equal(after[k], trained[k]) for k in trained)
        containers.check_alive()
    finally:
        containers.stop()
        jaeger.shutdown()
        jaeger.server_close()
    assert jaeger.exports > 0, "no service exported spans to OTEL_EXPORTER_OTLP_ENDPOINT"
