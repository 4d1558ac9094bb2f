"""The lean data plane: what crosses NATS per agent turn (docs/benchmarks.md, "Gateway
load"). An answer the agent does not stream gets its engine's progress chunks at most
every ``chunk_every_s`` (chunk 0, naming the engine, at once); a streamed one gets a
chunk per decode step. Either way the reply carries every token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from nats.aio.msg import Msg
from openai import AsyncOpenAI

from seamlessflow.bus import Bus
from seamlessflow.protocol import GenerateChunk, GenerateReply, GenerateRequest, decode
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, recorded_turns

MAX_TOKENS = 12


async def _start_engine(mesh: InProcessMesh) -> EngineService:
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    # the scripted engine: one token per request per decode step, no model compute
    engine = await mesh.start(EngineService(EngineSettings(engine_id="e", backend="scripted")))
    async with asyncio.timeout(60):
        await engine.ready.wait()
    return engine


async def _generate(bus: Bus, request_id: str, chunk_every_s: float) -> tuple[list, GenerateReply]:
    inbox = bus.nc.new_inbox()
    chunks: list[GenerateChunk] = []

    async def on_chunk(msg: Msg) -> None:
        chunks.append(decode(msg.data, GenerateChunk))

    subscription = await bus.nc.subscribe(inbox, cb=on_chunk)
    reply: GenerateReply = await bus.request(
        bus.subjects.engine_generate(),
        GenerateRequest(
            request_id=request_id,
            session_id="s",
            prompt_ids=[1, 2, 3],
            max_tokens=MAX_TOKENS,
            stream_subject=inbox,
            chunk_every_s=chunk_every_s,
        ),
        GenerateReply,
        timeout=30,
    )
    await bus.nc.flush()  # chunks published before the reply have arrived
    await subscription.unsubscribe()
    return chunks, reply


async def test_engine_chunks_come_per_step_or_per_interval(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        await _start_engine(mesh)
        every_step, reply = await _generate(bus, "per-step", 0.0)
        assert [c.index for c in every_step] == list(range(len(every_step)))
        assert every_step[0].token_ids == [] and every_step[0].engine_id == "e"
        streamed = [t for c in every_step for t in c.token_ids]
        assert streamed == reply.token_ids  # every token streamed, in order
        assert len(reply.token_ids) >= 1 and len(every_step) >= 2

        # an interval longer than the answer: chunk 0 only, the reply has every token
        rare, reply = await _generate(bus, "rare", 3600.0)
        assert len(rare) == 1 and rare[0].index == 0 and rare[0].token_ids == []
        assert rare[0].engine_id == "e" and len(reply.token_ids) >= 1
    finally:
        await mesh.stop()


async def test_unstreamed_answers_ask_for_rare_chunks_and_are_recorded_whole(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    """The gateway asks an engine for per-step chunks only where it uses them (a
    streamed answer, stop strings); every answer is recorded with all its tokens."""
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    asked: list[GenerateRequest] = []

    async def on_request(msg: Msg) -> None:
        asked.append(decode(msg.data, GenerateRequest))

    watch = await bus.nc.subscribe(bus.subjects.engine_generate(), cb=on_request)
    try:
        await _start_engine(mesh)
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0)))
        async with asyncio.timeout(60):
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            session = (await http.post("/sessions", json={})).json()
        async with AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
            texts = []
            for stream, stop in ((False, None), (True, None), (False, ["\n\n\n"])):
                messages = [{"role": "user", "content": f"turn {len(texts)}"}]
                if stream:
                    parts = await client.chat.completions.create(
                        model="policy", messages=messages, max_tokens=MAX_TOKENS, stream=True
                    )
                    texts.append("".join([c.choices[0].delta.content or "" async for c in parts]))
                else:
                    answer = await client.chat.completions.create(
                        model="policy", messages=messages, max_tokens=MAX_TOKENS, stop=stop
                    )
                    texts.append(answer.choices[0].message.content)
        await bus.nc.flush()
    finally:
        await watch.unsubscribe()
        await mesh.stop()
    from sf_gateway.engine_client import PROGRESS_CHUNK_S

    assert [r.chunk_every_s for r in asked] == [PROGRESS_CHUNK_S, 0.0, 0.0]
    assert len({r.stream_subject for r in asked}) == 3  # one per engine call
    turns = await recorded_turns(bus)
    assert [t.completion_text for t in turns] == texts
    for turn in turns:
        assert len(turn.completion_ids) == len(turn.logprobs) == len(turn.versions) >= 1
