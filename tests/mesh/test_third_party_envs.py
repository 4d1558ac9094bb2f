"""Third-party environments as their packages ship them, each served from its own
virtual environment (``just env-venv NAME``) by OpenEnv's current server (openenv 0.10):
TextArena's games, played over OpenEnv's WebSocket protocol by the project's own client
over MCP by a JSON-RPC client, and through its MCP tools by the ``openenv_tools``
agent; SkyRL-Gym's multi-turn math environment and a
verifiers environment run by its own rollout loop, each scored against answers computed
here. Each is trained in by ``seamlessflow up --env URL``.

A venv is installed by its fixture when it is missing (about 50 s with a warm pip
cache); what is measured with SmolLM2 is docs/benchmarks.md, "Third-party environments".
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from seamlessflow.agents import AgentTask, EpisodeReturn, get_agent
from seamlessflow.envs.openenv_client import EnvFailed, OpenEnvSession, observation_text
from seamlessflow.protocol import TurnRecorded
from tests.support import load_loadtest, small_embedded_run
from tests.support.store import stored

pytestmark = [pytest.mark.integration]

GAME = "GuessTheNumber-v0"  # a secret from 1 to 20, ten guesses, moves as "[n]"


@pytest.fixture(scope="module")
def textarena_url() -> Iterator[str]:
    with load_loadtest("env_train").env_server("textarena", GAME) as url:
        yield url


@pytest.fixture(scope="module")
def verifiers_url() -> Iterator[str]:
    env_train = load_loadtest("env_train")
    spec = env_train.ENVIRONMENTS["verifiers"]
    with env_train.env_server("verifiers", spec.game, *spec.train_options) as url:
        yield url


@pytest.fixture(scope="module")
def skyrl_gym_url() -> Iterator[str]:
    with load_loadtest("env_train").env_server("skyrl_gym", "gsm8k_multi_turn") as url:
        yield url


async def play_by_bisection(move: Any, first: str) -> tuple[list[int], float, str]:
    """Guess by bisection with ``move(text) -> (prompt, reward, done)``: the guesses, the
    final reward, and the game's last word."""
    assert "between 1 and 20" in first
    low, high, guesses = 1, 20, []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        prompt, reward, done = await move(f"I guess [{guess}]")
        if done:
            return guesses, reward, prompt
        assert reward == 0.0 and f"[{guess}]" not in prompt  # the news, not the echo
        if "higher" in prompt:
            low = guess + 1
        else:
            assert "lower" in prompt, prompt
            high = guess - 1


async def test_a_textarena_game_over_openenv_websocket_and_mcp(textarena_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        plays = []
        for _ in range(2):  # the same seed: the same game
            async with OpenEnvSession(textarena_url, http=http) as env:
                reset = await env.reset(seed=11)

                async def move(text: str, env: OpenEnvSession = env) -> tuple[str, float, bool]:
                    step = await env.step({"message": text})
                    return observation_text(step.observation), float(step.reward or 0), step.done

                plays.append(await play_by_bisection(move, observation_text(reset.observation)))
                with pytest.raises(EnvFailed) as after_the_end:
                    await env.step({"message": "[1]"})
                assert after_the_end.value.reason == "env_error"
        assert plays[0] == plays[1]
        guesses, reward, last = plays[0]
        assert reward == 1.0 and "Congratulations" in last and len(guesses) <= 5

        # the same game through MCP tools, on the /mcp WebSocket (JSON-RPC 2.0)
        ws_url = textarena_url.replace("http://", "ws://") + "/mcp"
        async with http.ws_connect(ws_url) as ws:
            calls = iter(range(1, 100))

            async def rpc(method: str, params: dict[str, Any]) -> Any:
                ident = next(calls)
                request = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
                await ws.send_str(json.dumps(request))
                reply = json.loads((await ws.receive()).data)
                assert reply["id"] == ident and "error" not in reply, reply
                return reply["result"]

            tools = await rpc("tools/list", {})
            assert {t["name"] for t in tools["tools"]} == {"new_game", "move"}

            async def tool(name: str, **arguments: Any) -> dict[str, Any]:
                result = await rpc("tools/call", {"name": name, "arguments": arguments})
                assert not result["is_error"], result
                return dict(result["structured_content"])

            async def mcp_move(text: str) -> tuple[str, float, bool]:
                outcome = await tool("move", action=text)
                return outcome["prompt"], outcome["reward"], outcome["done"]

            rules = await tool("new_game", seed=11)
            assert await play_by_bisection(mcp_move, rules["prompt"]) == plays[0]


class BisectingModel:
    """A real OpenAI-compatible HTTP server in the model's place, which plays
    GuessTheNumber through the tools it is offered: first a call of ``new_game`` (which
    the agent hides), then ``move`` by bisection, read from the tool messages. What it
    was asked is kept (``requests``)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.low, self.high, self.guess = 1, 20, 0
        self.guesses: list[int] = []

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        last = body["messages"][-1]
        if last["role"] == "user":  # the game's rules: try a tool it was not offered
            name, arguments = "new_game", {"seed": 3}
        else:
            assert last["role"] == "tool", last
            if "higher" in last["content"]:
                self.low = self.guess + 1
            elif "lower" in last["content"]:
                self.high = self.guess - 1
            self.guess = (self.low + self.high) // 2
            self.guesses.append(self.guess)
            name, arguments = "move", {"action": f"I guess [{self.guess}]"}
        call = {"id": f"call_{len(self.requests)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


async def test_the_openenv_tools_agent_plays_a_textarena_game_through_its_mcp_tools(
    textarena_url: str,
) -> None:
    """The ``openenv_tools`` agent against TextArena's server: the environment's MCP tools
    (less the hidden ``new_game``) offered as OpenAI tools with a call required, each
    call one ``call_tool`` step on the episode's session, a call of a tool not offered
    answered with an error the model reads, and the game's own reward as the return."""
    model = BisectingModel()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", model.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        task = AgentTask(
            task_id="episode-11",
            messages=[{"role": "system", "content": "Play the game with your tools."}],
            model="policy",
            reference="11",
            max_tokens=32,
            temperature=1.0,
            env_url=textarena_url,
            env_hidden_tools=("new_game",),
        )
        base_url = f"http://127.0.0.1:{port}/v1"
        async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            played = await get_agent("openenv_tools")(client, task)
    finally:
        await runner.cleanup()
    assert isinstance(played, EpisodeReturn)
    # the yardstick: the same seed played by bisection over plain /ws messages
    async with aiohttp.ClientSession() as http, OpenEnvSession(textarena_url, http=http) as env:
        reset = await env.reset(seed=11)

        async def move(text: str) -> tuple[str, float, bool]:
            step = await env.step({"message": text})
            return observation_text(step.observation), float(step.reward or 0), step.done

        guesses, reward, _ = await play_by_bisection(move, observation_text(reset.observation))
    assert model.guesses == guesses and reward == 1.0
    assert played.reward == 1.0 and played.step_rewards == (0.0,) * (len(guesses) - 1) + (1.0,)
    assert all(r["tool_choice"] == "required" for r in model.requests)
    assert all([t["function"]["name"] for t in r["tools"]] == ["move"] for r in model.requests)
    first = model.requests[0]["messages"]
    assert "between 1 and 20" in first[-1]["content"]  # the game's rules, from the reset
    refused = model.requests[1]["messages"][-1]
    assert refused["role"] == "tool" and "there is no tool 'new_game'" in refused["content"]
    assert len(model.requests) == 1 + len(guesses)  # the episode ended with the game


@pytest.mark.slow
async def test_a_run_trains_through_textarena_s_mcp_tools(
    textarena_url: str,
    base_model_dir: Path,
    tmp_path: Path,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``seamlessflow up --env URL --agent openenv_tools``: the model's answers are forced
    tool calls through the real gateway (the test model writes them malformed, and the
    agent answers each with an error), every episode is played to its cut, recorded
    with its tool-call errors, and trained."""
    monkeypatch.setenv("SF_AGENTS_ENV_HIDDEN_TOOLS", '["new_game"]')
    monkeypatch.setenv("SF_AGENTS_ENV_MAX_STEPS", "3")
    turns, first_prompt = await two_steps(
        textarena_url, base_model_dir, tmp_path, run_id, 1.0, agent="openenv_tools"
    )
    assert "You are playing Guess The Number" in first_prompt
    assert '"move"' in first_prompt and "new_game" not in first_prompt  # the tools offered
    per_session = Counter(t.session_id for t in turns)
    assert len(per_session) >= 16  # 2 steps x 2 groups x 4 episodes, and any in flight
    assert set(per_session.values()) <= {1, 2, 3}  # cut after SF_AGENTS_ENV_MAX_STEPS


@pytest.mark.slow
async def test_a_run_trains_in_a_textarena_game(
    textarena_url: str, base_model_dir: Path, tmp_path: Path, run_id: str
) -> None:
    """``seamlessflow up --env URL`` against the third-party server: the ``openenv`` agent
    plays each group's game, the trainer trains on the episodes' returns."""
    # a return is the game's own (0 to 1)
    _, first_prompt = await two_steps(textarena_url, base_model_dir, tmp_path, run_id, 1.0)
    assert "You are playing Guess The Number" in first_prompt  # the game's own rules


async def two_steps(
    url: str, model_dir: Path, tmp_path: Path, run_id: str, max_return: float, **config: object
) -> tuple[list[TurnRecorded], str]:
    """A 2-step ``seamlessflow up --env URL`` run (two groups of four episodes a step)
    that finishes with returns within 0 and ``max_return``, every episode played to its
    end; its turns and the first one's prompt as text. ``config``: more run fields."""
    run = small_embedded_run(run_id, tmp_path, model_dir, steps=2, env=url, max_tokens=8, **config)
    summary = await run.run()
    assert summary.status == "finished", summary.status
    metrics = run.state.metrics
    assert [m.step for m in metrics] == [1, 2]
    assert all(0 < m.samples <= 8 and 0.0 <= m.mean_reward <= max_return for m in metrics)
    events, dropped = await stored(tmp_path / run_id, run_id)
    # none failed in the environment (a sample the staleness filter drops is the
    # trainer's choice, not the environment's)
    assert set(dropped.values()) <= {"stale"}, dropped
    turns = [e for e in events if isinstance(e, TurnRecorded)]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return turns, tokenizer.decode(turns[0].prompt_ids)


def sum_of(problem: str) -> int:
    """The answer to reasoning-gym's "Calculate a op b." computed here, not read from the
    environment (the yardstick its scoring is checked against)."""
    left, operator, right = problem.split("\n")[0].removeprefix("Calculate ").rstrip(".").split()
    assert operator in "+-*", problem  # the server's default options: no division
    a, b = int(left), int(right)
    return a + b if operator == "+" else a - b if operator == "-" else a * b


async def test_a_skyrl_gym_environment_scores_turn_by_turn_over_openenv(
    skyrl_gym_url: str,
) -> None:
    """SkyRL-Gym's ``gsm8k_multi_turn`` as its package ships it, on problems reasoning-gym
    generates from the reset's seed: every well-formed answer earns a share of 0.2, the
    right number earns 1 and ends the episode, and three turns end it either way."""
    async with aiohttp.ClientSession() as http:
        for seed in (3, 4, 5):
            problems = []
            for _ in range(2):  # the same seed: the same problem
                async with OpenEnvSession(skyrl_gym_url, http=http) as env:
                    problems.append(observation_text((await env.reset(seed=seed)).observation))
            assert problems[0] == problems[1] and "####" in problems[0]
            answer = sum_of(problems[0])
            async with OpenEnvSession(skyrl_gym_url, http=http) as env:
                await env.reset(seed=seed)
                unformed = await env.step({"message": f"it is {answer}"})
                assert (unformed.reward, unformed.done) == (0.0, False)
                assert "####" in observation_text(unformed.observation)  # the env's reminder
                wrong = await env.step({"message": f"#### {answer + 1}"})
                assert wrong.reward == pytest.approx(0.2 / 3) and not wrong.done
                right = await env.step({"message": f"so #### {answer}"})
                assert (right.reward, right.done) == (1.0, True)
                with pytest.raises(EnvFailed) as after_the_end:
                    await env.step({"message": f"#### {answer}"})
                assert after_the_end.value.reason == "env_error"
            async with OpenEnvSession(skyrl_gym_url, http=http) as env:
                await env.reset(seed=seed)
                for turn in range(3):
                    step = await env.step({"message": "no idea"})
                    assert step.reward == 0.0 and step.done == (turn == 2)


@pytest.mark.slow
async def test_a_run_trains_in_a_skyrl_gym_environment(
    skyrl_gym_url: str, base_model_dir: Path, tmp_path: Path, run_id: str
) -> None:
    """``seamlessflow up --env URL`` against SkyRL-Gym's server: each group answers one
    problem over up to three turns, the trainer trains on the episodes' returns."""
    # a return: at most two well-formed wrong answers (0.2 / 3 each) and a right one (1)
    turns, first_prompt = await two_steps(
        skyrl_gym_url, base_model_dir, tmp_path, run_id, 1.0 + 0.4 / 3
    )
    assert "Calculate " in first_prompt  # reasoning-gym's problem
    by_session: dict[str, int] = {}
    for turn in turns:
        by_session[turn.session_id] = by_session.get(turn.session_id, 0) + 1
    assert max(by_session.values()) <= 3  # the environment's max_turns


async def test_a_verifiers_environment_runs_its_own_rollout_turn_by_turn(
    verifiers_url: str,
) -> None:
    """falsepass's toy, loaded with ``load_environment`` and run by verifiers' own rollout
    loop: its model call is the episode's turn, its rubric's score the reward (1 for the
    sum, computed here, in ``<answer>`` tags; 0 otherwise); the seed picks the row."""
    async with aiohttp.ClientSession() as http:
        async with OpenEnvSession(verifiers_url, http=http) as env:
            prompts = {}
            for seed, off_by in ((0, 0), (0, 1), (7, 0), (207, 0)):
                reset = await env.reset(seed=seed)
                prompt = observation_text(reset.observation)
                assert prompts.setdefault(seed % 200, prompt) == prompt  # 200 rows
                assert "<answer></answer>" in prompt  # the environment's own system prompt
                left, right = prompt.rsplit("\n", 1)[-1].split(" + ")
                step = await env.step(
                    {"message": f"<answer>{int(left) + int(right) + off_by}</answer>"}
                )
                assert step.done and step.reward == (1.0 if off_by == 0 else 0.0)
            assert prompts[0] != prompts[7]
            with pytest.raises(EnvFailed) as after_the_end:
                await env.step({"message": "<answer>1</answer>"})
            assert after_the_end.value.reason == "env_error"


@pytest.mark.slow
async def test_a_run_trains_in_a_verifiers_environment(
    verifiers_url: str, base_model_dir: Path, tmp_path: Path, run_id: str
) -> None:
    """``seamlessflow up --env URL`` against the verifiers server: each group answers one
    row, scored by the environment's rubric."""
    turns, first_prompt = await two_steps(verifiers_url, base_model_dir, tmp_path, run_id, 1.0)
    assert "Add the two numbers" in first_prompt  # the environment's own system prompt
    assert len({t.session_id for t in turns}) == len(turns)  # one turn an episode


async def test_a_third_party_server_waits_its_step_latency() -> None:
    """``--step-latency-ms`` (environments/serving.py, every server there): each step
    answers no sooner than the latency asked, here 300 ms exactly (sigma 0)."""
    env_train = load_loadtest("env_train")
    options = ("--step-latency-ms", "300", "--step-latency-sigma", "0")
    with env_train.env_server("skyrl_gym", "gsm8k_multi_turn", *options) as url:
        async with aiohttp.ClientSession() as http, OpenEnvSession(url, http=http) as env:
            for turn in range(3):
                await env.reset(seed=turn)
                began = time.monotonic()
                await env.step({"message": "#### 1"})
                assert time.monotonic() - began >= 0.3
