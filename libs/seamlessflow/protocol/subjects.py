"""``Subjects``: every NATS subject, stream, key-value bucket and object store of a run.

Subjects are built only here: ``sf.<run>.<domain>.<...>``, lowercase. Each concrete
subject's builder declares its route (``@route``, ``seamlessflow.protocol.routes``): the
message(s) on it, producer(s), consumer(s), and how it travels. Its docstring does not
say it again: it adds only what the route cannot say (why, queue groups, what a reader
takes from it). docs/architecture.md's producer -> subject -> consumer table is
generated from these declarations (``seamlessflow.protocol.table``).

Longer than the package's other modules on purpose: one class, one builder per subject
with its route next to it, so the whole map of the mesh is read in one place.
"""

from __future__ import annotations

from seamlessflow.protocol.base import (
    DEFAULT_POLICY,
    ProtocolError,
    check_policy,
    check_run_id,
    check_token,
)
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
    ShedReport,
    ShedRequests,
    WeightsLoaded,
)
from seamlessflow.protocol.routes import route
from seamlessflow.protocol.scheduler import (
    CoresLent,
    Heartbeat,
    LendReport,
    PhaseChanged,
    ResourceRegister,
    RoleAck,
    RoleAssignment,
    SlotsClaim,
    SlotsFreed,
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
    GroupClosed,
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


class Subjects:
    """Subject builders for one policy of one run. Services hold one instance; nothing
    else formats subjects.

    A run trains one or more policies (multi-policy: e.g. a solver and a verifier). What
    belongs to one policy's version line carries its name as the token after the domain:
    engines (``sf.<run>.engine.<policy>.generate``), weights, batches, trainer progress
    and batch reports, and the policy's batch and weight streams and object store. What
    the whole run shares has no policy token: trajectory events, task claims, epoch
    reports, the tag-scheduler, engine aborts, and the trajectory and metrics streams
    (the metrics stream holds every policy's). ``for_policy`` gives another policy's
    builders on the same run.

    Each concrete builder declares its route (``@route``): the message(s) on the
    subject, who produces them and who consumes them, and how they travel: *core* (NATS
    publish, lost if nobody listens), *request/reply*, or a JetStream stream (durable).
    Its docstring adds only what the route cannot say. This class is the map of the
    mesh, rendered as the table of docs/architecture.md ("How the parts talk"): a
    subject is found here, then its producer and consumer by name.
    """

    def __init__(self, run_id: str, policy: str = DEFAULT_POLICY) -> None:
        self.run_id = check_run_id(run_id)
        self.policy = check_policy(policy)
        self._root = f"sf.{run_id}"

    def for_policy(self, policy: str) -> Subjects:
        return self if policy == self.policy else Subjects(self.run_id, policy)

    # engine workers (gateway -> engines of one policy)
    @route(
        GenerateRequest,
        replies=(GenerateChunk, GenerateReply),
        by="gateway",
        to="engine",
        transport="request/reply",
        note="chunks on the request's `stream_subject`",
    )
    def engine_generate(self) -> str:
        """One engine worker of the policy answers each request: they share the queue
        group ``ENGINE_QUEUE``."""
        return f"{self._root}.engine.{self.policy}.generate"

    @route(
        GenerateRequest,
        replies=(GenerateChunk, GenerateReply),
        by="gateway",
        to="engine",
        transport="request/reply",
        note="chunks on the request's `stream_subject`",
    )
    def engine_generate_on(self, engine_id: str) -> str:
        """This one engine worker, outside the queue group: a request rebalanced onto it
        (``GenerateReply.resume_on``) goes on here."""
        return f"{self._root}.engine.{self.policy}.direct.{check_token(engine_id, 'engine id')}"

    @route(
        ShedRequests, replies=ShedReport, by="tag-scheduler", to="engine", transport="request/reply"
    )
    def engine_shed(self, engine_id: str) -> str:
        """Rebalance on lend: the engine hands requests over to a freshly lent one."""
        return f"{self._root}.engine.shed.{check_token(engine_id, 'engine id')}"

    @route(AbortGeneration, by="gateway", to="engine", transport="core")
    def engine_abort(self) -> str:
        """Every engine worker of the run hears it (no policy token); the one running the
        request aborts it."""
        return f"{self._root}.engine.abort"

    @route(LoadWeights, by="weight-sync", to="engine", transport="core")
    def engine_load(self) -> str:
        """Every engine worker of the policy hears it."""
        return f"{self._root}.engine.{self.policy}.load"

    # trajectory (gateway -> trajectory, durable; run-wide)
    @route(
        (SessionOpened, TurnRecorded, RewardReported, SessionFinished),
        by="gateway",
        to=("trajectory", "gateway (replayed on start-up; shared sessions)"),
        transport="JetStream",
        stream="stream_trajectory",
    )
    def trajectory_event(self, session_id: str) -> str:
        """One subject per session. The gateway reads its sessions back on start-up (the
        open ones), and with shared sessions (``SF_GATEWAY_SHARED_SESSIONS``) a session's
        newest event before each call."""
        return f"{self._root}.traj.event.{check_token(session_id, 'session id')}"

    @route(
        GroupClosed,
        by="trajectory",
        to=("trajectory (replayed on start-up)", "gateway (replayed on start-up)"),
        transport="JetStream",
        stream="stream_trajectory",
    )
    def trajectory_group_event(self, group_id: str) -> str:
        """Among the trajectory events (``trajectory_events_all`` covers it), but never a
        session's subject."""
        return f"{self._root}.traj.event.group.{check_token(group_id, 'group id')}"

    def trajectory_events_all(self) -> str:
        """Every trajectory event: what ``stream_trajectory`` captures and the
        trajectory service and the gateway replay and follow."""
        return f"{self._root}.traj.event.>"

    @route(
        SessionExportQuery,
        replies=SessionExport,
        by=("seamlessflow export", "gateway"),
        to="trajectory",
        transport="request/reply",
    )
    def trajectory_export(self) -> str:
        """One session's samples; the gateway asks on behalf of its export endpoint."""
        return f"{self._root}.traj.export"

    # tasks (agent runner <-> trajectory; run-wide)
    @route(
        TaskClaim,
        replies=(TaskAssignment, NoTask),
        by="agent runner",
        to="trajectory",
        transport="request/reply",
    )
    def task_claim(self) -> str:
        """An agent runner's next sample to roll out, or none for now."""
        return f"{self._root}.task.claim"

    # batches (trajectory -> the policy's trainer, durable)
    @route(
        BatchReady,
        by="trajectory",
        to=("trainer (durable consumer)", "trajectory (on start-up)"),
        transport="JetStream",
        stream="stream_batches",
    )
    def batch_ready(self) -> str:
        """Sent once the batch's payload is stored (``batch_payload``); the trajectory
        service reads it back on start-up for the batches already formed."""
        return f"{self._root}.batch.{self.policy}.ready"

    @route(BatchProgress, by="trajectory", to="tag-scheduler", transport="core")
    def batch_progress(self) -> str:
        """A hint: another group of the policy's next batch is ready."""
        return f"{self._root}.batch.{self.policy}.progress"

    def batch_progress_all(self) -> str:
        """Every policy's ``batch_progress`` (what the tag-scheduler subscribes to)."""
        return f"{self._root}.batch.*.progress"

    @route(
        TrainBatch,
        by="trajectory",
        to="trainer",
        transport="JetStream",
        stream="stream_batch_payloads",
        note="packed, in raw chunks read by sequence",
    )
    def batch_payload(self, batch_index: int) -> str:
        """One subject per batch; the chunks' format is ``seamlessflow.batches``'s."""
        if batch_index < 0:
            raise ProtocolError(f"batch index {batch_index} is negative")
        return f"{self._root}.batch.{self.policy}.payload.{batch_index}"

    def batch_payloads_all(self) -> str:
        """What ``stream_batch_payloads`` captures."""
        return f"{self._root}.batch.{self.policy}.payload.*"

    # weights (the policy's trainer -> weight-sync -> engines)
    @route(
        WeightsPublished,
        by="trainer",
        to=("weight-sync", "trainer (on start-up)"),
        transport="JetStream",
        stream="stream_weights",
    )
    def weights_published(self) -> str:
        """The weights themselves are in ``object_store_weights``; a resuming trainer
        reads its last published version back."""
        return f"{self._root}.weights.{self.policy}.published"

    @route(
        CurrentVersionQuery,
        replies=CurrentVersion,
        by="engine",
        to="weight-sync",
        transport="request/reply",
    )
    def weights_current(self) -> str:
        """Which version an engine is to serve now, and its chain."""
        return f"{self._root}.weights.{self.policy}.current"

    @route(
        WeightsGroupQuery,
        replies=WeightsGroupOffer,
        by="engine",
        to="trainer",
        transport="request/reply",
    )
    def weights_group(self) -> str:
        """Join the trainer's push group (its NCCL id)."""
        return f"{self._root}.weights.{self.policy}.group"

    @route(WeightsLoaded, by="engine", to="weight-sync", transport="core")
    def weights_loaded(self) -> str:
        """The version an engine now serves."""
        return f"{self._root}.weights.{self.policy}.loaded"

    # trainer progress (the policy's trainer -> observers, durable)
    @route(
        TrainStepMetrics,
        by="trainer",
        to=("trajectory", "trainer (on start-up)", "embedded run", "seamlessflow track"),
        transport="JetStream",
        stream="stream_metrics",
    )
    def train_metrics(self) -> str:
        """One record per step: the trajectory service paces dispatch by it, a starting
        trainer reads its last recorded step back, observers display and report it."""
        return f"{self._root}.train.{self.policy}.metrics"

    @route(
        TrainingPlanned,
        by="trainer",
        to=("trajectory", "embedded run", "seamlessflow track"),
        transport="JetStream",
        stream="stream_metrics",
    )
    def train_plan(self) -> str:
        """Sent at each trainer start: the policy's step budget, which the trajectory
        service dispatches for, and the run's seed."""
        return f"{self._root}.train.{self.policy}.plan"

    @route(
        TrainingFinished,
        by="trainer",
        to=("trajectory", "embedded run", "seamlessflow track"),
        transport="JetStream",
        stream="stream_metrics",
    )
    def train_finished(self) -> str:
        """The policy reached its step budget."""
        return f"{self._root}.train.{self.policy}.finished"

    @route(
        TrainEvalMetrics,
        by="trainer",
        to=("embedded run", "seamlessflow track"),
        transport="JetStream",
        stream="stream_metrics",
    )
    def train_eval(self) -> str:
        """The policy's held-out evaluations."""
        return f"{self._root}.train.{self.policy}.eval"

    def train_all(self) -> str:
        """Every policy's trainer progress (observers of the whole run)."""
        return f"{self._root}.train.>"

    # data filters (trajectory -> observers, durable). Batch reports belong to the
    # policy whose batch they describe; epoch records are run-wide (the prompt set) and
    # are read back by the trajectory service on start-up.
    @route(
        BatchFilterReport,
        by="trajectory",
        to="trajectory (on start-up)",
        transport="JetStream",
        stream="stream_metrics",
    )
    def data_batch_report(self) -> str:
        """What the data filters dropped from each batch. Read back on start-up, so that
        nothing is reported twice; it stays for whoever reads the run's record, and no
        service follows it live."""
        return f"{self._root}.data.{self.policy}.batch"

    @route(
        EpochFilterReport,
        by="trajectory",
        to="trajectory (on start-up)",
        transport="JetStream",
        stream="stream_metrics",
    )
    def data_epoch_report(self) -> str:
        """Every epoch's prompt order, read back on start-up; it stays for whoever reads
        the run's record, and no service follows it live."""
        return f"{self._root}.data.epoch"

    def data_reports_all(self) -> str:
        """Every data report (part of what ``stream_metrics`` captures)."""
        return f"{self._root}.data.>"

    # tag scheduler (run-wide: resources carry a ``policy:<name>`` tag)
    @route(
        ResourceRegister,
        replies=RoleAssignment,
        by=("engine", "trainer"),
        to="tag-scheduler",
        transport="request/reply",
    )
    def sched_register(self) -> str:
        """Engine workers and trainers register through ``seamlessflow.resources``."""
        return f"{self._root}.sched.register"

    @route(Heartbeat, by=("engine", "trainer"), to="tag-scheduler", transport="core")
    def sched_heartbeat(self, resource_id: str) -> str:
        """One subject per registered resource."""
        return f"{self._root}.sched.heartbeat.{check_token(resource_id, 'resource id')}"

    def sched_heartbeat_all(self) -> str:
        """Every resource's ``sched_heartbeat`` (what the tag-scheduler subscribes to)."""
        return f"{self._root}.sched.heartbeat.*"

    @route(
        RoleAssignment,
        replies=RoleAck,
        by="tag-scheduler",
        to=("engine", "trainer"),
        transport="request/reply",
    )
    def sched_assignment(self, resource_id: str) -> str:
        """Lend (``rollout``), reclaim (``idle``), or the role after a restart."""
        return f"{self._root}.sched.assign.{check_token(resource_id, 'resource id')}"

    @route(PhaseChanged, by="tag-scheduler", to=("gateway", "weight-sync"), transport="core")
    def sched_phase(self) -> str:
        """Phase changes, deaths and NATS reconnects."""
        return f"{self._root}.sched.phase"

    @route(
        SlotsClaim,
        replies=SlotsGranted,
        by="trainer",
        to="tag-scheduler",
        transport="request/reply",
    )
    def sched_claim(self) -> str:
        """A batch is ready: the trainer wants its slots back."""
        return f"{self._root}.sched.claim"

    @route(
        SlotsReleased,
        replies=LendReport,
        by="trainer",
        to="tag-scheduler",
        transport="request/reply",
    )
    def sched_release(self) -> str:
        """The step is published: the trainer's slots may be lent."""
        return f"{self._root}.sched.release"

    @route(
        SlotsFreed,
        replies=LendReport,
        by="trainer",
        to="tag-scheduler",
        transport="request/reply",
    )
    def sched_freed(self) -> str:
        """The trainer moved its state off the device: its lent slots may serve now."""
        return f"{self._root}.sched.freed"

    @route(CoresLent, by="tag-scheduler", to="trainer", transport="core")
    def sched_cores(self, trainer_id: str) -> str:
        """The cores of idle rollout engines on the trainer's host it may train on now
        (lending in the other direction)."""
        return f"{self._root}.sched.cores.{check_token(trainer_id, 'trainer id')}"

    # JetStream streams, KV buckets and object stores. Run-level names are
    # ``SF_<RUN>_<KIND>``; a policy's append ``-<policy>`` (a run id has no ``-`` left
    # once upper-cased, so the first ``-`` starts the policy name).
    def stream_trajectory(self) -> str:
        return f"SF_{self._upper}_TRAJ"

    def stream_batches(self) -> str:
        return f"SF_{self._upper}_BATCH-{self.policy}"

    def stream_batch_payloads(self) -> str:
        """The chunks of the policy's batch payloads (read by sequence: direct get)."""
        return f"SF_{self._upper}_BATCHDATA-{self.policy}"

    def stream_weights(self) -> str:
        return f"SF_{self._upper}_WEIGHTS-{self.policy}"

    def stream_metrics(self) -> str:
        return f"SF_{self._upper}_METRICS"

    def kv_resources(self) -> str:
        return f"sf_{self._lower}_resources"

    def object_store_weights(self) -> str:
        return f"sf_{self._lower}_weights-{self.policy}"

    @property
    def _upper(self) -> str:
        return self.run_id.replace("-", "_").upper()

    @property
    def _lower(self) -> str:
        return self.run_id.replace("-", "_")

    def run_streams(self) -> dict[str, list[str]]:
        """The run-wide durable streams and the subjects each captures."""
        return {
            self.stream_trajectory(): [self.trajectory_events_all()],
            self.stream_metrics(): [self.train_all(), self.data_reports_all()],
        }

    def policy_streams(self) -> dict[str, list[str]]:
        """This policy's durable streams."""
        return {
            self.stream_batches(): [self.batch_ready()],
            self.stream_batch_payloads(): [self.batch_payloads_all()],
            self.stream_weights(): [self.weights_published()],
        }

    def streams(self) -> dict[str, list[str]]:
        """Every durable stream this policy's services use, run-wide ones included."""
        return {**self.run_streams(), **self.policy_streams()}
