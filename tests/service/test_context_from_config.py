"""With ``max_context`` left at 0 (the default), the gateway and the engine both allow the
model's own context, read from its config.json: no 1024-token cap."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from sf_engine.settings import EngineSettings
from tests.support import InProcessMesh, start_rollout


async def test_the_gateway_and_the_engine_take_the_model_s_context(
    nats_url: str, run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    # the test model, stating a context neither the old 1024 default nor its own build's
    model_dir = tmp_path / "model"
    shutil.copytree(base_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = context = 640
    (model_dir / "config.json").write_text(json.dumps(config))
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    try:
        await served_at_the_model_s_context(mesh, context)
    finally:
        await mesh.stop()


async def served_at_the_model_s_context(mesh: InProcessMesh, context: int) -> None:
    url = await start_rollout(mesh, EngineSettings(engine_id="engine-c"), max_context=0)
    engine = mesh.running[2][0].engine  # scheduler, weight-sync, engine, gateway
    assert engine.max_context == context
    async with httpx.AsyncClient(base_url=url) as http:
        counted = await http.post("/tokenize", json={"prompt": "What is 2 + 2?"})
        assert counted.status_code == 200, counted.text
        assert counted.json()["max_model_len"] == context
    async with await agent_client(url) as client:
        with pytest.raises(BadRequestError) as refused:
            await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "What is 2 + 2?"}],
                max_tokens=context,
            )
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
        assert f"the context is {context} tokens" in error["message"]
        answer = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=4
        )
        assert answer.choices[0].message.content is not None


async def test_an_engine_with_a_smaller_context_refuses_with_openai_s_code(
    nats_url: str, run_id: str, base_model_dir: Path
) -> None:
    """The gateway allows the model's context, an engine less (``SF_ENGINE_MAX_CONTEXT``,
    or a KV cache that holds less): the engine's refusal is a typed error reply that the
    agent gets as the 400 ``context_length_exceeded`` the gateway's own check gives."""
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        url = await start_rollout(
            mesh, EngineSettings(engine_id="engine-s", max_context=64), max_context=0
        )
        async with await agent_client(url) as client:
            with pytest.raises(BadRequestError) as refused:
                await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "What is 2 + 2?"}],
                    max_tokens=100,  # fits the model's context, not the engine's
                )
            error = refused.value.body
            assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
            assert "the context limit of 64 tokens" in error["message"]
            answer = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "What is 2 + 2?"}],
                max_tokens=4,
            )
            assert answer.choices[0].finish_reason in ("stop", "length")
    finally:
        await mesh.stop()


async def agent_client(url: str) -> AsyncOpenAI:
    """An OpenAI client on a new session of the gateway at ``url``, as an agent gets one."""
    async with httpx.AsyncClient(base_url=url) as http:
        session = (await http.post("/sessions", json={})).json()
    return AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
