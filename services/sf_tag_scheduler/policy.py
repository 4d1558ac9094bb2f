"""Scheduling policy: which role each resource plays, from its tags and the trainer's demand.

The policy is a plain object with no I/O and no clock of its own (every call takes
``now``), so one object drives both the live tag-scheduler and the simulator
(``sf_app.simulator``) on virtual time.

Tags, not code paths, make the deployment:

- an ``engine`` tagged ``rollout`` is a *dedicated* rollout resource: always ``rollout``;
- an ``engine`` tagged ``rollout`` **and** ``train`` sits on a training slot: it is
  *lendable*. It serves rollout while the trainer waits for a batch and is reclaimed
  (role ``idle``, memory released) the moment the trainer claims its slots;
- a ``trainer`` tagged ``train`` trains; without the tag a resource stays ``idle``.

So *colocated* = every engine lendable (train and rollout time-share every slot),
*disaggregated* = no engine lendable, *multiplexed* = dedicated engines plus lendable
ones on the trainer's slots. The mode only sets how lending is decided
(:data:`LENDING_BY_MODE`): ``always`` (colocated: there is no other rollout capacity),
``never`` (disaggregated), ``when_pays`` (multiplexed).

When lending pays (``when_pays``): when the run trains more steps per second with it
than without. Both are measured on the run, over **blocks** of ``block_steps``
consecutive waits that all take the same choice:

    lend iff  period_alone > (1 + lend_margin) x period_lent

- ``period_lent`` / ``period_alone``: the mean step period (one trainer wait to the
  next: the wait for the batch, the reclaim, training, publishing) over blocks that
  lent / kept the slots (EWMAs over blocks). A period holds every cost of lending
  wherever it lands (a reclaim on the trainer's critical path, a lent engine's weight
  catch-up, handed-back requests re-prefilled on the dedicated engines) and every gain,
  also one that shows up a step later. The first period of each block is not counted:
  in a pipelined run it carries over the previous block's choice.
- Why not single waits: a wait depends on what the steps before it did, and a lend can
  cost time away from the wait; a rule on single waits kept lending on the 2-core
  benchmark while steps/s fell (docs/design.md, "When lending pays").

Granularity (``lend_shares``): a block may lend part of the lendable engines, e.g.
``(0.5, 1.0)`` = half or all of them (rounded up; the first ones by id). Each share is
measured like "lend all" and the rule becomes: the share whose blocks had the shortest
step period, where a share above 0 must beat keeping the slots by ``lend_margin``
(ties go to the smaller share). The default ``(1.0,)`` is all or nothing.

Exploration: the first wait of a run is not measured (the pipeline fills: no batch is
under way yet) and lends; then one block lends all to measure ``period_lent``, the next
keeps the slots to measure ``period_alone``, then one block per other share, largest
first; after that each block is decided by the rule, and after ``reprobe_after`` blocks
alike the share measured longest ago is taken for one block to refresh its
measurement, because the workload changes over a run. With no dedicated engine alive
lending is the only rollout capacity: always lend (not measured).

Early reclaim (:meth:`TagPolicy.trainer_prepares`): lent engines can be taken back
while the trainer still waits, once the next batch is nearly formed, so that the
reclaim (requests handed back, memory freed) overlaps the end of rollout instead of
delaying training; the claim then has nothing left to take back.

Rebalance on lend (:meth:`TagPolicy.shed_plan`): a freshly lent engine otherwise gets
only requests made after it joined, while the step's requests sit on the dedicated
engines. The plan moves in-flight requests from the busiest engines onto it (partial
rollout: they keep their tokens and resume there) until it holds its share. The
tag-scheduler sends the plan to the engines; the simulator applies it the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from seamlessflow.protocol import Role

Mode = Literal["colocated", "disaggregated", "multiplexed"]
Lending = Literal["always", "never", "when_pays"]

LENDING_BY_MODE: dict[str, Lending] = {
    "colocated": "always",
    "disaggregated": "never",
    "multiplexed": "when_pays",
}

# The role a kind of process can play, and the tag that allows it.
ROLE_FOR_KIND: dict[str, tuple[Role, str]] = {
    "engine": ("rollout", "rollout"),
    "trainer": ("train", "train"),
}


@dataclass(frozen=True)
class ResourceView:
    resource_id: str
    kind: str
    tags: frozenset[str]
    slots: tuple[str, ...] = ()
    """The physical slots (cores, GPUs) this process runs on; default: its own id."""

    @property
    def lendable(self) -> bool:
        """An engine on a training slot: serves rollout only while training does not."""
        return self.kind == "engine" and {"rollout", "train"} <= self.tags

    @property
    def dedicated_rollout(self) -> bool:
        return self.kind == "engine" and "rollout" in self.tags and "train" not in self.tags


@dataclass(frozen=True)
class EngineLoad:
    """An engine as its latest heartbeat shows it, for lending its cores to training."""

    view: ResourceView
    host: str
    phase: str
    in_flight: int
    alive: bool = True


def cores_for_training(trainer_host: str, engines: Sequence[EngineLoad]) -> tuple[str, ...]:
    """Lending in the other direction: the engines whose cores a training trainer may
    use now. A dedicated rollout engine on the trainer's host lends its cores while it
    has nothing to do: alive, in phase ``idle`` (not generating, not loading weights)
    and no request in flight. Its next request takes them back (its heartbeat on the
    phase change reaches the scheduler at once). Lendable engines are not in this: they
    sit on the trainer's own slots and are reclaimed while it trains. An unknown host
    lends nothing. Sorted by id."""
    if not trainer_host:
        return ()
    return tuple(
        sorted(
            engine.view.resource_id
            for engine in engines
            if engine.alive
            and engine.view.dedicated_rollout
            and engine.host == trainer_host
            and engine.phase == "idle"
            and engine.in_flight == 0
        )
    )


def lent_threads(engines: Sequence[EngineLoad], lent: Sequence[str]) -> int:
    """One thread per slot of each lending engine (an engine without slots: one)."""
    slots = {engine.view.resource_id: len(engine.view.slots) or 1 for engine in engines}
    return sum(slots.get(engine_id, 0) for engine_id in lent)


@dataclass(frozen=True)
class Decision:
    role: Role
    reason: str


@dataclass(frozen=True)
class LendPlan:
    """What to do when the trainer starts waiting: lend these engines (maybe none)."""

    lend: tuple[str, ...]
    reason: str
    expected_wait_s: float
    """W: the estimated wait with dedicated engines alone (inf: none exist / unknown)."""
    gain_s: float
    cost_s: float


@dataclass(frozen=True)
class ReclaimPlan:
    """What to do when the trainer claims its slots: take these engines back."""

    reclaim: tuple[str, ...]
    reason: str


class Ewma:
    def __init__(self, alpha: float, prior: float | None = None) -> None:
        self.alpha = alpha
        self.value = prior
        self.samples = 0

    def add(self, sample: float) -> None:
        self.samples += 1
        if self.value is None:
            self.value = sample
        else:
            self.value = self.alpha * sample + (1 - self.alpha) * self.value


@dataclass
class PolicyConfig:
    mode: Mode = "disaggregated"
    lend_margin: float = 0.0
    """Lend when steps/s with lending exceed steps/s without by more than this fraction
    (measured over blocks of steps)."""
    switch_cost_prior_s: float = 1.0
    """Lend-in and reclaim time assumed before any has been measured (reported only)."""
    ewma_alpha: float = 0.5
    """Weight of the newest block in the running estimates."""
    block_steps: int = 3
    """Consecutive waits that take the same lending choice; the block's mean step period
    (its first one left out) is one measurement of that choice."""
    reprobe_after: int = 10
    """After this many blocks alike in a row, take the choice measured longest ago for
    one block to refresh its measurement."""
    lend_shares: tuple[float, ...] = (1.0,)
    """The shares of the lendable engines a block may lend besides none (``when_pays``);
    each in (0, 1], rounded up to whole engines."""

    def __post_init__(self) -> None:
        if not self.lend_shares or not all(0 < s <= 1 for s in self.lend_shares):
            raise ValueError(f"lend_shares must be in (0, 1], got {self.lend_shares!r}")
        if 1.0 not in self.lend_shares:
            raise ValueError("lend_shares must include 1.0 (lend all is the first measured)")
        if self.block_steps < 1 or self.reprobe_after < 1:
            raise ValueError("block_steps and reprobe_after must be >= 1")

    @property
    def lending(self) -> Lending:
        return LENDING_BY_MODE[self.mode]


@dataclass(frozen=True)
class Shed:
    """Move ``count`` in-flight requests from engine ``donor`` onto engine ``target``."""

    donor: str
    target: str
    count: int


@dataclass
class _Block:
    """Consecutive waits that take one lending choice; their step periods measure it."""

    share: float
    """Of the lendable engines, lent in each wait of the block (0: keep the slots)."""
    left: int
    periods: list[float] = field(default_factory=list)

    @property
    def lend(self) -> bool:
        return self.share > 0


@dataclass
class _Member:
    view: ResourceView
    alive: bool = True


@dataclass
class _Trainer:
    training: bool = False
    waiting_since: float | None = None
    dedicated_at_wait: int = 0
    lent_at_wait: int = 0


@dataclass
class PolicyStats:
    lends: int = 0
    reclaims: int = 0
    declined: int = 0
    decisions: list[str] = field(default_factory=list)


class TagPolicy:
    """The tag-scheduler's decisions. Feed it the pool and the trainer's demand; it says
    which role each resource plays and which engines to lend or reclaim."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.members: dict[str, _Member] = {}
        self.lent: set[str] = set()
        self.trainer = _Trainer()
        self.shares = (0.0, *sorted(set(self.config.lend_shares)))
        """Every lending choice of a block, as a share of the lendable engines."""
        self.periods = {share: Ewma(self.config.ewma_alpha) for share in self.shares}
        """Mean step period over the blocks of each share (measured)."""
        self._measured_at = dict.fromkeys(self.shares, -1)
        """The block count at which each share was last measured (reprobe the oldest)."""
        self._blocks_closed = 0
        self.lend_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self.reclaim_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self._block: _Block | None = None
        """The block of waits under way (None: none begun yet)."""
        self._blocks_alike = 0
        self._last_block_share: float | None = None
        self._last_wait: tuple[float, _Block | None] | None = None
        """When the previous wait began, and the block whose period it starts (None: the
        period is not measured)."""
        self._share_now = 0.0
        """The choice of the current wait (a resource joining mid-wait follows it)."""
        self._prepared = False
        """The lent engines were taken back early in the current wait."""
        self.claims = 0
        """Batches the trainer claimed its slots for (steps begun)."""
        self.stats = PolicyStats()

    @property
    def mode(self) -> Mode:
        return self.config.mode

    @property
    def period_alone(self) -> Ewma:
        """Mean step period over blocks that kept the slots (measured)."""
        return self.periods[0.0]

    @property
    def period_lent(self) -> Ewma:
        """Mean step period over blocks that lent every lendable engine (measured)."""
        return self.periods[1.0]

    # ------------------------------------------------------------------ the pool

    def add(self, resource: ResourceView) -> Decision:
        """A resource registered (or re-registered): the role it plays right now."""
        self.members[resource.resource_id] = _Member(resource)
        return self.role_of(resource.resource_id)

    def remove(self, resource_id: str) -> None:
        """Dead or gone: it counts for nothing until it registers again."""
        member = self.members.get(resource_id)
        if member is not None:
            member.alive = False
        self.lent.discard(resource_id)

    def forget(self, resource_id: str) -> None:
        """It registered again for another policy: no longer one of this pool."""
        self.members.pop(resource_id, None)
        self.lent.discard(resource_id)

    def revive(self, resource_id: str) -> None:
        member = self.members.get(resource_id)
        if member is not None:
            member.alive = True

    def role_of(self, resource_id: str) -> Decision:
        view = self.members[resource_id].view
        role_and_tag = ROLE_FOR_KIND.get(view.kind)
        if role_and_tag is None:
            return Decision("idle", f"no role for kind {view.kind!r}")
        role, tag = role_and_tag
        if tag not in view.tags:
            return Decision("idle", f"kind {view.kind!r} lacks tag {tag!r}")
        if view.lendable:
            if resource_id in self.lent:
                return Decision("rollout", f"{self.mode}: lent to rollout while the trainer waits")
            if self.trainer.training:
                return Decision("idle", f"{self.mode}: its slot is training")
            return Decision("idle", f"{self.mode}: lendable, not lent")
        return Decision(role, f"{self.mode}: tag {tag!r} -> {role}")

    def _alive(self, predicate: str) -> list[str]:
        return sorted(
            rid for rid, m in self.members.items() if m.alive and getattr(m.view, predicate)
        )

    @property
    def dedicated(self) -> list[str]:
        return self._alive("dedicated_rollout")

    @property
    def lendable(self) -> list[str]:
        return self._alive("lendable")

    # ------------------------------------------------------------------ the trainer's demand

    def trainer_waiting(self, now: float) -> LendPlan:
        """The trainer finished a step (weights published) and waits for the next batch."""
        self.trainer.training = False
        self.trainer.waiting_since = now
        self._prepared = False
        if self._last_wait is not None:
            began, block = self._last_wait
            if block is not None:
                block.periods.append(now - began)
        plan, block = self._wait_rule()
        self._last_wait = (now, block)
        self.trainer.dedicated_at_wait = len(self.dedicated)
        self.stats.decisions.append(f"wait: lend {len(plan.lend)} ({plan.reason})")
        return plan

    def rebalance(self, now: float) -> LendPlan:
        """The pool changed (a resource joined or died) while the trainer is not
        training: apply the current wait's choice to the engines not lent yet, so that
        an engine that registers after the trainer started waiting (or the loss of the
        last dedicated engine) does not leave rollout without capacity."""
        if self.trainer.training:
            return LendPlan((), "the trainer is training", math.inf, 0.0, 0.0)
        lending = self.config.lending
        if lending == "never":
            return self._plan(0.0, "mode never lends")
        if not self.dedicated:
            plan = self._plan(1.0, "no dedicated engine: lending is all the rollout there is")
        elif self._prepared:
            plan = self._plan(0.0, "taken back early for the next batch")
        elif lending == "always":
            return self._plan(1.0, "mode always lends")
        elif self.claims == 0:
            plan = self._plan(1.0, "the first batch fills the pipeline: lend, not measured")
        else:
            plan = self._plan(self._share_now, "as decided for this wait")
        if plan.lend:
            self.stats.decisions.append(f"rebalance: lend {len(plan.lend)} ({plan.reason})")
        return plan

    def _wait_rule(self) -> tuple[LendPlan, _Block | None]:
        """The lending choice of a new wait, and the block its period measures."""
        lending = self.config.lending
        if lending == "never":
            return self._plan(0.0, "mode never lends"), None
        if lending == "always":
            return self._plan(1.0, "mode always lends"), None
        if not self.lendable:
            return self._plan(0.0, "nothing lendable"), None
        if not self.dedicated:
            return self._plan(1.0, "no dedicated engine: lending is all the rollout there is"), None
        if self.claims == 0:
            return self._plan(1.0, "the first batch fills the pipeline: lend, not measured"), None
        block = self._block
        if block is None or block.left == 0:
            if block is not None:
                self._close(block)
            share, reason = self._choose()
            block = self._block = _Block(share, self.config.block_steps)
            first = True
        else:
            reason = f"block: {_choice(block.share)} "
            reason += f"({self.config.block_steps - block.left + 1} of {self.config.block_steps})"
            first = False
        block.left -= 1
        if not block.lend:
            self.stats.declined += 1
        # the first period of a block carries over the previous block's choice
        measured = block if not first or self.config.block_steps == 1 else None
        return self._plan(block.share, reason), measured

    def _close(self, block: _Block) -> None:
        self._blocks_closed += 1
        if block.periods:
            mean = sum(block.periods) / len(block.periods)
            self.periods[block.share].add(mean)
            self._measured_at[block.share] = self._blocks_closed
        alike = block.share == self._last_block_share
        self._blocks_alike = self._blocks_alike + 1 if alike else 1
        self._last_block_share = block.share

    def _choose(self) -> tuple[float, str]:
        """A new block: the share of the lendable engines to lend, and why."""
        n = self.config.block_steps
        # measure every choice once: lend all, keep the slots, then the other shares
        for share in (1.0, 0.0, *sorted(self.shares[1:], reverse=True)):
            if self.periods[share].samples == 0:
                return share, f"steps/s not measured yet: a block of {n} {_choice(share)}"
        period = {share: self.periods[share].value or 0.0 for share in self.shares}
        margin = 1 + self.config.lend_margin
        # a lending share must beat keeping the slots by the margin; ties: the smaller
        best = min(self.shares, key=lambda s: (period[s] * (margin if s else 1.0), s))
        if self._blocks_alike >= self.config.reprobe_after:
            others = [s for s in self.shares if s != self._last_block_share]
            best = min(others, key=lambda s: (self._measured_at[s], s))
            verdict = f"{self._blocks_alike} blocks alike: another choice, to re-measure"
        elif len(self.shares) == 2:
            alone, lent = period[0.0], period[1.0]
            pays = best > 0
            verdict = f"step {lent:.3f}s lent {'<' if pays else '>='} {alone:.3f}s alone"
            if self.config.lend_margin:
                verdict += f" / {margin:g}"
        else:
            measured = ", ".join(f"{_choice(s)} {period[s]:.3f}s" for s in self.shares)
            verdict = f"shortest step: {_choice(best)} ({measured})"
        return best, f"{verdict}: a block of {n} {_choice(best)}"

    def _plan(self, share: float, reason: str) -> LendPlan:
        """Lend ``share`` of the lendable engines (rounded up; the first by id), counting
        those lent already, and record it."""
        self._share_now = share
        lendable = self.lendable
        count = math.ceil(share * len(lendable) - 1e-9)
        room = max(count - len(self.lent), 0)
        lend = tuple(r for r in lendable if r not in self.lent)[:room]
        self.lent.update(lend)
        self.stats.lends += len(lend)
        self.trainer.lent_at_wait = len(self.lent)
        cost = self.reclaim_cost.value or 0.0
        return LendPlan(lend, reason, self.expected_wait(), self.expected_gain(), cost)

    def expected_gain(self) -> float:
        """Seconds per step lending saved (period alone - period lent) once both are
        measured; unbounded before (explore)."""
        if self.period_alone.value is None or self.period_lent.value is None:
            return math.inf
        return self.period_alone.value - self.period_lent.value

    def trainer_prepares(self, now: float) -> ReclaimPlan:
        """The next batch is nearly formed: take the lent engines back now, while the
        trainer still waits, so that the reclaim overlaps the end of rollout. Nothing is
        lent again until the trainer's next wait. With no dedicated engine alive the
        lent engines are all the rollout there is: they stay until the claim."""
        if not self.dedicated:
            return ReclaimPlan((), "no dedicated engine: lent engines stay until the claim")
        self._prepared = True
        self._share_now = 0.0
        reclaim = tuple(sorted(self.lent))
        self.lent.clear()
        self.stats.reclaims += len(reclaim)
        if reclaim:
            self.stats.decisions.append(f"prepare: reclaim {len(reclaim)} early")
        return ReclaimPlan(reclaim, "batch nearly ready: lent engines are taken back early")

    def trainer_claims(self, now: float) -> ReclaimPlan:
        """A full batch is ready: the trainer needs its slots back now."""
        self.trainer.waiting_since = None
        self.trainer.training = True
        self._share_now = 0.0
        self.claims += 1
        reclaim = tuple(sorted(self.lent))
        self.lent.clear()
        self.stats.reclaims += len(reclaim)
        reason = "batch ready: the trainer claims its slots"
        self.stats.decisions.append(f"claim: reclaim {len(reclaim)}")
        return ReclaimPlan(reclaim, reason)

    def expected_wait(self) -> float:
        """The step period without lending (measured; inf before, or with no dedicated
        engine alive: there is no "without lending")."""
        value = self.period_alone.value
        return math.inf if value is None or not self.dedicated else value

    # ------------------------------------------------------------------ rebalance on lend

    def shed_plan(self, loads: dict[str, int], targets: Sequence[str]) -> list[Shed]:
        """Requests to move onto freshly lent engines ``targets``.

        ``loads``: requests in flight per serving engine (the targets included). Each
        target is filled up to the mean load (rounded down), from the busiest engines
        first, none of which is taken below the mean. Targets are filled in order; a
        target is never a donor."""
        if not targets or not loads:
            return []
        load = dict(loads)
        share = sum(load.values()) // len(load)
        plan: list[Shed] = []
        for target in targets:
            donors = sorted((r for r in load if r not in targets), key=lambda r: (-load[r], r))
            for donor in donors:
                wanted = share - load.get(target, 0)
                excess = load[donor] - share
                if wanted <= 0:
                    break
                if excess <= 0:
                    continue
                count = min(wanted, excess)
                load[donor] -= count
                load[target] = load.get(target, 0) + count
                plan.append(Shed(donor, target, count))
        return plan

    # ------------------------------------------------------------------ measurements

    def observe_lend(self, seconds: float) -> None:
        """An engine took ``seconds`` from being lent until it served. Reported with each
        decision; the decision itself needs no separate term for it, since the lend-in
        time is already inside the measured ``W_lent``."""
        self.lend_cost.add(seconds)

    def observe_reclaim(self, seconds: float) -> None:
        """Reclaiming the lent engines delayed the trainer by ``seconds``."""
        self.reclaim_cost.add(seconds)


def _choice(share: float) -> str:
    """A lending choice in words (decision reasons)."""
    if share == 0:
        return "keeps the slots"
    if share == 1:
        return "lends"
    return f"lends {share:.0%}"
