"""Encoding and decoding: every message type in one tagged union, found by its tag.

``AnyMessage`` is the union ``decode`` uses when no type is expected; a decoder per
expected type is built once and kept.
"""

from __future__ import annotations

from typing import Any

import msgspec

from seamlessflow.protocol.base import SCHEMA_VERSION, ErrorReply, Message, ProtocolError
from seamlessflow.protocol.batches import (
    BatchFilterReport,
    BatchProgress,
    BatchReady,
    EpochFilterReport,
    TrainBatch,
)
from seamlessflow.protocol.engine import (
    AbortGeneration,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
    LoadWeights,
    WeightsLoaded,
)
from seamlessflow.protocol.scheduler import (
    CoresLent,
    Heartbeat,
    LendReport,
    PhaseChanged,
    ResourceRegister,
    RoleAck,
    RoleAssignment,
    SlotsClaim,
    SlotsGranted,
    SlotsReleased,
)
from seamlessflow.protocol.tasks import NoTask, TaskAssignment, TaskClaim
from seamlessflow.protocol.trainer import (
    TrainEvalMetrics,
    TrainingFinished,
    TrainingPlanned,
    TrainStepMetrics,
)
from seamlessflow.protocol.trajectory import (
    RewardReported,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    TurnRecorded,
)
from seamlessflow.protocol.weights import (
    CurrentVersion,
    CurrentVersionQuery,
    WeightsGroupOffer,
    WeightsGroupQuery,
    WeightsPublished,
)

AnyMessage = (
    ErrorReply
    | GenerateRequest
    | GenerateReply
    | GenerateChunk
    | AbortGeneration
    | LoadWeights
    | WeightsLoaded
    | SessionOpened
    | TurnRecorded
    | RewardReported
    | SessionFinished
    | TaskClaim
    | TaskAssignment
    | NoTask
    | TrainBatch
    | BatchReady
    | BatchProgress
    | BatchFilterReport
    | EpochFilterReport
    | SessionExportQuery
    | SessionExport
    | WeightsPublished
    | CurrentVersionQuery
    | CurrentVersion
    | WeightsGroupQuery
    | WeightsGroupOffer
    | TrainStepMetrics
    | TrainEvalMetrics
    | TrainingPlanned
    | TrainingFinished
    | ResourceRegister
    | RoleAssignment
    | RoleAck
    | SlotsClaim
    | SlotsGranted
    | CoresLent
    | SlotsReleased
    | LendReport
    | Heartbeat
    | PhaseChanged
)

_encoder = msgspec.json.Encoder()
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, expected: Any = None) -> Any:
    """Decode a wire payload; ``expected`` is a Message class or a union of them.

    Raises ``ProtocolError`` for anything that is not a valid message of the expected
    type(s) or that carries a newer schema than this build understands.
    """
    try:
        if expected is None:
            message = _any_decoder.decode(data)
        else:
            message = _decoder_for(expected).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    if message.schema > SCHEMA_VERSION:
        raise ProtocolError(
            f"message schema {message.schema} is newer than supported {SCHEMA_VERSION}"
        )
    return message


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder_for(expected: Any) -> msgspec.json.Decoder[Any]:
    decoder = _decoders.get(expected)
    if decoder is None:
        decoder = _decoders[expected] = msgspec.json.Decoder(expected)
    return decoder
