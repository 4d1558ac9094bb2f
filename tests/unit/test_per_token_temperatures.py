"""Per-token sampling temperatures in the trainer: each row of logits divided by its own
temperature (the scalar form position by position), ``pack`` shifting temperatures with
the targets and filling the ones a record lacks, records of older runs (turns and batches
without temperatures) decoding and training at the fallback, and a negative temperature
refused. The temperatures travelling from an agent through a real gateway to the
trainer are tests/service/test_sampling_travels.py."""

from __future__ import annotations

import math

import pytest
import torch

from seamlessflow.protocol import (
    UNRECORDED_TEMPERATURE,
    TrainBatch,
    TrainSample,
    TrajectoryEvent,
    TurnRecorded,
    decode,
    encode,
)
from sf_trainer.grpo import token_logprobs
from sf_trainer.step import pack
from sf_trajectory.grouping import branch
from tests.support.trainer_batches import fields_of

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
    fresh = TurnRecorded(**{**fields_of(turn), "temperature": 0.7, "top_p": 0.9})
    assert decode(encode(fresh), TrajectoryEvent) == fresh


def test_a_turn_with_a_negative_temperature_is_malformed() -> None:
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            TurnRecorded(**{**fields_of(decode(OLD_TURN, TrajectoryEvent)), "temperature": bad})
    malformed = OLD_TURN.replace(b'"node_digest":""', b'"node_digest":"","temperature":-1')
    with pytest.raises(ValueError, match="temperature"):
        decode(malformed, TrajectoryEvent)
