"""The defaults sweep's own logic (loadtests/defaults_sweep.py): which variants exist,
what command each runs, and what it reads back from a run's files. Its runs are real
`seamlessflow up` runs of minutes each: `just sweep-defaults`, not the suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import load_loadtest

sweep = load_loadtest("defaults_sweep")


def test_each_variant_changes_one_setting_from_the_models_defaults() -> None:
    args = sweep.parse_args(["--steps", "4", "--variants", "default,kl,group4"])
    commands = {v.name: sweep.up_command(args, v, f"r-{v.name}") for v in args.variant_list}
    base = commands["default"]
    assert base[base.index("--model") + 1] == "smollm2-135m-instruct"
    assert base[base.index("--steps") + 1] == "4"
    assert base[base.index("--eval-every") + 1] == "4"  # before the first step and after
    assert commands["group4"][len(base) :] == ["--group-size", "4", "--groups-per-batch", "8"]
    assert commands["kl"][len(base) :] == []
    assert sweep.VARIANTS["kl"].env == {"SF_TRAINER_KL_COEF": "0.05"}
    with pytest.raises(SystemExit):
        sweep.parse_args(["--variants", "default,warp-speed"])


def test_figures_come_from_the_runs_summary_and_metrics(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(
        json.dumps(
            {
                "status": "finished",
                "steps": 2,
                "eval_first": {"mean_reward": 0.25},
                "eval_last": {"mean_reward": 0.5},
                "mean_step_s": 20.0,
                "tokens_generated": 100,
            }
        )
    )
    records = [
        {"type": "train.eval", "step": 0, "mean_reward": 0.25},
        {"type": "train.metrics", "step": 1, "mean_reward": 0.125, "kl_mean": 0.0},
        {"type": "train.metrics", "step": 2, "mean_reward": 0.375, "kl_mean": 0.01},
        {"type": "train.eval", "step": 2, "mean_reward": 0.5},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    row = sweep.figures(run, sweep.VARIANTS["kl"], wall_s=61.0)
    assert row["eval"] == [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 0.5}]
    assert row["reward_by_step"] == [0.125, 0.375]
    assert row["kl_by_step"] == [0.0, 0.01]
    line = sweep.table([row]).splitlines()[-1]
    assert line.split()[:4] == ["kl", "0.250", "0.500", "+0.250"]
