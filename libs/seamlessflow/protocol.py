"""The wire protocol: every NATS subject, stream, bucket and message type, defined once.

Rules (docs/architecture.md, "How the parts talk"):
- Subjects are built only by the functions below: ``sf.<run>.<domain>.<...>``, lowercase.
- Every message is a msgspec Struct with a type tag (``type`` field) and a schema
  version (``schema``); its docstring states ``producer -> consumer``.
- Durable data (trajectory events, batches, weight versions, metrics) goes through the
  JetStream streams named here; core NATS carries only what may be lost (heartbeats,
  broadcasts that are re-sent, request/reply).

This module imports nothing heavy: no torch, no web framework, no NATS client.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1

_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_POLICY = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_TOKEN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,127}$")

DEFAULT_POLICY = "policy"
"""The policy of a single-policy run; also the model name agents ask for."""


class ProtocolError(ValueError):
    """A message or identifier that does not follow this protocol."""


def check_run_id(run_id: str) -> str:
    """Run ids become subject tokens, stream and bucket names, so the alphabet is narrow."""
    if not _RUN_ID.match(run_id):
        raise ProtocolError(f"run id {run_id!r} must match {_RUN_ID.pattern}")
    return run_id


def check_policy(name: str) -> str:
    """Policy names are model names agents send, subject tokens and part of stream and
    bucket names: lowercase letters, digits and ``-``."""
    if not _POLICY.match(name):
        raise ProtocolError(f"policy name {name!r} must match {_POLICY.pattern}")
    return name


def check_token(value: str, what: str = "identifier") -> str:
    if not _TOKEN.match(value):
        raise ProtocolError(f"{what} {value!r} must match {_TOKEN.pattern}")
    return value


# --------------------------------------------------------------------------- subjects


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

    Each builder's docstring names the message(s) on the subject, who produces them and
    who consumes them (``producer -> consumer``), and how they travel: *core* (NATS
    publish, lost if nobody listens), *request/reply*, or a JetStream stream (durable).
    This class is the map of the mesh: a subject is found here, then its producer and
    consumer by name.
    """

    def __init__(self, run_id: str, policy: str = DEFAULT_POLICY) -> None:
        self.run_id = check_run_id(run_id)
        self.policy = check_policy(policy)
        self._root = f"sf.{run_id}"

    def for_policy(self, policy: str) -> Subjects:
        return self if policy == self.policy else Subjects(self.run_id, policy)

    # engine workers (gateway -> engines of one policy)
    def engine_generate(self) -> str:
        """GenerateRequest -> GenerateChunk..., GenerateReply: gateway -> one engine worker
        of the policy (request/reply, queue group ``ENGINE_QUEUE``)."""
        return f"{self._root}.engine.{self.policy}.generate"

    def engine_generate_on(self, engine_id: str) -> str:
        """GenerateRequest -> GenerateReply: gateway -> this one engine worker (request/
        reply, no queue group: a request it was rebalanced onto, ``resume_on``)."""
        return f"{self._root}.engine.{self.policy}.direct.{check_token(engine_id, 'engine id')}"

    def engine_shed(self, engine_id: str) -> str:
        """ShedRequests -> ShedReport: tag-scheduler -> one engine worker (request/reply):
        hand requests over to a freshly lent engine."""
        return f"{self._root}.engine.shed.{check_token(engine_id, 'engine id')}"

    def engine_abort(self) -> str:
        """AbortGeneration: gateway -> every engine worker of the run (core broadcast);
        the one running the request aborts it."""
        return f"{self._root}.engine.abort"

    def engine_load(self) -> str:
        """LoadWeights: weight-sync -> the policy's engine workers (core broadcast)."""
        return f"{self._root}.engine.{self.policy}.load"

    # trajectory (gateway -> trajectory, durable; run-wide)
    def trajectory_event(self, session_id: str) -> str:
        """SessionOpened, TurnRecorded, RewardReported, SessionFinished: gateway ->
        trajectory (JetStream ``stream_trajectory``)."""
        return f"{self._root}.traj.event.{check_token(session_id, 'session id')}"

    def trajectory_group_event(self, group_id: str) -> str:
        """GroupClosed: trajectory -> trajectory, read back on restart (JetStream
        ``stream_trajectory``); never a session's subject."""
        return f"{self._root}.traj.event.group.{check_token(group_id, 'group id')}"

    def trajectory_events_all(self) -> str:
        """Every trajectory event: what ``stream_trajectory`` captures and the
        trajectory service replays and follows."""
        return f"{self._root}.traj.event.>"

    def trajectory_export(self) -> str:
        """SessionExportQuery -> SessionExport: ``seamlessflow export`` and the gateway's
        export endpoint -> trajectory (request/reply)."""
        return f"{self._root}.traj.export"

    # tasks (agent runner <-> trajectory; run-wide)
    def task_claim(self) -> str:
        """TaskClaim -> TaskAssignment | NoTask: agent runner -> trajectory
        (request/reply)."""
        return f"{self._root}.task.claim"

    # batches (trajectory -> the policy's trainer, durable)
    def batch_ready(self) -> str:
        """BatchReady: trajectory -> the policy's trainer (JetStream ``stream_batches``,
        a durable pull consumer); sent once the payload is stored."""
        return f"{self._root}.batch.{self.policy}.ready"

    def batch_progress(self) -> str:
        """BatchProgress: trajectory -> tag-scheduler (core, a hint): another group of
        the next batch is ready."""
        return f"{self._root}.batch.{self.policy}.progress"

    def batch_progress_all(self) -> str:
        """Every policy's ``batch_progress`` (what the tag-scheduler subscribes to)."""
        return f"{self._root}.batch.*.progress"

    def batch_payload(self, batch_index: int) -> str:
        """Raw chunks of one batch's payload (``seamlessflow.batches``): trajectory ->
        the policy's trainer (JetStream ``stream_batch_payloads``, read by sequence)."""
        if batch_index < 0:
            raise ProtocolError(f"batch index {batch_index} is negative")
        return f"{self._root}.batch.{self.policy}.payload.{batch_index}"

    def batch_payloads_all(self) -> str:
        """What ``stream_batch_payloads`` captures."""
        return f"{self._root}.batch.{self.policy}.payload.*"

    # weights (the policy's trainer -> weight-sync -> engines)
    def weights_published(self) -> str:
        """WeightsPublished: the policy's trainer -> weight-sync, and the trainer itself
        on resume (JetStream ``stream_weights``); payloads in ``object_store_weights``."""
        return f"{self._root}.weights.{self.policy}.published"

    def weights_current(self) -> str:
        """CurrentVersionQuery -> CurrentVersion: engine worker -> weight-sync
        (request/reply): which version to serve now, and its chain."""
        return f"{self._root}.weights.{self.policy}.current"

    def weights_group(self) -> str:
        """WeightsGroupQuery -> WeightsGroupOffer: engine worker -> the policy's trainer
        (request/reply): join its push group (NCCL id)."""
        return f"{self._root}.weights.{self.policy}.group"

    def weights_loaded(self) -> str:
        """WeightsLoaded: engine worker -> weight-sync (core): the version it now serves."""
        return f"{self._root}.weights.{self.policy}.loaded"

    # trainer progress (the policy's trainer -> observers, durable)
    def train_metrics(self) -> str:
        """TrainStepMetrics: the policy's trainer -> trajectory (pacing) and observers
        (the embedded run's display and report) (JetStream ``stream_metrics``)."""
        return f"{self._root}.train.{self.policy}.metrics"

    def train_plan(self) -> str:
        """TrainingPlanned: the policy's trainer, at each start -> trajectory (its step
        budget and the run's seed) and observers (JetStream ``stream_metrics``)."""
        return f"{self._root}.train.{self.policy}.plan"

    def train_finished(self) -> str:
        """TrainingFinished: the policy's trainer -> trajectory and observers (JetStream
        ``stream_metrics``)."""
        return f"{self._root}.train.{self.policy}.finished"

    def train_eval(self) -> str:
        """TrainEvalMetrics: the policy's trainer -> observers (JetStream
        ``stream_metrics``): its held-out evaluations."""
        return f"{self._root}.train.{self.policy}.eval"

    def train_all(self) -> str:
        """Every policy's trainer progress (observers of the whole run)."""
        return f"{self._root}.train.>"

    # data filters (trajectory -> observers, durable). Batch reports belong to the
    # policy whose batch they describe; epoch records are run-wide (the prompt set) and
    # are read back by the trajectory service on start-up.
    def data_batch_report(self) -> str:
        """BatchFilterReport: trajectory -> observers, and itself on restart (JetStream
        ``stream_metrics``)."""
        return f"{self._root}.data.{self.policy}.batch"

    def data_epoch_report(self) -> str:
        """EpochFilterReport: trajectory -> itself on restart, and observers (JetStream
        ``stream_metrics``)."""
        return f"{self._root}.data.epoch"

    def data_reports_all(self) -> str:
        """Every data report (part of what ``stream_metrics`` captures)."""
        return f"{self._root}.data.>"

    # tag scheduler (run-wide: resources carry a ``policy:<name>`` tag)
    def sched_register(self) -> str:
        """ResourceRegister -> RoleAssignment: engine workers and trainers
        (``seamlessflow.resources``) -> tag-scheduler (request/reply)."""
        return f"{self._root}.sched.register"

    def sched_heartbeat(self, resource_id: str) -> str:
        """Heartbeat: every registered resource -> tag-scheduler (core)."""
        return f"{self._root}.sched.heartbeat.{check_token(resource_id, 'resource id')}"

    def sched_heartbeat_all(self) -> str:
        """Every resource's ``sched_heartbeat`` (what the tag-scheduler subscribes to)."""
        return f"{self._root}.sched.heartbeat.*"

    def sched_assignment(self, resource_id: str) -> str:
        """RoleAssignment -> RoleAck: tag-scheduler -> one resource (request/reply): lend
        (``rollout``), reclaim (``idle``), or the role after a restart."""
        return f"{self._root}.sched.assign.{check_token(resource_id, 'resource id')}"

    def sched_phase(self) -> str:
        """PhaseChanged: tag-scheduler -> gateway and weight-sync (core): phase changes
        and deaths."""
        return f"{self._root}.sched.phase"

    def sched_claim(self) -> str:
        """SlotsClaim -> SlotsGranted: trainer -> tag-scheduler (request/reply): a batch
        is ready, give me my slots."""
        return f"{self._root}.sched.claim"

    def sched_release(self) -> str:
        """SlotsReleased -> LendReport: trainer -> tag-scheduler (request/reply): step
        published, my slots may be lent."""
        return f"{self._root}.sched.release"

    def sched_cores(self, trainer_id: str) -> str:
        """CoresLent: tag-scheduler -> one trainer (core): the cores of idle rollout
        engines on its host it may train on now (lending in the other direction)."""
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


class MessageIds:
    """JetStream message ids (``Nats-Msg-Id``), all built here.

    A durable publish carries the id of the fact it records, so a publish retried after
    a lost acknowledgement, or repeated by a restarted service, is stored once (the
    stream's duplicate window): part of exactly-once. An id names the kind of fact, the
    policy whose line it belongs to (where there is one) and its index or version: two
    different facts never share an id, the same fact always gets the same one."""

    @staticmethod
    def batch(policy: str, batch_index: int) -> str:
        """BatchReady of one batch (the trajectory service, also after a restart)."""
        return f"batch-{policy}-{batch_index}"

    @staticmethod
    def batch_chunk(batch_id: str, digest: str, number: int) -> str:
        """One chunk of a batch's payload; the payload's digest is in it, so a batch
        rebuilt differently under the same index never reuses stale chunks."""
        return f"{batch_id}.{digest[:16]}.{number}"

    @staticmethod
    def data_batch_report(policy: str, batch_index: int) -> str:
        return f"data-batch-{policy}-{batch_index}"

    @staticmethod
    def data_epoch_report(stage_index: int, epoch: int) -> str:
        return f"data-epoch-{stage_index}-{epoch}"

    @staticmethod
    def group_closed(group_id: str) -> str:
        return f"closed-{group_id}"

    # The trainer's facts are keyed by version: after a resume, step numbers repeat,
    # versions never do.
    @staticmethod
    def weights(policy: str, version: int) -> str:
        return f"weights-{policy}-v{version}"

    @staticmethod
    def train_metrics(policy: str, version: int) -> str:
        return f"metrics-{policy}-v{version}"

    @staticmethod
    def train_eval(policy: str, version: int) -> str:
        return f"eval-{policy}-v{version}"

    @staticmethod
    def train_finished(policy: str, version: int) -> str:
        return f"finished-{policy}-v{version}"

    @staticmethod
    def train_plan(policy: str, trainer_id: str) -> str:
        """One per trainer process (a restart announces again, perhaps another budget)."""
        return f"plan-{policy}-{trainer_id}"


POLICY_TAG_PREFIX = "policy:"


def policy_tag(policy: str) -> str:
    """The capability tag of a resource that serves or trains ``policy``."""
    return POLICY_TAG_PREFIX + check_policy(policy)


def policy_of_tags(tags: list[str] | frozenset[str]) -> str:
    """The policy a resource's tags name (``DEFAULT_POLICY`` without a policy tag)."""
    named = sorted(t[len(POLICY_TAG_PREFIX) :] for t in tags if t.startswith(POLICY_TAG_PREFIX))
    if len(named) > 1:
        raise ProtocolError(f"a resource belongs to one policy; its tags name {named}")
    return check_policy(named[0]) if named else DEFAULT_POLICY


ENGINE_QUEUE = "engines"
TRAJECTORY_QUEUE = "trajectory"
TRAINER_DURABLE = "trainer"
WEIGHT_SYNC_DURABLE = "weight-sync"
TRAJECTORY_DURABLE = "trajectory"


# --------------------------------------------------------------------------- messages


class Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=False):
    """Base of every message on the wire."""

    schema: int = SCHEMA_VERSION


class ErrorReply(Message, tag="error"):
    """Any service -> a requester: the request was refused. ``code`` is machine-readable."""

    code: Literal["bad_request", "not_found", "conflict", "unavailable", "internal"]
    message: str


# engine ---------------------------------------------------------------------


class GenerateRequest(Message, tag="engine.generate"):
    """rollout-gateway -> engine worker (queue group): generate a continuation of prompt_ids."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    """0 = greedy; so is any temperature below ``GREEDY_BELOW``."""
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens (0 = all); like top_p, it does not change
    the reported logprobs (taken before truncation)."""
    structured_output: str = ""
    """Constrained decoding (``response_format``), as the fields of vLLM's
    ``StructuredOutputsParams`` in JSON; empty: none. Engines that cannot constrain
    answer it with a bad_request error."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None
    """In ``SEEDS``."""
    top_logprobs: int = 0
    """How many most likely alternatives to report per generated token (0-20)."""
    stream_subject: str = ""
    """If set, the engine also publishes GenerateChunk messages here as tokens appear;
    the final GenerateReply still carries every token."""
    chunk_every_s: float = 0.0
    """Token chunks at most this often (0: one per decode step; chunk 0, which names
    the engine, is always sent at once). A caller that does not stream the answer
    needs the tokens so far only to re-route a dead engine's request: fewer messages."""
    min_version: int = 0
    """The engine starts this request only on weights of at least this version: one
    that holds older ones first catches up (waiting up to ``SF_ENGINE_MIN_VERSION_WAIT_S``
    for weight-sync to announce it). 0: any version."""


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily, as in vLLM: logits divided by a temperature
that small overflow float32 and the logprobs become NaN or -inf."""

SEEDS = range(-(2**63), 2**64)
"""The seeds a request may carry: what a 64-bit generator takes (torch's reads a
negative seed modulo 2**64)."""

TOP_P_MIN = 2.0**-126
"""float32's smallest normal value: a smaller ``top_p`` is raised to it, since float32
(an engine's sampler) would round it to 0, a nucleus of no token. Either keeps only the
most likely token."""


UNRECORDED_TEMPERATURE = -1.0
"""The temperature of a token whose turn was recorded before turns carried their
sampling temperature (a replay of an older run's streams): the trainer recomputes its
logprob at ``SF_TRAINER_TEMPERATURE``, as trainers did then."""


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class GenerateChunk(Message, tag="engine.generate.chunk"):
    """engine worker -> rollout-gateway (core, on ``stream_subject``): new tokens so far.

    Chunks of one request are numbered from 0; chunk 0 has no tokens and only names the
    engine. A gateway that misses one falls back to the final GenerateReply, which is
    authoritative.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[TopLogprob]] = msgspec.field(default_factory=list)
    engine_id: str = ""
    """Which engine is generating: lets the gateway re-route if that engine dies."""


class GenerateReply(Message, tag="engine.generate.reply"):
    """engine worker -> rollout-gateway: the tokens, their behaviour logprobs and versions."""

    request_id: str
    engine_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    top_logprobs: list[list[TopLogprob]] = msgspec.field(default_factory=list)
    resume_on: str = ""
    """With ``abort``: the engine to re-submit the rest to (the request was shed onto a
    freshly lent engine, ``ShedRequests``); empty: any engine of the queue group."""


class ShedRequests(Message, tag="engine.shed"):
    """tag-scheduler -> engine worker (request; rebalance on lend): end up to ``count``
    of your requests in flight at a token boundary, the most recently started first,
    and name ``to_engine`` in their replies, so the gateway resumes them there."""

    to_engine: str
    count: int


class ShedReport(Message, tag="engine.shed.report"):
    """engine worker -> tag-scheduler: how many requests it handed over."""

    engine_id: str
    handed_over: int


class AbortGeneration(Message, tag="engine.abort"):
    """rollout-gateway -> engine workers (broadcast): stop a request at a token boundary."""

    request_id: str
    reason: str


class LoadWeights(Message, tag="engine.load"):
    """weight-sync -> engine workers (broadcast): load this payload. An engine whose
    weights are not ``manifest.base_version`` (a delta after a gap) asks
    ``weights.current`` for the whole chain instead."""

    manifest: WeightManifest


class WeightsLoaded(Message, tag="engine.loaded"):
    """engine worker -> weight-sync: the version this engine now serves."""

    engine_id: str
    version: int


# trajectory events (gateway -> trajectory, JetStream) -------------------------


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class SessionOpened(Message, tag="traj.session_opened"):
    """rollout-gateway -> trajectory: a new agent session for one sample of a task."""

    session_id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    reference: str = ""
    reward_fn: str = ""
    policy: str = DEFAULT_POLICY
    """The task's policy: the one whose last answer ``reward_fn`` scores."""
    key_sha256: str = ""
    """sha256 of the session's API key (never the key): the session's routes take only
    that key."""
    min_version: int = 0
    """The task's ``min_version`` (``TaskAssignment``): the session's calls to ``policy``
    ask engines for at least this weight version."""
    opened_at: float = msgspec.field(default_factory=time.time)


class TurnRecorded(Message, tag="traj.turn"):
    """rollout-gateway -> trajectory: exactly what one engine call consumed and produced."""

    session_id: str
    turn_index: int
    request_id: str
    engine_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    completion_text: str
    """The answer's text as the agent got it: ``completion_ids`` decoded (after a forced
    tool call's opening, which ends ``prompt_ids``, that opening and then them)."""
    policy: str = DEFAULT_POLICY
    """The policy whose engine generated it (the request's ``model``)."""
    node_depth: int = 0
    node_digest: str = ""
    """Where the answer sits in the session's conversation tree (a chat turn; 0 and ""
    for a completion): messages + reply, and the sha256 chain over the tools and those
    messages (``sf_gateway.conversation``). A restarted gateway rebuilds the tree of an
    open session from them, with ``prompt_ids + completion_ids`` as the node's ids."""
    temperature: float | None = None
    """The temperature the engine sampled at (0 = greedy: the request asked for less
    than ``GREEDY_BELOW``), which defines ``logprobs``: ``log_softmax(logits /
    temperature)``, at temperature 1 when greedy. The trainer recomputes each token's
    logprob at it. None: recorded before turns carried it (``UNRECORDED_TEMPERATURE``)."""
    top_p: float = 1.0
    """The nucleus the engine sampled from. It does not enter ``logprobs``, which are
    taken before the truncation; recorded so that every turn says how it was sampled."""
    parent_digest: str = ""
    """The ``node_digest`` of the earlier turn whose messages (request + reply) this
    chat request continued, "" for none. Usually that turn's ids are a prefix of this
    prompt; when the chat template rewrites its reply (Qwen3 drops a ``<think>`` block
    once a later user message follows) they are not, and the trajectory service trains
    that turn as a sample of its own (``sf_trajectory.grouping.trained_branches``)."""
    top_k: int = 0
    """The top-k the engine sampled from (0 = none); like ``top_p``, it does not enter
    ``logprobs`` and is recorded so that every turn says how it was sampled."""
    constrained: bool = False
    """Sampled under constrained decoding (``response_format``): its ``logprobs`` are of
    the constrained distribution, which the trainer cannot recompute from the weights,
    so its tokens are context for later turns but never trained (loss mask 0)."""

    def __post_init__(self) -> None:
        # One logprob and one version per generated token, and real token ids: a turn
        # that breaks this could never become a well-formed sample (docs/architecture.md,
        # invariant 1), so it is refused where it is made and counted as malformed where
        # it is read.
        if not len(self.completion_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"{len(self.completion_ids)} completion ids but {len(self.logprobs)} "
                f"logprobs and {len(self.versions)} versions"
            )
        if any(t < 0 for t in self.prompt_ids) or any(t < 0 for t in self.completion_ids):
            raise ValueError("token ids must be non-negative")
        if self.temperature is not None and not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


class RewardReported(Message, tag="traj.reward"):
    """rollout-gateway -> trajectory: the agent (or its environment) reported a reward."""

    session_id: str
    reward: float
    policy: str = ""
    """The policy this reward is for; empty: every policy of the session without a
    reward of its own."""
    step_rewards: list[float] = msgspec.field(default_factory=list)
    """The rewards an environment gave step by step (an OpenEnv episode's), kept with the
    session for export and analysis; ``reward`` is what training uses (the episode's
    return). Empty: the agent reported one reward only."""


FAILURE_PATTERN = r"^([a-z][a-z0-9_]{0,63})?$"
"""What a session's failure reason looks like: a short identifier (``env_timeout``), or
nothing (it did not fail)."""


class SessionFinished(Message, tag="traj.finished"):
    """rollout-gateway -> trajectory: the agent finished; the session becomes a sample."""

    session_id: str
    finished_at: float = msgspec.field(default_factory=time.time)
    failure: str = ""
    """Why the episode failed (``env_timeout``, ``env_error``, ``env_lost``: its
    environment did not answer, answered an error, or went away), reported by the agent
    runner; the sample is then dropped with this reason, whatever its turns and reward.
    Empty: it did not fail."""


class GroupClosed(Message, tag="traj.group_closed"):
    """trajectory -> trajectory (replayed on every start): group ``group_id`` made no
    progress for ``SF_TRAJECTORY_GROUP_TIMEOUT_S`` (e.g. its sessions were open on a
    gateway that restarted, or a claim's reply was lost). Every sample of it not
    finished yet is dropped (reason ``timed_out``); its session, if it opens or finishes
    later, is ignored. The group closes with the samples it has."""

    group_id: str
    task_id: str
    group_size: int
    closed_at: float = msgspec.field(default_factory=time.time)


TrajectoryEvent = SessionOpened | TurnRecorded | RewardReported | SessionFinished | GroupClosed


# tasks (agent runner <-> trajectory) ----------------------------------------------


class TaskClaim(Message, tag="task.claim"):
    """agent runner -> trajectory: give me one sample of a task to roll out."""

    runner_id: str
    claim_id: str = ""
    """Unique per claim. A runner that got no reply repeats the claim with the same id
    and gets the same assignment: a reply that was late or lost (the claim waited
    behind others, the service was slow under load) loses no sample. Empty: every
    request is a new claim."""


class TaskAssignment(Message, tag="task.assignment"):
    """trajectory -> agent runner: roll out sample ``sample_index`` of group ``group_id``."""

    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    messages: list[ChatMessage]
    reference: str
    reward_fn: str
    policy: str = DEFAULT_POLICY
    """The task's policy (the run's first): ``reward_fn`` scores its last answer."""
    min_version: int = 0
    """Serve this sample's calls to ``policy`` with weights of at least this version
    (0: any). Set in synchronous runs (``SF_TRAJECTORY_MAX_BATCHES_AHEAD=0``) to the
    version the trainer last published, so no token of the batch is generated on the
    weights before it while an engine is still loading the new ones."""


class NoTask(Message, tag="task.none"):
    """trajectory -> agent runner: nothing to do now (backpressure) or ever (exhausted)."""

    reason: Literal["backpressure", "exhausted"]
    retry_after_s: float = 0.2


# batches (trajectory -> trainer, JetStream) -------------------------------------


class TrainSample(msgspec.Struct, kw_only=True):
    """One trajectory as the trainer sees it: token ids exactly as the engine saw them.

    ``loss_mask[i] == 1`` iff token i was produced by the engine (trained on);
    ``behaviour_logprobs[i]``, ``versions[i]`` and ``temperatures[i]`` are meaningful only
    where the mask is 1 (0.0, -1 and 1.0 elsewhere).
    """

    session_id: str
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float
    temperatures: list[float] = msgspec.field(default_factory=list)
    """The temperature each token was sampled at (its turn's ``TurnRecorded.temperature``,
    0 = greedy), at which the trainer recomputes its logprob; ``UNRECORDED_TEMPERATURE``
    for a turn recorded without one. Empty: a sample made before samples carried
    temperatures (every token unrecorded)."""
    finish_reason: str = ""
    """Why the sample's last generation (the turn it ends at) ended:
    ``TurnRecorded.finish_reason`` (``stop``, or ``length`` when it reached its token
    budget). "": a sample made before samples carried it."""


class SampleGroup(msgspec.Struct, kw_only=True):
    """All samples of one task (a GRPO group)."""

    group_id: str
    task_id: str
    samples: list[TrainSample]


class ExportedSample(msgspec.Struct, kw_only=True):
    """One branch of a session's conversation tree, as the trainer would see it."""

    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    turn_indexes: list[int]
    """The turns whose completions lie on this branch (trained tokens)."""
    final: bool
    """True for the branch ending at the policy's last turn in the session (the one that
    is trained)."""
    reward: float | None = None
    policy: str = DEFAULT_POLICY
    """The policy whose turns this branch holds (one set of branches per policy used)."""
    temperatures: list[float] = msgspec.field(default_factory=list)
    """Per token, as ``TrainSample.temperatures``."""


class SessionExportQuery(Message, tag="traj.export_query"):
    """rollout-gateway / CLI -> trajectory (request): export a session's samples."""

    session_id: str


class SessionExport(Message, tag="traj.export"):
    """trajectory -> requester: every branch of a session, exact ids and versions."""

    session_id: str
    task_id: str
    finished: bool
    samples: list[ExportedSample]
    step_rewards: list[float] = msgspec.field(default_factory=list)
    """The environment's per-step rewards the agent reported (the last report's)."""
    failure: str = ""
    """Why the episode failed (``SessionFinished.failure``); empty if it did not."""


class TrainBatch(Message, tag="batch"):
    """trajectory -> trainer: one optimizer step's worth. Travels as the payload a
    BatchReady names (``seamlessflow.batches``); a trainer also takes one published
    whole on the batch subject (a small batch, as published before payloads existed)."""

    batch_index: int
    groups: list[SampleGroup]
    policy: str = DEFAULT_POLICY
    """The policy this batch trains (each policy has its own batch stream and indexes)."""
    created_at: float = msgspec.field(default_factory=time.time)


class SampleSummary(msgspec.Struct, array_like=True):
    """A sample of a batch, without its tokens."""

    session_id: str
    reward: float
    tokens: int


class GroupSummary(msgspec.Struct, kw_only=True):
    """A group of a batch, without its samples' tokens."""

    group_id: str
    task_id: str
    samples: list[SampleSummary]


class BatchPayload(msgspec.Struct, kw_only=True):
    """Where a batch's encoded ``TrainBatch`` is: chunk messages of the policy's batch
    payload stream, by stream sequence, in order."""

    encoding: str
    """``packed-msgpack-1`` (``seamlessflow.batches``)."""
    chunk_seqs: list[int]
    payload_bytes: int
    sha256: str


class BatchReady(Message, tag="batch.ready"):
    """trajectory -> trainer (JetStream, durable consumer): batch ``batch_index`` is
    complete in its payload stream (stored before this message exists). ``groups``
    names its groups and sessions: what a restarted trajectory service reads back,
    without the payloads."""

    batch_index: int
    groups: list[GroupSummary]
    payload: BatchPayload
    policy: str = DEFAULT_POLICY
    created_at: float = msgspec.field(default_factory=time.time)


class BatchProgress(Message, tag="batch.progress"):
    """trajectory -> tag-scheduler (core NATS): another group of the batch being formed
    is ready. A hint for the early reclaim (``SF_TAG_SCHEDULER_RECLAIM_EARLY_AT``): one
    that is lost only means the lent engines are taken back at the trainer's claim."""

    batch_index: int
    groups_ready: int
    groups_per_batch: int
    policy: str = DEFAULT_POLICY


class BatchFilterReport(Message, tag="data.batch"):
    """trajectory -> observers (JetStream): what the data filters did while batch
    ``batch_index`` was formed, counted from the previous batch on."""

    batch_index: int
    stage: str
    """The task source of the schedule stage this batch belongs to."""
    groups_kept: int
    samples_kept: int
    policy: str = DEFAULT_POLICY
    groups_dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Groups that never reach a batch, by reason (``zero_variance``, ``stale``,
    ``no_samples``); the dispatcher hands out one more group for each (a refill)."""
    samples_dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Samples left out, by reason (``stale``, ``zero_variance``, ``no_turns``,
    ``timed_out``...)."""
    groups_waived: dict[str, int] = msgspec.field(default_factory=dict)
    """Groups a filter would have dropped but let through, by reason
    (``zero_variance``: the refill cap of the batch was reached)."""
    dropped_samples: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """The samples counted in ``samples_dropped``, by reason: session ids, or
    ``<group_id>/<sample_index>`` for a sample whose session never opened. Each dropped
    sample is reported once, also across restarts of the trajectory service."""
    dropped_groups: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """The groups counted in ``groups_dropped``, by reason (reported once, likewise)."""


class EpochFilterReport(Message, tag="data.epoch"):
    """trajectory -> observers, and itself after a restart (JetStream): the prompt set an
    epoch dispatches. Recorded before the epoch's first group is handed out; a restarted
    trajectory service rebuilds every epoch's prompt order from these records."""

    stage: str
    stage_index: int
    epoch: int
    """Epoch number within the stage, from 0."""
    first_group: int
    """Dispatch index of the epoch's first group."""
    prompts: int
    """Prompts this epoch dispatches (one group each)."""
    kept: dict[str, int] = msgspec.field(default_factory=dict)
    """Prompts of the previous epoch that stay, by why (``mixed``, ``all_wrong``,
    ``unseen``: no complete group yet); empty for epoch 0."""
    dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Prompts of the previous epoch left out from now on, by reason (``all_correct``)."""
    dropped_task_ids: list[str] = msgspec.field(default_factory=list)
    kept_all: bool = False
    """Every prompt would have been dropped: the previous epoch's set was kept instead."""


# weights ----------------------------------------------------------------------------


class TensorSpec(msgspec.Struct, array_like=True):
    """One tensor of a weight set, at ``offset`` bytes into the flat state buffer."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix: ``bfloat16``, ``float32``..."""
    shape: list[int]
    offset: int


class DeltaEncoding(msgspec.Struct, kw_only=True):
    """How a delta payload is laid out: changed words, then their new values."""

    word_bytes: int
    """Comparison unit: the smallest element size of the weight set (2 for bf16)."""
    changed_words: int
    positions: Literal["indices", "bitmap"]
    """``indices``: uint32/uint64 word indices; ``bitmap``: one bit per word."""
    index_bytes: int = 4


class WeightManifest(msgspec.Struct, kw_only=True):
    """One weight payload: where it is, how to check it, what it turns into.

    ``full`` payloads are the flat state itself; a ``delta`` applies on top of exactly
    ``base_version``. Payloads move in buckets of ``bucket_bytes`` with one sha256 each;
    ``state_sha256`` is the digest of the resulting flat state (the sha256 of its bucket
    digests), checked after a delta is applied.
    """

    version: int
    kind: Literal["full", "delta"]
    base_version: int = 0
    transport: str
    """Pull store holding the payload: ``object`` (NATS Object Store) or ``shm``."""
    location: str
    payload_bytes: int
    bucket_bytes: int
    bucket_sha256: list[str]
    state_bytes: int
    state_sha256: str
    layout: list[TensorSpec]
    delta: DeltaEncoding | None = None


class WeightsPublished(Message, tag="weights.published"):
    """trainer -> weight-sync (JetStream): the payload of ``manifest.version`` is complete
    in its store (written before this message exists)."""

    manifest: WeightManifest
    step: int

    @property
    def version(self) -> int:
        return self.manifest.version


class CurrentVersionQuery(Message, tag="weights.query"):
    """engine worker -> weight-sync: which version should I serve?"""

    engine_id: str


class CurrentVersion(Message, tag="weights.current"):
    """weight-sync -> engine worker: the newest complete version (0 = the base model) and
    the chain that builds it: the latest full payload, then every delta after it."""

    version: int
    chain: list[WeightManifest] = msgspec.field(default_factory=list)


class WeightsGroupQuery(Message, tag="weights.group.query"):
    """engine worker -> trainer: how do I join the push group?"""

    rank: int


class WeightsGroupOffer(Message, tag="weights.group.offer"):
    """trainer -> engine worker: the push group's NCCL unique id and size."""

    unique_id: list[int]
    size: int


# trainer progress ---------------------------------------------------------------------


class TrainStepMetrics(Message, tag="train.metrics"):
    """trainer -> observers (JetStream): what one optimizer step did."""

    step: int
    version: int
    batch_index: int
    mean_reward: float
    loss: float
    clip_fraction: float
    samples: int
    tokens_generated: int
    tokens_trained: int
    max_staleness: int
    step_seconds: float
    wait_seconds: float
    publish_seconds: float
    staleness_histogram: dict[int, int] = msgspec.field(default_factory=dict)
    """Trained tokens by version gap (trained version - generating version)."""
    logprob_abs_diff: float = 0.0
    """Mean |trainer - behaviour| logprob over trained tokens."""
    truncated_fraction: float = 0.0
    """Fraction of trained tokens whose importance weight was truncated."""
    kl_mean: float = 0.0
    """Mean k3 KL to the reference model over trained tokens (0 without ``KL_COEF``)."""
    weights_kind: str = ""
    """``full`` or ``delta``: how this step's weights were sent."""
    weights_payload_bytes: int = 0
    """Bytes this version put on the wire (per receiver); the full state is
    ``weights_state_bytes``."""
    weights_state_bytes: int = 0
    lr: float = 0.0
    """The learning rate this step used (``SF_TRAINER_LR_SCHEDULE``); 0: not recorded."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping (``SF_TRAINER_MAX_GRAD_NORM``), over every
    rank's gradient."""
    reward_std: float = 0.0
    """Standard deviation of the batch's sample rewards (population: divided by the
    sample count), unshaped like ``mean_reward``."""
    reward_min: float = 0.0
    """Lowest sample reward of the batch."""
    reward_max: float = 0.0
    """Highest sample reward of the batch."""
    completion_tokens_mean: float = 0.0
    """Mean per sample of the tokens the policy generated and is trained on (loss mask
    1), summed over the turns of a multi-turn sample."""
    completion_tokens_max: int = 0
    """Most such tokens of one sample."""
    prompt_tokens_mean: float = 0.0
    """Mean per sample of the tokens the policy did not generate (loss mask 0): the
    prompt, and in a multi-turn sample the tool results and other context between its
    turns (a constrained-decoding turn, never trained, counts here too)."""
    entropy_mean: float = 0.0
    """Mean over trained tokens of the entropy (nats) of the policy's next-token
    distribution, at each token's sampling temperature (1 for greedy tokens, like their
    logprobs), under the weights the step started from."""
    mean_staleness: float = 0.0
    """Mean version gap of the trained tokens (``staleness_histogram``, token-weighted)."""
    completions_truncated_fraction: float = 0.0
    """Fraction of the samples whose last generation stopped at its token budget
    (``TrainSample.finish_reason`` ``length``); 0 for samples that do not say."""
    lent_thread_seconds: float = 0.0
    """Thread-seconds the step ran on cores lent by idle rollout engines (CoresLent),
    beyond the trainer's own threads."""
    policy: str = DEFAULT_POLICY
    timestamp: float = msgspec.field(default_factory=time.time)


class TrainEvalMetrics(Message, tag="train.eval"):
    """trainer -> observers (JetStream): the policy of one version evaluated on a task's
    held-out split (``SF_TRAINER_EVAL_EVERY``): greedy answers, mean reward."""

    step: int
    """Steps taken when evaluated (the step that published ``version``)."""
    version: int
    task: str
    split: str
    samples: int
    """Prompts evaluated, one greedy answer each."""
    mean_reward: float
    """Mean reward of the answers (the accuracy for a 0/1 reward)."""
    max_tokens: int
    eval_seconds: float
    policy: str = DEFAULT_POLICY
    timestamp: float = msgspec.field(default_factory=time.time)


class TrainingPlanned(Message, tag="train.plan"):
    """trainer -> trajectory and observers (JetStream), at each start: the policy's step
    budget (``SF_TRAINER_STEPS``), which the trajectory service dispatches for, and the
    run's seed (``SF_SEED``), which every service must share."""

    steps: int
    seed: int
    policy: str = DEFAULT_POLICY


class TrainingFinished(Message, tag="train.finished"):
    """trainer -> observers (JetStream): the run reached its step budget."""

    steps: int
    final_version: int
    checkpoint_dir: str
    policy: str = DEFAULT_POLICY


TrainProgress = TrainStepMetrics | TrainEvalMetrics | TrainingPlanned | TrainingFinished
"""Every message of ``Subjects.train_all()`` (a trainer's progress, for observers)."""


# tag scheduler ---------------------------------------------------------------------


Role = Literal["rollout", "train", "idle"]
Phase = Literal["rollout", "train", "sync", "idle"]


class ResourceRegister(Message, tag="sched.register"):
    """any resource -> tag-scheduler (request): I exist, with these capability tags."""

    resource_id: str
    kind: str
    tags: list[str]
    host: str = ""
    pid: int = 0
    slots: list[str] = msgspec.field(default_factory=list)
    """Physical slots (cores, GPUs) this process computes on; empty = its own id. An
    engine and a trainer sharing a slot are one resource in time: the timeline's lane."""


class RoleAssignment(Message, tag="sched.assignment"):
    """tag-scheduler -> resource (registration reply, or a request on the resource's
    assignment subject answered with RoleAck): the role it should play now."""

    resource_id: str
    role: Role
    reason: str
    min_version: int = 0
    """``rollout``: serve no older weight version than this (the version the trainer
    just published), even if weight-sync has not announced it yet."""


class RoleAck(Message, tag="sched.role_ack"):
    """resource -> tag-scheduler (reply to RoleAssignment): the role is in effect.

    An engine acks ``rollout`` once it serves the current weight version and takes
    requests; ``idle`` once it left the queue, handed its in-flight requests back for
    transparent resume and released its memory."""

    resource_id: str
    role: Role
    seconds: float
    """How long the transition took on the resource."""
    handed_back: int = 0
    """Requests in flight that were interrupted for re-submission elsewhere."""
    busy_s: float = 0.0
    """``idle`` after serving: seconds it had requests in flight since it last joined
    the generate queue (what lending it yielded)."""


class SlotsClaim(Message, tag="sched.claim"):
    """trainer -> tag-scheduler (request): a batch is ready; reclaim my lent slots."""

    trainer_id: str
    batch_index: int = -1
    policy: str = DEFAULT_POLICY
    """Whose slots: the scheduler lends and reclaims only engines tagged ``policy:<name>``."""


class SlotsGranted(Message, tag="sched.granted"):
    """tag-scheduler -> trainer: every lent engine on the training slots released them
    (or missed the deadline and is treated as gone)."""

    reclaimed: list[str]
    seconds: float
    missed: list[str] = msgspec.field(default_factory=list)


class CoresLent(Message, tag="sched.cores"):
    """tag-scheduler -> trainer (core, lossy: each message replaces the last): while it
    trains, the dedicated rollout engines on its host that have nothing to generate lend
    it their cores; it trains on ``threads`` more intra-op threads until the next
    message. Sent on every change (an engine going idle or busy, a claim, a release)."""

    trainer_id: str
    threads: int
    """Extra threads the trainer may run now (0: none; the cores went back)."""
    engines: list[str] = msgspec.field(default_factory=list)
    """The idle engines whose slots these are."""
    policy: str = DEFAULT_POLICY


class SlotsReleased(Message, tag="sched.released"):
    """trainer -> tag-scheduler (request): the step's weights are published; I wait."""

    trainer_id: str
    version: int
    policy: str = DEFAULT_POLICY


class LendReport(Message, tag="sched.lend"):
    """tag-scheduler -> trainer: what the policy decided for the wait that starts now."""

    lent: list[str]
    reason: str
    expected_wait_s: float | None
    """The trainer's expected wait with dedicated engines alone; None = unbounded."""
    gain_s: float | None
    cost_s: float


class Heartbeat(Message, tag="sched.heartbeat"):
    """resource -> tag-scheduler (core, lossy): still alive; current phase and load."""

    resource_id: str
    phase: Phase = "idle"
    in_flight: int = 0
    version: int = 0
    sent_at: float = msgspec.field(default_factory=time.time)
    leaving: bool = False
    """The last beat of a process that stops cleanly: the tag-scheduler retires it now
    (a "left" line, not a "missed heartbeats" warning ``dead_after_s`` later)."""


class PhaseChanged(Message, tag="sched.phase"):
    """tag-scheduler -> observers: a resource changed phase, or was declared dead."""

    resource_id: str
    phase: Phase | Literal["dead"]
    at: float = msgspec.field(default_factory=time.time)


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
