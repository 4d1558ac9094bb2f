"""A run's timeline: one lane per resource slot, phases coloured, pipeline bubbles marked.

Input: the run's ``spans.jsonl``; every resource process (engine, trainer) records each
phase interval as a root span ``phase.<phase>`` with ``resource.id`` and
``resource.slots`` (``seamlessflow.resources``). A lane is a *slot* (a core, a GPU):
processes that share one (a trainer and the engine lent from its slot) draw on the
same lane, and a process on several slots (a trainer sharded over them) on each.
Spans without slots use their resource id as the slot.

Definitions (used by ``summary.json`` and ``seamlessflow timeline``):
- the *window* runs from the first moment any slot works (a non-idle phase starts)
  to the last moment any slot works;
- a slot's *busy* time is the union of the non-idle phase intervals of every process on
  it, inside the window; everything else in the window is idle: a *bubble*;
- ``bubble_ratio = idle slot-time / (slots x window)``.

Output: ``timeline.html`` and ``timeline.png`` (``render_run``), and on request the same
lanes as a Trace Event file (``chrome_trace``, ``seamlessflow timeline --chrome-trace``)
for Perfetto or ``chrome://tracing``, where the intervals can be zoomed, measured and
read alongside the scheduler's lend and reclaim spans.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

BUSY_PHASES = ("rollout", "train", "sync")
COLOURS = {"rollout": "#4c9be8", "train": "#e8964c", "sync": "#8e6ad8", "idle": "#f3c4c4"}


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    phase: str


@dataclass
class Timeline:
    lanes: dict[str, list[Interval]]
    """Busy intervals per resource, merged, clipped to the window."""
    window: tuple[float, float]

    @property
    def duration(self) -> float:
        return max(self.window[1] - self.window[0], 0.0)

    def busy(self, resource: str) -> float:
        return sum(i.end - i.start for i in self.lanes[resource])

    def bubbles(self, resource: str) -> list[tuple[float, float]]:
        gaps, cursor = [], self.window[0]
        for interval in self.lanes[resource]:
            if interval.start > cursor:
                gaps.append((cursor, interval.start))
            cursor = max(cursor, interval.end)
        if cursor < self.window[1]:
            gaps.append((cursor, self.window[1]))
        return gaps

    @property
    def bubble_ratio(self) -> float:
        total = self.duration * len(self.lanes)
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in self.lanes) / total


def load_phase_spans(spans_path: Path, by_resource: bool = False) -> dict[str, list[Interval]]:
    """Phase intervals per slot (the timeline's lanes), or per resource."""
    lanes: dict[str, list[Interval]] = defaultdict(list)
    with spans_path.open() as lines:
        for line in lines:
            span = json.loads(line)
            if not span["name"].startswith("phase."):
                continue
            attributes = span["attributes"]
            resource = attributes.get("resource.id")
            if not resource:
                continue
            phase = span["name"].removeprefix("phase.")
            interval = Interval(span["start"], span["end"], phase)
            if by_resource:
                lanes[resource].append(interval)
                continue
            for slot in attributes.get("resource.slots") or [resource]:
                lanes[slot].append(interval)
    return dict(lanes)


def build_timeline(phase_spans: dict[str, list[Interval]]) -> Timeline:
    busy = {
        resource: [i for i in intervals if i.phase in BUSY_PHASES and i.end > i.start]
        for resource, intervals in phase_spans.items()
    }
    starts = [i.start for intervals in busy.values() for i in intervals]
    ends = [i.end for intervals in busy.values() for i in intervals]
    if not starts:
        return Timeline({r: [] for r in phase_spans}, (0.0, 0.0))
    window = (min(starts), max(ends))
    return Timeline({r: _merge(intervals) for r, intervals in busy.items()}, window)


def _merge(intervals: list[Interval]) -> list[Interval]:
    """Union of overlapping intervals; adjacent ones of the same phase become one."""
    merged: list[Interval] = []
    for interval in sorted(intervals, key=lambda i: i.start):
        if merged and interval.start <= merged[-1].end:
            last = merged[-1]
            if interval.end > last.end:
                if interval.phase == last.phase:
                    merged[-1] = Interval(last.start, interval.end, last.phase)
                else:
                    merged.append(Interval(last.end, interval.end, interval.phase))
            continue
        merged.append(interval)
    return merged


def render_png(timeline: Timeline, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    resources = sorted(timeline.lanes)
    t0 = timeline.window[0]
    fig, ax = plt.subplots(figsize=(11, 1 + 0.6 * len(resources)))
    for row, resource in enumerate(resources):
        gaps = [(a - t0, b - a) for a, b in timeline.bubbles(resource)]
        ax.broken_barh(gaps, (row - 0.4, 0.8), facecolors=COLOURS["idle"])
        for phase in BUSY_PHASES:
            bars = [
                (i.start - t0, i.end - i.start)
                for i in timeline.lanes[resource]
                if i.phase == phase
            ]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[phase])
    ax.set_yticks(range(len(resources)), resources)
    ax.set_xlabel("seconds since the first busy phase")
    ax.set_title(f"{title}: bubble ratio {timeline.bubble_ratio:.3f}")
    ax.legend(
        handles=[
            Patch(color=c, label=p if p != "idle" else "idle (bubble)") for p, c in COLOURS.items()
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_html(timeline: Timeline, path: Path, title: str) -> None:
    t0, duration = timeline.window[0], max(timeline.duration, 1e-9)

    def bar(start: float, end: float, colour: str, label: str) -> str:
        left = 100 * (start - t0) / duration
        width = max(100 * (end - start) / duration, 0.02)
        return (
            f'<div class="bar" style="left:{left:.4f}%;width:{width:.4f}%;'
            f'background:{colour}" title="{html.escape(label)}"></div>'
        )

    rows = []
    for resource in sorted(timeline.lanes):
        bars = [
            bar(a, b, COLOURS["idle"], f"bubble {b - a:.3f}s")
            for a, b in timeline.bubbles(resource)
        ]
        bars += [
            bar(i.start, i.end, COLOURS[i.phase], f"{i.phase} {i.end - i.start:.3f}s")
            for i in timeline.lanes[resource]
        ]
        busy = timeline.busy(resource) / duration
        rows.append(
            f'<div class="row"><div class="name">{html.escape(resource)} '
            f'({100 * busy:.1f}% busy)</div><div class="lane">{"".join(bars)}</div></div>'
        )
    legend = " ".join(
        f'<span style="background:{c}">&nbsp;{p}&nbsp;</span>' for p, c in COLOURS.items()
    )
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>{t}</title><style>"
        "body{{font:14px sans-serif;margin:20px}}.row{{display:flex;margin:4px 0}}"
        ".name{{width:260px}}.lane{{position:relative;flex:1;height:22px;background:#fafafa}}"
        ".bar{{position:absolute;top:0;height:22px}}</style>"
        "<h2>{t}</h2><p>bubble ratio <b>{r:.3f}</b> (idle resource-time / total), window "
        "{d:.1f}s, {n} resources. {legend}</p>{rows}".format(
            t=html.escape(title),
            r=timeline.bubble_ratio,
            d=timeline.duration,
            n=len(timeline.lanes),
            legend=legend,
            rows="".join(rows),
        )
    )


def render_run(run_dir: Path) -> Timeline:
    """Write ``timeline.html`` and ``timeline.png`` for a run directory."""
    timeline = build_timeline(load_phase_spans(run_dir / "spans.jsonl"))
    render_png(timeline, run_dir / "timeline.png", run_dir.name)
    render_html(timeline, run_dir / "timeline.html", run_dir.name)
    return timeline


# -- the Trace Event format (Chrome's tracing, Perfetto) ----------------------------------

BUBBLES = "bubbles"
"""The name of each slot's track of idle gaps (the same bubbles ``Timeline`` counts)."""


@dataclass(frozen=True)
class TraceSlice:
    """One interval on one track: ``process`` is a slot or a service, ``track`` a
    resource, ``bubbles`` or a span name."""

    process: str
    track: str
    name: str
    category: str
    start: float
    end: float
    args: dict[str, object]


def trace_slices(spans_path: Path) -> list[TraceSlice]:
    """Every phase interval on each of its slots (the track: its resource), the slots'
    bubbles (the ``bubbles`` track), and the scheduler's ``sched.*`` spans (one track
    per span name, in a process named after the service)."""
    slices: list[TraceSlice] = []
    with spans_path.open() as lines:
        for line in lines:
            span = json.loads(line)
            name, start, end = span["name"], span["start"], span["end"]
            attributes = span.get("attributes") or {}
            if end < start:
                continue
            if name.startswith("phase."):
                resource = attributes.get("resource.id")
                if not resource:
                    continue
                args = {
                    "resource.id": resource,
                    "resource.kind": attributes.get("resource.kind", ""),
                    "seconds": end - start,
                }
                for slot in attributes.get("resource.slots") or [resource]:
                    slices.append(
                        TraceSlice(
                            slot, resource, name.removeprefix("phase."), "phase", start, end, args
                        )
                    )
            elif name.startswith("sched."):
                service = span.get("service") or "tag-scheduler"
                args = {**attributes, "seconds": end - start}
                slices.append(TraceSlice(service, name, name, "scheduler", start, end, args))
    timeline = build_timeline(load_phase_spans(spans_path))
    for slot in timeline.lanes:
        for start, end in timeline.bubbles(slot):
            slices.append(
                TraceSlice(slot, BUBBLES, "bubble", "bubble", start, end, {"seconds": end - start})
            )
    return slices


def _stacked(slices: list[TraceSlice]) -> list[list[TraceSlice]]:
    """Slices of one track as rows in which none overlaps the next: a viewer nests the
    slices of one thread, so a slice that overlaps without nesting goes one row down."""
    rows: list[list[TraceSlice]] = []
    for piece in sorted(slices, key=lambda s: (s.start, s.end)):
        for row in rows:
            if row[-1].end <= piece.start:
                row.append(piece)
                break
        else:
            rows.append([piece])
    return rows


def chrome_trace(spans_path: Path) -> dict[str, object]:
    """A run's phases as a Trace Event file (``{"traceEvents": [...]}``) for Perfetto
    or ``chrome://tracing``: one process per slot, in it one track per resource on that
    slot and one of bubbles; the scheduler's spans in a process of their own. Complete
    events (``"ph": "X"``), times in microseconds since the first slice starts."""
    slices = trace_slices(spans_path)
    t0 = min((s.start for s in slices), default=0.0)
    # slots first, then services (a slot and a service may share a name: kept apart)
    processes = sorted({(s.category == "scheduler", s.process) for s in slices})
    events: list[dict[str, object]] = []
    for pid, (is_service, process) in enumerate(processes, start=1):
        events.append(_metadata("process_name", pid, 0, process))
        events.append(_metadata("process_sort_index", pid, 0, pid))
        mine = [
            s for s in slices if (s.category == "scheduler", s.process) == (is_service, process)
        ]
        # resources by name, the bubbles under them
        tracks = sorted({s.track for s in mine}, key=lambda t: (t == BUBBLES, t))
        tid = 0
        for track in tracks:
            rows = _stacked([s for s in mine if s.track == track])
            for index, row in enumerate(rows):
                tid += 1
                label = track if index == 0 else f"{track} ({index + 1})"
                events.append(_metadata("thread_name", pid, tid, label))
                events.append(_metadata("thread_sort_index", pid, tid, tid))
                events.extend(
                    {
                        "name": s.name,
                        "cat": s.category,
                        "ph": "X",
                        "ts": round((s.start - t0) * 1e6, 3),
                        "dur": round((s.end - s.start) * 1e6, 3),
                        "pid": pid,
                        "tid": tid,
                        "args": s.args,
                    }
                    for s in row
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": str(spans_path), "start_unix_s": t0},
    }


def _metadata(name: str, pid: int, tid: int, value: object) -> dict[str, object]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def write_chrome_trace(spans_path: Path, out: Path) -> int:
    """Write :func:`chrome_trace` to ``out``; the number of slices written."""
    trace = chrome_trace(spans_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace))
    events = trace["traceEvents"]
    assert isinstance(events, list)
    return sum(1 for e in events if e["ph"] == "X")
