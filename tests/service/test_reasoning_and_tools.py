"""Each family's tool-call and reasoning format, through the official openai SDK against
a real gateway, engine worker and trajectory service on a real nats-server.

The engine is the scripted engine answering with scripted texts (``scripted_replies``),
so a tiny random model "writes" a think block or a tool call; everything after the
engine's tokens is the real data plane. The parsers alone are
tests/unit/test_reasoning_and_tool_parsers.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from seamlessflow.assets.families import ADD_TOOL, build_family_model
from seamlessflow.bus import Bus
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trajectory.service import TrajectoryService
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, session_auth, session_turns, trajectory_events
from tests.support.scripted_replies import scripted_engine

TOOLS = [ADD_TOOL]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family_model(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


class Run:
    def __init__(self, url: str, replies: list[list[int]], model_dir: Path) -> None:
        self.url = url
        self.replies = replies
        self.model_dir = model_dir


@pytest.fixture
async def start_run(
    nats_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch, family_dirs: Any
) -> AsyncIterator[Callable[[str, list[str]], Any]]:
    """Start a run of ``family`` whose engine answers ``texts`` in order."""
    meshes: list[InProcessMesh] = []

    async def start(family: str, texts: list[str]) -> Run:
        model_dir = family_dirs(family)
        replies = scripted_engine(monkeypatch, model_dir, texts)
        mesh = InProcessMesh(nats_url, run_id, model_dir)
        meshes.append(mesh)
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        engine = await mesh.start(
            EngineService(EngineSettings(engine_id="engine-r", backend="scripted"))
        )
        trajectory = await mesh.start(TrajectoryService())
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(60):
            await engine.ready.wait()
            await gateway.ready.wait()
            await trajectory.ready.wait()
        return Run(f"http://127.0.0.1:{gateway.bound_port}", replies, model_dir)

    yield start
    for mesh in meshes:
        await mesh.stop()


async def open_session(http: httpx.AsyncClient) -> tuple[dict[str, Any], AsyncOpenAI]:
    response = await http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    session = response.json()
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    return session, client


def trained_tokens(token_ids: list[int], mask: list[int], logprobs: list[float]) -> list[Any]:
    return [(t, lp) for t, m, lp in zip(token_ids, mask, logprobs, strict=True) if m]


async def test_qwen3_reasoning_and_tool_calls_streamed_and_not(start_run: Any, bus: Bus) -> None:
    answers = [
        '<think>\nI need the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
        '{"a": 7, "b": 12}}\n</tool_call>',
    ] * 2 + ["<think>\nThe tool says 19.\n</think>\n\n19"] * 2
    run = await start_run("qwen3", answers)
    question = [{"role": "user", "content": "What is 7 + 12?"}]
    async with httpx.AsyncClient(base_url=run.url) as http:
        session, client = await open_session(http)
        async with client:
            plain = await client.chat.completions.create(
                model="policy",
                messages=question,
                tools=TOOLS,
                max_tokens=64,  # type: ignore[arg-type]
            )
            streamed = await client.chat.completions.create(
                model="policy",
                messages=question,
                tools=TOOLS,
                max_tokens=64,
                stream=True,  # type: ignore[arg-type]
            )
            chunks = [chunk async for chunk in streamed]
            [choice] = plain.choices
            assert choice.finish_reason == "tool_calls"
            assert choice.message.model_extra["reasoning_content"] == "I need the tool."
            assert choice.message.content is None
            [call] = choice.message.tool_calls or []
            assert call.function.name == "add"
            assert json.loads(call.function.arguments) == {"a": 7, "b": 12}

            # streamed: reasoning deltas first, then the call as OpenAI streams it
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            reasoning = "".join(
                (d.model_extra or {}).get("reasoning_content") or "" for d in deltas
            )
            assert reasoning == "I need the tool."
            assert "".join(d.content or "" for d in deltas) == ""
            call_deltas = [tc for d in deltas for tc in d.tool_calls or []]
            assert (
                call_deltas[0].index == 0
                and call_deltas[0].id
                and call_deltas[0].type == "function"
            )
            assert call_deltas[0].function.name == "add"
            arguments = "".join(tc.function.arguments or "" for tc in call_deltas)
            assert json.loads(arguments) == {"a": 7, "b": 12}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            first_reasoning = next(
                i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content")
            )
            first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
            assert first_reasoning < first_call

            # the agent sends the call back with its result, and gets a reasoned answer
            history = [
                *question,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "19"},
            ]
            final = await client.chat.completions.create(
                model="policy",
                messages=history,
                tools=TOOLS,
                max_tokens=64,  # type: ignore[arg-type]
            )
            assert final.choices[0].message.content == "19"
            assert final.choices[0].finish_reason == "stop"
            assert final.choices[0].message.model_extra["reasoning_content"] == "The tool says 19."
            stream = await client.chat.completions.create(
                model="policy",
                messages=history,
                tools=TOOLS,
                max_tokens=64,
                stream=True,  # type: ignore[arg-type]
            )
            deltas = [c.choices[0].delta async for c in stream if c.choices]
            assert "".join(d.content or "" for d in deltas) == "19"

    turns = await session_turns(bus, session["session_id"])
    # the record keeps the engine's exact tokens, think block and markers included
    assert [t.completion_ids for t in turns] == run.replies
    # turn 3 continued turn 1 (tool call sent back): its prompt extends turn 1's ids
    assert turns[2].prompt_ids[: len(turns[0].prompt_ids) + len(turns[0].completion_ids)] == [
        *turns[0].prompt_ids,
        *turns[0].completion_ids,
    ]


async def test_llama3_json_tool_calls_both_ways(start_run: Any, bus: Bus) -> None:
    """A Llama 3 call is parsed; sent back, the template renders it as the model wrote
    it, so the next turn continues the turn's exact ids."""
    answers = ['{"name": "add", "parameters": {"a": 7, "b": 12}}'] * 2 + ["It is 19."]
    run = await start_run("llama3-tied", answers)
    question = [{"role": "user", "content": "What is 7 + 12?"}]
    async with httpx.AsyncClient(base_url=run.url) as http:
        session, client = await open_session(http)
        async with client:
            streamed = await client.chat.completions.create(
                model="policy",
                messages=question,
                tools=TOOLS,
                max_tokens=64,
                stream=True,  # type: ignore[arg-type]
            )
            chunks = [c async for c in streamed]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == ""
            calls = [tc for d in deltas for tc in d.tool_calls or []]
            assert calls[0].function.name == "add" and calls[0].id
            arguments = "".join(tc.function.arguments or "" for tc in calls)
            assert json.loads(arguments) == {"a": 7, "b": 12}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            # the SDK's own stream accumulator rebuilds the same message from the deltas
            async with client.chat.completions.stream(
                model="policy",
                messages=question,
                tools=TOOLS,
                max_tokens=64,  # type: ignore[arg-type]
            ) as accumulating:
                rebuilt = await accumulating.get_final_completion()
            [rebuilt_call] = rebuilt.choices[0].message.tool_calls or []
            assert rebuilt_call.function.name == "add" and rebuilt_call.id
            assert json.loads(rebuilt_call.function.arguments) == {"a": 7, "b": 12}
            assert rebuilt.choices[0].finish_reason == "tool_calls"
            history = [
                *question,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": calls[0].id,
                            "type": "function",
                            "function": {"name": "add", "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": calls[0].id, "content": "19"},
            ]
            answer = await client.chat.completions.create(
                model="policy",
                messages=history,
                tools=TOOLS,
                max_tokens=64,  # type: ignore[arg-type]
            )
            assert answer.choices[0].message.content == "It is 19."
            assert answer.choices[0].finish_reason == "stop"
            assert "reasoning_content" not in (answer.choices[0].message.model_extra or {})
    first, _, second = await session_turns(bus, session["session_id"])
    on_path = [*first.prompt_ids, *first.completion_ids]
    assert second.prompt_ids[: len(on_path)] == on_path


async def test_qwen3_turns_whose_think_block_the_template_drops_are_all_trained(
    start_run: Any, bus: Bus
) -> None:
    """Three thinking turns; the agent resends only the content (and Qwen3's template
    drops earlier think blocks anyway), so each next prompt continues the previous
    prompt, not its completion. Every turn's exact engine tokens are still trained,
    once each, in the export and in the batch."""
    from sf_trajectory.grouping import Grouper

    answers = [f"<think>\nStep {i}.\n</think>\n\nAnswer {i}" for i in range(3)]
    run = await start_run("qwen3", answers)
    messages: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=run.url) as http:
        session, client = await open_session(http)
        async with client:
            for i in range(3):
                messages.append({"role": "user", "content": f"Question {i}?"})
                answer = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    max_tokens=64,  # type: ignore[arg-type]
                )
                message = answer.choices[0].message
                assert message.content == f"Answer {i}"
                assert message.model_extra["reasoning_content"] == f"Step {i}."
                messages.append({"role": "assistant", "content": message.content})
        auth = session_auth(session)
        sid = session["session_id"]
        assert (await http.post(f"/sessions/{sid}/reward", json={"reward": 1.0},
                                headers=auth)).status_code == 200  # fmt: skip
        assert (await http.post(f"/sessions/{sid}/finish", headers=auth)).status_code == 200
        exported = (await http.get(f"/sessions/{sid}/export", headers=auth)).json()

    turns = await session_turns(bus, sid)
    assert [t.completion_ids for t in turns] == run.replies
    # the template dropped each earlier think block: turn k+1's prompt continues turn
    # k's prompt ids, not its completion, and names turn k as its parent by messages
    for before, after in itertools.pairwise(turns):
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
        on_path = [*before.prompt_ids, *before.completion_ids]
        assert after.prompt_ids[: len(on_path)] != on_path
        assert after.parent_digest == before.node_digest
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run.model_dir))
    rendered = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(turns[2].prompt_ids) == rendered  # what the template renders
    assert "<think>" not in tokenizer.decode(turns[2].prompt_ids)

    expected = sorted(
        (t, lp) for turn in turns for t, lp in zip(turn.completion_ids, turn.logprobs, strict=True)
    )
    trained = [s for s in exported["samples"] if s["reward"] is not None]
    assert len(trained) == 3 and all(s["reward"] == 1.0 for s in trained)
    in_export = [
        x
        for s in trained
        for x in trained_tokens(s["token_ids"], s["loss_mask"], s["behaviour_logprobs"])
    ]
    assert sorted(in_export) == expected
    assert sorted(i for s in trained for i in s["turn_indexes"]) == [0, 1, 2]

    # the trajectory service's batch path makes the same samples
    grouper = Grouper(lambda name: lambda text, ref: 0.0)
    for event in await trajectory_events(bus):
        grouper.apply(event)
    [group] = grouper.take_batch(1) or []
    assert {sample.session_id for sample in group.samples} == {sid}
    in_batch = [
        x
        for s in group.samples
        for x in trained_tokens(s.token_ids, s.loss_mask, s.behaviour_logprobs)
    ]
    assert sorted(in_batch) == expected


async def test_malformed_tool_calls_come_back_as_openai_shapes_and_are_counted(
    start_run: Any, bus: Bus
) -> None:
    """An SDK agent's tool loop meets a call with broken JSON (answered whole) and a call
    of a function it never offered (streamed). Each comes back as OpenAI documents calls
    without strict mode: a call, its arguments as written, the agent's to check; the
    choice's ``tool_call_errors`` say what is wrong. The agent answers each with a
    ``tool`` error message and the model corrects itself. Nothing crashes, every turn is
    recorded and trained, and the errors are counted with the session and the batch."""
    from sf_trajectory.grouping import Grouper

    def block(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

    answers = [
        block("add", '{"a": 7, "b": }'),
        block("multiply", '{"a": 7, "b": 12}'),
        block("add", '{"a": 7, "b": 12}'),
        "It is 19.",
    ]
    run = await start_run("qwen2", answers)
    offered = {tool["function"]["name"] for tool in TOOLS}

    def run_tool(name: str, arguments: str) -> str:  # as an agent checks any call
        if name not in offered:
            return f"error: no tool {name!r}"
        try:
            values = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: the arguments are not JSON"
        return str(values["a"] + values["b"])

    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 7 + 12?"}]
    errors_seen: list[list[dict[str, Any]]] = []
    async with httpx.AsyncClient(base_url=run.url) as http:
        session, client = await open_session(http)
        async with client:
            for round_ in range(4):
                request: dict[str, Any] = dict(
                    model="policy", messages=messages, tools=TOOLS, max_tokens=64
                )
                if round_ == 1:  # streamed: the errors come with the closing chunk
                    async with client.chat.completions.stream(**request) as stream:
                        chunks = [event.chunk async for event in stream if event.type == "chunk"]
                        completion = await stream.get_final_completion()
                    [closing] = [c.choices[0] for c in chunks if c.choices[0].finish_reason]
                    errors_seen.append((closing.model_extra or {}).get("tool_call_errors", []))
                else:
                    completion = await client.chat.completions.create(**request)
                    extra = completion.choices[0].model_extra or {}
                    errors_seen.append(extra.get("tool_call_errors", []))
                choice = completion.choices[0]
                if round_ < 3:
                    assert choice.finish_reason == "tool_calls"
                    [call] = choice.message.tool_calls or []
                    assert call.id and call.type == "function"
                messages.append(choice.message.model_dump(exclude_none=True))
                for call in choice.message.tool_calls or []:
                    result = run_tool(call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            assert choice.message.content == "It is 19." and choice.finish_reason == "stop"
        sid = session["session_id"]
        auth = session_auth(session)
        assert (await http.post(f"/sessions/{sid}/reward", json={"reward": 1.0},
                                headers=auth)).status_code == 200  # fmt: skip
        assert (await http.post(f"/sessions/{sid}/finish", headers=auth)).status_code == 200
        exported = (await http.get(f"/sessions/{sid}/export", headers=auth)).json()

    # what the agent got: the broken call as written, the unknown one as named
    first_call = messages[1]["tool_calls"][0]
    assert first_call["function"] == {"name": "add", "arguments": '{"a": 7, "b": }}'}
    assert messages[2]["content"] == "error: the arguments are not JSON"
    assert messages[3]["tool_calls"][0]["function"]["name"] == "multiply"
    assert messages[4]["content"] == "error: no tool 'multiply'"
    assert messages[6]["content"] == "19"
    assert [[e["type"] for e in errors] for errors in errors_seen] == [
        ["invalid_json"],
        ["unknown_tool"],
        [],
        [],
    ]
    assert errors_seen[0][0]["tool_call_id"] == first_call["id"]
    assert errors_seen[1][0]["tool_call_id"] == messages[3]["tool_calls"][0]["id"]
    assert all(e["message"] for errors in errors_seen for e in errors)

    # recorded with each turn; every turn continues the last one's exact ids
    turns = await session_turns(bus, sid)
    assert [t.completion_ids for t in turns] == run.replies
    assert [t.tool_call_errors for t in turns] == [["invalid_json"], ["unknown_tool"], [], []]
    for before, after in itertools.pairwise(turns):
        on_path = [*before.prompt_ids, *before.completion_ids]
        assert after.prompt_ids[: len(on_path)] == on_path
    assert exported["tool_call_errors"] == {"invalid_json": 1, "unknown_tool": 1}

    # the batch path trains all four turns and counts the errors in the batch's tally
    grouper = Grouper(lambda name: lambda text, ref: 0.0)
    for event in await trajectory_events(bus):
        grouper.apply(event)
    [group] = grouper.take_batch(1) or []
    [sample] = group.samples
    expected = sorted(
        (t, lp) for turn in turns for t, lp in zip(turn.completion_ids, turn.logprobs, strict=True)
    )
    trained = trained_tokens(sample.token_ids, sample.loss_mask, sample.behaviour_logprobs)
    assert sorted(trained) == expected and sample.reward == 1.0
    assert grouper.last_tally.tool_call_errors == {"invalid_json": 1, "unknown_tool": 1}
