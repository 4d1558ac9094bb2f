"""Trajectory events and session export: what the gateway records of each agent session.

Sessions open, record turns (the exact ids an engine consumed and produced), get rewards
and finish; the trajectory service closes groups that stalled. All of them are stored in
the run's trajectory stream, from which the trajectory service (and a restarted gateway)
rebuilds; a session's samples can be exported on request.
"""

from __future__ import annotations

import time

import msgspec

from seamlessflow.protocol.base import DEFAULT_POLICY, Message


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
    tool_call_errors: list[str] = msgspec.field(default_factory=list)
    """One kind per tool call the answer wrote malformed (``invalid_json``,
    ``invalid_arguments``, ``no_name``, ``unknown_tool``; the gateway's tool parsers say
    which). The turn is recorded and trained as any other: the model wrote it, and the
    reward says what it was worth; these count it in the batch reports."""

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
    progress for ``SF_GROUP_TIMEOUT_S`` (e.g. its sessions were open on a
    gateway that restarted, or a claim's reply was lost). Every sample of it not
    finished yet is dropped (reason ``timed_out``); its session, if it opens or finishes
    later, is ignored. The group closes with the samples it has."""

    group_id: str
    task_id: str
    group_size: int
    closed_at: float = msgspec.field(default_factory=time.time)


TrajectoryEvent = SessionOpened | TurnRecorded | RewardReported | SessionFinished | GroupClosed


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
    tool_call_errors: dict[str, int] = msgspec.field(default_factory=dict)
    """The malformed tool calls of its turns, by kind (``TurnRecorded.tool_call_errors``)."""
