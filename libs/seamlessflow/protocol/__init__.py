"""The wire protocol: every NATS subject, stream, bucket and message type, defined once.

Rules (docs/architecture.md, "How the parts talk"):
- Subjects are built only by ``Subjects``: ``sf.<run>.<domain>.<...>``, lowercase. Each
  concrete subject declares its route (message, producers, consumers, transport), from
  which docs/architecture.md's producer -> subject -> consumer table is generated.
- Every message is a msgspec Struct with a type tag (``type`` field) and a schema
  version (``schema``); its docstring states ``producer -> consumer``.
- Durable data (trajectory events, batches, weight versions, metrics) goes through the
  JetStream streams named by ``Subjects``; core NATS carries only what may be lost
  (heartbeats, broadcasts that are re-sent, request/reply).

Everything is imported from here (``from seamlessflow.protocol import X``); the modules
hold one domain each:

- ``base``: identifiers and their checks, ``Message``, ``ErrorReply``, ``MessageIds``,
  policy tags, queue-group and durable-consumer names
- ``subjects``: ``Subjects``, every subject, stream, bucket and object store
- ``routes``: the ``@route`` declarations ``Subjects`` carries (who sends what to whom)
- ``table``: those routes rendered as docs/architecture.md's table
  (``python -m seamlessflow.protocol.table --write docs/architecture.md``)
- ``engine``: generate, chunks, abort, shed, load weights
- ``trajectory``: session events (opened, turn, reward, finished, group closed), export
- ``tasks``: task claims and assignments
- ``batches``: samples, batches, their payload and progress, the data filters' reports
- ``weights``: weight manifests, announcements, current version, push groups
- ``trainer``: step metrics, evaluations, plan, finish
- ``scheduler``: resources, roles, heartbeats, phases, slot and core lending
- ``codec``: ``MESSAGE_TYPES`` (every message type, read from the domain modules: a
  message is catalogued by being defined), ``AnyMessage`` (their union), ``encode``,
  ``decode``

The names below are the package's interface, listed for type checkers;
tests/unit/test_protocol_catalogue.py fails when a message type is not among them.

This package imports nothing heavy: no torch, no web framework, no NATS client.
"""

from seamlessflow.protocol.base import (
    DEFAULT_POLICY,
    ENGINE_QUEUE,
    POLICY_TAG_PREFIX,
    SCHEMA_VERSION,
    TRAINER_DURABLE,
    TRAJECTORY_DURABLE,
    TRAJECTORY_QUEUE,
    WEIGHT_SYNC_DURABLE,
    ErrorReply,
    Message,
    MessageIds,
    ProtocolError,
    check_policy,
    check_run_id,
    check_token,
    policy_of_tags,
    policy_tag,
)
from seamlessflow.protocol.batches import (
    BatchFilterReport,
    BatchPayload,
    BatchProgress,
    BatchReady,
    EpochFilterReport,
    GroupSummary,
    SampleGroup,
    SampleSummary,
    TrainBatch,
    TrainSample,
)
from seamlessflow.protocol.codec import MESSAGE_TYPES, AnyMessage, decode, encode
from seamlessflow.protocol.engine import (
    GREEDY_BELOW,
    SEEDS,
    TOP_P_MIN,
    UNRECORDED_TEMPERATURE,
    AbortGeneration,
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
    LoadWeights,
    ShedReport,
    ShedRequests,
    TopLogprob,
    WeightsLoaded,
)
from seamlessflow.protocol.scheduler import (
    CoresLent,
    Heartbeat,
    LendReport,
    Phase,
    PhaseChanged,
    ResourceRegister,
    Role,
    RoleAck,
    RoleAssignment,
    SlotsClaim,
    SlotsFreed,
    SlotsGranted,
    SlotsReleased,
)
from seamlessflow.protocol.subjects import Subjects
from seamlessflow.protocol.tasks import ChatMessage, NoTask, TaskAssignment, TaskClaim
from seamlessflow.protocol.trainer import (
    TrainEvalMetrics,
    TrainingFinished,
    TrainingPlanned,
    TrainProgress,
    TrainStepMetrics,
)
from seamlessflow.protocol.trajectory import (
    FAILURE_PATTERN,
    ExportedSample,
    GroupClosed,
    RewardReported,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    TrajectoryEvent,
    TurnRecorded,
)
from seamlessflow.protocol.weights import (
    CurrentVersion,
    CurrentVersionQuery,
    DeltaEncoding,
    DeviceHandle,
    DevicePayload,
    TensorSpec,
    WeightManifest,
    WeightsGroupOffer,
    WeightsGroupQuery,
    WeightsPublished,
)

__all__ = [
    "DEFAULT_POLICY",
    "ENGINE_QUEUE",
    "FAILURE_PATTERN",
    "GREEDY_BELOW",
    "MESSAGE_TYPES",
    "POLICY_TAG_PREFIX",
    "SCHEMA_VERSION",
    "SEEDS",
    "TOP_P_MIN",
    "TRAINER_DURABLE",
    "TRAJECTORY_DURABLE",
    "TRAJECTORY_QUEUE",
    "UNRECORDED_TEMPERATURE",
    "WEIGHT_SYNC_DURABLE",
    "AbortGeneration",
    "AnyMessage",
    "BatchFilterReport",
    "BatchPayload",
    "BatchProgress",
    "BatchReady",
    "ChatMessage",
    "CoresLent",
    "CurrentVersion",
    "CurrentVersionQuery",
    "DeltaEncoding",
    "DeviceHandle",
    "DevicePayload",
    "EpochFilterReport",
    "ErrorReply",
    "ExportedSample",
    "GenerateChunk",
    "GenerateReply",
    "GenerateRequest",
    "GroupClosed",
    "GroupSummary",
    "Heartbeat",
    "LendReport",
    "LoadWeights",
    "Message",
    "MessageIds",
    "NoTask",
    "Phase",
    "PhaseChanged",
    "ProtocolError",
    "ResourceRegister",
    "RewardReported",
    "Role",
    "RoleAck",
    "RoleAssignment",
    "SampleGroup",
    "SampleSummary",
    "SessionExport",
    "SessionExportQuery",
    "SessionFinished",
    "SessionOpened",
    "ShedReport",
    "ShedRequests",
    "SlotsClaim",
    "SlotsFreed",
    "SlotsGranted",
    "SlotsReleased",
    "Subjects",
    "TaskAssignment",
    "TaskClaim",
    "TensorSpec",
    "TopLogprob",
    "TrainBatch",
    "TrainEvalMetrics",
    "TrainProgress",
    "TrainSample",
    "TrainStepMetrics",
    "TrainingFinished",
    "TrainingPlanned",
    "TrajectoryEvent",
    "TurnRecorded",
    "WeightManifest",
    "WeightsGroupOffer",
    "WeightsGroupQuery",
    "WeightsLoaded",
    "WeightsPublished",
    "check_policy",
    "check_run_id",
    "check_token",
    "decode",
    "encode",
    "policy_of_tags",
    "policy_tag",
]
