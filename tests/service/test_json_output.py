"""response_format through the real gateway and the vLLM engine (structured outputs) on
the tied family model, with the official SDK as the agent: the answer is JSON of the
schema, and the turn is recorded as constrained (context, never trained)."""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from seamlessflow.bus import Bus
from sf_engine.settings import EngineSettings
from tests.support import recorded_turns, rollout_gateway

pytestmark = [
    pytest.mark.slow,  # starts vLLM
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [4, 5]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture
async def gateway_url(nats_url: str, run_id: str, qwen2_tied_model_dir: Path) -> AsyncIterator[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm  # noqa: F401
    except Exception as exc:
        pytest.skip(f"`import vllm` failed ({exc!r})")
    engine = EngineSettings(engine_id="engine-v", backend="vllm", max_batch_size=4, max_context=512)
    async with rollout_gateway(nats_url, run_id, qwen2_tied_model_dir, engine, 512) as url:
        yield url


async def test_json_schema_output_on_vllm_is_json_and_recorded_as_constrained(
    gateway_url: str, bus: Bus
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2 + 3? Answer in JSON."}]
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = (await http.post("/sessions", json={})).json()
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:  # closed even when a call fails
            forms = [
                {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}},
                {"type": "json_object"},
            ]
            replies = [
                await client.chat.completions.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]
                    response_format=form,  # type: ignore[arg-type]
                    max_tokens=400,  # far more than the grammar's answers take
                    seed=1,
                )
                for form in forms
            ]
            plain = await client.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=4,  # type: ignore[arg-type]
            )
    # The grammar ends each answer with a complete value (then only the stop token is
    # allowed); the random model fills free strings and whitespace with anything.
    answers = []
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        answers.append(json.loads(choice.message.content or ""))
    assert isinstance(answers[1], dict)
    assert set(answers[0]) == {"answer", "sure"}
    assert answers[0]["answer"] in (4, 5) and isinstance(answers[0]["sure"], bool)
    recorded = await recorded_turns(bus)
    assert [t.constrained for t in recorded] == [True, True, False]
    assert [r.choices[0].message.content for r in [*replies, plain]] == [
        t.completion_text for t in recorded
    ]
