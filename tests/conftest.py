"""The fixtures every test may take (a real nats-server on a random port, a fresh run
id, the small real models, an in-process mesh, a live gateway, the OpenAI shape check)
and the marking of tests by kind. Plain helpers are in tests/support/, the one place
tests import from (the suite is a package; no test module imports another).

The tests are laid out by what they start: tests/unit (no nats-server, no built model,
no service process; a few start a fresh Python to check an import or a sandbox),
tests/service (one service or part against real parts) and tests/mesh (several
services, processes, the embedded run, compose). ``just test-units``
selects by the ``integration`` marker set here, not by folder."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from seamlessflow.bus import Bus, connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import Subjects
from tests.support import InProcessMesh, start_rollout

# The suite's trainers compute in float32 on every machine, whatever ``auto`` would pick
# there: the tests compare the trainer's logprobs with the engines' (float32) at float32
# tolerances (tests/service/test_model_families.py, ``tol_same``). Tests of bf16 name it
# (tests/mesh/test_trainer_practice.py), and tests of ``auto`` ask for it
# (tests/unit/test_machine.py; tests/mesh/test_modes.py's embedded runs).
os.environ["SF_PRECISION"] = "fp32"

REAL_PARTS = frozenset({"nats_url", "base_model_dir", "chatty_model_dir", "qwen2_tied_model_dir"})
"""Fixtures that start a nats-server or build a model: a test that uses one
(directly or through another fixture) is an ``integration`` test."""


def pytest_configure(config: pytest.Config) -> None:
    """The README's test install leaves bytecode to the imports (``pip install
    --no-compile``), so a third-party module may be compiled for the first time inside the
    suite, under its ``error`` filter. The compiler's warnings about a module's source
    (SyntaxWarning, such as cellpylib's ``is "recursive"``; Python 3.11's "invalid escape
    sequence" DeprecationWarning) would then turn its import into a SyntaxError, where
    pip's compile shows them to nobody. Ours have neither (ruff F632, W605)."""
    config.addinivalue_line("filterwarnings", "ignore::SyntaxWarning")
    config.addinivalue_line("filterwarnings", "ignore:invalid escape sequence:DeprecationWarning")


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
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SF_* variable of the caller's shell reaches the settings under test."""
    for name in list(os.environ):
        if name.startswith("SF_"):
            monkeypatch.delenv(name)
    return monkeypatch


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


@pytest.fixture
async def mesh(nats_url: str, run_id: str, base_model_dir: Path) -> AsyncIterator[InProcessMesh]:
    in_process = InProcessMesh(nats_url, run_id, base_model_dir)
    yield in_process
    await in_process.stop()


@pytest.fixture(scope="session")
def qwen2_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init tied-embedding model of Qwen2.5-0.5B's shape, with its ChatML
    template with tools (the ``qwen2-tied`` family); read only by the tests."""
    from seamlessflow.assets.families import build_family_model

    return build_family_model("qwen2-tied", tmp_path_factory.mktemp("tied") / "model", seed=0)


@pytest.fixture
async def gateway_url(mesh: InProcessMesh) -> str:
    """A live gateway on ``mesh`` (scheduler, weight-sync, one engine worker of the base
    model, context ``support.GATEWAY_MAX_CONTEXT``): its URL. A test module may override
    it with a gateway of its own."""
    from sf_engine.settings import EngineSettings

    return await start_rollout(mesh, EngineSettings(engine_id="engine-t", max_batch_size=8))


@pytest.fixture
def openai_shapes(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Every answer of every gateway the test starts is checked against the ``openai``
    package's types (tests/support/openai_shapes.py); any mismatch fails the test."""
    from sf_gateway.service import Gateway
    from tests.support.openai_shapes import ShapeChecker

    checker = ShapeChecker()
    serve = Gateway.app
    monkeypatch.setattr(Gateway, "app", lambda gateway: checker.wrap(serve(gateway)))
    yield checker
    assert not checker.problems, "answers that do not conform:\n" + "\n".join(checker.problems)
