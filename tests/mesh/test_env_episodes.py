"""A run that plays episodes in the built-in OpenEnv server: ``seamlessflow up --env
guess_number`` (the environment its own supervised process, its steps 100 ms apart),
with that server SIGKILLed mid-run.

What must hold, read back from the run's own JetStream store afterwards:

- the run finishes its steps, and the environment server was restarted once;
- the episodes open on the killed server failed with ``env_lost`` and were dropped
  with that reason (reported in a batch report), never trained;
- the trained episodes are long (10+ turns) and prefix-stable: each turn's prompt is the
  previous turn's prompt + answer + the environment's next observation, so the episode
  is recorded once, as one sample;
- episodes span weight updates (their turns carry several policy versions), and each
  reports the environment's step rewards with a return equal to their sum.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from seamlessflow.protocol import (
    RewardReported,
    SessionFinished,
    SessionOpened,
    TurnRecorded,
)
from sf_app.run.config import RunConfig
from sf_app.run.embedded import EmbeddedRun
from sf_app.run.forkserver import ForkedProcess
from tests.support import eventually
from tests.support.store import cancel_if_running, stored

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 6
MAX_TURNS = 12  # the built-in guess_number's default: binary search needs 10 for 1..1000


def episodes_in_play(env_pid: int) -> int:
    """Open WebSocket sessions on the environment server, by the kernel's count: each
    episode holds one connection to its listening port from reset to close (the agent
    makes no other requests to it), so this is how many episodes a kill would cut."""
    try:
        connections = psutil.Process(env_pid).net_connections("tcp")
    except psutil.NoSuchProcess:
        return 0
    listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    return sum(
        c.status == psutil.CONN_ESTABLISHED and c.laddr.port in listening for c in connections
    )


async def test_episodes_in_an_openenv_server_train_and_survive_its_restart(
    run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    config = RunConfig(
        run_id=run_id,
        runs_dir=tmp_path,
        model_dir=base_model_dir,
        env="guess_number",
        env_step_latency_ms=100,
        steps=STEPS,
        group_size=4,
        groups_per_batch=2,
        max_tokens=8,
        agent_concurrency=8,
        engine_batch_size=8,
        group_timeout_s=30,
        live=False,
    )
    assert (config.agent, config.task) == ("openenv", "episodes")
    run = EmbeddedRun(config)
    running = asyncio.create_task(run.run())
    try:
        async with asyncio.timeout(600):
            # mid-run, with episodes in play on it: the server goes away. Rollout waits
            # for the trainer at times (max_batches_ahead), so two steps in is not
            # enough: CI once killed it between batches, with no episode to cut. Two in
            # play, as the kill comes, leaves no chance that both end in between
            await eventually(lambda: len(run.state.metrics) >= 2 or running.done(), 300, "steps")
            env_pid = run.processes["env"].pid
            await eventually(
                lambda: episodes_in_play(env_pid) >= 2 or running.done(), 120, "episodes"
            )
            assert not running.done(), run.state.status
            killed_at = time.monotonic()
            os.kill(env_pid, signal.SIGKILL)
            await eventually(lambda: "env" in run.restarts or running.done(), 30, "restart")
            summary = await running
    finally:
        await cancel_if_running(running)
    assert summary.status == "finished", summary.status
    assert summary.final_version == STEPS
    assert summary.restarts == {"env": 1}
    # started, and started again, from the fork server (the default)
    assert isinstance(run.processes["env"], ForkedProcess)
    assert isinstance(run.processes["trainer"], ForkedProcess)
    assert time.monotonic() > killed_at

    events, dropped = await stored(tmp_path / run_id, run_id)
    opened = {e.session_id: e for e in events if isinstance(e, SessionOpened)}
    finishes = {e.session_id: e for e in events if isinstance(e, SessionFinished)}
    rewards = {e.session_id: e for e in events if isinstance(e, RewardReported)}
    turns: dict[str, list[TurnRecorded]] = {}
    for event in events:
        if isinstance(event, TurnRecorded):
            turns.setdefault(event.session_id, []).append(event)

    # the episodes cut by the kill: failed with the reason, dropped with it, no reward
    lost = {s for s, f in finishes.items() if f.failure}
    assert lost, "no episode was in play when the server was killed"
    assert {finishes[s].failure for s in lost} == {"env_lost"}
    assert all(dropped.get(s) == "env_lost" for s in lost), (lost, dropped)
    assert not lost & rewards.keys()

    # the episodes played to their end: long, prefix-stable, their return the sum of
    # their step rewards, one reward per step
    played = [s for s in finishes if s not in lost and s in rewards]
    assert len(played) >= STEPS * 2 * 4 // 2
    long_episodes = 0
    spanning = 0
    for session in played:
        episode = sorted(turns[session], key=lambda t: t.turn_index)
        reward = rewards[session]
        assert len(reward.step_rewards) == len(episode)
        assert reward.reward == pytest.approx(sum(reward.step_rewards))
        for before, after in itertools.pairwise(episode):
            context = before.prompt_ids + before.completion_ids
            assert after.prompt_ids[: len(context)] == context, "the context was rewritten"
            assert len(after.prompt_ids) > len(context), "no observation between turns"
        long_episodes += len(episode) >= 10
        spanning += len({v for t in episode for v in t.versions}) > 1
    assert long_episodes >= len(played) // 2, (long_episodes, len(played))
    assert spanning > 0, "no episode spanned a weight update"
    assert all(o.task_id.startswith("episode-") for o in opened.values())
    print(
        f"\nenv episodes: {len(opened)} sessions, {len(played)} played to their end "
        f"({long_episodes} of 10+ turns, {spanning} across weight updates), "
        f"{len(lost)} lost with the server; run {summary.wall_s:.0f}s"
    )
