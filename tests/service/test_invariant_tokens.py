"""docs/architecture.md, invariant 1, over HTTP: every trained token id is one the engine produced.

A multi-turn agent with tools (the official openai SDK) talks to the real gateway; it
carries a tool exchange in its history, continues the conversation, then edits an
earlier answer. The engine worker itself records what it consumed and produced (an
audit subclass at its NATS handler), independently of the gateway's records; every
exported sample is checked against that record.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from seamlessflow.protocol import GenerateReply, GenerateRequest
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trajectory.service import TrajectoryService
from sf_weight_sync.service import WeightSyncService
from tests.support import session_auth

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


class AuditedEngineService(EngineService):
    """Records every (prompt ids, produced ids) pair at the engine worker's boundary."""

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self.record: list[tuple[list[int], GenerateReply]] = []

    async def on_generate(self, request: GenerateRequest) -> GenerateReply:
        reply = await super().on_generate(request)
        self.record.append((list(request.prompt_ids), reply))
        return reply


async def test_trained_tokens_of_a_tool_using_agent_that_edits_history(
    mesh, base_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    trajectory = await mesh.start(TrajectoryService())
    engine = await mesh.start(AuditedEngineService(EngineSettings(engine_id="engine-a")))
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
    async with asyncio.timeout(60):
        for service in (trajectory, engine, gateway):
            await service.ready.wait()

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.bound_port}") as http:
        session = (
            await http.post("/sessions", json={"reference": "5", "reward_fn": "integer_match"})
        ).json()
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:

            async def ask(messages: list[dict]) -> dict:  # type: ignore[type-arg]
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    tools=TOOLS,
                    max_tokens=8,
                    seed=3,  # type: ignore[arg-type]
                )
                return reply.choices[0].message.model_dump(exclude_none=True)

            history = [
                {"role": "user", "content": "What is 2 + 3? Use the tool."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "content": "5"},
            ]
            first = await ask(history)
            second_messages = [*history, first, {"role": "user", "content": "Say it again."}]
            await ask(second_messages)
            edited = [
                *history,
                {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "Say it again."},
            ]
            await ask(edited)
        assert (
            await http.post(
                f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
            )
        ).status_code == 200
        export = (
            await http.get(
                f"/sessions/{session['session_id']}/export", headers=session_auth(session)
            )
        ).json()

    produced = {(tuple(prompt), tuple(reply.token_ids)): reply for prompt, reply in engine.record}
    assert len(engine.record) == 3
    samples = export["samples"]
    assert len(samples) == 2, "the edited history must fork the session"
    trained_turns = 0
    for sample in samples:
        mask, ids = sample["loss_mask"], sample["token_ids"]
        position = 0
        while position < len(mask):
            if not mask[position]:
                position += 1
                continue
            end = position
            while end < len(mask) and mask[end]:
                end += 1
            reply = produced.get((tuple(ids[:position]), tuple(ids[position:end])))
            assert reply is not None, "a trained token run is not an engine output"
            assert sample["behaviour_logprobs"][position:end] == reply.logprobs
            assert sample["versions"][position:end] == reply.versions
            trained_turns += 1
            position = end
    assert trained_turns == 3  # turns 1 and 2 on one branch, turn 3 on the fork
    continued = next(s for s in samples if s["turn_indexes"] == [0, 1])
    first_prompt, first_reply = engine.record[0]
    second_prompt, _ = engine.record[1]
    # the second call continued the first one's exact ids (no re-tokenization)
    assert second_prompt[: len(first_prompt) + len(first_reply.token_ids)] == [
        *first_prompt,
        *first_reply.token_ids,
    ]
    assert continued["token_ids"][: len(second_prompt)] == second_prompt
