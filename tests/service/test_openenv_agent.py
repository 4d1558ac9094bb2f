"""The "openenv" agent when its episode outgrows the model's context, against the real
gateway, engine worker, scheduler and weight-sync on a real nats-server, and the
built-in environment server in its own process.

A game's conversation grows every turn, and a model's context does not. In
CI a TextArena game ran past it on turn 14 and the agent raised (the gateway's 400),
so the whole episode was lost. It is now cut there and keeps the rewards it got; an
episode whose first turn does not fit fails with ``context_exceeded``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from seamlessflow.agents import AgentTask, EpisodeFailed, EpisodeReturn, get_agent
from seamlessflow.bus import Bus
from seamlessflow.protocol import TrajectoryEvent, TurnRecorded, decode
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, session_auth
from tests.support.envserver import EnvServer

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
CONTEXT = 512  # the gateway's limit (SF_GATEWAY_MAX_CONTEXT), under the test model's
GAME_TURNS = 200  # far more than fit: only the context can end the episode


@pytest.fixture(scope="module")
def long_game() -> Iterator[EnvServer]:
    server = EnvServer("--step-latency-ms", "0", "--upper", "1000000",
                       "--max-turns", str(GAME_TURNS))  # fmt: skip
    yield server
    server.stop()


@pytest.fixture
async def gateway_url(nats_url: str, run_id: str, base_model_dir: Path) -> AsyncIterator[str]:
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        await mesh.start(EngineService(EngineSettings(engine_id="engine-c", max_batch_size=4)))
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=CONTEXT)))
        await asyncio.wait_for(gateway.ready.wait(), 60)
        yield f"http://127.0.0.1:{gateway.bound_port}"
    finally:
        await mesh.stop()


def system_prompt_of(model_dir: Path, tokens: int) -> str:
    """The longest system prompt of repeated words that takes at most ``tokens`` of the
    chat template's prompt."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def prompt_tokens(words: int) -> int:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": " ".join(["rule"] * words)}], tokenize=False
        )
        return len(tokenizer(rendered, add_special_tokens=False).input_ids)

    low, high = 0, tokens  # a word is at least one token
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if prompt_tokens(middle) <= tokens else (low, middle - 1)
    assert prompt_tokens(low) > tokens - 10, "the words do not fill the prompt"
    return " ".join(["rule"] * low)


async def play(
    gateway_url: str, env_url: str, model_dir: Path, system_tokens: int
) -> tuple[Any, str]:
    """One episode of the openenv agent in the long game: what it returned (or the
    exception it raised) and its session id."""
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = (await http.post("/sessions", json={"task_id": "game-0"})).json()
        task = AgentTask(
            "game-0", [{"role": "system", "content": system_prompt_of(model_dir, system_tokens)}],
            "policy", "7", max_tokens=MAX_TOKENS, temperature=0.0, env_url=env_url,
            env_max_steps=GAME_TURNS,
        )  # fmt: skip
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            try:
                outcome: Any = await get_agent("openenv")(client, task)
            except EpisodeFailed as exc:
                outcome = exc
        finish = await http.post(
            f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
        )
        assert finish.is_success
    return outcome, session["session_id"]


async def test_an_episode_that_outgrows_the_context_is_cut_and_keeps_its_rewards(
    long_game: EnvServer, gateway_url: str, base_model_dir: Path, bus: Bus
) -> None:
    context = CONTEXT
    # the rules take most of the context: a few turns fill the rest
    outcome, session_id = await play(gateway_url, long_game.url, base_model_dir, context - 150)
    assert isinstance(outcome, EpisodeReturn), outcome
    s = bus.subjects
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]
    turns = [e for e in events if isinstance(e, TurnRecorded) and e.session_id == session_id]
    # every turn the gateway answered was stepped in the game, and the game went on
    assert 1 <= len(turns) == len(outcome.step_rewards) < GAME_TURNS
    last = turns[-1]
    assert len(last.prompt_ids) + MAX_TOKENS <= context
    # the next turn would have been the last one's conversation and one more observation
    assert len(last.prompt_ids) + len(last.completion_ids) + MAX_TOKENS > context - 100

    # rules that alone do not fit: nothing to score, the episode fails with the reason
    outcome, _ = await play(gateway_url, long_game.url, base_model_dir, context + 10)
    assert isinstance(outcome, EpisodeFailed) and outcome.reason == "context_exceeded", outcome
