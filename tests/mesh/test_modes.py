"""The deployments are configurations of one scheduler: the whole mesh, every service
its own process, in each mode, for a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seamlessflow.machine import resolve_precision
from sf_app.run.config import RunConfig, deployment, resolve_mode
from sf_app.timeline import build_timeline, load_phase_spans
from tests.support import small_embedded_run

pytestmark = pytest.mark.slow


def test_modes_differ_only_in_tags() -> None:
    disaggregated = deployment("disaggregated", engines=1)
    multiplexed = deployment("multiplexed", engines=1)
    colocated = deployment("colocated", engines=1)
    # the same two slots in every mode
    assert disaggregated.slots == multiplexed.slots == colocated.slots == ["slot-0", "slot-1"]
    assert [(e.tags, e.slot) for e in disaggregated.engines] == [("rollout", "slot-0")]
    assert disaggregated.trainer_slots == ["slot-1"] and disaggregated.trainer_tags == "train"
    # multiplexed = disaggregated + an engine lendable from the trainer's slot
    assert multiplexed.engines[:1] == disaggregated.engines
    assert [(e.tags, e.slot) for e in multiplexed.engines[1:]] == [("train,rollout", "slot-1")]
    # colocated: every slot trains and rolls out
    assert {e.tags for e in colocated.engines} == {"train,rollout"}
    assert colocated.trainer_slots == ["slot-0", "slot-1"]
    assert RunConfig(mode="colocated").max_batches_ahead == 0
    assert RunConfig(mode="colocated", max_batches_ahead=1).max_batches_ahead == 1
    # auto (the default) is laid out as multiplexed where slots are real, else as
    # disaggregated: unpinned CPU cores have no idle slot to lend
    assert RunConfig().mode == "auto"
    assert deployment("auto", engines=1) == multiplexed
    for pinned, device, layout in [
        (True, "cpu", "multiplexed"),
        (False, "cuda", "multiplexed"),
        (False, "cpu", "disaggregated"),
    ]:
        choice = resolve_mode("auto", pin_slots=pinned, device=device)
        assert (choice.requested, choice.layout) == ("auto", layout), choice
        assert choice.line().startswith("mode auto: laid out " + layout)
    assert "--pin-slots" in resolve_mode("auto", pin_slots=False, device="cpu").reason
    for mode in ("colocated", "disaggregated", "multiplexed"):
        choice = resolve_mode(mode, pin_slots=False, device="cpu")
        assert choice.layout == mode and choice.line() == f"mode {mode}"


@pytest.mark.parametrize("mode", ["colocated", "multiplexed", "auto"])
async def test_a_run_lends_and_reclaims_training_slots(
    mode: str,
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = 3
    if mode == "colocated":  # trainer and engines offload in turn, as on a GPU by default
        monkeypatch.setenv("SF_TRAINER_OFFLOAD_WHEN_LENT", "on")
        monkeypatch.setenv("SF_ENGINE_HF_OFFLOAD_ASLEEP", "on")
    # auto on pinned slots: laid out as multiplexed, lending decided by measurement
    summary = await small_embedded_run(
        run_id, tmp_path, base_model_dir, steps, nats_url=nats_url, mode=mode,
        precision="auto", pin_slots=mode == "auto",
    ).run()  # fmt: skip
    assert summary.status == "finished" and summary.final_version == steps
    assert summary.mode == mode
    written = json.loads((tmp_path / run_id / "summary.json").read_text())
    assert written["mode"] == mode and 0 <= written["bubble_ratio"] < 1
    layout = "colocated" if mode == "colocated" else "multiplexed"
    assert written["mode_choice"]["layout"] == layout, written["mode_choice"]
    # three steps are the fill and one exploring block: no measured choice, no switch
    assert written["lending_switches"] == []
    # the run records the precision it resolved on this machine, and why
    chosen = resolve_precision("auto")
    assert written["precision"] == {**chosen.record(), "requested": "auto"}
    assert written["hardware"]["cpu_bf16"] == (chosen.chosen == "bf16-mixed")
    trainer_log = (tmp_path / run_id / "logs" / "trainer.log").read_text()
    assert chosen.line() in trainer_log
    spans = [
        json.loads(line) for line in (tmp_path / run_id / "spans.jsonl").read_text().splitlines()
    ]
    # the trainer released its slots before every step (at start, then after each publish)
    decisions = [s["attributes"] for s in spans if s["name"] == "sched.decide"]
    assert len(decisions) == steps
    if mode == "colocated":  # lending is unconditional: both engines at every step
        # (the first step may come before the slower engine has even registered)
        assert 2 * (steps - 1) <= summary.reclaims <= 2 * steps, summary
        assert all(d["reason"] in ("mode always lends", "nothing lendable") for d in decisions)
    elif mode == "multiplexed":  # lends at every wait that has something to lend
        assert summary.reclaims <= steps
        known = ("mode always lends", "nothing lendable", "no dedicated engine")
        assert all(any(k in d["reason"] for k in known) for d in decisions), decisions
    else:  # auto: the policy followed its block rule at every wait (or had nothing to lend)
        assert summary.reclaims <= steps
        known = ("block", "measure", "nothing lendable", "no dedicated engine")
        assert all(any(k in d["reason"] for k in known) for d in decisions), decisions
    reclaims = [s for s in spans if s["name"] == "sched.reclaim"]
    assert len(reclaims) == steps and all(not s["attributes"]["missed"] for s in reclaims)
    # training never overlapped a lent engine's generation on the same slot
    train = [
        s
        for s in spans
        if s["name"] == "phase.train" and s["attributes"]["resource.kind"] == "trainer"
    ]
    lent_rollout = [
        s
        for s in spans
        if s["name"] == "phase.rollout"
        and (mode == "colocated" or "lend" in s["attributes"]["resource.id"])
    ]
    assert len(train) == steps
    # summary.json's phase seconds are the phase spans, added up per resource
    trainer_phases = written["phase_seconds"][train[0]["attributes"]["resource.id"]]
    assert trainer_phases["train"] == pytest.approx(sum(t["end"] - t["start"] for t in train),
                                                    abs=0.01)  # fmt: skip
    engines = {s["attributes"]["resource.id"] for s in spans if s["name"] == "phase.rollout"}
    assert engines and engines <= set(written["phase_seconds"])
    for t in train:
        for r in lent_rollout:
            assert r["end"] <= t["start"] or r["start"] >= t["end"], "engine and trainer overlapped"
    if mode == "colocated":
        assert_lent_only_while_offloaded(spans, decisions)
        for engine in ("engine-0", "engine-1"):  # asleep while reclaimed, awake when lent
            engine_log = (tmp_path / run_id / "logs" / f"{engine}.log").read_text()
            asleep = engine_log.count("asleep: offload in")
            assert asleep >= steps - 1 and engine_log.count("awake: reload in") >= asleep - 1
    lanes = build_timeline(load_phase_spans(tmp_path / run_id / "spans.jsonl")).lanes
    assert sorted(lanes) == ["slot-0", "slot-1"]


def assert_lent_only_while_offloaded(spans: list[dict], decisions: list[dict]) -> None:
    """Every wait that lent engines offloaded the trainer first, and took its state back
    before the step; from the first offload on, a lent engine started serving only while
    the trainer's state was off the device. (Engines that register while no trainer
    trains are lent at once, before any release: the first wait then lends nothing new.)"""
    offloads = sorted(
        (s for s in spans if s["name"] == "trainer.offload"), key=lambda s: s["start"]
    )
    reloads = sorted((s for s in spans if s["name"] == "trainer.reload"), key=lambda s: s["start"])
    lending_waits = [d for d in decisions if d["lent"]]
    assert len(offloads) == len(lending_waits) and offloads, decisions
    assert all(o["attributes"]["bytes"] > 0 for o in offloads)
    # the last wait ends the run: no claim, no reload after it
    assert len(reloads) in (len(offloads), len(offloads) - 1)
    rollouts = [
        s for s in spans
        if s["name"] == "phase.rollout" and s["start"] > offloads[0]["start"]
        and s["attributes"]["resource.kind"] == "engine"
    ]  # fmt: skip
    assert rollouts
    for rollout in rollouts:
        offloaded = [o["end"] for o in offloads if o["end"] <= rollout["start"]]
        reloaded = [r["start"] for r in reloads if r["start"] <= rollout["start"]]
        assert offloaded and (not reloaded or max(reloaded) < max(offloaded)), rollout
