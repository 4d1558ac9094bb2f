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

When lending pays (``when_pays``): lending is worth it when it shortens the trainer's
wait for a batch by more than taking the engines back costs the trainer. Both sides
are measured on the run, on the trainer's critical path:

    gain = W_alone - W_lent    >    margin x s_reclaim = switch cost

- ``W_alone`` / ``W_lent``: the trainer's observed waits for a batch (EWMAs) when
  nothing was lent and when engines were lent during the wait. Their difference is
  what lending really bought: it is ~0 when the lent engines get no work (the next
  batch's requests already sit on dedicated engines) or when rollout is limited by
  something else (a slow data plane, the long tail of a group), even if the lent
  engines look busy;
- ``s_reclaim``: how long the trainer waited for its slots at the claim (in-flight
  requests handed back for transparent resume, memory freed); EWMA from
  ``switch_cost_prior_s``.

Exploration: the first wait of a run is not measured (the pipeline fills: no batch is
under way yet) and lends; the next one lends to measure ``W_lent``, the one after does
not, to measure ``W_alone``; after that the rule decides, and after ``reprobe_after``
decisions in a row the other choice is taken once to refresh its measurement, because
the workload changes over a run. With no dedicated engine alive lending is the only
rollout capacity: always lend.

Known limit: single waits carry over effects of the steps before them (a pipelined run)
and miss costs that land away from the trainer; on the 2-core benchmark this rule kept
lending while steps/s fell. Deciding on throughput over blocks of steps is the next
step (docs/design.md, "Known limits").
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
        if self.value is None:
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
    """After this many identical decisions in a row, take the other one once to refresh
    its measurement."""

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
        self.wait_alone = Ewma(self.config.ewma_alpha)
        """The trainer's wait for a batch when nothing was lent (measured)."""
        self.wait_lent = Ewma(self.config.ewma_alpha)
        """The trainer's wait for a batch when engines were lent during it (measured)."""
        self.lend_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self.reclaim_cost = Ewma(self.config.ewma_alpha, self.config.switch_cost_prior_s)
        self._same_in_row = 0
        self._last_lent: bool | None = None
        self.claims = 0
        """Batches the trainer claimed its slots for (steps begun)."""
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
        cost = self.reclaim_cost.value or 0.0
        gain = self.expected_gain()
        lending = self.config.lending
        lend: tuple[str, ...] = ()
        if not candidates:
            reason = "nothing lendable"
        elif lending == "never":
            reason = "mode never lends"
        elif lending == "always":
            lend, reason = candidates, "mode always lends"
        elif dedicated == 0:
            lend, reason = candidates, "no dedicated engine: lending is all the rollout there is"
        elif self.claims == 0:
            lend, reason = candidates, "the first batch fills the pipeline: lend, not measured"
        elif self.wait_lent.samples == 0:
            lend, reason = candidates, "wait with lending not measured yet: lend to measure"
        elif self.wait_alone.samples == 0:
            reason = "wait without lending not measured yet: keep the slots to measure"
        else:
            pays = gain > self.config.lend_margin * cost
            if count_declined and self._same_in_row + 1 >= self.config.reprobe_after:
                pays = not pays
                verdict = f"{self._same_in_row + 1} alike in a row: the other way, to re-measure"
            else:
                verdict = f"gain {gain:.3f}s {'>' if pays else '<='} cost {cost:.3f}s"
            reason = f"{verdict} (waits alone {self.wait_alone.value:.3f}s, "
            reason += f"lent {self.wait_lent.value:.3f}s)"
            if pays:
                lend = candidates
            elif count_declined:
                self.stats.declined += 1
        if count_declined and candidates and lending == "when_pays":
            lent_now = bool(lend)
            self._same_in_row = self._same_in_row + 1 if lent_now == self._last_lent else 1
            self._last_lent = lent_now
        self.lent.update(lend)
        self.stats.lends += len(lend)
        self.trainer.lent_at_wait = len(self.lent)
        return LendPlan(lend, reason, self.expected_wait(dedicated), gain, cost)

    def expected_gain(self) -> float:
        """W_alone - W_lent once both are measured; unbounded before (explore)."""
        if self.wait_alone.value is None or self.wait_lent.value is None:
            return math.inf
        return self.wait_alone.value - self.wait_lent.value

    def trainer_claims(self, now: float) -> ReclaimPlan:
        """A full batch is ready: the trainer needs its slots back now."""
        if self.trainer.waiting_since is not None:
            waited = max(now - self.trainer.waiting_since, 0.0)
            # the first wait fills the pipeline; without dedicated engines there is no
            # "alone" to compare with
            if self.claims > 0 and self.trainer.dedicated_at_wait > 0:
                lent = self.trainer.lent_at_wait > 0
                (self.wait_lent if lent else self.wait_alone).add(waited)
        self.trainer.waiting_since = None
        self.trainer.training = True
        self.claims += 1
        reclaim = tuple(sorted(self.lent))
        self.lent.clear()
        self.stats.reclaims += len(reclaim)
        reason = "batch ready: the trainer claims its slots"
        self.stats.decisions.append(f"claim: reclaim {len(reclaim)}")
        return ReclaimPlan(reclaim, reason)

    def expected_wait(self, dedicated: int | None = None) -> float:
        """W_alone: the trainer's expected wait with dedicated engines only (inf if
        there are none or it was not measured yet)."""
        if dedicated is None:
            dedicated = len(self.dedicated)
        if dedicated == 0 or self.wait_alone.value is None:
            return math.inf
        return self.wait_alone.value

    # ------------------------------------------------------------------ measurements

    def observe_lend(self, seconds: float) -> None:
        """An engine took ``seconds`` from being lent until it served. Reported with each
        decision; the decision itself needs no separate term for it, since the lend-in
        time is already inside the measured ``W_lent``."""
        self.lend_cost.add(seconds)

    def observe_reclaim(self, seconds: float) -> None:
        """Reclaiming the lent engines delayed the trainer by ``seconds``."""
        self.reclaim_cost.add(seconds)
