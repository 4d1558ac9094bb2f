"""Scheduling policy: which role each resource plays, from its tags and the trainer's demand.

The policy is a plain object with no I/O and no clock of its own (every call takes
``now``), so one object drives both the live tag-scheduler and the simulator
(``sf_tag_scheduler.simulator``) on virtual time.

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

When lending pays (``when_pays``): at the moment the trainer starts waiting, lend iff

    expected rollout gain   >   margin x s_reclaim  = switch cost

- the *gain* is the rollout time a lent engine delivers per lend: once lends have been
  measured, the EWMA of the time each lent engine actually had requests in flight
  (``observe_yield``); before that, the estimate ``W - s_lend``;
- ``W``: how long the trainer would wait with dedicated engines alone. Each observed
  wait ``w`` with ``D`` dedicated and ``L`` lent engines serving is scaled to
  ``w x (D + L) / D`` (engines count as equal capacity), then averaged (EWMA). With
  no dedicated engine ``W`` is unbounded (always lend); before the first observation
  lending is tried once, so there is something to measure;
- ``s_lend``: measured time from lending an engine until it serves (wake, catch up to
  the current weight version, join the queue); ``s_reclaim``: measured time from the
  trainer's claim until every lent engine released its slot (in-flight requests
  handed back for transparent resume, memory freed): the trainer's loss. Both EWMAs
  start from ``switch_cost_prior_s``.

The measured yield is what keeps the rule honest: ``W`` says the trainer waits, not
that a lent engine would get work in that time (when the next batch's requests are all
on dedicated engines before a lent one wakes, it idles, and ``W`` does not shrink).
After ``reprobe_after`` declines in a row the policy lends once more to re-measure,
because the workload changes over a run.
"""

from __future__ import annotations

import math
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
        if self.value is None or math.isinf(self.value):
            self.value = sample
        else:
            self.value = self.alpha * sample + (1 - self.alpha) * self.value


@dataclass
class PolicyConfig:
    mode: Mode = "disaggregated"
    lend_margin: float = 1.0
    """Lend when the expected gain exceeds ``lend_margin`` x the switch cost."""
    switch_cost_prior_s: float = 1.0
    """Lend-in and reclaim time assumed before any has been measured."""
    ewma_alpha: float = 0.3
    """Weight of the newest measurement in the running estimates."""
    reprobe_after: int = 10
    """After this many declined lends in a row, lend once to measure the yield again."""

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
        self.no_lend_wait = Ewma(self.config.ewma_alpha)
        self.lend_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self.reclaim_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self.lend_yield = Ewma(self.config.ewma_alpha)
        """Seconds a lent engine had requests in flight, per lend (measured)."""
        self._declined_in_row = 0
        self.stats = PolicyStats()

    @property
    def mode(self) -> Mode:
        return self.config.mode

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
        plan = self._lend_rule(count_declined=True)
        self.trainer.dedicated_at_wait = len(self.dedicated)
        self.stats.decisions.append(f"wait: lend {len(plan.lend)} ({plan.reason})")
        return plan

    def rebalance(self, now: float) -> LendPlan:
        """The pool changed (a resource joined or died) while the trainer is not
        training: apply the lending rule again to the engines not lent yet, so that an
        engine that registers after the trainer started waiting (or the loss of the
        last dedicated engine) does not leave rollout without capacity."""
        if self.trainer.training:
            return LendPlan((), "the trainer is training", math.inf, 0.0, 0.0)
        plan = self._lend_rule(count_declined=False)
        if plan.lend:
            self.stats.decisions.append(f"rebalance: lend {len(plan.lend)} ({plan.reason})")
        return plan

    def _lend_rule(self, *, count_declined: bool) -> LendPlan:
        candidates = tuple(r for r in self.lendable if r not in self.lent)
        dedicated = len(self.dedicated)
        wait = self.expected_wait(dedicated)
        cost = self.reclaim_cost.value or 0.0
        if self.lend_yield.value is not None and dedicated > 0:
            gain, basis = self.lend_yield.value, "measured yield"
        else:
            gain, basis = wait - (self.lend_cost.value or 0.0), "expected wait"
        lending = self.config.lending
        lend: tuple[str, ...] = ()
        if not candidates:
            reason = "nothing lendable"
        elif lending == "never":
            reason = "mode never lends"
        elif lending == "always":
            lend, reason = candidates, "mode always lends"
        elif self.no_lend_wait.samples == 0 and dedicated > 0:
            lend, reason = candidates, "no wait measured yet: lend to measure"
        elif gain > self.config.lend_margin * cost:
            lend, reason = candidates, f"gain {gain:.3f}s ({basis}) > cost {cost:.3f}s"
        elif count_declined and self._declined_in_row + 1 >= self.config.reprobe_after:
            lend = candidates
            reason = f"{self._declined_in_row + 1} declines in a row: lend to re-measure"
        else:
            reason = f"gain {gain:.3f}s ({basis}) <= cost {cost:.3f}s"
            if count_declined:
                self.stats.declined += 1
                self._declined_in_row += 1
        if lend:
            self._declined_in_row = 0
        self.lent.update(lend)
        self.stats.lends += len(lend)
        self.trainer.lent_at_wait = len(self.lent)
        return LendPlan(lend, reason, wait, gain, cost)

    def trainer_claims(self, now: float) -> ReclaimPlan:
        """A full batch is ready: the trainer needs its slots back now."""
        if self.trainer.waiting_since is not None:
            waited = max(now - self.trainer.waiting_since, 0.0)
            dedicated, lent = self.trainer.dedicated_at_wait, self.trainer.lent_at_wait
            if dedicated > 0:
                self.no_lend_wait.add(waited * (dedicated + lent) / dedicated)
        self.trainer.waiting_since = None
        self.trainer.training = True
        reclaim = tuple(sorted(self.lent))
        self.lent.clear()
        self.stats.reclaims += len(reclaim)
        reason = "batch ready: the trainer claims its slots"
        self.stats.decisions.append(f"claim: reclaim {len(reclaim)}")
        return ReclaimPlan(reclaim, reason)

    def expected_wait(self, dedicated: int | None = None) -> float:
        """W: the trainer's expected wait for a batch with dedicated engines alone."""
        if dedicated is None:
            dedicated = len(self.dedicated)
        if dedicated == 0 or self.no_lend_wait.value is None:
            return math.inf
        return self.no_lend_wait.value

    # ------------------------------------------------------------------ measurements

    def observe_lend(self, seconds: float) -> None:
        """An engine took ``seconds`` from being lent until it served."""
        self.lend_cost.add(seconds)

    def observe_yield(self, busy_seconds: float) -> None:
        """A reclaimed engine had requests in flight for ``busy_seconds`` while lent."""
        self.lend_yield.add(busy_seconds)

    def observe_reclaim(self, seconds: float) -> None:
        """Reclaiming the lent engines delayed the trainer by ``seconds``."""
        self.reclaim_cost.add(seconds)
