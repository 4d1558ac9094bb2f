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
*disaggregated* = no engine lendable, *multiplexed* and *auto* = dedicated engines plus
lendable ones on the trainer's slots. The mode only sets how lending is decided
(:data:`LENDING_BY_MODE`): ``always`` (colocated: there is no other rollout capacity;
multiplexed: the trainer's slots serve rollout at every wait), ``never``
(disaggregated), ``when_pays`` (auto, the default: lend while the run measures more
steps/s with it than without, and switch when the measurements change).

When lending pays (``when_pays``): when the run trains more steps per second with it
than without, both measured on the run over blocks of consecutive waits that take one
choice (:mod:`sf_tag_scheduler.when_pays`: the rule, the shares of the lendable engines
a block may lend, and how each choice is measured and measured again). Two waits lend
without asking the rule and are not measured: the first wait of a run (the pipeline
fills: no batch is under way yet), and any wait with no dedicated engine alive (lending
is the only rollout capacity).

Early reclaim (:meth:`TagPolicy.trainer_prepares`): lent engines can be taken back
while the trainer still waits, once the next batch is nearly formed, so that the
reclaim (requests handed back, memory freed) overlaps the end of rollout instead of
delaying training; the claim then has nothing left to take back.

Rebalance on lend (:meth:`TagPolicy.shed_plan`, planned by :mod:`sf_tag_scheduler.rebalance`):
requests in flight are moved onto freshly lent engines from the busiest ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from seamlessflow.protocol import Role
from sf_tag_scheduler.rebalance import Shed, shed_plan
from sf_tag_scheduler.when_pays import Block, Ewma, Switch, WhenPays

Mode = Literal["auto", "colocated", "disaggregated", "multiplexed"]
Lending = Literal["always", "never", "when_pays"]

LENDING_BY_MODE: dict[str, Lending] = {
    "colocated": "always",
    "disaggregated": "never",
    "multiplexed": "always",
    "auto": "when_pays",
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
    switch: Switch | None = None
    """``when_pays``: the rule's choice changed with this wait (its first choice too)."""


@dataclass(frozen=True)
class ReclaimPlan:
    """What to do when the trainer claims its slots: take these engines back."""

    reclaim: tuple[str, ...]
    reason: str


@dataclass
class PolicyConfig:
    mode: Mode = "auto"
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
    reprobe_backoff_max: int = 8
    """A re-measurement that confirms the choice doubles the interval before the next,
    up to this many times ``reprobe_after``; a switch sets it back."""
    lend_shares: tuple[float, ...] = (1.0,)
    """The shares of the lendable engines a block may lend besides none (``when_pays``);
    each in (0, 1], rounded up to whole engines."""

    def __post_init__(self) -> None:
        if not self.lend_shares or not all(0 < s <= 1 for s in self.lend_shares):
            raise ValueError(f"lend_shares must be in (0, 1], got {self.lend_shares!r}")
        if 1.0 not in self.lend_shares:
            raise ValueError("lend_shares must include 1.0 (lend all is the first measured)")
        if self.block_steps < 1 or self.reprobe_after < 1 or self.reprobe_backoff_max < 1:
            raise ValueError("block_steps, reprobe_after and reprobe_backoff_max must be >= 1")

    @property
    def lending(self) -> Lending:
        return LENDING_BY_MODE[self.mode]


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
        self.when_pays = WhenPays(
            self.config.lend_shares,
            block_steps=self.config.block_steps,
            reprobe_after=self.config.reprobe_after,
            reprobe_backoff_max=self.config.reprobe_backoff_max,
            lend_margin=self.config.lend_margin,
            ewma_alpha=self.config.ewma_alpha,
        )
        """The blocks of waits and the step periods measured for each share."""
        self.lend_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self.reclaim_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
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
    def periods(self) -> dict[float, Ewma]:
        """Mean step period over the blocks of each share (measured)."""
        return self.when_pays.periods

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
        self.when_pays.period_ends(now)
        plan, measured = self._wait_rule()
        self.when_pays.period_begins(now, measured)
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

    def _wait_rule(self) -> tuple[LendPlan, Block | None]:
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
        share, reason, measured = self.when_pays.next_wait()
        if not share:
            self.stats.declined += 1
        plan = self._plan(share, reason)
        switch = self.when_pays.switch_now
        if switch is not None:
            plan = replace(plan, switch=switch)
            self.stats.decisions.append(f"switch: {switch.in_words()}")
        return plan, measured

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
        """Requests to move onto freshly lent engines ``targets``
        (:func:`sf_tag_scheduler.rebalance.shed_plan`)."""
        return shed_plan(loads, targets)

    # ------------------------------------------------------------------ measurements

    def observe_lend(self, seconds: float) -> None:
        """An engine took ``seconds`` from being lent until it served. Reported with each
        decision; the decision itself needs no separate term for it, since the lend-in
        time is already inside the measured ``W_lent``."""
        self.lend_cost.add(seconds)

    def observe_reclaim(self, seconds: float) -> None:
        """Reclaiming the lent engines delayed the trainer by ``seconds``."""
        self.reclaim_cost.add(seconds)
