"""Partial rollout: weight updates land while many agents are mid-answer.

A real engine worker, weight-sync, scheduler and gateway on a real nats-server; the
test plays the trainer, publishing new weight versions as fast as the engine loads
them while agents (the official openai SDK) keep asking for long answers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from seamlessflow.bus import Bus
from seamlessflow.protocol import TrajectoryEvent, TurnRecorded, decode
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support import session_auth

AGENTS = 12
VERSIONS = 5
MAX_TOKENS = 48


async def publish_versions(
    bus: Bus, engine: EngineService, base: dict, done: asyncio.Event
) -> None:  # type: ignore[type-arg]
    """Publish VERSIONS versions, each as soon as the engine serves the previous one."""
    from tests.support import eventually, publish_perturbed_version

    for version in range(1, VERSIONS + 1):
        await publish_perturbed_version(bus, version, base)
        await eventually(
            lambda: engine.engine.version >= version,  # noqa: B023 (awaited at once)
            30,
            f"the engine serves version {version}",
            interval_s=0.01,
        )
        await asyncio.sleep(0.05)  # the agents generate on it before the next lands
    done.set()


@pytest.mark.parametrize("interrupt_mode", ["keep", "abort"])
async def test_agents_never_notice_weight_updates(
    interrupt_mode: str, nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus
) -> None:
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        engine = await mesh.start(
            EngineService(
                EngineSettings(
                    engine_id="engine-p", max_batch_size=16, interrupt_mode=interrupt_mode
                )
            )
        )  # type: ignore[arg-type]
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(60):
            await engine.ready.wait()
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        base = AutoModelForCausalLM.from_pretrained(str(chatty_model_dir)).state_dict()

        done = asyncio.Event()

        async def agent(index: int, http: httpx.AsyncClient) -> list[tuple[str, list[float]]]:
            session = (await http.post("/sessions", json={})).json()
            async with AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"], max_retries=0
            ) as client:
                seen = []
                turn = 0
                while turn == 0 or not done.is_set():  # answers keep flowing during every update
                    messages = [{"role": "user", "content": f"What is {index} + {turn}?"}]
                    turn += 1
                    if index % 2:  # half the agents stream: the SSE stream must not break
                        stream = await client.chat.completions.create(
                            model="policy",
                            messages=messages,
                            max_tokens=MAX_TOKENS,
                            logprobs=True,
                            stream=True,  # type: ignore[arg-type]
                        )
                        text, logprobs, finishes = "", [], []
                        async for chunk in stream:
                            if not chunk.choices:
                                continue
                            delta = chunk.choices[0]
                            text += delta.delta.content or ""
                            if delta.logprobs and delta.logprobs.content:
                                logprobs += [t.logprob for t in delta.logprobs.content]
                            if delta.finish_reason:
                                finishes.append(delta.finish_reason)
                        assert len(finishes) == 1, "one answer, one finish"
                        seen.append((text, logprobs))
                        continue
                    reply = await client.chat.completions.create(
                        model="policy",
                        messages=messages,
                        max_tokens=MAX_TOKENS,
                        logprobs=True,  # type: ignore[arg-type]
                    )
                    choice = reply.choices[0]
                    assert choice.message.content is not None
                    logprobs = [t.logprob for t in choice.logprobs.content]  # type: ignore[union-attr]
                    seen.append((choice.message.content, logprobs))
            await http.post(
                f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
            )
            return seen

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            publisher = asyncio.create_task(publish_versions(bus, engine, base, done))
            answers = await asyncio.gather(*(agent(i, http) for i in range(AGENTS)))
            await publisher
        assert engine.engine.version == VERSIONS
    finally:
        await mesh.stop()

    s = bus.subjects
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]
    turns = [e for e in events if isinstance(e, TurnRecorded)]
    assert len(turns) == sum(len(a) for a in answers) >= AGENTS
    recorded = {(t.completion_text, tuple(t.logprobs)) for t in turns}
    for agent_answers in answers:
        for text, logprobs in agent_answers:
            # what the agent read is exactly one recorded engine output
            assert (text, tuple(logprobs)) in recorded
    for turn in turns:
        assert turn.versions == sorted(turn.versions), "versions decreased within a response"
        assert len(turn.versions) == len(turn.completion_ids) == len(turn.logprobs)
    interrupted = [t for t in turns if len(set(t.versions)) > 1]
    assert interrupted, "no weight update landed mid-response: the test proved nothing"
    streamed = {
        text
        for index, agent_answers in enumerate(answers)
        if index % 2
        for text, _ in agent_answers
    }
    assert any(t.completion_text in streamed for t in interrupted), "no streamed answer resumed"
