"""A run's task schedule: which task sources each trainer batch draws its prompts from.

The grammar of ``SF_TRAJECTORY_STAGES`` and of a run's task (``seamlessflow up --task``,
``[run] task``), which may be one source, a mixture of sources, or SRPO's stages; built
into prompt sets by the trajectory service (``sf_trajectory.schedule``), read for its
sources by the trainer's evaluation and the run's checks. Pure: no task is built here.

``SF_TRAJECTORY_STAGES="lookup:100,arithmetic"``: entries separated by commas, each a task
source name (``seamlessflow.tasks.get_task_source``) and, after the last ``:``, how many
batches the stage lasts. Every stage but the last has a count; the last runs to the end
of the run (``total_batches``). Stage ``s`` covers the batches after the earlier stages'
counts: here ``lookup`` trains batches 0-99, ``arithmetic`` batch 100 on. One entry
without a count is a one-stage schedule: a plain task name is one.

A task name may itself hold a ``:`` (a dataset path): only a final ``:<digits>`` is a
count.

**A stage of several sources** (SRPO's second stage: math and code together) joins them
with ``+``, each with an optional ``*<weight>``: ``rg:chain_sum*2+rg:bf*1:40``. Its prompt
set holds the sources in those proportions, as many prompts as the proportions allow
without repeating one (each source's share is a seeded sample of its train split), and
each prompt is scored by its own source's reward function. Its task ids are prefixed
with their source (``rg:bf/17``), so prompts of two sources never share an id. (``+``,
``*`` and ``,`` inside a source's options are written ``%2B``, ``%2A`` and ``%2C``.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSource:
    """One task source of a stage and its weight in the stage's prompt set."""

    task: str
    weight: float = 1.0


@dataclass(frozen=True)
class StageSpec:
    """One stage as configured: its task sources (as written) and its length in batches."""

    task: str
    """The stage's entry without its count: a source name, or sources joined by ``+``."""
    batches: int | None
    """None for the last stage: it lasts to the end of the run."""

    def sources(self) -> list[StageSource]:
        """``"a*2+b"`` -> ``a`` weight 2, ``b`` weight 1. Raises ValueError."""
        return [_parse_source(part, self.task) for part in self.task.split("+")]


def parse_stages(text: str) -> list[StageSpec]:
    """``"lookup:100,arithmetic"`` -> two specs; ``""`` -> none. Raises ValueError."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    specs = [_parse_entry(entry) for entry in entries]
    for spec in specs:
        spec.sources()  # each source names a task and, where given, a positive weight
    for spec in specs[:-1]:
        if spec.batches is None:
            raise ValueError(f"stage {spec.task!r} needs a length in batches ({spec.task}:N)")
    if specs and specs[-1].batches is not None:
        raise ValueError(
            f"the last stage ({specs[-1].task!r}) runs to the end of the run: give it no count"
        )
    return specs


def _parse_entry(entry: str) -> StageSpec:
    task, sep, count = entry.rpartition(":")
    if not sep or not count.isdigit():
        return StageSpec(task=entry, batches=None)
    if not task or int(count) < 1:
        raise ValueError(f"stage {entry!r}: expected <task>:<batches>, batches >= 1")
    return StageSpec(task=task, batches=int(count))


def _parse_source(part: str, entry: str) -> StageSource:
    task, sep, weight = part.strip().rpartition("*")
    if not sep:
        task, weight = part.strip(), "1"
    try:
        value = float(weight)
    except ValueError:
        value = 0.0
    if not task or not value > 0 or value == float("inf"):
        raise ValueError(
            f"stage {entry!r}: {part.strip()!r} is not <task> or <task>*<weight> with a "
            "weight above 0"
        )
    return StageSource(task=task, weight=value)


def schedule_sources(text: str) -> list[str]:
    """Every task source a schedule (or a plain comma-separated list of tasks) names, in
    order, each once, without counts or weights: ``"a:10,a*2+b"`` -> ``["a", "b"]``."""
    names: list[str] = []
    for entry in (part.strip() for part in text.split(",")):
        if entry:
            names += [source.task for source in _parse_entry(entry).sources()]
    return list(dict.fromkeys(names))
