import json
from pathlib import Path

import pytest

from sf_app.timeline import Interval, build_timeline, load_phase_spans, render_run


def span(resource: str, phase: str, start: float, end: float) -> dict:  # type: ignore[type-arg]
    return {
        "name": f"phase.{phase}",
        "start": start,
        "end": end,
        "attributes": {"resource.id": resource, "phase": phase},
    }


def test_bubble_ratio_by_hand(tmp_path: Path) -> None:
    spans = [
        span("engine-0", "idle", 0, 1),  # before the window: not counted
        span("engine-0", "rollout", 1, 4),
        span("engine-0", "idle", 4, 6),
        span("engine-0", "rollout", 6, 11),
        span("trainer", "idle", 0, 5),
        span("trainer", "train", 5, 7),
        span("trainer", "sync", 7, 8),
        {"name": "engine.generate", "start": 1, "end": 2, "attributes": {}},
    ]
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    timeline = build_timeline(load_phase_spans(tmp_path / "spans.jsonl"))
    assert timeline.window == (1, 11)
    assert timeline.busy("engine-0") == 8 and timeline.busy("trainer") == 3
    assert timeline.bubbles("engine-0") == [(4, 6)]
    assert timeline.bubbles("trainer") == [(1, 5), (8, 11)]
    # idle = 2 + 7 over 2 resources x 10 s
    assert timeline.bubble_ratio == pytest.approx(9 / 20)
    rendered = render_run(tmp_path)
    assert rendered.bubble_ratio == timeline.bubble_ratio
    page = (tmp_path / "timeline.html").read_text()
    assert "bubble ratio <b>0.450</b>" in page and "engine-0" in page
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_overlapping_phases_are_not_double_counted() -> None:
    lanes = {"e": [Interval(0, 4, "rollout"), Interval(2, 6, "rollout"), Interval(5, 8, "sync")]}
    timeline = build_timeline(lanes)
    assert timeline.busy("e") == 8 and timeline.bubble_ratio == 0


def test_no_busy_phase_means_an_empty_window() -> None:
    timeline = build_timeline({"e": [Interval(0, 3, "idle")]})
    assert timeline.duration == 0 and timeline.bubble_ratio == 0


def test_processes_sharing_a_slot_draw_one_lane(tmp_path: Path) -> None:
    """Multiplexed: the trainer's slot is lent to an engine while the trainer waits, so
    the slot is busy throughout; a trainer sharded over two slots fills both lanes."""

    def on(slots: list[str], resource: str, phase: str, start: float, end: float) -> dict:  # type: ignore[type-arg]
        record = span(resource, phase, start, end)
        record["attributes"]["resource.slots"] = slots
        return record

    spans = [
        on(["s0"], "engine-0", "rollout", 0, 10),
        on(["s1"], "trainer", "idle", 0, 6),
        on(["s1"], "engine-lend-0", "rollout", 0, 5.5),
        on(["s1"], "engine-lend-0", "sync", 5.5, 6),  # releasing its slot
        on(["s1"], "trainer", "train", 6, 9),
        on(["s1"], "trainer", "sync", 9, 10),
    ]
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    timeline = build_timeline(load_phase_spans(tmp_path / "spans.jsonl"))
    assert sorted(timeline.lanes) == ["s0", "s1"]
    assert timeline.bubble_ratio == 0

    sharded = build_timeline(
        load_phase_spans_from([on(["a", "b"], "trainer", "train", 0, 2)], tmp_path)
    )
    assert sorted(sharded.lanes) == ["a", "b"] and sharded.busy("a") == sharded.busy("b") == 2


def load_phase_spans_from(spans: list[dict], tmp_path: Path) -> dict:  # type: ignore[type-arg]
    path = tmp_path / "more.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    return load_phase_spans(path)
