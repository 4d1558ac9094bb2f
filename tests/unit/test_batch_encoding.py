"""The packed encoding of the batches the trajectory service sends the trainer
(``seamlessflow.batches``), without NATS: every field of a ``TrainSample`` keeps its
value and type (a new field included), each list packs into the narrowest exact array,
float32 logprobs take four bytes a token, and a damaged payload is a protocol error.
Delivery through a real nats-server is tests/service/test_batches.py."""

from __future__ import annotations

import random
import types
import typing

import msgspec
import numpy as np
import pytest

from seamlessflow import batches
from seamlessflow.protocol import ProtocolError, SampleGroup, TrainBatch, TrainSample, encode
from tests.support.trainer_batches import big_batch


def value_for(annotation: object, rng: random.Random, length: int) -> object:
    """A value of type ``annotation`` that differs from any default: long lists of
    numbers (packed), short ones (kept as MessagePack arrays), every kind of field
    ``TrainSample`` has. An annotation it does not know fails the test: extend it."""
    origin = typing.get_origin(annotation)
    if origin is list:
        [item] = typing.get_args(annotation)
        return [value_for(item, rng, length) for _ in range(length)]
    if origin in (typing.Union, types.UnionType):
        # the first non-None member (e.g. ``list[float] | None``)
        member = next(a for a in typing.get_args(annotation) if a is not type(None))
        return value_for(member, rng, length)
    if annotation is int:
        return rng.randrange(-(2**40), 2**40)
    if annotation is float:
        return rng.uniform(-50.0, 50.0)  # not exact in float32: travels as float64
    if annotation is str:
        return f"s{rng.randrange(10**9)}"
    if annotation is bool:
        return bool(rng.randrange(2))
    raise AssertionError(f"TrainSample has a field of type {annotation!r}: teach value_for it")


def every_field_set(rng: random.Random, length: int) -> TrainSample:
    hints = typing.get_type_hints(TrainSample)
    values = {
        field.name: value_for(hints[field.name], rng, length)
        for field in msgspec.structs.fields(TrainSample)
    }
    return TrainSample(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [0, 3, 4096])
def test_every_field_of_a_train_sample_round_trips_exactly(length: int) -> None:
    """Whatever fields TrainSample has (a new one included), each comes back with the
    value and type it had, for lists too short to pack and long ones alike."""
    rng = random.Random(length)
    samples = [every_field_set(rng, length) for _ in range(3)]
    batch = TrainBatch(
        batch_index=7,
        groups=[SampleGroup(group_id="g1", task_id="t", samples=samples)],
        policy="solver",
        created_at=1234.5,
    )
    decoded = batches.decode_batch(batches.encode_batch(batch))
    assert decoded == batch
    for sent, got in zip(samples, decoded.groups[0].samples, strict=True):
        for field in msgspec.structs.fields(TrainSample):
            a, b = getattr(sent, field.name), getattr(got, field.name)
            assert a == b and type(a) is type(b), field.name
            if isinstance(a, list):
                assert [type(x) for x in a] == [type(x) for x in b], field.name


def test_values_keep_their_exact_value_and_type_at_every_width() -> None:
    """Each list packs into the narrowest exact array: the values come back equal,
    ints as ints and floats as floats, at the edges of each width too."""
    f32 = [float(np.float32(x)) for x in np.linspace(-30, 0, 16)]
    cases = {
        "int8": [-128, 127, 0, 1, -1, 5, 6, 7],
        "int16": [-32768, 32767, 0, 1, 2, 3, 4, 5],
        "int32": [-(2**31), 2**31 - 1, 0, 151_000, 2, 3, 4, 5],
        "int64": [-(2**63), 2**63 - 1, 0, 1, 2, 3, 4, 5],
        "beyond int64": [2**64 - 1, 0, 1, 2, 3, 4, 5, 6],
        "float32 exact": f32,
        "float64": [0.1, -1e-300, 1e300, -0.0, 0.0, float("inf"), float("-inf"), 2.5],
        "integral floats": [0.0, 1.0, -3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        "bools": [True, False] * 4,
        "ints and floats": [1, 2.5, 3, 4, 5, 6, 7, 8],
        "floats and ints": [2.5, 1, 3, 4, 5, 6, 7, 2**60 + 1],
        "strings": ["a"] * 8,
    }
    for name, values in cases.items():
        encoded = batches._encoder.encode(batches._packed({"v": values}))
        decoded = batches._decoder.decode(encoded)["v"]
        assert decoded == values, name
        assert [type(x) for x in decoded] == [type(x) for x in values], name
        assert [str(x) for x in decoded] == [str(x) for x in values], name  # -0.0 stays


def test_behaviour_logprobs_from_float32_take_four_bytes() -> None:
    """Engines compute logprobs in float32: they travel as float32, exactly; ids of a
    150k vocabulary as int32, the mask and versions as int8 (about 10 bytes a token)."""
    rng = random.Random(0)
    n = 4096
    sample = TrainSample(
        session_id="s",
        token_ids=[rng.randrange(151_000) for _ in range(n)],
        loss_mask=[0] * 100 + [1] * (n - 100),
        behaviour_logprobs=[0.0] * 100
        + [float(np.float32(-rng.uniform(0, 8))) for _ in range(n - 100)],
        versions=[-1] * 100 + [3] * (n - 100),
        reward=1.0,
    )
    batch = TrainBatch(
        batch_index=0, groups=[SampleGroup(group_id="g", task_id="t", samples=[sample])]
    )
    payload = batches.encode_batch(batch)
    assert batches.decode_batch(payload) == batch
    assert n * (4 + 1 + 4 + 1) <= len(payload) < n * (4 + 1 + 4 + 1) + 400  # + field names
    assert len(payload) < len(encode(batch)) / 2


def test_a_damaged_payload_is_a_protocol_error() -> None:
    payload = batches.encode_batch(big_batch(0, [[20]]))
    for damaged in (payload[:-3], b"\xc7\x03\x01q\x00\x00", b"junk"):
        with pytest.raises(ProtocolError):
            batches.decode_batch(damaged)
