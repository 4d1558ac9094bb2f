"""Data algorithms as plug-ins: which groups reach a batch, which prompts an epoch dispatches.

Two kinds of hooks (a plug-in implements one):

- **group filters** (``GroupFilter.judge``) see each complete group once, against the
  batch it would join, and keep it, trim it (drop some samples) or drop it, with a
  reason. They run in the configured order; each sees what the previous ones kept, and
  the first that drops a group names the reason. A dropped group is replaced: the
  dispatcher hands out one more group for it (``Grouper.groups_lost``).
- **prompt-set filters** (``PromptSetFilter``) ``observe`` every complete group before
  any group filter judges it, and at an epoch boundary ``select`` which of the epoch's
  prompts the next epoch dispatches (``Dispatcher``).

A plug-in is a class with a ``name``, an optional ``settings_class`` (a
``seamlessflow.plugin_settings.PluginSettings``: its keys, their defaults and checks)
and a constructor that takes those keys as keyword arguments. ``SF_TRAJECTORY_DATA_FILTERS``
lists the filters in order, each a name registered in ``DATA_FILTERS`` or a dotted path
(``package.module:Class``) to a user's own; each one's keys are set under its ``name``:
``[trajectory.data_filter.<name>]`` in the run file, or
``SF_TRAJECTORY_DATA_FILTER__<NAME>__<KEY>``. A key the filter lacks, settings for a
filter that is not listed and a class that is not a filter are configuration errors.
The built-in filters are the classes below, registered in ``DATA_FILTERS``; the
configuration reference (docs/configuration.md, "Plug-ins") lists them from there, each
with its docstring's first paragraph and its keys.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from seamlessflow.plugin_settings import NoSettings, PluginChoice, PluginSettings, settings_of
from seamlessflow.plugins import Registry
from seamlessflow.protocol import GroupSummary, SampleGroup
from seamlessflow.tasks import TaskItem
from sf_trajectory.group_ids import group_index

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- group filters


@dataclass(frozen=True)
class Verdict:
    """What one group filter decided about one group."""

    group: SampleGroup | None
    """What goes on to the next filter and the batch (maybe fewer samples); None: dropped."""
    reason: str = ""
    dropped_sessions: tuple[str, ...] = ()
    """Sessions left out, for ``reason``."""
    waived: bool = False
    """The group met ``reason`` but was let through (a cap was reached)."""


def keep(group: SampleGroup) -> Verdict:
    return Verdict(group)


def drop(group: SampleGroup, reason: str) -> Verdict:
    # a session may give several samples (``grouping.trained_branches``): named once
    return Verdict(None, reason, tuple(dict.fromkeys(s.session_id for s in group.samples)))


def waive(group: SampleGroup, reason: str) -> Verdict:
    return Verdict(group, reason, waived=True)


@runtime_checkable
class GroupFilter(Protocol):
    name: str

    def judge(self, group: SampleGroup, batch_index: int) -> Verdict:
        """Judge a complete group once, for batch ``batch_index`` (trained by version
        ``batch_index``). Called in completion order."""
        ...


class StalenessSettings(PluginSettings):
    """``staleness``."""

    max_staleness: int = Field(default=4, ge=0)
    """A sample with a token generated more than this many versions before the version
    that will train it is dropped (reason ``stale``)."""


class Staleness:
    """Drop the samples with a token generated more than ``max_staleness`` versions
    before the version that trains the batch (reason ``stale``); a group left empty is
    dropped."""

    name = "staleness"
    settings_class = StalenessSettings

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness

    def judge(self, group: SampleGroup, batch_index: int) -> Verdict:
        # judged per session: a session's samples (``grouping.trained_branches``) go or
        # stay together
        stale: list[str] = []
        for sample in group.samples:
            produced = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
            if produced and batch_index - min(produced) > self.max_staleness:
                stale.append(sample.session_id)
        stale = list(dict.fromkeys(stale))
        fresh = [sample for sample in group.samples if sample.session_id not in stale]
        if not stale:
            return keep(group)
        if not fresh:
            return drop(group, "stale")
        trimmed = SampleGroup(group_id=group.group_id, task_id=group.task_id, samples=fresh)
        return Verdict(trimmed, "stale", tuple(stale))


class DynamicSamplingSettings(PluginSettings):
    """``dynamic_sampling``."""

    max_refills: int = Field(default=32, ge=0)
    """At most this many zero-variance groups are dropped (and refilled) per batch; later
    ones are kept (``groups_waived``), so a run whose groups all agree still makes
    progress. 0 = count zero-variance groups but keep them."""


class DynamicSampling:
    """DAPO's dynamic sampling: drop a group whose rewards are all equal (reason
    ``zero_variance``): its GRPO advantages are all zero, it would only dilute the batch.
    At most ``max_refills`` per batch, then such groups are let through.

    Each dropped group is refilled by the dispatcher. The cap bounds what a batch costs
    when the policy solves (or fails) every prompt: past it, zero-variance groups fill
    the batch (zero gradient, but the run goes on instead of dispatching forever).
    """

    name = "dynamic_sampling"
    settings_class = DynamicSamplingSettings

    def __init__(self, max_refills: int) -> None:
        self.max_refills = max_refills
        self._batch_index = -1
        self._refills = 0

    def judge(self, group: SampleGroup, batch_index: int) -> Verdict:
        if batch_index != self._batch_index:
            self._batch_index, self._refills = batch_index, 0
        if len({s.reward for s in group.samples}) > 1:
            return keep(group)
        if self._refills < self.max_refills:
            self._refills += 1
            return drop(group, "zero_variance")
        if self._refills == self.max_refills:
            self._refills += 1  # warn once per batch, and not when refills are off
            if self.max_refills:
                log.warning(
                    "batch %d: refill cap reached (%d zero-variance groups dropped); "
                    "zero-variance groups now fill the batch",
                    batch_index, self.max_refills,
                )  # fmt: skip
        return waive(group, "zero_variance")


# --------------------------------------------------------------------------- prompt-set filters


Outcome = Literal["all_correct", "mixed", "all_wrong"]


@dataclass
class PromptSelection:
    """Which prompts the next epoch dispatches, and why the others do not."""

    kept: list[TaskItem]
    kept_reasons: Counter[str] = field(default_factory=Counter)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> task ids left out."""


@runtime_checkable
class PromptSetFilter(Protocol):
    name: str

    def observe(self, group: SampleGroup | GroupSummary) -> None:
        """A complete group of a dispatched prompt, before any group filter."""
        ...

    def select(self, prompts: Sequence[TaskItem], since_group: int) -> PromptSelection:
        """At an epoch boundary: which of ``prompts`` (the ending epoch's) stay. Only
        groups dispatched at ``since_group`` or later (this stage) count."""
        ...


class HistoryResamplingSettings(PluginSettings):
    """``history_resampling``."""

    correct_reward: float = 1.0
    """A rollout whose reward is at least this counts as correct."""


class HistoryResampling:
    """SRPO's history resampling: at each epoch boundary, drop the prompts whose latest
    complete group, in this stage, was all correct (reward at least ``correct_reward``);
    keep the mixed and the all-wrong ones.

    "Latest" is by dispatch index, so the verdict does not depend on the order groups are
    observed in (completion order, or a replay after a restart). A prompt whose group of
    the ending epoch is still in flight at the boundary is judged by its previous group;
    a prompt without any complete group in the stage is kept (``unseen``).
    """

    name = "history_resampling"
    settings_class = HistoryResamplingSettings

    def __init__(self, correct_reward: float) -> None:
        self.correct_reward = correct_reward
        self.latest: dict[str, tuple[int, Outcome]] = {}
        """task id -> (dispatch index, outcome) of its latest complete group."""

    def observe(self, group: SampleGroup | GroupSummary) -> None:
        index = group_index(group.group_id)
        if index < 0 or not group.samples:
            return  # not dispatched by us, or nothing to learn from
        seen = self.latest.get(group.task_id)
        if seen is None or seen[0] <= index:
            self.latest[group.task_id] = (index, self.outcome(group))

    def outcome(self, group: SampleGroup | GroupSummary) -> Outcome:
        correct = sum(s.reward >= self.correct_reward for s in group.samples)
        if correct == len(group.samples):
            return "all_correct"
        return "all_wrong" if correct == 0 else "mixed"

    def select(self, prompts: Sequence[TaskItem], since_group: int) -> PromptSelection:
        selection = PromptSelection(kept=[])
        for item in prompts:
            index, outcome = self.latest.get(item.task_id, (-1, None))
            reason = outcome if outcome is not None and index >= since_group else "unseen"
            if reason == "all_correct":
                selection.dropped.setdefault(reason, []).append(item.task_id)
            else:
                selection.kept.append(item)
                selection.kept_reasons[reason] += 1
        return selection


# --------------------------------------------------------------------------- the registry


DataFilter = GroupFilter | PromptSetFilter

FILTERS_VARIABLE = "SF_TRAJECTORY_DATA_FILTERS"
SETTINGS_VARIABLE = "SF_TRAJECTORY_DATA_FILTER"
"""Each listed filter's keys: ``SF_TRAJECTORY_DATA_FILTER__<NAME>__<KEY>``."""

DATA_FILTERS: Registry[Callable[..., DataFilter]] = Registry(
    "data filter", FILTERS_VARIABLE, dotted_paths=True
)
for _builtin in (Staleness, DynamicSampling, HistoryResampling):
    DATA_FILTERS.add(_builtin.name, _builtin)


def parse_filter_names(text: str) -> list[str]:
    """``"staleness,dynamic_sampling"`` -> the listed names and dotted paths, in order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"a data filter is listed twice: {text!r}")
    return names


def filter_class(listed: str) -> Any:
    """The plug-in a ``SF_TRAJECTORY_DATA_FILTERS`` entry names: registered, or imported
    from its dotted path. Raises ValueError (one line) for a name nobody registered, a
    path that does not import, or a class without a ``name``."""
    try:
        plugin = DATA_FILTERS.get(listed)
    except (ImportError, AttributeError, TypeError) as exc:
        # a dotted path that is not there, or not callable
        raise ValueError(f"{FILTERS_VARIABLE}: {listed!r}: {exc}") from None
    name = getattr(plugin, "name", None)
    if not isinstance(plugin, type) or not isinstance(name, str) or not name:
        raise ValueError(
            f"{FILTERS_VARIABLE}: {listed!r} is not a data filter: a class with a "
            "'name' (see sf_trajectory.data_filters)"
        )
    return plugin


def build_filters(listed: Sequence[str], options: dict[str, dict[str, Any]]) -> list[DataFilter]:
    """The filters ``listed`` (names or dotted paths, in order), each built from its keys
    in ``options`` (keyed by the filter's ``name``). Raises ValueError in one line for
    anything :func:`filter_class` refuses, two filters of one name, keys for a filter
    not listed, a key the filter lacks, and a class that implements neither hook."""
    classes = [filter_class(entry) for entry in listed]
    names = [plugin.name for plugin in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"{FILTERS_VARIABLE}: two filters are named alike: {names}")
    for name in options:
        if name not in names:
            listing = ", ".join(names) or "none"
            raise ValueError(
                f"{SETTINGS_VARIABLE}__{name.upper()}: settings for the data filter {name!r}, "
                f"which {FILTERS_VARIABLE} does not list (it lists: {listing})"
            )
    filters = []
    for entry, plugin in zip(listed, classes, strict=True):
        choice = PluginChoice(name=plugin.name, **options.get(plugin.name, {}))
        settings_class = getattr(plugin, "settings_class", NoSettings)
        variable = f"{SETTINGS_VARIABLE}__{plugin.name.upper()}"
        settings = settings_of(choice, settings_class, "data filter", variable)
        built = plugin(**settings.model_dump())
        if not isinstance(built, GroupFilter | PromptSetFilter):
            raise ValueError(
                f"{FILTERS_VARIABLE}: {entry!r} is not a data filter: it has neither "
                "judge(group, batch_index) nor observe(group) and select(prompts, since_group)"
            )
        filters.append(built)
    return filters


class DataFilters:
    """The configured plug-ins, in order: one object the grouper and dispatcher share."""

    def __init__(self, filters: Sequence[DataFilter] = ()) -> None:
        self.names = [f.name for f in filters]
        self.group_filters = [f for f in filters if isinstance(f, GroupFilter)]
        self.prompt_filters = [f for f in filters if isinstance(f, PromptSetFilter)]

    @classmethod
    def from_settings(
        cls, listed: Sequence[str], options: dict[str, dict[str, Any]]
    ) -> DataFilters:
        """The filters ``SF_TRAJECTORY_DATA_FILTERS`` lists, with their keys (``build_filters``)."""
        return cls(build_filters(listed, options))

    def judge(self, group: SampleGroup, batch_index: int) -> list[Verdict]:
        """Every group filter's verdict, in order, up to the first that drops the group."""
        verdicts = []
        for group_filter in self.group_filters:
            verdict = group_filter.judge(group, batch_index)
            verdicts.append(verdict)
            if verdict.group is None:
                break
            group = verdict.group
        return verdicts

    def observe(self, group: SampleGroup | GroupSummary) -> None:
        for prompt_filter in self.prompt_filters:
            prompt_filter.observe(group)

    def select(self, prompts: Sequence[TaskItem], since_group: int) -> PromptSelection:
        """Each prompt-set filter chooses among what the previous ones kept."""
        selection = PromptSelection(kept=list(prompts))
        for prompt_filter in self.prompt_filters:
            step = prompt_filter.select(selection.kept, since_group)
            selection.kept = step.kept
            selection.kept_reasons = step.kept_reasons  # the last filter saw exactly these
            for reason, task_ids in step.dropped.items():
                selection.dropped.setdefault(reason, []).extend(task_ids)
        return selection
