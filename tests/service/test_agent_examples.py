"""The example agents (examples/agents_sdk_agent.py with the OpenAI Agents SDK,
examples/langgraph_agent.py with LangChain/LangGraph), unchanged, against a live
gateway: they run their tool loop to an answer, and the exported session holds exactly
what they received. The engine is `tool_script.ToolScriptEngine` (it calls the tool)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from seamlessflow.bus import Bus
from seamlessflow.protocol import TrajectoryEvent, TurnRecorded, decode
from tests.support import REPO_ROOT, session_auth
from tests.support.tool_script import tool_script_gateway

pytestmark = pytest.mark.usefixtures("openai_shapes")

EXAMPLES = REPO_ROOT / "examples"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 12}}\n</tool_call>'
ANSWER = "The result is 19."


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def gateway_url(
    nats_url: str, run_id: str, base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[str]:
    # the Agents SDK would export traces to the OpenAI platform: never in tests
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    async with tool_script_gateway(nats_url, run_id, base_model_dir, monkeypatch) as url:
        yield url


async def open_session(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as http:
        opened = await http.post("/sessions", json={"task_id": "example"})
    assert opened.status_code == 201, opened.text
    return opened.json()  # type: ignore[no-any-return]


async def check_export(url: str, bus: Bus, session: dict[str, Any], model_dir: Path) -> None:
    """Two recorded turns, the tool call then the answer, on one trained branch whose
    completion tokens decode to exactly what the agent received."""
    s = bus.subjects
    turns = [
        event
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
        if isinstance(event := decode(m.data, TrajectoryEvent), TurnRecorded)
        and event.session_id == session["session_id"]
    ]
    assert [t.completion_text for t in turns] == [CALL, ANSWER]
    async with httpx.AsyncClient(base_url=url) as http:
        exported = await http.get(
            f"/sessions/{session['session_id']}/export", headers=session_auth(session)
        )
    [sample] = [s for s in exported.json()["samples"] if s["final"]]
    assert sample["turn_indexes"] == [0, 1]
    assert sample["token_ids"] == [*turns[1].prompt_ids, *turns[1].completion_ids]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trained: list[list[int]] = []
    for token, mask, previous in zip(
        sample["token_ids"], sample["loss_mask"], [0, *sample["loss_mask"]], strict=False
    ):
        if mask and not previous:
            trained.append([])
        if mask:
            trained[-1].append(token)
    end = tokenizer.eos_token
    assert [tokenizer.decode(ids) for ids in trained] == [CALL + end, ANSWER + end]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_agents_sdk_example_uses_its_tool_and_is_recorded(
    gateway_url: str, bus: Bus, base_model_dir: Path, stream: bool
) -> None:
    session = await open_session(gateway_url)
    agents_sdk = example("agents_sdk_agent")
    answer = await agents_sdk.solve(
        session["base_url"], session["api_key"], "What is 7 + 12?", stream=stream
    )
    assert answer == ANSWER
    await check_export(gateway_url, bus, session, base_model_dir)


@pytest.mark.parametrize("responses_api", [False, True])
async def test_the_langgraph_example_uses_its_tool_and_is_recorded(
    gateway_url: str,
    bus: Bus,
    base_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    responses_api: bool,
) -> None:
    from langchain_openai.chat_models import _client_utils

    # langchain-openai caches one HTTP client per base URL for the process and never
    # closes it; here each is built afresh and closed after the run (no leaked socket)
    clients: list[Any] = []

    def fresh_client(*args: Any) -> Any:
        clients.append(_client_utils._build_async_httpx_client(*args))
        return clients[-1]

    monkeypatch.setattr(_client_utils, "_cached_async_httpx_client", fresh_client)
    session = await open_session(gateway_url)
    langgraph = example("langgraph_agent")
    try:
        answer = await langgraph.solve(
            session["base_url"], session["api_key"], "What is 7 + 12?", responses_api=responses_api
        )
    finally:
        for client in clients:
            await client.aclose()
    assert answer == ANSWER
    await check_export(gateway_url, bus, session, base_model_dir)
