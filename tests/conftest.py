"""Shared fixtures: a real nats-server on a random port, a small real model."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from seamlessflow.bus import Bus, connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import Subjects

REAL_PARTS = frozenset({"nats_url", "base_model_dir", "chatty_model_dir"})
"""Fixtures that start a nats-server or build the base model: a test that uses one
(directly or through another fixture) is an ``integration`` test."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests split by kind: ``integration`` (a real nats-server, the built model, other
    processes: marked here from their fixtures, or by hand) and the pure units (the
    rest: ``just test-units``). Tests marked ``gpu`` need CUDA; without one they are
    skipped, not failed."""
    import torch

    integration = pytest.mark.integration
    for item in items:
        if REAL_PARTS.intersection(getattr(item, "fixturenames", ())) or "slow" in item.keywords:
            item.add_marker(integration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One nats-server (R1 streams) for every test that takes it: the services behave the
    same on a cluster except where a node is lost, and what losing one does is tested on
    real three-node clusters (tests/test_nats_cluster.py; test_faults.py's cluster tests,
    the run's own and an external one; compose's nats-cluster profile in CI)."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server.url


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test: subjects, streams and buckets never collide."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
async def bus(nats_url: str, run_id: str) -> AsyncIterator[Bus]:
    bus = await connect(nats_url, Subjects(run_id), name="test")
    await bus.ensure_streams()
    yield bus
    await bus.drain()


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real base-model builder with a short SFT: a loadable model + tokenizer."""
    from sf_app.base_model import build_base_model

    return build_base_model(tmp_path_factory.mktemp("model") / "base", seed=0, sft_steps=30)


@pytest.fixture(scope="session")
def chatty_model_dir(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base tokenizer with a random-init model: it rarely emits a stop token, so
    answers run to their budget and events (weight updates, deaths) land mid-answer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("chatty")
    for name in base_model_dir.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_model_dir)))
    model.save_pretrained(out)
    return out


class InProcessMesh:
    """Services of one run started in this test's event loop, each with its own
    connection, exactly as ``run_service`` would start them (minus signals)."""

    def __init__(
        self, nats_url: str, run_id: str, model_dir: Path | None, policies: str = ""
    ) -> None:
        from seamlessflow.settings import MeshSettings

        self.mesh = MeshSettings(
            nats_url=nats_url, run_id=run_id, model_dir=model_dir, policies=policies
        )
        self.running: list[tuple[object, object, object]] = []

    async def start(self, service, policy: str = ""):  # type: ignore[no-untyped-def]
        """Start ``service``; ``policy``: the one it serves or trains (``SF_POLICY``)."""
        import asyncio

        from seamlessflow.service import ServiceContext

        mesh = self.mesh.model_copy(update={"policy": policy}) if policy else self.mesh
        service_bus = await connect(
            mesh.nats_url, Subjects(mesh.run_id, mesh.policy), name=service.name
        )
        await service_bus.ensure_streams(mesh.policy_names())
        ctx = ServiceContext(mesh=mesh, bus=service_bus)
        task = asyncio.create_task(service.run(ctx))
        self.running.append((service, ctx, task))
        return service

    async def stop(self) -> None:
        import asyncio

        running, self.running = self.running, []
        for _, ctx, _ in reversed(running):
            ctx.stopping.set()  # type: ignore[attr-defined]
        # every service is stopped and its connection drained, even after one failed;
        # then the first failure is raised
        failures: list[BaseException] = []
        for _, ctx, task in reversed(running):
            try:
                await asyncio.wait_for(task, 20)  # type: ignore[arg-type]
            except BaseException as exc:
                failures.append(exc)
            finally:
                await ctx.bus.drain()  # type: ignore[attr-defined]
        if failures:
            raise failures[0]


@pytest.fixture
async def mesh(nats_url: str, run_id: str, base_model_dir: Path) -> AsyncIterator[InProcessMesh]:
    in_process = InProcessMesh(nats_url, run_id, base_model_dir)
    yield in_process
    await in_process.stop()


async def announce_plan(bus: Bus, steps: int, seed: int = 0) -> None:
    """Announce a step budget as ``sf_trainer`` does at start (TrainingPlanned): what the
    trajectory service dispatches for."""
    from seamlessflow.protocol import MessageIds, TrainingPlanned

    policy = bus.subjects.policy
    await bus.js_publish(
        bus.subjects.train_plan(),
        TrainingPlanned(steps=steps, seed=seed, policy=policy),
        msg_id=MessageIds.train_plan(policy, f"test-{steps}-{seed}"),
    )


async def announce_weights(bus: Bus, manifest) -> None:  # type: ignore[no-untyped-def]
    """Announce a stored payload as ``sf_trainer`` does after a step."""
    from seamlessflow.protocol import MessageIds, WeightsPublished

    await bus.js_publish(
        bus.subjects.weights_published(),
        WeightsPublished(manifest=manifest, step=manifest.version),
        msg_id=MessageIds.weights(bus.subjects.policy, manifest.version),
    )


async def publish_perturbed_version(bus: Bus, version: int, base: dict) -> None:  # type: ignore[type-arg]
    """Play the trainer: store a slightly perturbed copy of ``base`` as a full payload of
    ``version`` in the object store, then announce it."""
    import torch

    from seamlessflow.weights import ObjectStorePayloads, WeightEncoder, WeightPublisher

    state = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
    publisher = WeightPublisher(ObjectStorePayloads(bus), WeightEncoder(bucket_bytes=1 << 20))
    await announce_weights(bus, await publisher.publish(version, state))


async def recorded_turns(bus: Bus) -> list:  # type: ignore[type-arg]
    """Every TurnRecorded in the run's durable trajectory stream, in order."""
    from seamlessflow.protocol import TrajectoryEvent, TurnRecorded, decode

    s = bus.subjects
    events = (
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    )
    return [e for e in events if isinstance(e, TurnRecorded)]


@pytest.fixture
def openai_shapes(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Every answer of every gateway the test starts is checked against the ``openai``
    package's types (tests/openai_shapes.py); any mismatch fails the test."""
    from openai_shapes import ShapeChecker

    from sf_gateway.service import Gateway

    checker = ShapeChecker()
    serve = Gateway.app
    monkeypatch.setattr(Gateway, "app", lambda gateway: checker.wrap(serve(gateway)))
    yield checker
    assert not checker.problems, "answers that do not conform:\n" + "\n".join(checker.problems)


def session_auth(session: dict) -> dict[str, str]:  # type: ignore[type-arg]
    """Headers carrying a session's own key (what its OpenAI client sends)."""
    return {"authorization": f"Bearer {session['api_key']}"}


def small_embedded_run(  # type: ignore[no-untyped-def]
    run_id: str, runs_dir: Path, model_dir: Path, steps: int, **config: object
):
    """An embedded run (``seamlessflow up``) of a few small steps on the test model;
    ``config``: further ``RunConfig`` fields (over the small group, batch and agents)."""
    from sf_app.run.config import RunConfig
    from sf_app.run.embedded import EmbeddedRun

    small = {"group_size": 4, "groups_per_batch": 2, "agent_concurrency": 8}
    return EmbeddedRun(
        RunConfig(
            run_id=run_id,
            runs_dir=runs_dir,
            model_dir=model_dir,
            steps=steps,
            engine_batch_size=8,
            live=False,
            **{**small, **config},  # type: ignore[arg-type]
        )
    )


def load_loadtest(name: str):  # type: ignore[no-untyped-def]
    """``loadtests/<name>.py`` as a module (the loadtests are scripts, not a package),
    registered under ``loadtests_<name>``: dataclasses look their module up by name."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "loadtests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"loadtests_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
