"""Joining a live ``seamlessflow up`` run: the user's own operator keys work beside the
agent runner's, the run's connection details are in a file only its owner reads, an
unmodified openai-SDK agent opens a session, and the CLI exports it from the run
directory. A run whose agents are refused stops with that error instead of spinning."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from seamlessflow.connection import CONNECTION_FILE, RunConnection
from tests.support import small_embedded_run

OWN_KEY = "my-own-operator-key"


async def connection_of(run_dir: Path, running: asyncio.Task) -> RunConnection:  # type: ignore[type-arg]
    async with asyncio.timeout(120):
        while not (run_dir / CONNECTION_FILE).exists():
            assert not running.done(), running.result()
            await asyncio.sleep(0.1)
    return RunConnection.read(run_dir)


async def wait_healthy(url: str) -> None:
    async with httpx.AsyncClient() as http:
        async with asyncio.timeout(120):
            while True:
                try:
                    if (await http.get(f"{url}/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_an_openai_agent_joins_a_live_run_with_its_own_key_and_its_session_exports(
    run_id: str, base_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_GATEWAY_API_KEYS", OWN_KEY)  # what the README tells a user
    run = small_embedded_run(run_id, tmp_path, base_model_dir, steps=8)
    running = asyncio.create_task(run.run())
    try:
        connection = await connection_of(tmp_path / run_id, running)
        path = tmp_path / run_id / CONNECTION_FILE
        assert path.stat().st_mode & 0o077 == 0
        assert connection.run_id == run_id and connection.gateway_key != OWN_KEY
        await wait_healthy(connection.gateway_url)
        async with httpx.AsyncClient(base_url=connection.gateway_url) as http:
            refused = await http.post("/sessions", json={})
            assert refused.status_code == 401
            opened = await http.post(
                "/sessions",
                json={"reference": "19", "reward_fn": "integer_match"},
                headers={"authorization": f"Bearer {OWN_KEY}"},
            )
            assert opened.status_code == 201, opened.text
            session = opened.json()
            async with openai.AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"]
            ) as agent:
                answer = await agent.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "What is 7 + 12?"}],
                    max_tokens=8,
                )
            assert answer.choices[0].message.content is not None
            finished = await http.post(
                f"/sessions/{session['session_id']}/finish",
                headers={"authorization": f"Bearer {session['api_key']}"},
            )
            assert finished.status_code == 200, finished.text
        exported = await asyncio.to_thread(
            subprocess.run,
            [
                *(sys.executable, "-m", "sf_app", "export", session["session_id"]),
                *("--run-dir", str(tmp_path / run_id)),
            ],
            env={k: v for k, v in os.environ.items() if not k.startswith("SF_")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert exported.returncode == 0, exported.stderr
        export = json.loads(exported.stdout)
        assert export["session_id"] == session["session_id"] and export["finished"]
        [branch] = [s for s in export["samples"] if s["final"]]
        trained = [t for t, m in zip(branch["token_ids"], branch["loss_mask"], strict=True) if m]
        assert trained and len(trained) == answer.usage.completion_tokens  # type: ignore[union-attr]
        summary = await asyncio.wait_for(running, 600)
    finally:
        if not running.done():
            running.cancel()
    # the agent runner trained the run beside the user's key (it has its own)
    assert summary.status == "finished", summary.status
    assert summary.steps == 8


@pytest.mark.slow
async def test_a_run_whose_agents_are_refused_stops_with_that_error(
    run_id: str, base_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_GATEWAY_API_KEYS", OWN_KEY)
    monkeypatch.setenv("SF_AGENTS_GATEWAY_KEY", "not-a-key-of-the-gateway")
    run = small_embedded_run(run_id, tmp_path, base_model_dir, steps=8)
    async with asyncio.timeout(600):  # today it trains nothing and never ends
        summary = await run.run()
    assert summary.status.startswith("failed: agents: the gateway"), summary.status
    assert "SF_AGENTS_GATEWAY_KEY" in summary.status
    assert run.restarts.get("agents", 0) == 0  # a restart would be refused the same way
    stored = json.loads((tmp_path / run_id / "summary.json").read_text())
    assert stored["status"] == summary.status
