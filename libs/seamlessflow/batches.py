"""Training batches from the trajectory service to a trainer, at any size.

A batch holds per-token lists (ids, loss mask, behaviour logprobs, versions...) for
every sample: 64 samples of 4k tokens are 262k tokens, far above what one NATS message
carries (``max_payload``, 1 MiB by default). So a batch travels in two parts, on two
streams of the policy:

- its payload, the whole ``TrainBatch`` in the packed encoding below, split into chunks
  that each fit a message, on ``sf.<run>.batch.<policy>.payload.<index>`` (stream
  ``SF_<RUN>_BATCHDATA-<policy>``);
- then a small ``BatchReady`` on ``sf.<run>.batch.<policy>.ready`` (stream
  ``SF_<RUN>_BATCH-<policy>``, the trainer's durable consumer), naming the chunks by
  stream sequence, with the payload's size and sha256 and which sessions and groups it
  holds (what a restarted trajectory service needs, without reading payloads).

Invariant: a ``BatchReady`` is published only once every chunk it names is stored, so
a trainer that sees one can fetch the whole batch, also after any restart, for as long
as the streams keep it (both have the batch retention, ``SF_RETENTION_BATCHES_*``).
Chunks of a batch whose ``BatchReady`` was never published (a crash in between) are
named by nothing and go with that retention.

The packed encoding is MessagePack of the message as msgspec turns it into built-in
types, where every list of at least ``PACK_MIN`` ints or floats becomes a little-endian
array (a MessagePack extension): ints in the narrowest of int8/16/32/64 that holds them,
floats as float32 where that is exact (behaviour logprobs computed in float32 are) and
float64 otherwise. No field is named: a field added to ``TrainSample`` is carried (and
packed, if it is such a list) without a change here, and every value decodes to
exactly what was encoded (checked in tests/unit/test_batch_encoding.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from typing import Any

import msgspec
import numpy as np

from seamlessflow.bus import BROKER_ERRORS, Bus
from seamlessflow.protocol import (
    SCHEMA_VERSION,
    BatchPayload,
    BatchReady,
    GroupSummary,
    MessageIds,
    ProtocolError,
    SampleSummary,
    TrainBatch,
)

ENCODING = "packed-msgpack-1"
"""``BatchPayload.encoding`` of this module's payloads."""

PACK_MIN = 8
"""Shorter lists stay MessagePack arrays (an extension's header would not pay off)."""

PACKED_ARRAY = 1
"""MessagePack extension type of a packed array: one dtype letter, then the values."""

_DTYPES: dict[bytes, np.dtype[Any]] = {
    b"b": np.dtype("<i1"),
    b"h": np.dtype("<i2"),
    b"i": np.dtype("<i4"),
    b"q": np.dtype("<i8"),
    b"f": np.dtype("<f4"),
    b"d": np.dtype("<f8"),
}
_LETTERS = {dtype: letter for letter, dtype in _DTYPES.items()}
_INT_WIDTHS = [_DTYPES[letter] for letter in (b"b", b"h", b"i", b"q")]

CHUNK_HEADROOM = 16 * 1024
"""Bytes of a message left for headers (message id, trace context): a chunk is the
server's ``max_payload`` less this."""


class BatchPayloadMissing(Exception):
    """A ``BatchReady`` whose payload is not (or no longer, or not intact) in its stream:
    retention dropped it, or it was tampered with. Retrying cannot bring it back."""


# --------------------------------------------------------------------------- encoding


def encode_batch(batch: TrainBatch) -> bytes:
    """``batch`` in the packed encoding (see the module docstring)."""
    return _encoder.encode(_packed(msgspec.to_builtins(batch)))


def decode_batch(data: bytes | memoryview) -> TrainBatch:
    """The ``TrainBatch`` of a packed payload; ``ProtocolError`` if it is not one."""
    try:
        batch = msgspec.convert(_decoder.decode(data), TrainBatch)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, struct.error) as exc:
        raise ProtocolError(f"invalid batch payload: {exc}") from None
    if batch.schema > SCHEMA_VERSION:
        raise ProtocolError(f"batch schema {batch.schema} is newer than supported {SCHEMA_VERSION}")
    return batch


def _packed(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _packed(item) for key, item in value.items()}
    if isinstance(value, list):
        array = _number_array(value)
        if array is not None:
            return msgspec.msgpack.Ext(PACKED_ARRAY, _LETTERS[array.dtype] + array.tobytes())
        return [_packed(item) for item in value]
    return value


def _number_array(values: list[Any]) -> np.ndarray | None:
    """``values`` as the narrowest exact little-endian array; None if it is not a long
    enough list of only ints or only floats (bools, strings, nested lists, ints beyond
    int64, a mix)."""
    if len(values) < PACK_MIN or type(values[0]) not in (int, float):
        return None
    try:
        array = np.asarray(values)
    except (OverflowError, ValueError, TypeError):
        return None
    if array.ndim != 1:
        return None
    if array.dtype.kind == "i" and type(values[0]) is int:
        low, high = array.min(), array.max()
        for dtype in _INT_WIDTHS:
            info = np.iinfo(dtype)
            if info.min <= low and high <= info.max:
                return array.astype(dtype)
    # numpy turns ints into floats in a list with a float (or an int beyond int64)
    if array.dtype.kind == "f" and all(type(value) is float for value in values):
        with np.errstate(over="ignore"):  # a value beyond float32 stays float64
            narrow = array.astype("<f4")
        if np.array_equal(narrow.astype(np.float64), array, equal_nan=True):
            return narrow
        return array.astype("<f8")
    return None


def _unpacked(code: int, data: memoryview) -> list[Any]:
    if code != PACKED_ARRAY:
        raise ValueError(f"unknown MessagePack extension {code}")
    dtype = _DTYPES.get(bytes(data[:1]))
    if dtype is None or (len(data) - 1) % dtype.itemsize:
        raise ValueError("malformed packed array")
    values: list[Any] = np.frombuffer(data[1:], dtype).tolist()
    return values


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ext_hook=_unpacked)


# --------------------------------------------------------------------------- delivery


def summary(batch: TrainBatch) -> list[GroupSummary]:
    """Which groups and sessions ``batch`` holds (``BatchReady.groups``)."""
    return [
        GroupSummary(
            group_id=group.group_id,
            task_id=group.task_id,
            samples=[
                SampleSummary(session_id=s.session_id, reward=s.reward, tokens=len(s.token_ids))
                for s in group.samples
            ],
        )
        for group in batch.groups
    ]


def chunk_bytes(max_payload: int) -> int:
    """Payload bytes per chunk message under a server's ``max_payload``."""
    return max(max_payload - CHUNK_HEADROOM, 1024)


async def publish_batch(bus: Bus, batch: TrainBatch, *, msg_id: str = "") -> BatchReady:
    """Store ``batch``'s payload, then announce it (``BatchReady``) on the policy's
    batch subject. ``msg_id`` (default ``MessageIds.batch``) makes a re-publish land
    once; a chunk's id adds the payload's digest, so a different batch under the same
    index (rebuilt after a crash before its ``BatchReady``) never reuses stale chunks."""
    subjects = bus.subjects.for_policy(batch.policy)
    msg_id = msg_id or MessageIds.batch(batch.policy, batch.batch_index)
    payload = await asyncio.to_thread(encode_batch, batch)
    digest = hashlib.sha256(payload).hexdigest()
    size = chunk_bytes(bus.max_payload)
    view = memoryview(payload)
    seqs = []
    for number, start in enumerate(range(0, max(len(payload), 1), size)):
        seqs.append(
            await bus.js_publish_bytes(
                subjects.batch_payload(batch.batch_index),
                bytes(view[start : start + size]),
                msg_id=MessageIds.batch_chunk(msg_id, digest, number),
            )
        )
    ready = BatchReady(
        batch_index=batch.batch_index,
        policy=batch.policy,
        created_at=batch.created_at,
        groups=summary(batch),
        payload=BatchPayload(
            encoding=ENCODING, chunk_seqs=seqs, payload_bytes=len(payload), sha256=digest
        ),
    )
    await bus.js_publish(subjects.batch_ready(), ready, msg_id=msg_id)
    return ready


async def fetch_batch(bus: Bus, ready: BatchReady | TrainBatch) -> TrainBatch:
    """The ``TrainBatch`` a ``BatchReady`` announces (a batch published whole, as before
    payloads existed, is itself). ``BatchPayloadMissing`` if the payload is gone or not
    what was announced; NATS errors (a broker restarting) propagate: retry later."""
    if isinstance(ready, TrainBatch):
        return ready
    subjects = bus.subjects.for_policy(ready.policy)
    stream, subject = subjects.stream_batch_payloads(), subjects.batch_payload(ready.batch_index)
    if ready.payload.encoding != ENCODING:
        raise BatchPayloadMissing(
            f"batch {ready.batch_index}: unknown payload encoding {ready.payload.encoding!r}"
        )

    async def chunk(seq: int) -> bytes:
        stored = await bus.stored_at(stream, seq, direct=True)
        if stored is None:
            raise BatchPayloadMissing(
                f"batch {ready.batch_index}: chunk {seq} is no longer in {stream} "
                "(dropped by SF_RETENTION_BATCHES_*?)"
            )
        if stored.subject != subject:
            raise BatchPayloadMissing(
                f"batch {ready.batch_index}: message {seq} of {stream} is not its chunk"
            )
        return stored.data

    chunks = await asyncio.gather(*(chunk(seq) for seq in ready.payload.chunk_seqs))
    payload = b"".join(chunks)
    if (
        len(payload) != ready.payload.payload_bytes
        or hashlib.sha256(payload).hexdigest() != ready.payload.sha256
    ):
        raise BatchPayloadMissing(
            f"batch {ready.batch_index}: the stored payload is not the one announced "
            f"({len(payload)} bytes, {ready.payload.payload_bytes} announced)"
        )
    try:
        batch = await asyncio.to_thread(decode_batch, payload)
    except ProtocolError as exc:
        raise BatchPayloadMissing(f"batch {ready.batch_index}: {exc}") from None
    if (batch.batch_index, batch.policy) != (ready.batch_index, ready.policy):
        raise BatchPayloadMissing(
            f"batch {ready.batch_index} of {ready.policy!r}: the payload holds batch "
            f"{batch.batch_index} of {batch.policy!r}"
        )
    return batch


async def stored_announcements(bus: Bus, policy: str = "") -> list[BatchReady | TrainBatch]:
    """Every batch announcement the policy's batch stream holds (undecodable ones are
    skipped): ``BatchReady``, or a whole ``TrainBatch`` as published before payloads."""
    subjects = bus.subjects.for_policy(policy or bus.subjects.policy)
    return await bus.read_decoded(
        subjects.stream_batches(), subjects.batch_ready(), BatchReady | TrainBatch
    )


async def stored_batches(bus: Bus, policy: str = "") -> list[TrainBatch]:
    """Every batch the policy's streams hold, whole (tests, tools)."""
    return [await fetch_batch(bus, ready) for ready in await stored_announcements(bus, policy)]


TRANSIENT_ERRORS = BROKER_ERRORS
"""What ``fetch_batch`` raises when the broker is away: try again later."""
