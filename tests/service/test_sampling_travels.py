"""Sampling travels with the data: each turn records the temperature it was sampled at,
and the trainer recomputes every token's logprob at its own turn's temperature.

End to end: one agent (the official openai SDK) asks a real gateway + HF engine at
temperature 0.7 (top_p 0.9), then 1.0, then greedily; the trajectory service (real
nats-server) batches the session; the trainer's recomputation at the same weights
matches the engine's behaviour logprobs on every token, which no single temperature
does. The per-token temperature math, and records made before turns carried their
temperature, are tests/unit/test_per_token_temperatures.py.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import httpx
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus
from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trainer.grpo import token_logprobs
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import pack, train_step
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, recorded_turns, session_auth
from tests.support.trainer_batches import fields_of

ENGINE_TRAINER_GAP = 1e-4
"""The engine contract (``sf_engine.backends.base``, enforced by test_engine_contract):
an fp32 engine's logprobs equal the trainer's plain forward to 1e-4. Everything between
them here (gateway, JetStream, trajectory, batch) copies the float64 logprobs exactly;
the trainer's float32 cast adds at most |logprob| * 2**-24, far below it."""

TURNS = [(0.7, 0.9), (1.0, 1.0), (0.0, 1.0)]
"""(temperature, top_p) of the agent's three calls; 0 = greedy."""
MAX_TOKENS = 12


async def published_batches(bus: Bus, count: int) -> list[TrainBatch]:
    """The first ``count`` batches the trajectory service published for the trainer."""
    async with asyncio.timeout(60):
        while True:
            stored = await stored_batches(bus)
            if len(stored) >= count:
                return stored[:count]
            await asyncio.sleep(0.1)


async def run_agent(url: str) -> None:
    """One session, three turns on one branch, each at its own temperature."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        session = (await http.post("/sessions", json={})).json()
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            messages: list[dict] = []  # type: ignore[type-arg]
            for index, (temperature, top_p) in enumerate(TURNS):
                messages.append({"role": "user", "content": f"Say something, {index}."})
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                    temperature=temperature,
                    top_p=top_p,
                    seed=index,  # type: ignore[arg-type]
                )
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        auth = session_auth(session)
        path = f"/sessions/{session['session_id']}"
        assert (await http.post(f"{path}/reward", json={"reward": 1.0}, headers=auth)).is_success
        assert (await http.post(f"{path}/finish", headers=auth)).is_success


def masked_gap(sample: TrainSample, logprobs: torch.Tensor) -> torch.Tensor:
    """|recomputed - behaviour| per target token (0 where not trained)."""
    packed = pack([sample], [0.0])
    return ((logprobs - packed.old_logprobs).abs() * packed.loss_mask)[0]


async def test_each_turn_is_trained_at_the_temperature_it_was_sampled_at(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus
) -> None:
    # the random-init model: answers run to their budget, its distributions are broad
    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    try:
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        trajectory = await mesh.start(
            TrajectoryService(TrajectorySettings(groups_per_batch=1, data_filters=""))
        )
        engine = await mesh.start(EngineService(EngineSettings(engine_id="engine-t")))
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(60):
            for service in (trajectory, engine, gateway):
                await service.ready.wait()
        await run_agent(f"http://127.0.0.1:{gateway.bound_port}")
        (batch,) = await published_batches(bus, 1)
        turns = await recorded_turns(bus)
    finally:
        await mesh.stop()

    # the gateway recorded how each turn was sampled
    assert [(t.temperature, t.top_p) for t in turns] == TURNS
    generated = sum(len(t.completion_ids) for t in turns)
    # the trajectory service carried it into the sample, token by token
    (sample,) = batch.groups[0].samples
    assert len(sample.temperatures) == len(sample.token_ids)
    for turn in turns:
        start = len(turn.prompt_ids)
        end = start + len(turn.completion_ids)
        assert sample.token_ids[start:end] == turn.completion_ids
        assert sample.loss_mask[start:end] == [1] * (end - start)
        assert sample.temperatures[start:end] == [turn.temperature] * (end - start)
    assert sum(sample.loss_mask) == generated

    # the trainer, at the engine's weights (version 0: the model directory's): its step
    # recomputes logprobs that match the behaviour ones (its logprob_abs_diff metric)
    model = AutoModelForCausalLM.from_pretrained(str(chatty_model_dir), dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    result = train_step(model, optimizer, batch, TrainerSettings(), current_version=0)
    assert result.tokens_trained == generated
    assert result.logprob_abs_diff <= ENGINE_TRAINER_GAP
    # token by token
    packed = pack([sample], [0.0])
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
    per_token = token_logprobs(logits[:, :-1], packed.targets, packed.temperatures)
    assert float(masked_gap(sample, per_token).max()) <= ENGINE_TRAINER_GAP
    # any one temperature for the whole sample (the old SF_TRAINER_TEMPERATURE) misses
    # the turns sampled at another one by far more than the engine contract allows
    for single in (0.7, 1.0):
        gap = masked_gap(sample, token_logprobs(logits[:, :-1], packed.targets, single))
        assert float(gap.max()) > 100 * ENGINE_TRAINER_GAP, single

    # the same batch without temperatures falls back to the setting, and misses
    stripped = TrainSample(**{**fields_of(sample), "temperatures": []})
    old_style = TrainBatch(
        batch_index=0, groups=[SampleGroup(group_id="g", task_id="t", samples=[stripped])]
    )
    for setting in (0.7, 1.0):
        result = train_step(
            model, optimizer, old_style, TrainerSettings(temperature=setting), current_version=0
        )
        assert result.logprob_abs_diff > 10 * ENGINE_TRAINER_GAP, setting

    # the reference model's logprobs are taken at the same per-token temperatures: a
    # reference with the policy's weights is at KL 0. k3 of a logprob gap d is ~d**2/2;
    # two trainer forwards differ less than engine and trainer do (d < 1e-4)
    reference = copy.deepcopy(model)
    settings = TrainerSettings(kl_coef=0.1)
    result = train_step(model, optimizer, batch, settings, current_version=0, reference=reference)
    assert result.kl_mean <= ENGINE_TRAINER_GAP**2 / 2
