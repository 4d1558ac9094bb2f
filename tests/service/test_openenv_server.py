"""The built-in OpenEnv environment (``python -m sf_envs guess_number``) and our client
(``seamlessflow.envs.openenv_client``), against real servers on real sockets.

Each server is its own process, started as a supervisor starts it (``--port 0``, the
URL read from its one ``listening on`` line). openenv-core's own ``EnvClient`` plays
against it too: the server speaks OpenEnv's protocol, not a dialect of ours.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, get_args

import aiohttp
import pytest
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import State

from seamlessflow.envs import EnvFailed, EnvStep, OpenEnvSession, observation_text
from sf_envs.guess_number import StepLatency, first_integer
from sf_envs.server import ENVIRONMENTS
from sf_envs.settings import EnvironmentName
from tests.support.envserver import EnvServer

pytestmark = pytest.mark.integration

UPPER = 1000
MAX_TURNS = 12
BINARY_SEARCH_TURNS = 10  # ceil(log2(1000 + 1))


@pytest.fixture(scope="module")
def server() -> Iterator[EnvServer]:
    env_server = EnvServer(
        "--step-latency-ms", "0", "--upper", str(UPPER), "--max-turns", str(MAX_TURNS)
    )
    yield env_server
    env_server.stop()


@pytest.fixture(scope="module")
def slow_server() -> Iterator[EnvServer]:
    """Every step takes exactly 300 ms (sigma 0: timings compare without noise)."""
    env_server = EnvServer("--step-latency-ms", "300", "--sigma", "0")
    yield env_server
    env_server.stop()


def next_guess(observation: dict[str, Any]) -> int:
    """Binary search over what the answers so far allow."""
    return (observation["low"] + observation["high"]) // 2


async def play_by_binary_search(env: OpenEnvSession, seed: int) -> tuple[int, list[EnvStep]]:
    """The secret of game ``seed`` and every step it took to find it."""
    first = await env.reset(seed=seed)
    assert first.reward is None and not first.done
    steps = [first]
    while not steps[-1].done:
        steps.append(await env.step({"message": f"My guess: {next_guess(steps[-1].observation)}"}))
    assert steps[-1].reward == 1.0, steps[-1]
    return steps[-1].observation["low"], steps


class GuessNumberClient(EnvClient[dict[str, Any], dict[str, Any], State]):
    """A client as OpenEnv users write one: the action and observation as plain dicts."""

    def _step_payload(self, action: dict[str, Any]) -> dict[str, Any]:
        return action

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[dict[str, Any]]:
        return StepResult(
            observation=payload["observation"], reward=payload.get("reward"), done=payload["done"]
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def test_openenv_s_own_client_wins_by_binary_search(server: EnvServer) -> None:
    seed = 11
    with GuessNumberClient(base_url=server.url) as env:
        result = env.reset(seed=seed)
        assert "1 to 1000" in result.observation["prompt"]
        assert result.observation["guesses_left"] == MAX_TURNS and result.reward is None
        rewards = []
        while not result.done:
            result = env.step({"message": str(next_guess(result.observation))})
            rewards.append(result.reward)
        state = env.state()
    secret = random.Random(seed).randint(1, UPPER)
    assert result.observation["low"] == result.observation["high"] == secret
    assert "correct" in result.observation["prompt"]
    assert len(rewards) <= BINARY_SEARCH_TURNS
    # every guess before the last was inside the interval the answers allowed
    assert rewards == [0.1] * (len(rewards) - 1) + [1.0]
    assert state.step_count == len(rewards)
    assert getattr(state, "found") is True and getattr(state, "secret") == secret  # noqa: B009


async def test_our_session_wins_by_binary_search_and_serves_health_and_schema(
    server: EnvServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/health") as response:
            assert response.status == 200
        async with http.get(f"{server.url}/schema") as response:
            assert response.status == 200
            schema = await response.json()
        assert schema["action"]["required"] == ["message"]
        assert {"prompt", "turn", "guesses_left", "low", "high"} <= set(
            schema["observation"]["properties"]
        )
        async with OpenEnvSession(server.url, http=http) as env:
            secret, steps = await play_by_binary_search(env, seed=5)
    assert secret == random.Random(5).randint(1, UPPER)
    rewards = [step.reward for step in steps[1:]]
    assert rewards == [0.1] * (len(rewards) - 1) + [1.0] and len(rewards) <= BINARY_SEARCH_TURNS
    assert [step.observation["turn"] for step in steps] == list(range(len(steps)))
    assert steps[-1].observation["guesses_left"] == MAX_TURNS - len(rewards)
    assert observation_text(steps[0].observation) == steps[0].observation["prompt"]


async def test_the_seed_decides_the_secret(server: EnvServer) -> None:
    async with aiohttp.ClientSession() as http:
        secrets = []
        # one session plays game after game: reset starts a new one
        async with OpenEnvSession(server.url, http=http) as env:
            for seed in (1, 2, 3, 1):
                secret, _ = await play_by_binary_search(env, seed)
                secrets.append(secret)
    assert secrets[0] == secrets[3]
    assert len(set(secrets[:3])) == 3
    assert secrets == [random.Random(seed).randint(1, UPPER) for seed in (1, 2, 3, 1)]


async def test_replies_without_a_number_and_wasted_guesses_until_the_turns_run_out(
    server: EnvServer,
) -> None:
    async with aiohttp.ClientSession() as http, OpenEnvSession(server.url, http=http) as env:
        await env.reset(seed=0)  # the secret of seed 0 is 865
        empty = await env.step({"message": "Let me think about it."})
        assert (empty.reward, empty.done) == (-0.1, False)
        assert empty.observation["turn"] == 1 and empty.observation["guesses_left"] == 11
        assert "one whole number" in empty.observation["prompt"]
        useful = await env.step({"message": "500"})
        assert useful.reward == 0.1 and useful.observation["low"] == 501
        assert "higher" in useful.observation["prompt"]
        wasted = await env.step({"message": "400, surely"})  # ruled out by the answer to 500
        assert wasted.reward == 0.0 and wasted.observation["low"] == 501
        out_of_range = await env.step({"message": "5000"})
        assert out_of_range.reward == 0.0 and "lower" in out_of_range.observation["prompt"]
        last = out_of_range
        for _ in range(MAX_TURNS - 4):
            assert not last.done
            last = await env.step({"message": "no idea"})
        assert last.done and last.reward == -0.1
        assert last.observation["guesses_left"] == 0
        assert "my number was 865" in last.observation["prompt"]
        with pytest.raises(EnvFailed) as after_the_end:
            await env.step({"message": "865"})
        assert after_the_end.value.reason == "env_error"
        assert "episode is over" in after_the_end.value.detail


async def test_a_bad_action_is_an_env_error_and_the_session_goes_on(server: EnvServer) -> None:
    async with aiohttp.ClientSession() as http, OpenEnvSession(server.url, http=http) as env:
        with pytest.raises(EnvFailed) as before_reset:
            await env.step({"message": "1"})
        assert before_reset.value.reason == "env_error"
        assert "reset first" in before_reset.value.detail
        await env.reset(seed=4)
        with pytest.raises(EnvFailed) as no_message:
            await env.step({"guess": 12})
        assert no_message.value.reason == "env_error"
        assert (
            "VALIDATION_ERROR" in no_message.value.detail and "message" in no_message.value.detail
        )
        # the refused action cost nothing: the game goes on from its first turn
        step = await env.step({"message": "500"})
        assert step.observation["turn"] == 1 and step.reward == 0.1


async def test_step_latency_is_applied_and_sessions_do_not_wait_for_each_other(
    slow_server: EnvServer,
) -> None:
    steps_per_session = 4

    async def session(http: aiohttp.ClientSession) -> None:
        async with OpenEnvSession(slow_server.url, http=http) as env:
            await env.reset(seed=0)
            for guess in range(steps_per_session):
                await env.step({"message": str(guess)})

    async with aiohttp.ClientSession() as http:
        started = time.perf_counter()
        await session(http)
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(4):
                group.create_task(session(http))
        four_at_once_s = time.perf_counter() - started
    assert alone_s >= steps_per_session * 0.3 * 0.95  # the latency is there
    # serialized, four sessions would take four times as long as one
    assert four_at_once_s < 1.6 * alone_s, (alone_s, four_at_once_s)


async def test_a_step_without_a_reply_in_time_is_env_timeout(slow_server: EnvServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with OpenEnvSession(slow_server.url, http=http, step_timeout_s=0.05) as env:
            await env.reset(seed=0)  # resets are instant
            with pytest.raises(EnvFailed) as timed_out:
                await env.step({"message": "500"})
            assert timed_out.value.reason == "env_timeout"
            # a late reply would be taken for the next step's: the session is over
            with pytest.raises(EnvFailed) as after:
                await env.step({"message": "500"})
            assert after.value.reason == "env_timeout"


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM])
async def test_a_server_gone_mid_step_is_env_lost(stop_signal: signal.Signals) -> None:
    """Killed, or stopped (uvicorn closes open sessions with 1012 at once), while a step
    is in flight: the step fails ``env_lost`` and so does anything after it."""
    env_server = EnvServer("--step-latency-ms", "500", "--sigma", "0")
    try:
        async with aiohttp.ClientSession() as http:
            async with OpenEnvSession(env_server.url, http=http) as env:
                await env.reset(seed=0)
                step = asyncio.create_task(env.step({"message": "500"}))
                await asyncio.sleep(0.1)
                env_server.process.send_signal(stop_signal)
                with pytest.raises(EnvFailed) as lost:
                    await step
                assert lost.value.reason == "env_lost"
                with pytest.raises(EnvFailed) as after:
                    await env.step({"message": "750"})
                assert after.value.reason == "env_lost"
    finally:
        env_server.stop(signal.SIGKILL)


KEEPALIVE_SERVER = """
import asyncio, sys, uvicorn
from sf_envs.server import guess_number_app, listen
from sf_envs.settings import EnvServerSettings

# uvicorn's keepalive, 100x faster: a ping every 0.2 s, closed if unanswered in 0.2 s
config = uvicorn.Config(guess_number_app(EnvServerSettings()), log_level="warning",
                        lifespan="off", ws_ping_interval=0.2, ws_ping_timeout=0.2)
server, sock = uvicorn.Server(config), listen("127.0.0.1", 0)

async def main():
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await serving

asyncio.run(main())
"""


async def test_a_session_idle_between_steps_answers_the_server_s_pings() -> None:
    """An agent thinks between steps (a slow model's turn takes tens of seconds on a
    CPU); a server with keepalive pings the idle session meanwhile, and closes it if
    nothing answers (uvicorn: 20 s + 20 s). The session answers while idle, so the
    next step is played, not lost. Here the keepalive is 0.2 s and the idle 1.5 s."""
    env_server = EnvServer(command=(sys.executable, "-c", KEEPALIVE_SERVER))
    try:
        async with aiohttp.ClientSession() as http:
            async with OpenEnvSession(env_server.url, http=http) as env:
                await env.reset(seed=0)
                await asyncio.sleep(1.5)
                step = await env.step({"message": "500"})
                assert step.reward is not None and not step.done
    finally:
        env_server.stop()


async def test_a_session_over_the_server_s_limit_is_refused_with_env_error() -> None:
    env_server = EnvServer("--max-sessions", "1")
    try:
        async with aiohttp.ClientSession() as http:
            async with OpenEnvSession(env_server.url, http=http) as first:
                await first.reset(seed=0)
                async with OpenEnvSession(env_server.url, http=http) as second:
                    with pytest.raises(EnvFailed) as refused:
                        await second.reset(seed=0)
                assert refused.value.reason == "env_error"
                assert "CAPACITY_REACHED" in refused.value.detail
                assert (await first.step({"message": "865"})).reward == 1.0
    finally:
        env_server.stop()


async def test_with_no_arguments_it_serves_what_the_variables_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As ``seamlessflow serve env`` and the embedded run start it: ``python -m sf_envs``
    with ``SF_ENV_*`` variables."""
    for name, value in {
        "NAME": "guess_number",
        "PORT": "0",
        "UPPER": "10",
        "MAX_TURNS": "4",
    }.items():
        monkeypatch.setenv(f"SF_ENV_{name}", value)
    env_server = EnvServer(command=(sys.executable, "-m", "sf_envs"))
    try:
        async with aiohttp.ClientSession() as http:
            async with OpenEnvSession(env_server.url, http=http) as env:
                first = await env.reset(seed=0)
    finally:
        env_server.stop()
    assert "from 1 to 10" in first.observation["prompt"]
    assert first.observation["guesses_left"] == 4


async def test_a_closed_port_is_env_unreachable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    async with aiohttp.ClientSession() as http:
        with pytest.raises(EnvFailed) as unreachable:
            async with OpenEnvSession(f"http://127.0.0.1:{closed_port}", http=http):
                pass
    assert unreachable.value.reason == "env_unreachable"


def test_a_port_it_cannot_bind_is_one_line_and_a_failed_exit() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        finished = subprocess.run(
            [sys.executable, "-m", "sf_envs", "guess_number", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SF_ENV_HOST": "127.0.0.1"},
        )
    assert finished.returncode == 78  # EX_CONFIG: a supervisor does not restart it
    assert finished.stdout == ""
    [line] = finished.stderr.splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_every_environment_name_has_a_server() -> None:
    assert set(ENVIRONMENTS) == set(get_args(EnvironmentName))


def test_a_guess_is_the_first_whole_number_of_the_reply() -> None:
    assert first_integer("I guess 512. Or 600?") == 512
    assert first_integer("between 1 and 1000") == 1
    assert first_integer("-3") == -3
    assert first_integer("no idea") is None
    # past every bound, and not parsed digit by digit (Python refuses > 4300 digits)
    assert first_integer("9" * 5000) == 10**18
    assert first_integer("0" * 5000 + "7") == 7


def test_step_latency_is_log_normal_around_its_median_and_seeded() -> None:
    latency = StepLatency(100, 0.5, seed=0)
    draws = sorted(latency.draw_s() for _ in range(2001))
    assert 0.09 < draws[1000] < 0.11
    assert 0.6 < draws[500] / draws[1000] < 0.8  # the lower quartile: exp(-0.674 * 0.5)
    again = StepLatency(100, 0.5, seed=0)
    first = StepLatency(100, 0.5, seed=0)
    assert [again.draw_s() for _ in range(5)] == [first.draw_s() for _ in range(5)]
    assert StepLatency(100, 0.0, seed=1).draw_s() == pytest.approx(0.1)
    assert StepLatency(0, 0.5, seed=1).draw_s() == 0.0
