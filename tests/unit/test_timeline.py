import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sf_app.cli import app
from sf_app.timeline import Interval, build_timeline, chrome_trace, load_phase_spans, render_run


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


# -- the Trace Event file (seamlessflow timeline --chrome-trace) --------------------------


def test_the_chrome_trace_has_one_track_per_resource_on_each_slot(tmp_path: Path) -> None:
    """Multiplexed: the trainer's slot s1 is lent to an engine while the trainer waits.
    Every phase interval becomes one complete event of its duration on its resource's
    track in its slot's process; the bubbles are the timeline's; the scheduler's lend
    and reclaim spans get a process of their own; times are µs since the first one."""

    def on(slots: list[str], resource: str, phase: str, start: float, end: float) -> dict:  # type: ignore[type-arg]
        record = span(resource, phase, start, end)
        record["attributes"]["resource.slots"] = slots
        record["attributes"]["resource.kind"] = "trainer" if resource == "trainer" else "engine"
        return record

    t0 = 1_700_000_000.0  # epoch seconds, as the spans have them
    phases = [
        on(["s0"], "engine-0", "rollout", t0 + 0, t0 + 4),
        on(["s0"], "engine-0", "idle", t0 + 4, t0 + 5.5),
        on(["s0"], "engine-0", "rollout", t0 + 5.5, t0 + 10),
        on(["s1"], "trainer", "idle", t0 + 0, t0 + 6),
        on(["s1"], "engine-lend-0", "rollout", t0 + 0.5, t0 + 5.5),
        on(["s1"], "engine-lend-0", "sync", t0 + 5.5, t0 + 6),
        on(["s1"], "trainer", "train", t0 + 6, t0 + 9.25),
    ]
    scheduler = [
        {
            "name": name,
            "service": "sf-tag-scheduler",
            "start": t0 + start,
            "end": t0 + end,
            "attributes": {"policy": "policy"},
        }
        for name, start, end in [("sched.lend", 0.25, 0.5), ("sched.reclaim", 5.5, 6)]
    ]
    other = {"name": "engine.generate", "start": t0 + 1, "end": t0 + 2, "attributes": {}}
    spans = [*phases, *scheduler, other]
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))

    trace = chrome_trace(tmp_path / "spans.jsonl")
    events = trace["traceEvents"]
    assert isinstance(events, list)
    json.dumps(trace)  # what gets written
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert sorted(processes.values()) == ["s0", "s1", "sf-tag-scheduler"]

    def track(event: dict) -> tuple[str, str]:  # type: ignore[type-arg]
        return processes[event["pid"]], threads[event["pid"], event["tid"]]

    slices = [e for e in events if e["ph"] == "X"]
    phase_events = [e for e in slices if e["cat"] == "phase"]
    assert len(phase_events) == len(phases)  # every phase on its one slot; nothing else
    by_track = {track(e) for e in phase_events}
    assert by_track == {("s0", "engine-0"), ("s1", "trainer"), ("s1", "engine-lend-0")}
    # durations and starts are the phase intervals, in µs from the first span
    got = sorted((*track(e), e["name"], e["ts"], e["dur"]) for e in phase_events)
    want = sorted(
        (
            s["attributes"]["resource.slots"][0],
            s["attributes"]["resource.id"],
            s["attributes"]["phase"],
            (s["start"] - t0) * 1e6,  # exact: binary fractions of a second
            (s["end"] - s["start"]) * 1e6,
        )
        for s in phases
    )
    assert got == want
    # the bubbles are the timeline's: s0 idles 4-5.5 s; s1 is lent while the trainer
    # waits, so it idles only before the lent engine starts and after training
    bubbles = sorted((track(e), e["ts"], e["dur"]) for e in slices if e["cat"] == "bubble")
    timeline = build_timeline(load_phase_spans(tmp_path / "spans.jsonl"))
    assert bubbles == sorted(
        ((slot, "bubbles"), (a - t0) * 1e6, (b - a) * 1e6)
        for slot in ("s0", "s1")
        for a, b in timeline.bubbles(slot)
    )
    assert bubbles == [
        (("s0", "bubbles"), 4e6, 1.5e6),
        (("s1", "bubbles"), 0, 0.5e6),
        (("s1", "bubbles"), 9.25e6, 0.75e6),
    ]
    # the bubbles track comes after the slot's resources
    s0 = [tid for (pid, tid), name in threads.items() if processes[pid] == "s0"]
    assert threads[processes_pid(processes, "s0"), max(s0)] == "bubbles"
    switches = sorted((e["name"], e["ts"], e["dur"]) for e in slices if e["cat"] == "scheduler")
    assert switches == [("sched.lend", 0.25e6, 0.25e6), ("sched.reclaim", 5.5e6, 0.5e6)]
    assert trace["otherData"]["start_unix_s"] == t0  # type: ignore[index]


def processes_pid(processes: dict[int, str], name: str) -> int:
    [pid] = [pid for pid, process in processes.items() if process == name]
    return pid


def test_overlapping_slices_of_one_track_go_to_rows_of_their_own(tmp_path: Path) -> None:
    """A viewer nests the slices of one thread; two lends of two policies that overlap
    without nesting are drawn on two rows of the same track."""
    spans = [
        {"name": "sched.lend", "start": 0, "end": 2, "attributes": {"policy": "solver"}},
        {"name": "sched.lend", "start": 1, "end": 3, "attributes": {"policy": "verifier"}},
        {"name": "sched.lend", "start": 2, "end": 4, "attributes": {"policy": "solver"}},
    ]
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    events = chrome_trace(tmp_path / "spans.jsonl")["traceEvents"]
    assert isinstance(events, list)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    rows = sorted((names[e["tid"]], e["ts"]) for e in events if e["ph"] == "X")
    assert rows == [("sched.lend", 0), ("sched.lend", 2e6), ("sched.lend (2)", 1e6)]


def test_seamlessflow_timeline_writes_the_chrome_trace(tmp_path: Path) -> None:
    spans = [span("engine-0", "rollout", 10, 12), span("engine-0", "idle", 12, 13)]
    spans.append(span("trainer", "train", 12.5, 13))
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    out = tmp_path / "trace" / "run.json"
    result = CliRunner().invoke(app, ["timeline", str(tmp_path), "--chrome-trace", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (5 slices" in result.output  # 3 phases, 2 bubbles
    events = json.loads(out.read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e["ph"] == "X") == [
        "bubble",
        "bubble",
        "idle",
        "rollout",
        "train",
    ]
    assert (tmp_path / "timeline.html").exists()  # the usual outputs too


def test_timeline_of_a_compose_run_volume_merges_every_process_file(tmp_path: Path) -> None:
    """Under compose nothing merges the spans at the end: the run volume holds only
    ``spans/<service>-<host>-<pid>.jsonl``. ``seamlessflow timeline`` merges them (two
    engine replicas, both pid 1 on their own hosts, two files)."""
    parts = tmp_path / "spans"
    parts.mkdir()
    for name, lines in {
        "engine-a1b2-1.jsonl": [span("engine-a", "rollout", 10, 12)],
        "engine-c3d4-1.jsonl": [span("engine-b", "rollout", 10, 11)],
        "trainer-e5f6-1.jsonl": [span("trainer", "train", 12, 13)],
    }.items():
        (parts / name).write_text("".join(json.dumps(s) + "\n" for s in lines))
    result = CliRunner().invoke(app, ["timeline", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {"engine-a", "engine-b", "trainer"} <= set(render_run(tmp_path).lanes)
    assert len((tmp_path / "spans.jsonl").read_text().splitlines()) == 3


def test_timeline_of_a_directory_without_spans_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["timeline", str(tmp_path)])
    assert result.exit_code != 0
    # the message as words: the error box wraps it where the terminal's width (and the
    # temporary path's length) says
    words = " ".join(re.sub(r"[\u2500-\u257f]", " ", result.output).split())
    assert "neither spans.jsonl nor spans/" in words


def test_replicas_on_two_hosts_never_share_a_spans_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from seamlessflow.service import spans_file_name

    names = set()
    for host in ("0f3a9c1d2b4e", "7e6d5c4b3a21"):  # two containers' host names, both pid 1
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr("os.getpid", lambda: 1)
        names.add(spans_file_name("engine"))
    assert names == {"engine-0f3a9c1d2b4e-1.jsonl", "engine-7e6d5c4b3a21-1.jsonl"}
    monkeypatch.setattr(socket, "gethostname", lambda: "a/b c")  # never a path
    assert spans_file_name("engine") == "engine-a_b_c-1.jsonl"
