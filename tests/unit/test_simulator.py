"""The simulator drives the production policy object on virtual time, and its
bookkeeping closes: every sample is trained at most once, every decoded token is
accounted for, and the measures stay in range."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sf_app.cli import app
from sf_app.simulator import (
    AGENTIC,
    COLOCATED,
    SINGLE_TURN,
    Deployment,
    EngineModel,
    SimConfig,
    Simulation,
    SwitchModel,
    TrainerModel,
    WorkloadModel,
    auto,
    calibrate_from_run,
    disaggregated,
    multiplexed,
    simulate,
)
from sf_tag_scheduler.policy import TagPolicy

SMALL = SimConfig(gpus=8, steps=4)


def test_the_simulators_policy_is_the_production_object(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}

    def spy(name: str) -> None:
        original = getattr(TagPolicy, name)

        def counted(self: TagPolicy, *args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(TagPolicy, name, counted)

    for name in ("add", "trainer_waiting", "trainer_claims", "role_of", "observe_lend"):
        spy(name)
    sim = Simulation(replace(SMALL, deployment=multiplexed(0.5)))
    assert type(sim.policy) is TagPolicy
    result = sim.run()
    assert result.steps == SMALL.steps
    # one trainer + 4 dedicated + 4 lendable engines registered
    assert calls["add"] == 9
    # the trainer waits once before each step (the first at start) and claims once per step
    assert calls["trainer_waiting"] == calls["trainer_claims"] == SMALL.steps
    assert calls["role_of"] > 0 and calls["observe_lend"] > 0


def test_lending_decisions_come_from_the_policy() -> None:
    """The policy measures steps/s over a block that lends, a block that keeps the slots
    and a block that lends again (the bracket) on the simulated run, then decides block
    by block; a margin no gain can beat
    makes it keep the slots after the measuring blocks, and the simulation follows."""
    config = replace(SMALL, steps=13, deployment=auto(0.5))
    eager_sim = Simulation(config)
    eager = eager_sim.run()
    policy = eager_sim.policy
    block = policy.config.block_steps
    waits = [d for d in policy.stats.decisions if d.startswith("wait:")]
    assert "fills the pipeline" in waits[0]
    assert f"not measured yet: a block of {block} lends" in waits[1]
    assert f"not measured yet: a block of {block} keeps" in waits[1 + block]
    assert f"(a bracket): a block of {block} lends" in waits[1 + 2 * block]
    assert "alone" in waits[1 + 3 * block]  # the measurements decide
    assert policy.period_lent.samples == 2 and policy.period_alone.samples == 1
    lend_decisions = sum(1 for d in waits if not d.startswith("wait: lend 0 "))
    assert eager.lends == 4 * lend_decisions
    reluctant = simulate(replace(config, lend_margin=1e9))
    assert reluctant.lends == reluctant.reclaims == (1 + 2 * block) * 4  # fill, measure
    assert reluctant.declined == config.steps - 1 - 2 * block
    # multiplexed lends at every wait, whatever a margin says
    always = simulate(replace(config, deployment=multiplexed(0.5), lend_margin=1e9))
    assert always.lends == config.steps * 4 and always.declined == 0


@pytest.mark.parametrize("workload", [SINGLE_TURN, AGENTIC])
def test_a_freshly_lent_engine_gets_work_from_the_busiest(
    workload: WorkloadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rebalance on lend: once a lent engine serves, it holds the mean load of the
    serving engines (or every request above the mean the others had), taken from the
    busiest; without it, a lent engine only gets what arrives later."""
    seen: list[tuple[int, int, int]] = []
    rebalance = Simulation._rebalance_onto

    def spy(sim: Simulation, target) -> None:  # type: ignore[no-untyped-def]
        loads = [len(e.running) for e in sim.engines if e.serving]
        share = sum(loads) // len(loads)
        before = len(target.running)
        excess = sum(max(n - share, 0) for n in loads) - max(before - share, 0)
        rebalance(sim, target)
        seen.append((before, len(target.running), before + min(max(share - before, 0), excess)))

    monkeypatch.setattr(Simulation, "_rebalance_onto", spy)
    config = replace(SMALL, steps=8, workload=workload, deployment=multiplexed(0.5))
    with_rebalance = simulate(config)
    assert seen and all(after == expected for _, after, expected in seen)
    assert any(after > before for before, after, _ in seen)  # the mechanism engaged
    seen.clear()
    without = simulate(replace(config, rebalance_on_lend=False))
    assert not seen
    # the same samples; rebalancing moves sequences a reclaim alone would not
    assert with_rebalance.interrupted > 0 and without.trained_samples > 0


def test_disaggregated_never_lends_and_colocated_always_does() -> None:
    split = simulate(replace(SMALL, deployment=disaggregated(0.5)))
    assert split.lends == split.reclaims == split.declined == 0
    assert split.train_gpus == 4
    colocated = simulate(replace(SMALL, deployment=COLOCATED))
    assert colocated.train_gpus == 8
    assert colocated.lends == colocated.reclaims == 8 * SMALL.steps
    assert colocated.declined == 0
    # synchronous: every token is generated by the version that trains on it
    assert colocated.mean_staleness == pytest.approx(0, abs=1e-9)
    assert colocated.max_staleness == 0


@pytest.mark.parametrize(
    ("deployment", "workload", "rebalance", "options"),
    [
        (COLOCATED, SINGLE_TURN, False, {}),
        (disaggregated(0.5), SINGLE_TURN, False, {}),
        (multiplexed(0.75), AGENTIC, False, {}),
        (multiplexed(0.5), AGENTIC, True, {}),
        (multiplexed(0.5), SINGLE_TURN, True, {"reclaim_early_at": 0.5}),
        (multiplexed(0.75), AGENTIC, True, {"lend_shares": (0.5, 1.0)}),
        (multiplexed(0.5), SINGLE_TURN, True, {"overlap_weight_sync": True}),
        (auto(0.5), AGENTIC, True, {}),
    ],
)
def test_every_sample_is_trained_exactly_once(
    deployment: Deployment, workload: WorkloadModel, rebalance: bool, options: dict[str, Any]
) -> None:
    """With a bounded dispatch and no staleness bound, conservation is exact: every
    decoded token (also those of sequences moved off reclaimed engines) is trained."""
    config = replace(
        SMALL,
        deployment=deployment,
        workload=workload,
        max_staleness=None,
        bounded_dispatch=True,
        rebalance_on_lend=rebalance,
        **options,
    )
    sim = Simulation(config)
    result = sim.run()
    per_step = workload.groups_per_step(8) * workload.group_size
    assert len(sim.dispatched) == result.trained_samples == SMALL.steps * per_step
    assert all(sample.trained == 1 for sample in sim.dispatched)
    assert result.trained_tokens == sum(sample.generated for sample in sim.dispatched)
    assert result.decoded_tokens == pytest.approx(result.trained_tokens, rel=1e-9)
    assert result.dropped_samples == 0 and result.untrained_fraction < 1e-9
    if deployment.mode == "multiplexed":
        assert result.interrupted > 0  # partial rollout moved work and lost none


def test_stale_samples_are_dropped_and_never_trained() -> None:
    sim = Simulation(replace(SMALL, deployment=disaggregated(0.5), max_staleness=0))
    result = sim.run()
    dropped = [s for s in sim.dispatched if s.dropped]
    assert result.dropped_samples == len(dropped) > 0
    assert all(s.trained == 0 for s in dropped)
    assert all(s.trained <= 1 for s in sim.dispatched)
    assert result.max_staleness == 0
    generated = sum(s.generated for s in sim.dispatched)
    assert result.decoded_tokens >= generated - 1e-6
    assert generated >= result.trained_tokens + result.dropped_tokens


@pytest.mark.parametrize("workload", [SINGLE_TURN, AGENTIC])
def test_lending_fills_bubbles(workload: WorkloadModel) -> None:
    base = replace(SimConfig(gpus=16, steps=5), workload=workload)
    results = {
        name: simulate(replace(base, deployment=deployment))
        for name, deployment in [
            ("colocated", COLOCATED),
            ("split", disaggregated(0.5)),
            ("multiplexed", multiplexed(0.5)),
        ]
    }
    for result in results.values():
        assert 0.0 <= result.bubble_ratio <= 1.0
        assert result.tokens_per_s > 0
    assert results["multiplexed"].bubble_ratio <= results["split"].bubble_ratio
    # the synchronous baseline idles through every long tail
    assert results["colocated"].bubble_ratio > results["split"].bubble_ratio


BY_HAND = SimConfig(
    gpus=2,
    steps=1,
    deployment=disaggregated(0.5),
    workload=WorkloadModel(
        samples_per_gpu=1,
        group_size=2,
        prompt_tokens=0,
        response_sigma=0.0,
        response_mean_tokens=100.0,
    ),
    engine=EngineModel(
        max_concurrency=2, decode_tokens_per_s_alone=100.0, decode_tokens_per_s_full=150.0
    ),
    trainer=TrainerModel(
        train_tokens_per_s_per_gpu=100.0, step_overhead_s=0.0, model_bytes=0.0, sync_latency_s=0.5
    ),
    bounded_dispatch=True,
    overlap_weight_sync=False,
)
"""Two GPUs: a trainer on one, an engine on the other; one group of two 100-token
answers (no prompt, no spread). Two sequences decode at 1 / (base + 2 per_seq) = 75
tokens/s: done at 4/3 s. The trainer trains 200 tokens at 100/s (2 s), then publishes
for 0.5 s while the engine loads the weights."""


def test_a_step_worked_out_by_hand() -> None:
    """``BY_HAND``, the engine pausing for the whole publish."""
    result = simulate(BY_HAND)
    assert result.window_s == pytest.approx(4 / 3 + 2 + 0.5)
    busy = (4 / 3 + 0.5) + (2 + 0.5)  # engine slot + trainer slot
    assert result.bubble_ratio == pytest.approx(1 - busy / (2 * result.window_s))
    assert result.trained_tokens == 200 and result.tokens_per_s == pytest.approx(
        200 / (4 / 3 + 2.5)
    )
    assert result.mean_trainer_wait_s == pytest.approx(4 / 3)


def test_overlapped_weight_sync_pauses_the_engine_only_for_the_swap() -> None:
    """``BY_HAND`` with the payloads arriving while the engine decodes: the engine pauses
    0.1 s for the swap instead of the whole 0.5 s publish."""
    config = replace(
        BY_HAND, trainer=replace(BY_HAND.trainer, swap_s=0.1), overlap_weight_sync=True
    )
    result = simulate(config)
    assert result.window_s == pytest.approx(4 / 3 + 2 + 0.5)  # the trainer still publishes
    busy = (4 / 3 + 0.1) + (2 + 0.5)
    assert result.bubble_ratio == pytest.approx(1 - busy / (2 * result.window_s))


def test_an_early_reclaim_overlaps_the_end_of_rollout() -> None:
    """With ``reclaim_early_at`` the lent engines are taken back while the trainer still
    waits (``TagPolicy.trainer_prepares``): the claim that follows has nothing to take
    back, and everything lent is taken back exactly once."""
    config = replace(SMALL, steps=8, deployment=multiplexed(0.5), reclaim_early_at=0.5)
    sim = Simulation(config)
    result = sim.run()
    decisions = sim.policy.stats.decisions
    early = [i for i, d in enumerate(decisions) if d.startswith("prepare: reclaim")]
    assert early, "no lent engine was taken back early"
    for i in early:
        claim = next(d for d in decisions[i:] if d.startswith("claim:"))
        assert claim == "claim: reclaim 0"
    assert result.lends == result.reclaims
    assert result.interrupted > 0
    late = simulate(replace(config, reclaim_early_at=1.0))
    assert late.lends == late.reclaims and late.trained_samples == result.trained_samples


def test_same_seed_same_figures() -> None:
    config = replace(SMALL, deployment=multiplexed(0.5), workload=AGENTIC)
    assert simulate(config) == simulate(config)
    assert simulate(config) != simulate(replace(config, seed=1))


def test_calibration_from_a_run(tmp_path: Path) -> None:
    summary = {
        "steps": 10,
        "tokens_generated": 3200,
        "tokens_trained": 3200,
        "generated_tokens_per_s": 300.0,
        "mean_step_s": 0.2,
        "mean_wait_s": 0.4,
        "mean_publish_s": 0.02,
        "config": {"group_size": 8, "groups_per_batch": 4, "engines": 2, "max_tokens": 6,
                   "engine_batch_size": 64},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    spans = [
        {"name": "sched.reclaim", "attributes": {"seconds": 0.004, "reclaimed": ["e1"]}},
        {"name": "sched.reclaim", "attributes": {"seconds": 9.0, "reclaimed": []}},
        {"name": "sched.lend", "attributes": {"seconds": 0.05}},
        {"name": "engine.generate", "attributes": {"prompt_tokens": 20}},
        {"name": "engine.generate", "attributes": {"prompt_tokens": 30}},
    ]
    (tmp_path / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    calibration = calibrate_from_run(tmp_path, SimConfig())
    config = calibration.config
    assert config.workload.response_mean_tokens == pytest.approx(3200 / (10 * 32))
    assert config.workload.max_tokens == 6
    assert config.workload.prompt_tokens == 25
    assert config.workload.samples_per_gpu * 3 <= 32 < config.workload.samples_per_gpu * 4
    assert config.engine.decode_tokens_per_s_full == pytest.approx(150.0)
    assert config.engine.max_concurrency == 64
    # a modeled step over the run's batch takes the run's mean step time
    batch_tokens = 32 * (25 + 3200 / (10 * 32))
    assert batch_tokens / config.trainer.train_tokens_per_s_per_gpu == pytest.approx(0.2)
    assert config.trainer.sync_s == pytest.approx(0.02)
    assert config.switch == SwitchModel(lend_in_s=0.05, reclaim_s=0.004)
    result = simulate(replace(config, gpus=8, steps=3, deployment=multiplexed(0.5)))
    assert result.steps == 3 and result.trained_tokens > 0


def test_the_cli_prints_every_deployment(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app, ["simulate", "--gpus", "8", "--steps", "3", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    for name in ("colocated", "disaggregated", "multiplexed", "auto"):
        assert f"| 8 | {name} |" in result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["deployment"] for r in rows] == ["colocated", "disaggregated", "multiplexed", "auto"]
    assert rows[0]["speedup"] == 1.0 and all(0 <= r["bubble_ratio"] <= 1 for r in rows)
    bad = CliRunner().invoke(app, ["simulate", "--task", "poetry"])
    assert bad.exit_code != 0
    synchronous = CliRunner().invoke(app, ["simulate", "--max-batches-ahead", "0"])
    assert synchronous.exit_code != 0  # that is colocated's synchronous pacing, not an async one


def test_the_cli_passes_the_multiplexing_knobs(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    knobs = ["--lend-shares", "0.5,1", "--reclaim-early-at", "0.75", "--no-overlap-weight-sync"]
    result = CliRunner().invoke(
        app, ["simulate", "--gpus", "8", "--steps", "3", "--json", str(out), *knobs]
    )
    assert result.exit_code == 0, result.output
    assert "lend shares 0.5,1; reclaim early at 0.75; engines pause" in result.output
    model = json.loads(out.read_text())["model"]
    assert model["lend_shares"] == [0.5, 1.0] and model["reclaim_early_at"] == 0.75
    assert model["overlap_weight_sync"] is False
    for bad in (["--lend-shares", "0.5"], ["--lend-shares", "0,1"], ["--reclaim-early-at", "0"]):
        refused = CliRunner().invoke(app, ["simulate", "--gpus", "8", *bad])
        assert refused.exit_code == 2 and "Invalid value" in refused.output, bad


def test_rollout_runs_as_far_ahead_as_the_pacing_allows() -> None:
    """``max_batches_ahead`` (SF_TRAJECTORY's pacing): the dispatcher holds batch b's
    groups until batch b - ahead is trained, so at most ahead + 1 batches are dispatched
    and untrained at any time."""
    for ahead in (1, 2):
        sim = Simulation(replace(SMALL, steps=6, deployment=multiplexed(0.5, ahead)))
        dispatched_at: list[tuple[int, int]] = []
        dispatch = sim._dispatch

        def spy(sim: Simulation = sim, dispatch=dispatch, seen=dispatched_at) -> None:  # type: ignore[no-untyped-def]
            dispatch()
            seen.append((sim.trained_batches, sim.next_group // sim.groups_per_step))

        sim._dispatch = spy  # type: ignore[method-assign]
        sim.run()
        assert all(batches - trained == ahead + 1 for trained, batches in dispatched_at)


def test_a_bounded_dispatch_cannot_refill_dropped_groups() -> None:
    """Like the trajectory service once its trainer announced a step budget: once a
    whole group is dropped as stale, the last batch can never fill. The simulator says
    so instead of spinning."""
    config = replace(SMALL, deployment=disaggregated(0.5), max_staleness=1, bounded_dispatch=True)
    with pytest.raises(RuntimeError, match="stalled"):
        simulate(config)
