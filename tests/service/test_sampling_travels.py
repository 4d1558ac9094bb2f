"""Sampling travels with the data: each turn records the temperature it was sampled at,
and the trainer recomputes every token's logprob at its own turn's temperature.

End to end: one agent (the official openai SDK) asks a real gateway + HF engine at
temperature 0.7 (top_p 0.9), then 1.0, then greedily; the trajectory service (real
nats-server) batches the session; the trainer's recomputation at the same weights
matches the engine's behaviour logprobs on every token, which no single temperature
does. Then the per-token temperature math, and records made before turns carried their
temperature.
"""

from __future__ import annotations

import asyncio
import copy
import math
from pathlib import Path

import httpx
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    UNRECORDED_TEMPERATURE,
    SampleGroup,
    TrainBatch,
    TrainSample,
    TrajectoryEvent,
    TurnRecorded,
    decode,
    encode,
)
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trainer.grpo import token_logprobs
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import pack, train_step
from sf_trajectory.grouping import branch
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, recorded_turns, session_auth

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
    stripped = TrainSample(**{**_fields(sample), "temperatures": []})
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


def _fields(sample: TrainSample) -> dict:  # type: ignore[type-arg]
    return {name: getattr(sample, name) for name in sample.__struct_fields__}


# ------------------------------------------------------------- per-token temperature math


def test_per_token_temperatures_divide_each_row_by_its_own() -> None:
    logits = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [2.0, 0.0]]])
    targets = torch.tensor([[0, 0, 0]])
    temperatures = torch.tensor([[1.0, 2.0, 0.0]])  # 0: greedy, reported at temperature 1
    got = token_logprobs(logits, targets, temperatures)[0].tolist()
    at_1 = math.log(math.e**2 / (math.e**2 + 1))
    at_2 = math.log(math.e / (math.e + 1))
    assert got == pytest.approx([at_1, at_2, at_1], rel=1e-6)


def test_per_token_temperatures_equal_the_scalar_form_position_by_position() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator) * 4
    targets = torch.randint(0, 11, (3, 5), generator=generator)
    choices = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.9])
    temperatures = choices[torch.randint(0, 5, (3, 5), generator=generator)]
    vectorised = token_logprobs(logits, targets, temperatures)
    for b in range(3):
        for t in range(5):
            one = token_logprobs(logits[b, t], targets[b, t], float(temperatures[b, t]))
            # the same float32 operations on the same row, up to reduction order
            assert float(vectorised[b, t]) == pytest.approx(float(one), rel=1e-6, abs=1e-6)


def test_pack_shifts_temperatures_with_the_targets_and_fills_unrecorded_ones() -> None:
    recorded = TrainSample(
        session_id="a",
        token_ids=[5, 6, 7, 8, 9],
        loss_mask=[0, 1, 1, 0, 1],
        behaviour_logprobs=[0.0, -0.1, -0.2, 0.0, -0.3],
        versions=[-1, 0, 0, -1, 0],
        reward=1.0,
        temperatures=[1.0, 0.7, 0.7, 1.0, 0.0],
    )
    mixed = TrainSample(  # one turn recorded before turns carried their temperature
        session_id="b",
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -0.1, -0.2],
        versions=[-1, 0, 0],
        reward=0.0,
        temperatures=[1.0, UNRECORDED_TEMPERATURE, UNRECORDED_TEMPERATURE],
    )
    older = TrainSample(  # a sample made before samples carried temperatures
        session_id="c",
        token_ids=[5, 6],
        loss_mask=[0, 1],
        behaviour_logprobs=[0.0, -0.1],
        versions=[-1, 0],
        reward=0.0,
    )
    packed = pack([recorded, mixed, older], [0.0, 0.0, 0.0], unrecorded_temperature=0.6)
    # target t+1 is predicted at position t: its temperature sits at t
    assert packed.temperatures[0].tolist() == pytest.approx([0.7, 0.7, 1.0, 0.0])
    assert packed.temperatures[1].tolist()[:2] == pytest.approx([0.6, 0.6])
    assert packed.temperatures[2].tolist()[:1] == pytest.approx([0.6])


# ------------------------------------------------------------- records of older runs

OLD_TURN = (
    b'{"type":"traj.turn","schema":1,"session_id":"s1","turn_index":0,"request_id":"r",'
    b'"engine_id":"e","prompt_ids":[1,2],"completion_ids":[3,4],"logprobs":[-0.5,-0.25],'
    b'"versions":[0,0],"finish_reason":"length","completion_text":"xy","policy":"policy",'
    b'"node_depth":0,"node_digest":""}'
)
"""A TurnRecorded as gateways wrote it before turns carried their sampling."""

OLD_BATCH = (
    b'{"type":"batch","schema":1,"batch_index":0,"groups":[{"group_id":"g","task_id":"t",'
    b'"samples":[{"session_id":"s1","token_ids":[1,2,3,4],"loss_mask":[0,0,1,1],'
    b'"behaviour_logprobs":[0.0,0.0,-0.5,-0.25],"versions":[-1,-1,0,0],"reward":1.0}]}],'
    b'"policy":"policy","created_at":0.0}'
)
"""A TrainBatch as trajectory services published it before samples carried temperatures."""


def test_records_of_older_runs_decode_and_train_at_the_fallback_temperature() -> None:
    turn = decode(OLD_TURN, TrajectoryEvent)
    assert isinstance(turn, TurnRecorded)
    assert turn.temperature is None and turn.top_p == 1.0
    sample, _ = branch([turn], turn)
    assert sample.temperatures == [1.0, 1.0, UNRECORDED_TEMPERATURE, UNRECORDED_TEMPERATURE]

    batch = decode(OLD_BATCH, TrainBatch)
    (old,) = batch.groups[0].samples
    assert old.temperatures == []
    for fallback in (0.75, 0.0):  # exact in float32
        packed = pack([old], [0.0], unrecorded_temperature=fallback)
        assert packed.temperatures.tolist() == [[fallback] * 3]
    # a new record round-trips its temperatures
    assert decode(encode(batch), TrainBatch) == batch
    fresh = TurnRecorded(**{**_fields(turn), "temperature": 0.7, "top_p": 0.9})
    assert decode(encode(fresh), TrajectoryEvent) == fresh


def test_a_turn_with_a_negative_temperature_is_malformed() -> None:
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            TurnRecorded(**{**_fields(decode(OLD_TURN, TrajectoryEvent)), "temperature": bad})
    malformed = OLD_TURN.replace(b'"node_digest":""', b'"node_digest":"","temperature":-1')
    with pytest.raises(ValueError, match="temperature"):
        decode(malformed, TrajectoryEvent)
