"""Third-party environments as their packages ship them, each served from its own
virtual environment (``just env-venv NAME``): TextArena's games on OpenEnv's current
server (openenv 0.10), played over OpenEnv's WebSocket protocol by the project's own
client, over MCP by a JSON-RPC client, and trained in by ``seamlessflow up --env URL``.

The venv is installed by the fixture when it is missing (about 50 s with a warm pip
cache); what is measured with SmolLM2 is docs/benchmarks.md, "Third-party environments".
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import REPO_ROOT, small_embedded_run
from test_env_episodes import stored
from transformers import AutoTokenizer

from seamlessflow.envs.openenv_client import EnvFailed, OpenEnvSession, observation_text
from seamlessflow.protocol import TurnRecorded

pytestmark = [pytest.mark.integration]

GAME = "GuessTheNumber-v0"  # a secret from 1 to 20, ten guesses, moves as "[n]"


@pytest.fixture(scope="module")
def textarena_url() -> Iterator[str]:
    just = REPO_ROOT / ".venv" / "bin" / "just"
    subprocess.run([str(just) if just.exists() else "just", "env-venv", "textarena"],
                   cwd=REPO_ROOT, check=True)  # fmt: skip
    python = REPO_ROOT / ".venv-env-textarena" / "bin" / "python"
    server = REPO_ROOT / "environments" / "textarena" / "server.py"
    with subprocess.Popen(
        [str(python), str(server), "--game", GAME, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    ) as process:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.startswith("listening on http://"), line
        yield line.removeprefix("listening on ")
        process.terminate()
        process.wait(timeout=30)


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


@pytest.mark.slow
async def test_a_run_trains_in_a_textarena_game(
    textarena_url: str, base_model_dir: Path, tmp_path: Path, run_id: str
) -> None:
    """``seamlessflow up --env URL`` against the third-party server: the ``openenv`` agent
    plays each group's game, the trainer trains on the episodes' returns."""
    run = small_embedded_run(run_id, tmp_path, base_model_dir, steps=2, env=textarena_url,
                             max_tokens=8)  # fmt: skip
    summary = await run.run()
    assert summary.status == "finished", summary.status
    metrics = run.state.metrics
    assert [m.step for m in metrics] == [1, 2]
    # each step: two games of four episodes; a return is the game's own (0 to 1)
    assert all(0 < m.samples <= 8 and 0.0 <= m.mean_reward <= 1.0 for m in metrics)
    events, dropped = await stored(tmp_path / run_id, run_id)
    # every episode was played to its end: none failed in the environment (a sample the
    # staleness filter drops is the trainer's choice, not the environment's)
    assert set(dropped.values()) <= {"stale"}, dropped
    turns = [e for e in events if isinstance(e, TurnRecorded)]
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    first_prompt = tokenizer.decode(turns[0].prompt_ids)
    assert "You are playing Guess The Number" in first_prompt  # the game's own rules
