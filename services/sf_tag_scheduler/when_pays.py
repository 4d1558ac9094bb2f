"""When lending pays (mode ``auto``): measure steps/s with and without lending.

Pure, like :mod:`sf_tag_scheduler.policy`, which asks it for the share of the lendable
engines each trainer wait lends once lending is a choice at all.

Lending pays when the run trains more steps per second with it than without. Both are
measured on the run, over **blocks** of ``block_steps`` consecutive waits that all take
the same choice:

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

Exploration: one block lends all to measure ``period_lent``, the next keeps the slots to
measure ``period_alone``, then one block per other share, largest first, then lend all
again; after that each block is decided by the rule, and after ``reprobe_after`` blocks
alike the share measured longest ago is taken for one block to refresh its measurement,
because the workload changes over a run. Each re-measuring block costs what the choice
it tries loses, so the interval backs off: a re-measurement that confirms the choice
doubles it (up to ``reprobe_backoff_max`` x ``reprobe_after``), a switch sets it back. A
run whose choice holds pays less and less for checking it; once it switches, it is
re-measured at the base interval again.

Brackets: a run's step periods drift (answers grow or shrink as the policy learns, the
first versions differ from later ones), so a choice measured only before another is
favoured or penalised by the drift, not by what it does. Measuring therefore brackets:
the exploration ends with a second block lending all, and a re-measuring block is
followed by one block of the rule's choice before the rule decides again. With the
default ``ewma_alpha`` of 0.5 the bracketing choice's estimate is then the mean of the
blocks on either side, which cancels a drift that is linear over the three blocks. (On
SmolLM2 at 10 steps, unbracketed exploration measured "lent 23.9 s >= alone 20.8 s" and
kept the slots, while lending at every wait was the faster fixed mode:
docs/benchmarks.md, "auto against the fixed modes".)

Switches: the rule's choice (exploration and re-measuring blocks aside) is the run's
lending state. Its first value, and every later change of it, is a :class:`Switch`:
what changed and the measured periods that made it change (``switches``; the
tag-scheduler puts it on the ``sched.decide`` span, the run's report lists them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


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
class Block:
    """Consecutive waits that take one lending choice; their step periods measure it."""

    share: float
    """Of the lendable engines, lent in each wait of the block (0: keep the slots)."""
    left: int
    periods: list[float] = field(default_factory=list)

    @property
    def lend(self) -> bool:
        return self.share > 0


@dataclass(frozen=True)
class Switch:
    """The rule's choice changed (or was made for the first time, ``before`` None)."""

    block: int
    """Blocks closed before the one that takes the new choice."""
    before: float | None
    after: float
    reason: str

    def in_words(self) -> str:
        before = "unmeasured" if self.before is None else choice_in_words(self.before)
        return f"{before} -> {choice_in_words(self.after)} ({self.reason})"


class WhenPays:
    """The blocks of waits, the step period measured for each share, and the choice of
    each new block."""

    def __init__(
        self,
        lend_shares: Iterable[float],
        *,
        block_steps: int,
        reprobe_after: int,
        lend_margin: float,
        ewma_alpha: float,
        reprobe_backoff_max: int = 8,
    ) -> None:
        self.block_steps = block_steps
        self.reprobe_after = reprobe_after
        self.reprobe_backoff_max = reprobe_backoff_max
        self.reprobe_interval = reprobe_after
        """Blocks alike before the next re-measurement (backs off while confirmed)."""
        self._reprobing = False
        """The block under way re-measures a choice other than the rule's, or is the
        block of the rule's choice that brackets such a block (``_bracketing``)."""
        self._bracketing = False
        """The block under way follows a re-measuring block with the rule's choice."""
        self.lend_margin = lend_margin
        self.shares = (0.0, *sorted(set(lend_shares)))
        """Every lending choice of a block, as a share of the lendable engines."""
        self.periods = {share: Ewma(ewma_alpha) for share in self.shares}
        """Mean step period over the blocks of each share (measured)."""
        self._measured_at = dict.fromkeys(self.shares, -1)
        """The block count at which each share was last measured (reprobe the oldest)."""
        self._blocks_closed = 0
        self._block: Block | None = None
        """The block of waits under way (None: none begun yet)."""
        self._blocks_alike = 0
        self._last_block_share: float | None = None
        self._last_wait: tuple[float, Block | None] | None = None
        """When the previous wait began, and the block whose period it starts (None: the
        period is not measured)."""
        self.ruled: float | None = None
        """The rule's current choice (None: still measuring each choice once)."""
        self.switches: list[Switch] = []
        """Every change of the rule's choice, its first one included."""
        self.switch_now: Switch | None = None
        """The switch the newest block began with (None: it did not switch)."""

    def period_ends(self, now: float) -> None:
        """A wait begins at ``now``: the step period since the previous wait ends, and
        counts for the block it measures (if any)."""
        if self._last_wait is not None:
            began, block = self._last_wait
            if block is not None:
                block.periods.append(now - began)

    def period_begins(self, now: float, measured: Block | None) -> None:
        """The step period from the wait at ``now`` measures ``measured`` (None: not
        measured)."""
        self._last_wait = (now, measured)

    def next_wait(self) -> tuple[float, str, Block | None]:
        """The share a wait that follows the rule lends, why, and the block its period
        measures (None: the first period of a block, which carries over the previous
        block's choice)."""
        block = self._block
        self.switch_now = None
        if block is None or block.left == 0:
            if block is not None:
                self._close(block)
            share, reason = self._choose()
            block = self._block = Block(share, self.block_steps)
            first = True
        else:
            reason = f"block: {choice_in_words(block.share)} "
            reason += f"({self.block_steps - block.left + 1} of {self.block_steps})"
            first = False
        block.left -= 1
        # the first period of a block carries over the previous block's choice
        measured = block if not first or self.block_steps == 1 else None
        return block.share, reason, measured

    def _close(self, block: Block) -> None:
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
        n = self.block_steps
        # measure every choice once: lend all, keep the slots, then the other shares
        for share in (1.0, 0.0, *sorted(self.shares[1:], reverse=True)):
            if self.periods[share].samples == 0:
                return share, f"steps/s not measured yet: a block of {n} {choice_in_words(share)}"
        if self.periods[1.0].samples == 1:  # close the bracket around the other choices
            why = "lending measured again, after the other choices (a bracket)"
            return 1.0, f"{why}: a block of {n} {choice_in_words(1.0)}"
        if self._reprobing and not self._bracketing and self.ruled is not None:
            self._bracketing = True
            why = "after re-measuring, the rule's choice again before deciding (a bracket)"
            return self.ruled, f"{why}: a block of {n} {choice_in_words(self.ruled)}"
        period = {share: self.periods[share].value or 0.0 for share in self.shares}
        margin = 1 + self.lend_margin
        # a lending share must beat keeping the slots by the margin; ties: the smaller
        best = min(self.shares, key=lambda s: (period[s] * (margin if s else 1.0), s))
        if self._reprobing:  # the bracketed re-measurement closed: did it confirm?
            self._reprobing = self._bracketing = False
            confirmed = best == self.ruled
            longest = self.reprobe_after * self.reprobe_backoff_max
            self.reprobe_interval = (
                min(2 * self.reprobe_interval, longest) if confirmed else self.reprobe_after
            )
        if self._blocks_alike >= self.reprobe_interval:
            others = [s for s in self.shares if s != self._last_block_share]
            reprobe = min(others, key=lambda s: (self._measured_at[s], s))
            self._reprobing = True
            verdict = f"{self._blocks_alike} blocks alike: another choice, to re-measure"
            return reprobe, f"{verdict}: a block of {n} {choice_in_words(reprobe)}"
        if len(self.shares) == 2:
            alone, lent = period[0.0], period[1.0]
            pays = best > 0
            verdict = f"step {lent:.3f}s lent {'<' if pays else '>='} {alone:.3f}s alone"
            if self.lend_margin:
                verdict += f" / {margin:g}"
        else:
            measured = ", ".join(f"{choice_in_words(s)} {period[s]:.3f}s" for s in self.shares)
            verdict = f"shortest step: {choice_in_words(best)} ({measured})"
        if best != self.ruled:
            self.switch_now = Switch(self._blocks_closed, self.ruled, best, verdict)
            self.switches.append(self.switch_now)
            self.ruled = best
            self.reprobe_interval = self.reprobe_after
        return best, f"{verdict}: a block of {n} {choice_in_words(best)}"


def choice_in_words(share: float) -> str:
    """A lending choice in words (decision reasons)."""
    if share == 0:
        return "keeps the slots"
    if share == 1:
        return "lends"
    return f"lends {share:.0%}"
