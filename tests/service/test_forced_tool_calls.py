"""tool_choice 'required' and a named function, through the real gateway and HF engine
on the tied family model, with the official SDK as the agent.

The gateway appends the opening of a call (the tool parser's format) to the prompt: the
model continues it. Those ids are inserted, not sampled, so they are recorded as prompt
ids; every completion id is the engine's own sample, and its recorded logprob is what
the trainer recomputes over prompt + completion at the recorded temperature. How an
opening and its continuation parse is tests/unit/test_forced_tool_call_parsing.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from seamlessflow.assets.families import ADD_TOOL
from seamlessflow.bus import Bus
from seamlessflow.protocol import TurnRecorded
from sf_engine.settings import EngineSettings
from sf_gateway.tool_parsers import QwenToolParser
from tests.support import recorded_turns, rollout_gateway

TOOLS: list[dict[str, Any]] = [
    ADD_TOOL,
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.fixture
async def gateway_url(nats_url: str, run_id: str, qwen2_tied_model_dir: Path) -> AsyncIterator[str]:
    engine = EngineSettings(engine_id="engine-f", max_batch_size=4)
    async with rollout_gateway(nats_url, run_id, qwen2_tied_model_dir, engine, 512) as url:
        yield url


def recomputed_logprobs(model: Any, turn: TurnRecorded) -> list[float]:
    """The trainer's recomputation: one forward over prompt + completion at the turn's
    temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([turn.prompt_ids + turn.completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits / (turn.temperature or 1.0), dim=-1)
    start = len(turn.prompt_ids) - 1
    return [logp[start + j, t].item() for j, t in enumerate(turn.completion_ids)]


async def test_forced_tool_calls_are_opened_in_the_prompt_and_trained_exactly(
    gateway_url: str, bus: Bus, qwen2_tied_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tied_model_dir))
    parser = QwenToolParser()
    templated = tokenizer(
        tokenizer.apply_chat_template(
            MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )["input_ids"]
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = (await http.post("/sessions", json={})).json()
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            replies = []
            for tool_choice, stream in ((NAMED, False), ("required", False), (NAMED, True)):
                request: dict[str, Any] = {
                    "model": "policy",
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "tool_choice": tool_choice,
                    "max_tokens": 16,
                    "temperature": 0.9,
                    "seed": 5,
                }
                if not stream:
                    replies.append(await client.chat.completions.create(**request, logprobs=True))
                    continue
                chunks = [
                    c async for c in await client.chat.completions.create(**request, stream=True)
                ]
                replies.append(chunks)
            recorded = await recorded_turns(bus)

            # the agent sends its answer back (as it got it) and goes on: the next prompt
            # continues the exact ids of the forced turn, opening included
            message = replies[0].choices[0].message
            history = [*MESSAGES, message.model_dump(exclude_none=True)]
            if message.tool_calls:
                history.append(
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}
                )
            else:
                history.append({"role": "user", "content": "Go on."})
            await client.chat.completions.create(
                model="policy", messages=history, tools=TOOLS, max_tokens=4
            )
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_tied_model_dir), dtype=torch.float32)
    assert len(recorded) == 3
    for turn, tool_choice, reply in zip(recorded, (NAMED, "required", NAMED), replies, strict=True):
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        opening = parser.call_opening(name)
        assert (
            turn.prompt_ids == templated + tokenizer(opening, add_special_tokens=False)["input_ids"]
        )
        assert turn.completion_text.startswith(opening)  # what the agent's answer is made of
        assert turn.logprobs == pytest.approx(recomputed_logprobs(model, turn), abs=1e-4)
        parsed = parser.parse(turn.completion_text)
        if isinstance(reply, list):  # streamed: nothing before the call is parsed
            content = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            calls = [  # a call's name comes in its first chunk, the arguments after
                call.function.name
                for c in reply
                if c.choices
                for call in c.choices[0].delta.tool_calls or []
                if call.function and call.function.name
            ]
        else:
            got = reply.choices[0]
            content, calls = (
                got.message.content or "",
                [call.function.name for call in got.message.tool_calls or []],
            )
            assert [t.logprob for t in got.logprobs.content] == pytest.approx(turn.logprobs)
        # the answer is the parse of opening + samples: the call, finished or not (forced:
        # the answer is a call), unless 'required' had the function's name itself cut off
        assert calls == [c.name for c in parsed.tool_calls]
        assert content == (parsed.content or "")
        offered = {tool["function"]["name"] for tool in TOOLS}
        unknown = ["unknown_tool" for c in parsed.tool_calls if c.name not in offered]
        assert turn.tool_call_errors == [e.kind for e in parsed.errors] + unknown
        if not parsed.tool_calls:
            assert name is None
        if name is not None:
            assert calls and calls == [name] * len(calls)
    [follow_up] = [t for t in await recorded_turns(bus) if t not in recorded]
    first = recorded[0]
    assert follow_up.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids
    )
