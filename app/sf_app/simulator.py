"""Discrete-event simulator: the production scheduling policy on virtual time.

``seamlessflow simulate`` runs this. The decisions (which engine serves, which engine
is lent while the trainer waits, when it is taken back) are made by
:class:`sf_tag_scheduler.policy.TagPolicy`, the very object the live tag-scheduler
uses, called with ``now`` = virtual time; the simulator only models durations and
does the bookkeeping the services do around the policy (dispatch, batching, weight
sync). Every duration here is **modeled, not measured**, unless ``--from-run``
calibrates it from a run's ``summary.json`` (:func:`calibrate_from_run`).

The cluster and the deployments
-------------------------------------
``G`` GPUs ("slots"), each hosting at most one engine (one resource,
``ResourceView(slots=(slot,))``). The first ``T`` slots are training slots; the trainer
is one resource sharded over them. A deployment is only tags, a policy mode and the
rollout pacing (:class:`Deployment`); the mechanics below never branch on it:

- ``colocated``: ``T = G``; every slot's engine is tagged ``{train, rollout}``
  (lendable); mode ``colocated`` (always lend); ``max_batches_ahead = 0``.
- ``disaggregated``: ``T < G`` trains, no engine on training slots, the other
  slots' engines are tagged ``{rollout}``; mode ``disaggregated``; one batch ahead.
- ``multiplexed``: as disaggregated, plus a lendable ``{train, rollout}`` engine on each
  training slot; mode ``multiplexed`` (lend at every wait); one batch ahead.
- ``auto``: laid out as multiplexed; mode ``auto`` (lend while it measures more steps/s
  with lending than without: ``sf_tag_scheduler.when_pays``); one batch ahead.

What happens (mirroring the services)
-------------------------------------
- Dispatch (``sf_trajectory.dispatch``): groups of ``group_size`` samples; group ``k``
  is dispatched once ``k // groups_per_step <= trained_batches + max_batches_ahead``.
  Agents are never the bottleneck (every dispatched sample has an agent).
- Batching (``sf_trajectory.grouping``): a group is ready when all its samples are; a
  batch is the first ``groups_per_step`` ready groups, in completion order. Batch ``b``
  is trained by version ``b``; a sample whose first token is more than ``max_staleness``
  versions older is dropped as stale (a group left empty is dropped and the batch
  refilled from later groups), exactly like ``Grouper.take_batch``.
- Engines (continuous batching): an engine decodes up to ``max_concurrency`` sequences;
  one decode iteration takes ``base + per_seq x active`` seconds and gives every active
  sequence one token (:class:`EngineModel`). Prefill (a new prompt, a resumed partial, a
  tool result) stalls the engine for ``tokens / prefill_tokens_per_s``. Routing is the
  gateway's: every request (a new sample, an agent's next turn, a resumed partial) goes
  to a random serving engine (the NATS queue group ``engines``) that has room, else
  waits in one queue, resumed partials first. A turn that lands on the engine of its
  previous turn prefills only the tool result (prefix cache), elsewhere its whole
  context. When lent engines start serving, the policy's ``shed_plan`` moves the most
  recently started in-flight sequences of the busiest engines onto them, up to the
  mean load (``rebalance_on_lend``, the tag-scheduler's ``engine.shed`` requests).
- Trainer (``sf_trainer``): on a ready batch it claims its slots
  (``policy.trainer_claims``); every lent engine is reclaimed: its in-flight sequences
  keep their tokens and go back to the queue (partial rollout: they are resumed by
  another engine after prefilling prompt + partial); the trainer starts ``reclaim_s``
  later. A step takes ``batch tokens / (train_tokens_per_s_per_gpu x T) + overhead``;
  then the weights are published (``sync_s`` on the training slots); every serving
  engine loads them in place (in-flight sequences keep going on the new version): the
  payloads arrive while it decodes and it pauses only for the swap (``swap_s``;
  ``overlap_weight_sync=False``: a ``sync_s`` pause). Then the trainer waits
  (``policy.trainer_waiting``) and each engine the policy lends serves after
  ``lend_in_s`` (wake + catch up to the current version).
  With ``reclaim_early_at`` < 1 the lent engines are taken back once that share of the
  next batch's groups is ready (``policy.trainer_prepares``): the reclaim overlaps the
  end of rollout, and training starts at the claim or when the reclaim ends, whichever
  is later. ``lend_shares`` lets a block of waits lend part of the lendable engines.
- Pacing counts a batch as trained once its weights are published.

Measures
--------
Like ``sf_app.timeline``: a slot is busy while some process on it works: an
engine with at least one sequence (decoding or prefilling), an engine loading weights
or switching (lend-in, reclaim), the trainer training or publishing (phases
``rollout | train | sync``); otherwise it is idle. The window runs from the first to the
last moment any slot works (the run ends when the last step's weights are published);
``bubble_ratio = idle slot-time / (G x window)``. Switch and sync time counts as busy
(overhead, not bubble). Throughput counts only *trained* tokens and samples: tokens of
dropped (stale) samples and work still in flight when the run ends are *untrained*
(the latter is an end effect of running ahead: a longer run would train it).
Staleness is token-weighted (trained version - version that generated each token), as
``staleness_histogram`` in the trainer's metrics.

Algorithm: an exact event-driven simulation (no ticks). All sequences on an engine
advance at one shared rate, so each engine keeps a token clock ``tau`` (tokens produced
per active sequence so far) and a heap of the clock values at which its sequences end;
only the earliest end is an event. Cost per sequence: O(log n). Engines are homogeneous
and the workload is drawn from one seeded ``random.Random`` in dispatch order, so every
deployment sees the same samples and the same seed gives the same figures.

Default durations (:data:`SINGLE_TURN`, :data:`AGENTIC`, :class:`EngineModel`,
:class:`TrainerModel`, :class:`SwitchModel`) stand for a 7B-class model in bf16 on
H100-class GPUs, one engine per GPU; they are plausible round numbers, not measurements.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import json
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sf_tag_scheduler.policy import Mode, PolicyConfig, ResourceView, TagPolicy

# ---------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class WorkloadModel:
    """What rollout has to produce for one step (modeled)."""

    samples_per_gpu: int = 32
    """Samples per step per GPU: a step is ``samples_per_gpu x G`` samples (weak scaling:
    RL recipes grow the batch with the cluster, so per-GPU work is equal at every G)."""
    group_size: int = 8
    """Samples per prompt (a GRPO group); a group is ready when all its samples are."""
    prompt_tokens: int = 512
    """Prompt length."""
    response_mean_tokens: float = 2048.0
    """Mean length of one assistant turn before the cap (lognormal)."""
    response_sigma: float = 1.0
    """Lognormal shape of a turn's length: the long tail. 1.0: median 0.61 x mean,
    p99 6.2 x mean."""
    max_tokens: int = 16384
    """Cap on one turn (the sampling ``max_tokens``)."""
    turns: tuple[int, int] = (1, 1)
    """Assistant turns per sample, uniform in ``[low, high]``."""
    tool_latency_mean_s: float = 0.0
    """Mean time a tool call (environment step) takes between turns; lognormal. It
    occupies no GPU: the sequence leaves its engine meanwhile."""
    tool_latency_sigma: float = 1.0
    """Lognormal shape of the tool latency."""
    tool_timeout_s: float = 120.0
    """Tool calls are cut off here (environments time commands out)."""
    tool_output_tokens: int = 0
    """Tokens a tool result adds to the context (prefilled, trained but masked out)."""

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    def groups_per_step(self, gpus: int) -> int:
        return max(1, self.samples_per_gpu * gpus // self.group_size)


SINGLE_TURN = WorkloadModel()
"""Long chain-of-thought answers (math/code RL): one turn, mean 2048 tokens, cap 16k."""

AGENTIC = WorkloadModel(
    samples_per_gpu=16,
    prompt_tokens=1024,
    response_mean_tokens=384.0,
    max_tokens=4096,
    turns=(2, 12),
    tool_latency_mean_s=8.0,
    tool_output_tokens=384,
)
"""A tool-using agent (SWE-style): 2-12 turns of ~384 tokens (cap 4096), 8 s mean tool
latency (lognormal, cut at 120 s), 384 tokens of tool output per call."""

WORKLOADS: dict[str, WorkloadModel] = {"single-turn": SINGLE_TURN, "agentic": AGENTIC}


@dataclass(frozen=True)
class EngineModel:
    """One inference engine on one GPU, continuous batching (modeled).

    A decode iteration with ``a`` active sequences takes ``base + per_seq x a`` seconds
    and gives each one token: memory-bound (``base``: reading the weights) plus a cost
    per sequence (its KV cache). The two rates below fix ``base`` and ``per_seq``.
    """

    max_concurrency: int = 128
    """Sequences one engine decodes at once; more wait in the queue."""
    decode_tokens_per_s_alone: float = 100.0
    """Tokens/s of a single sequence on an otherwise idle engine."""
    decode_tokens_per_s_full: float = 3000.0
    """Tokens/s of the whole engine at ``max_concurrency`` sequences."""
    prefill_tokens_per_s: float = 40000.0
    """Prefill rate; prefill stalls the engine's decoding."""

    @property
    def per_seq_s(self) -> float:
        c = self.max_concurrency
        if c == 1:
            return 0.0
        return (c / self.decode_tokens_per_s_full - 1 / self.decode_tokens_per_s_alone) / (c - 1)

    @property
    def base_s(self) -> float:
        return 1 / self.decode_tokens_per_s_alone - self.per_seq_s

    def validate(self) -> None:
        if self.per_seq_s < 0 or self.base_s < 0:
            raise ValueError(
                "need decode_tokens_per_s_alone <= decode_tokens_per_s_full <= "
                "max_concurrency x decode_tokens_per_s_alone"
            )


@dataclass(frozen=True)
class TrainerModel:
    """The trainer, data-parallel over the training slots (modeled)."""

    train_tokens_per_s_per_gpu: float = 4000.0
    """Tokens/s per GPU over every token of a sample (prompt, responses, tool results):
    forward + backward + the logprob recomputation (~40% MFU for 7B on an H100)."""
    step_overhead_s: float = 2.0
    """Fixed cost per step (optimizer, gradient all-reduce tail, bookkeeping)."""
    model_bytes: float = 15.2e9
    """Weights sent per version (7.6B parameters in bf16)."""
    sync_bytes_per_s: float = 25e9
    """Trainer -> engines bandwidth (NCCL broadcast)."""
    sync_latency_s: float = 0.5
    """Fixed cost per version (gather, announce, load into the engine)."""

    swap_s: float = 0.3
    """With ``overlap_weight_sync``: the pause of a serving engine while it swaps in a
    version whose payloads arrived as it decoded (an in-place copy of the weights)."""

    @property
    def sync_s(self) -> float:
        """Publishing one version (training slots) and loading it (each engine)."""
        return self.model_bytes / self.sync_bytes_per_s + self.sync_latency_s


@dataclass(frozen=True)
class SwitchModel:
    """The cost of moving a training slot between roles (modeled; the policy measures it
    through ``observe_lend`` / ``observe_reclaim``)."""

    lend_in_s: float = 5.0
    """Lent engine: wake, reload weights and KV cache, catch up to the current version."""
    reclaim_s: float = 3.0
    """Reclaim: hand in-flight requests back, free the engine's memory, trainer state
    back on the GPU. The trainer starts this much after its claim."""


# ---------------------------------------------------------------------------------- deployments


@dataclass(frozen=True)
class Deployment:
    """Tags + policy mode + rollout pacing: nothing else differs between deployments."""

    name: str
    mode: Mode
    train_fraction: float
    """Share of slots that train (``1.0``: all of them, time-shared with rollout)."""
    engines_on_train_slots: bool
    """Put an engine tagged ``{train, rollout}`` (lendable) on each training slot."""
    max_batches_ahead: int
    """Rollout may run this many batches ahead of training (0: synchronous)."""

    def train_slots(self, gpus: int) -> int:
        if self.train_fraction >= 1.0:
            return gpus
        # at least one training slot and, without lendable engines, one rollout slot
        high = gpus if self.engines_on_train_slots else gpus - 1
        return min(max(1, round(self.train_fraction * gpus)), high)

    def resources(self, gpus: int) -> list[ResourceView]:
        """The trainer and the engines, as the services would register them."""
        slots = [f"gpu{i:04d}" for i in range(gpus)]
        training = slots[: self.train_slots(gpus)]
        views = [ResourceView("trainer", "trainer", frozenset({"train"}), tuple(training))]
        for index, slot in enumerate(slots):
            on_training_slot = index < len(training)
            if on_training_slot and not self.engines_on_train_slots:
                continue
            tags = {"train", "rollout"} if on_training_slot else {"rollout"}
            views.append(ResourceView(f"engine-{slot}", "engine", frozenset(tags), (slot,)))
        return views


COLOCATED = Deployment("colocated", "colocated", 1.0, True, 0)


def disaggregated(train_fraction: float, batches_ahead: int = 1) -> Deployment:
    return Deployment("disaggregated", "disaggregated", train_fraction, False, batches_ahead)


def multiplexed(train_fraction: float, batches_ahead: int = 1) -> Deployment:
    return Deployment("multiplexed", "multiplexed", train_fraction, True, batches_ahead)


def auto(train_fraction: float, batches_ahead: int = 1) -> Deployment:
    return Deployment("auto", "auto", train_fraction, True, batches_ahead)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run: a cluster, a deployment, a workload and the duration models."""

    gpus: int = 8
    """Cluster size G (slots)."""
    steps: int = 20
    """Optimizer steps; the run ends when the last one's weights are published."""
    seed: int = 0
    """Seeds the workload (response lengths, turns, tool latencies) and the routing."""
    deployment: Deployment = COLOCATED
    workload: WorkloadModel = SINGLE_TURN
    engine: EngineModel = EngineModel()
    trainer: TrainerModel = TrainerModel()
    switch: SwitchModel = SwitchModel()
    lend_margin: float = PolicyConfig.lend_margin
    """Passed to the policy (``PolicyConfig.lend_margin``)."""
    max_staleness: int | None = 4
    """Drop samples whose first token is more than this many versions older than the
    batch (the trajectory service's ``SF_TRAJECTORY_MAX_STALENESS``); None: never."""
    rebalance_on_lend: bool = True
    """As the product does (``TagPolicy.shed_plan``, sent by the tag-scheduler once lent
    engines serve): move the most recently started in-flight sequences of the busiest
    engines onto a freshly lent one (partial rollout: tokens kept, prompt + partial
    prefilled there). False: a lent engine only gets work that arrives after it joined
    (the product before rebalancing was built; for comparison)."""
    lend_shares: tuple[float, ...] = PolicyConfig.lend_shares
    """Passed to the policy (``PolicyConfig.lend_shares``): the shares of the lendable
    engines a block of waits may lend; ``(0.5, 1.0)``: half or all."""
    reclaim_early_at: float = 1.0
    """Take lent engines back once this share of the next batch's groups is ready,
    while the trainer still waits (``TagPolicy.trainer_prepares``), so the reclaim
    overlaps the end of rollout; 1.0: at the claim, on the trainer's critical path."""
    overlap_weight_sync: bool = True
    """A serving engine keeps decoding while a new version's payloads arrive and pauses
    only for the swap (``TrainerModel.swap_s``), as the engine worker does (payloads are
    fetched and checked while it serves); False: it pauses for the whole ``sync_s``
    (the simulator before 2026-11-25). The pause is placed at the publish; where it
    falls within the transfer changes no throughput, only which version a few tokens
    are counted on."""
    bounded_dispatch: bool = False
    """Dispatch exactly ``steps`` batches' worth of groups (the budget a trainer announces)
    instead of dispatching for as long as training goes on. With stale drops the last
    batch may then never fill (the simulation raises)."""

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            mode=self.deployment.mode,
            lend_margin=self.lend_margin,
            lend_shares=self.lend_shares,
        )


@dataclass(frozen=True)
class SimResult:
    deployment: str
    train_fraction: float
    gpus: int
    train_gpus: int
    steps: int
    window_s: float
    """First to last moment any slot works."""
    trained_samples: int
    trained_tokens: int
    """Generated tokens of trained samples (what ``tokens_trained`` counts)."""
    decoded_tokens: float
    """Every token the engines decoded, trained or not."""
    dropped_samples: int
    dropped_tokens: int
    bubble_ratio: float
    mean_staleness: float
    """Token-weighted: trained version - generating version."""
    max_staleness: int
    interrupted: int
    """Sequences moved off a reclaimed engine (partial rollout)."""
    mean_trainer_wait_s: float
    lends: int
    reclaims: int
    declined: int

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.window_s if self.window_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.trained_samples / self.window_s if self.window_s > 0 else 0.0

    @property
    def untrained_fraction(self) -> float:
        """Decoded tokens that were never trained (stale, or in flight at the end)."""
        if self.decoded_tokens <= 0:
            return 0.0
        return max(0.0, 1 - self.trained_tokens / self.decoded_tokens)


# ---------------------------------------------------------------------------------- state

_ENGINE, _TOOL_DONE, _LEND_READY, _TRAIN_START, _TRAIN_DONE, _PUBLISHED = range(6)
_TOKEN_EPSILON = 1e-6


class _Sample:
    __slots__ = (
        "cached_on",
        "context",
        "dropped",
        "first_version",
        "generated",
        "group",
        "remaining",
        "seg_tau",
        "seg_version",
        "tool_latencies",
        "trained",
        "turn",
        "turn_tokens",
        "version_tokens",
    )

    def __init__(self, group: _Group, turn_tokens: list[int], tool_latencies: list[float]):
        self.group = group
        self.turn_tokens = turn_tokens
        self.tool_latencies = tool_latencies
        self.turn = 0
        self.remaining = float(turn_tokens[0])
        """Tokens left in the current turn."""
        self.context = 0
        """Tokens in the context besides the current turn's (prompt, turns, tool results)."""
        self.generated = 0
        self.cached_on = -1
        """The engine whose KV cache holds this context (-1: none)."""
        self.first_version = -1
        self.version_tokens = 0.0
        """Sum over generated tokens of the version that generated each."""
        self.seg_tau = 0.0
        self.seg_version = 0
        self.trained = 0
        """Times trained (the conservation invariant: at most once)."""
        self.dropped = False


class _Group:
    __slots__ = ("done", "samples")

    def __init__(self) -> None:
        self.samples: list[_Sample] = []
        self.done = 0


class _Engine:
    __slots__ = (
        "busy",
        "clock",
        "decoding_since",
        "index",
        "lend_stamp",
        "lend_started",
        "lending_in",
        "resource_id",
        "room_at",
        "running",
        "serving",
        "slot",
        "stall_until",
        "stamp",
        "tau",
        "version",
    )

    def __init__(self, index: int, view: ResourceView) -> None:
        self.index = index
        self.resource_id = view.resource_id
        self.slot = view.slots[0]
        self.serving = False
        self.lending_in = False
        self.lend_started = 0.0
        self.lend_stamp = 0
        """Bumped on every lend and reclaim; an older lend-in event is stale."""
        self.version = 0
        self.tau = 0.0
        """Token clock: tokens each active sequence has gained since the engine started."""
        self.clock = 0.0
        """Virtual time up to which ``tau`` is accounted."""
        self.stall_until = 0.0
        """Prefill or weight loading: no decoding before this time."""
        self.running: list[tuple[float, int, _Sample]] = []
        """Heap of (tau at which the sequence's turn ends, tie-break, sequence)."""
        self.stamp = 0
        """Bumped on every change; older events and load entries are stale."""
        self.room_at = -1
        """Position in the simulation's list of engines with room (-1: not in it)."""
        self.decoding_since: float | None = None
        self.busy: list[tuple[float, float]] = []


class Simulation:
    """One deployment, one cluster size, one seed. ``run()`` once."""

    def __init__(self, config: SimConfig) -> None:
        config.engine.validate()
        self.config = config
        self.policy = TagPolicy(config.policy_config())
        self.workload = config.workload
        self.groups_per_step = config.workload.groups_per_step(config.gpus)
        self.rng = random.Random(config.seed)
        # lognormal with a given mean m and shape sigma: mu = ln(m) - sigma^2 / 2
        workload = config.workload
        self.length_mu = math.log(workload.response_mean_tokens) - workload.response_sigma**2 / 2
        self.tool_mu = (
            math.log(workload.tool_latency_mean_s) - workload.tool_latency_sigma**2 / 2
            if workload.tool_latency_mean_s > 0
            else 0.0
        )
        self.engines: list[_Engine] = []
        self.trainer_slots: tuple[str, ...] = ()
        for view in config.deployment.resources(config.gpus):
            decision = self.policy.add(view)
            if view.kind == "trainer":
                if decision.role != "train":
                    raise ValueError(f"the trainer got role {decision.role!r}: {decision.reason}")
                self.trainer_slots = view.slots
            else:
                engine = _Engine(len(self.engines), view)
                engine.serving = decision.role == "rollout"
                self.engines.append(engine)
        self.by_id = {e.resource_id: e for e in self.engines}
        self.base_s = config.engine.base_s
        self.per_seq_s = config.engine.per_seq_s
        self.capacity = config.engine.max_concurrency
        self.prefill_tokens_per_s = config.engine.prefill_tokens_per_s
        self.with_room: list[_Engine] = []
        """Serving engines below ``max_concurrency``: the queue group's members."""
        self.route_rng = random.Random(f"{config.seed}-routing")
        """Its own stream, so every deployment draws the same workload from ``rng``."""
        self.changed: dict[int, _Engine] = {}
        """Engines changed by the current event (ordered: deterministic)."""

        self.now = 0.0
        self.events: list[tuple[float, int, int, Any, int]] = []
        self.tiebreak = itertools.count()
        self.pending: deque[_Sample] = deque()
        self.next_group = 0
        self.ready: list[_Group] = []
        self.batches: deque[tuple[int, list[_Group]]] = deque()
        self.next_batch_index = 0
        self.trained_batches = 0
        self.version = 0
        self.trainer_waiting_since: float | None = None
        self.trainer_intervals: list[tuple[float, float]] = []
        self.waits: list[float] = []
        self.reclaimed_at = 0.0
        """When the last reclaim frees its slots (the trainer cannot start before)."""

        self.decoded_tokens = 0.0
        self.trained_samples = 0
        self.trained_tokens = 0
        self.dropped_samples = 0
        self.dropped_tokens = 0
        self.staleness_tokens = 0.0
        self.max_staleness_seen = 0
        self.interrupted = 0
        self.dispatched: list[_Sample] = []
        """Every sample, in dispatch order (for conservation checks)."""
        self.finished = False

    # ------------------------------------------------------------------ the event loop

    def run(self) -> SimResult:
        for engine in self.engines:
            self._touch(engine)  # file the serving ones as having room
        self._dispatch()
        self._trainer_waits()
        self._settle()
        while not self.finished:
            if not self.events:
                raise RuntimeError(
                    f"simulation stalled at t={self.now:.1f}s: step {self.trained_batches}"
                    f" of {self.config.steps}, {len(self.pending)} sequences queued"
                )
            time, _, kind, subject, stamp = heapq.heappop(self.events)
            self.now = time
            if kind == _ENGINE:
                engine = self.engines[subject]
                if stamp == engine.stamp:
                    self._on_engine(engine)
            elif kind == _TOOL_DONE:
                subject.context += self.workload.tool_output_tokens
                self._route(subject)
            elif kind == _LEND_READY:
                engine = self.engines[subject]
                if stamp == engine.lend_stamp and engine.lending_in:
                    self._lend_ready(engine)
            elif kind == _TRAIN_START:
                self._train()
            elif kind == _TRAIN_DONE:
                self._publish()
            elif kind == _PUBLISHED:
                self._published()
            # Route and claim once per instant, after every event at this time: engines
            # lent together join the queue group together (not one after the other).
            simultaneous = self.events and self.events[0][0] <= time
            if not simultaneous and (self.pending or self.batches or self.changed):
                self._settle()
        return self._result()

    def _at(self, time: float, kind: int, subject: Any = None, stamp: int = 0) -> None:
        heapq.heappush(self.events, (time, next(self.tiebreak), kind, subject, stamp))

    def _settle(self) -> None:
        """After the events of an instant: fill free engine capacity, let a waiting
        trainer claim a formed batch, schedule the engines that changed."""
        while self.pending and self.with_room:
            self._start(self.pending.popleft(), self._any_with_room())
        if self.trainer_waiting_since is not None and self.batches:
            self._claim()
            while self.pending and self.with_room:  # sequences handed back by the reclaim
                self._start(self.pending.popleft(), self._any_with_room())
        self._schedule_changed()

    # ------------------------------------------------------------------ dispatch and batching

    def _dispatch(self) -> None:
        """``Dispatcher.claim``: groups as far ahead as the pacing allows."""
        ahead = self.config.deployment.max_batches_ahead
        limit = self.config.steps * self.groups_per_step if self.config.bounded_dispatch else None
        while self.next_group // self.groups_per_step <= self.trained_batches + ahead:
            if limit is not None and self.next_group >= limit:
                return
            self.next_group += 1
            group = _Group()
            for _ in range(self.workload.group_size):
                sample = self._draw_sample(group)
                group.samples.append(sample)
                self.dispatched.append(sample)
                self.pending.append(sample)

    def _draw_sample(self, group: _Group) -> _Sample:
        w, rng = self.workload, self.rng
        low, high = w.turns
        turns = low if low == high else rng.randint(low, high)
        exp, gauss = math.exp, rng.gauss
        tokens = [
            min(w.max_tokens, max(1, round(exp(gauss(self.length_mu, w.response_sigma)))))
            for _ in range(turns)
        ]
        if w.tool_latency_mean_s > 0:
            latencies = [
                min(w.tool_timeout_s, exp(gauss(self.tool_mu, w.tool_latency_sigma)))
                for _ in range(turns - 1)
            ]
        else:
            latencies = [0.0] * (turns - 1)
        sample = _Sample(group, tokens, latencies)
        sample.context = w.prompt_tokens
        return sample

    def _sample_done(self, sample: _Sample) -> None:
        group = sample.group
        group.done += 1
        if group.done < len(group.samples):
            return
        self.ready.append(group)
        early = self.config.reclaim_early_at
        if (
            early < 1.0
            and self.trainer_waiting_since is not None
            and self.policy.lent
            and not self.batches
            and len(self.ready) >= math.ceil(early * self.groups_per_step)
        ):
            self._prepare()
        # ``Grouper.take_batch``: form every batch the ready groups allow, in order
        per_batch = self.groups_per_step
        while len(self.ready) >= per_batch:
            candidate, rest = self.ready[:per_batch], self.ready[per_batch:]
            fresh = [g for g in (self._drop_stale(g) for g in candidate) if g.samples]
            if len(fresh) == per_batch:
                self.ready = rest
                self.batches.append((self.next_batch_index, fresh))
                self.next_batch_index += 1
            else:
                self.ready = fresh + rest

    def _drop_stale(self, group: _Group) -> _Group:
        bound = self.config.max_staleness
        if bound is None:
            return group
        kept = []
        for sample in group.samples:
            if self.next_batch_index - sample.first_version > bound:
                self.dropped_samples += 1
                self.dropped_tokens += sample.generated
                sample.dropped = True
            else:
                kept.append(sample)
        group.samples = kept
        return group

    # ------------------------------------------------------------------ engines

    def _advance(self, engine: _Engine) -> None:
        """Bring the engine's token clock to ``now`` (decoding happens only after its
        stall ends)."""
        now, running = self.now, engine.running
        if running:
            start = engine.clock if engine.clock > engine.stall_until else engine.stall_until
            if now > start:
                active = len(running)
                gained = (now - start) / (self.base_s + self.per_seq_s * active)
                engine.tau += gained
                self.decoded_tokens += gained * active
        engine.clock = now

    def _touch(self, engine: _Engine) -> None:
        """The engine changed: its pending end event is stale (a new one is scheduled
        once the current event is handled: many changes at one instant, one event), and
        its load is refiled at once (routing reads it)."""
        engine.stamp += 1
        self.changed[engine.index] = engine
        room = engine.serving and len(engine.running) < self.capacity
        if room == (engine.room_at >= 0):
            return
        with_room = self.with_room
        if room:
            engine.room_at = len(with_room)
            with_room.append(engine)
        else:  # swap-remove
            last = with_room.pop()
            if last is not engine:
                with_room[engine.room_at] = last
                last.room_at = engine.room_at
            engine.room_at = -1

    def _schedule_changed(self) -> None:
        """Schedule the next sequence end of every engine changed by this event."""
        now, base_s, per_seq_s = self.now, self.base_s, self.per_seq_s
        events, tiebreak, push = self.events, self.tiebreak, heapq.heappush
        for engine in self.changed.values():
            running = engine.running
            if running:
                start = now if now > engine.stall_until else engine.stall_until
                left = running[0][0] - engine.tau
                iteration_s = base_s + per_seq_s * len(running)
                end = start + (left if left > 0 else 0.0) * iteration_s
                push(events, (end, next(tiebreak), _ENGINE, engine.index, engine.stamp))
        self.changed.clear()

    def _any_with_room(self) -> _Engine:
        """The production routing: a NATS queue group hands a request to any member."""
        return self.with_room[int(self.route_rng.random() * len(self.with_room))]

    def _route(self, sample: _Sample) -> None:
        if self.with_room:
            self._start(sample, self._any_with_room())
        else:
            self.pending.append(sample)

    def _start(self, sample: _Sample, engine: _Engine) -> None:
        self._advance(engine)
        prefill: float
        if sample.cached_on == engine.index:  # its previous turn ran here: prefix cached
            prefill = self.workload.tool_output_tokens
        else:  # the whole context, with the tokens of this turn generated so far
            prefill = sample.context + sample.turn_tokens[sample.turn] - sample.remaining
        stall_from = self.now if self.now > engine.stall_until else engine.stall_until
        engine.stall_until = stall_from + prefill / self.prefill_tokens_per_s
        sample.seg_tau = engine.tau
        sample.seg_version = engine.version
        if not engine.running:
            engine.decoding_since = self.now
        heapq.heappush(engine.running, (engine.tau + sample.remaining, next(self.tiebreak), sample))
        self._touch(engine)

    def _close_segment(self, sample: _Sample, tokens: float) -> None:
        """``tokens`` of ``sample`` were generated by its segment's version."""
        if tokens > _TOKEN_EPSILON and sample.first_version < 0:
            sample.first_version = sample.seg_version
        sample.version_tokens += tokens * sample.seg_version

    def _on_engine(self, engine: _Engine) -> None:
        self._advance(engine)
        running = engine.running
        while running and running[0][0] <= engine.tau + _TOKEN_EPSILON:
            end, _, sample = heapq.heappop(running)
            self._close_segment(sample, end - sample.seg_tau)
            self._turn_done(sample, engine)
        if not running:
            self._stop_decoding(engine)
        self._touch(engine)

    def _stop_decoding(self, engine: _Engine) -> None:
        if engine.decoding_since is not None:
            engine.busy.append((engine.decoding_since, self.now))
            engine.decoding_since = None

    def _turn_done(self, sample: _Sample, engine: _Engine) -> None:
        tokens = sample.turn_tokens[sample.turn]
        sample.generated += tokens
        sample.context += tokens
        sample.turn += 1
        if sample.turn < len(sample.turn_tokens):
            sample.remaining = float(sample.turn_tokens[sample.turn])
            sample.cached_on = engine.index
            self._at(self.now + sample.tool_latencies[sample.turn - 1], _TOOL_DONE, sample)
        else:
            sample.remaining = 0.0
            self._sample_done(sample)

    # ------------------------------------------------------------------ lending

    def _trainer_waits(self) -> None:
        """``sf_trainer``: released its slots; the policy lends what pays."""
        plan = self.policy.trainer_waiting(self.now)
        self.trainer_waiting_since = self.now
        lend_in = self.config.switch.lend_in_s
        for resource_id in plan.lend:
            engine = self.by_id[resource_id]
            engine.lending_in = True
            engine.lend_started = self.now
            engine.lend_stamp += 1
            self._at(self.now + lend_in, _LEND_READY, engine.index, engine.lend_stamp)

    def _lend_ready(self, engine: _Engine) -> None:
        engine.lending_in = False
        engine.busy.append((engine.lend_started, self.now))
        engine.serving = self.policy.role_of(engine.resource_id).role == "rollout"
        engine.version = self.version  # caught up while waking
        engine.clock = self.now
        engine.stall_until = self.now
        self.policy.observe_lend(self.now - engine.lend_started)
        self._touch(engine)
        if self.config.rebalance_on_lend and engine.serving:
            self._rebalance_onto(engine)

    def _rebalance_onto(self, target: _Engine) -> None:
        """The tag-scheduler's rebalance on lend: ``TagPolicy.shed_plan`` over the
        serving engines' loads; each donor hands back its most recently started
        sequences (the engine worker sheds the youngest requests: the cheapest to
        prefill again), which resume on the target (tokens kept, context prefilled)."""
        loads = {e.resource_id: len(e.running) for e in self.engines if e.serving}
        for move in self.policy.shed_plan(loads, [target.resource_id]):
            donor = self.by_id[move.donor]
            self._advance(donor)
            youngest = heapq.nlargest(move.count, donor.running, key=lambda r: r[2].seg_tau)
            moved = {id(entry) for entry in youngest}
            donor.running = [entry for entry in donor.running if id(entry) not in moved]
            heapq.heapify(donor.running)
            for end, _, sample in youngest:
                self._hand_back(sample, end, donor)
                self._start(sample, target)
            self.interrupted += len(youngest)
            if not donor.running:
                self._stop_decoding(donor)
            self._touch(donor)

    def _hand_back(self, sample: _Sample, end: float, engine: _Engine) -> None:
        """Take an in-flight sequence off ``engine``: it keeps its tokens (partial
        rollout) and has to be prefilled wherever it resumes."""
        sample.remaining = max(end - engine.tau, 0.0)
        self._close_segment(sample, engine.tau - sample.seg_tau)
        sample.cached_on = -1

    def _claim(self) -> None:
        """A batch is formed: the trainer takes its slots back, then trains."""
        assert self.trainer_waiting_since is not None
        self.waits.append(self.now - self.trainer_waiting_since)
        self.trainer_waiting_since = None
        plan = self.policy.trainer_claims(self.now)
        self._reclaim(plan.reclaim)
        # an early reclaim may still be under way: training starts once it is over
        self._at(max(self.now, self.reclaimed_at), _TRAIN_START)

    def _prepare(self) -> None:
        """The next batch is nearly formed (``reclaim_early_at``): take the lent engines
        back while the trainer still waits (``TagPolicy.trainer_prepares``)."""
        plan = self.policy.trainer_prepares(self.now)
        self._reclaim(plan.reclaim)

    def _reclaim(self, resource_ids: tuple[str, ...]) -> None:
        """Lent engines hand their in-flight sequences back (partial rollout) and free
        their slot, which is the trainer's ``reclaim_s`` later."""
        resumed: list[_Sample] = []
        reclaim_s = self.config.switch.reclaim_s
        for resource_id in resource_ids:
            engine = self.by_id[resource_id]
            engine.lend_stamp += 1
            if engine.lending_in:
                engine.lending_in = False
                engine.busy.append((engine.lend_started, self.now))
            self._advance(engine)
            for end, _, sample in sorted(engine.running):
                self._hand_back(sample, end, engine)
                resumed.append(sample)
            self.interrupted += len(engine.running)
            engine.running.clear()
            self._stop_decoding(engine)
            engine.busy.append((self.now, self.now + reclaim_s))
            engine.serving = self.policy.role_of(resource_id).role == "rollout"
            engine.stall_until = self.now
            self._touch(engine)
        # interrupted sequences are the oldest work: they resume first
        self.pending.extendleft(reversed(resumed))
        if resource_ids:
            self.policy.observe_reclaim(reclaim_s)
            self.reclaimed_at = max(self.reclaimed_at, self.now + reclaim_s)

    # ------------------------------------------------------------------ training

    def _train(self) -> None:
        batch_index, groups = self.batches.popleft()
        tokens = 0
        for group in groups:
            for sample in group.samples:
                tokens += sample.context
                self.trained_samples += 1
                self.trained_tokens += sample.generated
                self.staleness_tokens += batch_index * sample.generated - sample.version_tokens
                self.max_staleness_seen = max(
                    self.max_staleness_seen, batch_index - sample.first_version
                )
                sample.trained += 1
        trainer = self.config.trainer
        seconds = (
            tokens / (trainer.train_tokens_per_s_per_gpu * len(self.trainer_slots))
            + trainer.step_overhead_s
        )
        self.trainer_intervals.append((self.now, self.now + seconds))
        self._at(self.now + seconds, _TRAIN_DONE)

    def _publish(self) -> None:
        """New weights: published from the training slots, loaded in place by every
        serving engine (partial rollout: in-flight sequences continue on them)."""
        sync_s = self.config.trainer.sync_s
        # overlapped: payloads arrive while the engine decodes; it pauses for the swap
        pause_s = self.config.trainer.swap_s if self.config.overlap_weight_sync else sync_s
        self.version += 1
        self.trainer_intervals.append((self.now, self.now + sync_s))
        for engine in self.engines:
            if not engine.serving:
                continue  # lent engines catch up when they wake
            self._advance(engine)
            for _end, _, sample in engine.running:
                self._close_segment(sample, engine.tau - sample.seg_tau)
                sample.seg_tau = engine.tau
                sample.seg_version = self.version
            start = self.now if self.now > engine.stall_until else engine.stall_until
            engine.stall_until = start + pause_s
            engine.version = self.version
            engine.busy.append((start, start + pause_s))
            self._touch(engine)
        self._at(self.now + sync_s, _PUBLISHED)

    def _published(self) -> None:
        self.trained_batches += 1
        if self.trained_batches >= self.config.steps:
            self.finished = True
            return
        self._dispatch()
        self._trainer_waits()

    # ------------------------------------------------------------------ measures

    def _result(self) -> SimResult:
        end = self.now
        for engine in self.engines:
            self._advance(engine)
            self._stop_decoding(engine)
        lanes: dict[str, list[tuple[float, float]]] = {}
        for slot in self.trainer_slots:
            lanes[slot] = list(self.trainer_intervals)
        for engine in self.engines:
            lanes.setdefault(engine.slot, []).extend(engine.busy)
        window_start = min((s for lane in lanes.values() for s, _ in lane), default=end)
        window = end - window_start
        busy = sum(_union_length(lane, window_start, end) for lane in lanes.values())
        bubble = 1 - busy / (self.config.gpus * window) if window > 0 else 0.0
        stats = self.policy.stats
        return SimResult(
            deployment=self.config.deployment.name,
            train_fraction=self.config.deployment.train_fraction,
            gpus=self.config.gpus,
            train_gpus=len(self.trainer_slots),
            steps=self.trained_batches,
            window_s=window,
            trained_samples=self.trained_samples,
            trained_tokens=self.trained_tokens,
            decoded_tokens=self.decoded_tokens,
            dropped_samples=self.dropped_samples,
            dropped_tokens=self.dropped_tokens,
            bubble_ratio=min(max(bubble, 0.0), 1.0),
            # >= 0 by construction; the clamp only removes float noise (-0.00)
            mean_staleness=max(self.staleness_tokens / max(self.trained_tokens, 1), 0.0),
            max_staleness=self.max_staleness_seen,
            interrupted=self.interrupted,
            mean_trainer_wait_s=sum(self.waits) / max(len(self.waits), 1),
            lends=stats.lends,
            reclaims=stats.reclaims,
            declined=stats.declined,
        )


def _union_length(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    total, cursor = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, cursor), min(high, end)
        if high > low:
            total += high - low
            cursor = high
    return total


def simulate(config: SimConfig) -> SimResult:
    # Hundreds of thousands of long-lived objects and no garbage: the cyclic collector
    # would only rescan them (~20% of the run time at 1024 GPUs).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return Simulation(config).run()
    finally:
        if collecting:
            gc.enable()


# ---------------------------------------------------------------------------------- comparison

DEFAULT_TRAIN_FRACTIONS = (0.25, 0.5, 0.75)
"""Splits swept for the two disaggregated deployments; the best of each is reported."""


@dataclass(frozen=True)
class Row:
    result: SimResult
    speedup: float
    """Trained tokens/s over colocated's at the same G."""
    swept: tuple[float, ...] = ()
    """The train fractions tried (the best is shown)."""


def compare(
    gpus: Sequence[int],
    base: SimConfig,
    train_fractions: Sequence[float] = DEFAULT_TRAIN_FRACTIONS,
    batches_ahead: int = 1,
) -> list[Row]:
    """Colocated (synchronous), and the best split of disaggregated, multiplexed and
    auto (each running ``batches_ahead`` batches ahead of training), at every cluster
    size, on the same workload and seed."""
    rows: list[Row] = []
    for g in gpus:
        baseline = simulate(replace(base, gpus=g, deployment=COLOCATED))
        rows.append(Row(baseline, 1.0))
        for make in (disaggregated, multiplexed, auto):
            tried = [
                simulate(replace(base, gpus=g, deployment=make(f, batches_ahead)))
                for f in train_fractions
            ]
            best = max(tried, key=lambda r: r.tokens_per_s)
            speedup = best.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0
            rows.append(Row(best, speedup, tuple(train_fractions)))
    return rows


TABLE_HEADER = (
    "| GPUs | deployment | train GPUs | tokens/s | samples/s | bubble | speedup "
    "| staleness mean/max | untrained | lends/declined |\n" + "|---" * 10 + "|"
)
"""Markdown: trained tokens and samples per virtual second, bubble ratio, speedup over
colocated, token-weighted mean and max staleness, share of decoded tokens not
trained (stale or still in flight at the end), policy lends and declined decisions."""


def format_row(row: Row) -> str:
    r = row.result
    return (
        f"| {r.gpus} | {r.deployment} | {r.train_gpus} | {r.tokens_per_s:,.0f} "
        f"| {r.samples_per_s:,.1f} | {r.bubble_ratio:.3f} | {row.speedup:.2f}x "
        f"| {r.mean_staleness:.2f}/{r.max_staleness} | {100 * r.untrained_fraction:.1f}% "
        f"| {r.lends}/{r.declined} |"
    )


def rows_as_json(rows: Sequence[Row], base: SimConfig) -> dict[str, Any]:
    return {
        "model": {
            "workload": asdict(base.workload),
            "engine": asdict(base.engine),
            "trainer": asdict(base.trainer),
            "switch": asdict(base.switch),
            "steps": base.steps,
            "seed": base.seed,
            "max_staleness": base.max_staleness,
            "lend_shares": list(base.lend_shares),
            "reclaim_early_at": base.reclaim_early_at,
            "overlap_weight_sync": base.overlap_weight_sync,
        },
        "rows": [
            {
                **asdict(row.result),
                "tokens_per_s": row.result.tokens_per_s,
                "samples_per_s": row.result.samples_per_s,
                "untrained_fraction": row.result.untrained_fraction,
                "speedup": row.speedup,
                "train_fractions_swept": list(row.swept),
            }
            for row in rows
        ],
    }


# ---------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    config: SimConfig
    notes: list[str] = field(default_factory=list)
    """What was taken from the run, and what stayed modeled."""


def calibrate_from_run(run_dir: Path, base: SimConfig) -> Calibration:
    """Scale the model's rates to a measured run (``runs/<id>/summary.json``).

    Taken from the run: per-turn response length (mean tokens per sample / mean turns)
    and its cap, group size, samples per step (``samples_per_gpu`` at the run's slot
    count, engines + 1), engine concurrency, decode rate (steady generated tokens/s per
    engine worker if the summary has it, else over the whole run: a lower bound on the
    engine's full-batch rate, the run's data plane may have limited it; the
    single-sequence and prefill rates are scaled by the same factor), the training rate
    (set so that a modeled step takes the measured mean step time, on one training
    slot, with every token the model charges), weight sync (mean publish time) and, if
    ``spans.jsonl`` has them, the mean prompt length (``engine.generate`` spans) and
    the lend-in and reclaim times of a multiplexed run. Everything else stays modeled.
    """
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = int(summary["steps"])
    if steps <= 0:
        raise ValueError(f"{run_dir}: the run trained no step")
    run_config = summary.get("config", {})
    group_size = int(run_config.get("group_size", base.workload.group_size))
    groups_per_batch = int(run_config.get("groups_per_batch", 8))
    engines = max(int(run_config.get("engines", 1)), 1)
    notes = [f"calibrated from {run_dir}"]

    samples_per_step = group_size * groups_per_batch
    slots = engines + 1  # embedded: every mode uses the same N + 1 slots
    tokens_per_sample = summary["tokens_generated"] / (steps * samples_per_step)
    spans = _span_figures(run_dir / "spans.jsonl")
    prompt_tokens = round(spans.pop("prompt_tokens", base.workload.prompt_tokens))
    workload = replace(
        base.workload,
        group_size=group_size,
        samples_per_gpu=max(samples_per_step // slots, 1),
        prompt_tokens=max(prompt_tokens, 1),
        response_mean_tokens=max(tokens_per_sample / base.workload.mean_turns, 1.0),
        max_tokens=int(run_config.get("max_tokens", base.workload.max_tokens)),
    )
    notes.append(
        f"response: mean {workload.response_mean_tokens:.1f} tokens/turn, cap {workload.max_tokens}"
    )
    notes.append(
        f"workload: {workload.samples_per_gpu} samples/slot/step at {slots} slots, prompt "
        f"{workload.prompt_tokens} tokens"
    )
    engine = base.engine
    rate_key = "steady_generated_tokens_per_s"
    if not summary.get(rate_key):
        rate_key = "generated_tokens_per_s"
    engine_rate = summary[rate_key] / engines
    if engine_rate > 0:
        scale = engine_rate / engine.decode_tokens_per_s_full
        engine = replace(
            engine,
            max_concurrency=int(run_config.get("engine_batch_size", engine.max_concurrency)),
            decode_tokens_per_s_alone=engine.decode_tokens_per_s_alone * scale,
            decode_tokens_per_s_full=engine_rate,
            prefill_tokens_per_s=engine.prefill_tokens_per_s * scale,
        )
        notes.append(
            f"decode: {engine_rate:.1f} tokens/s per engine ({rate_key}, scale {scale:.3g})"
        )
    trainer = base.trainer
    if summary["mean_step_s"] > 0:
        # the model charges every token of a sample: prompt + responses (+ tool output)
        charged = samples_per_step * (
            workload.prompt_tokens
            + tokens_per_sample
            + workload.tool_output_tokens * (workload.mean_turns - 1)
        )
        rate = charged / summary["mean_step_s"]
        trainer = replace(trainer, train_tokens_per_s_per_gpu=rate, step_overhead_s=0.0)
        notes.append(
            f"training: {rate:.1f} charged tokens/s per slot (a step takes the measured "
            f"{summary['mean_step_s']:.3f} s)"
        )
    if summary["mean_publish_s"] > 0:
        trainer = replace(trainer, model_bytes=0.0, sync_latency_s=summary["mean_publish_s"])
        notes.append(f"weight sync: {summary['mean_publish_s']:.3f} s per version")
    switch = base.switch
    measured = spans
    if measured:
        switch = replace(switch, **measured)
        notes.append(f"switch: {measured} (from spans)")
    else:
        notes.append(f"switch: modeled ({asdict(switch)})")
    config = replace(base, workload=workload, engine=engine, trainer=trainer, switch=switch)
    config.engine.validate()
    return Calibration(config, notes)


def _span_figures(spans_path: Path) -> dict[str, float]:
    """From a run's spans: the mean prompt length of engine requests
    (``engine.generate``), and the mean lend-in and reclaim seconds (``sched.lend`` /
    ``sched.reclaim``, in a multiplexed or colocated run)."""
    if not spans_path.exists():
        return {}
    seconds: dict[str, list[float]] = {"lend_in_s": [], "reclaim_s": [], "prompt_tokens": []}
    with spans_path.open() as lines:
        for line in lines:
            span = json.loads(line)
            attributes = span.get("attributes", {})
            name = span.get("name")
            if name == "engine.generate" and "prompt_tokens" in attributes:
                seconds["prompt_tokens"].append(float(attributes["prompt_tokens"]))
            if "seconds" not in attributes:
                continue
            if name == "sched.lend":
                seconds["lend_in_s"].append(float(attributes["seconds"]))
            elif name == "sched.reclaim" and attributes.get("reclaimed"):
                seconds["reclaim_s"].append(float(attributes["seconds"]))
    return {name: sum(values) / len(values) for name, values in seconds.items() if values}
