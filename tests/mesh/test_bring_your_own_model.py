"""Bring your own model: a short embedded run (``seamlessflow up --model-dir``) on a model
of each family people train (tiny, random weights, the family's tokenizer and chat
template) trains its steps, and a session of it exports token ids that are the family's
template rendering of the conversation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from seamlessflow.assets.families import FAMILIES, build_family_model
from seamlessflow.bus import connect
from seamlessflow.connection import CONNECTION_FILE, RunConnection
from seamlessflow.protocol import SessionExport, SessionExportQuery, Subjects
from tests.support import small_embedded_run

pytestmark = pytest.mark.slow

STEPS = 2
QUESTION = [{"role": "user", "content": "What is 7 + 12?"}]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    family = request.param
    return family, build_family_model(family, tmp_path_factory.mktemp(family) / "model", seed=0)


async def connection_of(run_dir: Path, running: asyncio.Task) -> RunConnection:  # type: ignore[type-arg]
    async with asyncio.timeout(120):
        while not (run_dir / CONNECTION_FILE).exists():
            assert not running.done(), running.result()
            await asyncio.sleep(0.1)
    return RunConnection.read(run_dir)


async def one_exported_session(connection: RunConnection) -> tuple[list[int], list[int], int]:
    """Open a session on the live run, ask one question, finish it, export it: the final
    branch's token ids and loss mask, and the completion tokens the agent was told of."""
    operator = {"authorization": f"Bearer {connection.gateway_key}"}
    async with httpx.AsyncClient(base_url=connection.gateway_url, timeout=60) as http:
        async with asyncio.timeout(120):
            while True:
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)
        opened = await http.post(
            "/sessions", json={"reference": "19", "reward_fn": "integer_match"}, headers=operator
        )
        assert opened.status_code == 201, opened.text
        session = opened.json()
        async with openai.AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"]
        ) as agent:
            answer = await agent.chat.completions.create(
                model="policy",
                messages=QUESTION,
                max_tokens=8,  # type: ignore[arg-type]
            )
        own = {"authorization": f"Bearer {session['api_key']}"}
        finished = await http.post(f"/sessions/{session['session_id']}/finish", headers=own)
        assert finished.status_code == 200, finished.text
    bus = await connect(
        connection.nats_url, Subjects(connection.run_id), name="test", token=connection.nats_token
    )
    try:
        export = await bus.request(
            bus.subjects.trajectory_export(),
            SessionExportQuery(session_id=session["session_id"]),
            SessionExport,
            timeout=30.0,
        )
    finally:
        await bus.drain()
    [branch] = [s for s in export.samples if s.final]
    assert answer.usage is not None
    return branch.token_ids, branch.loss_mask, answer.usage.completion_tokens


async def test_a_run_on_each_family_trains_and_exports_its_template(
    family_model: tuple[str, Path], run_id: str, tmp_path: Path, nats_url: str
) -> None:
    from transformers import AutoTokenizer

    family, model_dir = family_model
    run = small_embedded_run(run_id, tmp_path, model_dir, STEPS, nats_url=nats_url)
    running = asyncio.create_task(run.run())
    try:
        connection = await connection_of(tmp_path / run_id, running)
        token_ids, loss_mask, completion_tokens = await one_exported_session(connection)
        summary = await asyncio.wait_for(running, 600)
    finally:
        if not running.done():
            running.cancel()
    assert summary.status == "finished", summary.status
    assert summary.steps == STEPS and summary.final_version == STEPS
    assert summary.tokens_trained > 0
    assert summary.checkpoint is not None

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # the prompt is exactly the family's template, tokenized as rendered text
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert token_ids[: len(prompt_ids)] == prompt_ids, family
    assert not any(loss_mask[: len(prompt_ids)])
    trained = [t for t, m in zip(token_ids, loss_mask, strict=True) if m]
    assert len(trained) == completion_tokens > 0
    assert all(0 <= t < len(tokenizer) for t in token_ids)
    # and the ids decode back to that rendering, then the completion
    assert tokenizer.decode(token_ids, skip_special_tokens=False).startswith(rendered)
