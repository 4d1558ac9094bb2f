"""Bring your own model: what a run needs from a model directory is checked at start,
with one error naming every problem (the check itself, the CLI, each service). Each
family's tiny build passing the check is tests/unit/test_model_check_families.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seamlessflow.assets.model_check import (
    ModelNeeds,
    ModelUnfit,
    check_model,
    model_problems,
    task_context_tokens,
)
from seamlessflow.bus import EXIT_UNRECOVERABLE
from sf_engine.backends import ENGINE_BACKENDS

# What each engine backend needs of a model's architecture, as it declares it.
SCRIPTED = ENGINE_BACKENDS.get("scripted").architecture
VLLM = ENGINE_BACKENDS.get("vllm").architecture

# What `broken_model_dir` lacks, as the check names each problem.
WEIGHTS = "no *.safetensors weights (found pytorch_model.bin"
TEMPLATE = "no chat template"
EOS = "no eos token in the tokenizer"
CONTEXT = "context of 8 tokens (config.json) is shorter than"


@pytest.fixture
def broken_model_dir(base_model_dir: Path, tmp_path: Path) -> Path:
    """The test model with four things missing at once: safetensors weights (a .bin
    instead), the chat template, the tokenizer's eos token, and context (8 positions).
    A llama config: its tokenizer class has no default eos (Qwen2's would fill one in)."""
    out = tmp_path / "broken"
    out.mkdir()
    config = json.loads((base_model_dir / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    config["max_position_embeddings"] = 8
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(base_model_dir / "tokenizer.json", out)
    tokenizer_config = json.loads((base_model_dir / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "pytorch_model.bin").write_bytes(b"not read by the check")
    return out


def assert_names_all(message: str, expected: list[str]) -> None:
    missing = [phrase for phrase in expected if phrase not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_a_usable_model_dir_passes_every_need(base_model_dir: Path) -> None:
    need = task_context_tokens(base_model_dir, "arithmetic", 0, max_tokens=6)
    assert need is not None and 6 < need <= 512
    for needs in (
        ModelNeeds(context_tokens=need),
        ModelNeeds(chat=False, tokenizer=False, architecture=SCRIPTED, context_tokens=512),
        ModelNeeds(chat=False),
    ):
        assert model_problems(base_model_dir, needs) == []


def test_every_problem_is_named_in_one_error(broken_model_dir: Path) -> None:
    with pytest.raises(ModelUnfit) as caught:
        check_model(broken_model_dir, ModelNeeds(context_tokens=40, context_reason="the task"))
    error = caught.value
    assert len(error.problems) == 4, error.problems
    assert "\n" not in str(error)
    assert_names_all(str(error), [WEIGHTS, TEMPLATE, EOS, CONTEXT + " the 40 the run needs"])
    # each consumer is told only what it needs: the engine has no use for a template
    engine = model_problems(broken_model_dir, ModelNeeds(tokenizer=False, chat=False))
    assert engine == [p for p in error.problems if p.startswith("no *.safetensors")]


def test_weights_config_and_template_problems(base_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(base_model_dir, model)
    # a sharded checkpoint whose index names a shard that is not there
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}})
    )
    # a template that fails on every conversation (as templates that demand a system turn)
    (model / "chat_template.jinja").write_text("{{ raise_exception('needs a system turn') }}")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no-such-family"}))
    problems = model_problems(model, ModelNeeds())
    assert len(problems) == 3, problems
    assert_names_all(
        " | ".join(problems),
        ["['model-2.safetensors']", "'no-such-family'", "needs a system turn"],
    )
    # not a directory at all: that alone
    assert model_problems(tmp_path / "nowhere", ModelNeeds()) == ["no such directory"]


def test_vllm_backend_checks_the_architecture(base_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    assert model_problems(base_model_dir, ModelNeeds(architecture=VLLM)) == []
    model = tmp_path / "m"
    shutil.copytree(base_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    # a family transformers loads under a class name vLLM does not run
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2Custom"]}))
    assert model_problems(model, ModelNeeds()) == []
    (problem,) = model_problems(model, ModelNeeds(architecture=VLLM))
    assert "Qwen2Custom" in problem and "vLLM" in problem


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_up_names_every_problem_and_starts_nothing(broken_model_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "sf_app", "up", "--model-dir", str(broken_model_dir)]
    command += ["--steps", "2", "--runs-dir", str(tmp_path / "runs"), "--run-id", "bad-model"]
    result = subprocess.run(
        [*command, "--no-live"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    run_dir = tmp_path / "runs" / "bad-model"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith(f"failed: model {broken_model_dir} is not usable")
    assert_names_all(summary["status"], [WEIGHTS, TEMPLATE, EOS, CONTEXT])
    assert "the longest arithmetic prompt + max_tokens 6" in summary["status"]
    assert not (run_dir / "logs").exists()  # no process was started
    assert summary["steps"] == 0


@pytest.mark.parametrize(
    ("service", "env", "expected"),
    [
        ("gateway", {"SF_GATEWAY_MAX_CONTEXT": "64"}, [TEMPLATE, EOS, CONTEXT + " the 64"]),
        ("engine", {"SF_ENGINE_MAX_CONTEXT": "32"}, [WEIGHTS, CONTEXT + " the 32"]),
        ("trainer", {}, [WEIGHTS]),
    ],
)
def test_a_service_exits_unrecoverable_naming_what_it_needs(
    service: str, env: dict[str, str], expected: list[str], broken_model_dir: Path, nats_url: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", service],
        env=_clean_env(SF_NATS_URL=nats_url, SF_MODEL_DIR=str(broken_model_dir), **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"{service}: model {broken_model_dir} is not usable: (1) ")
    assert_names_all(last_line, expected)
    assert f"({len(expected) + 1})" not in last_line  # what it needs, nothing else
