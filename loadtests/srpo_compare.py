"""SRPO against plain GRPO on the real model: the same run file (``examples/run_files/
srpo.toml``: math, then math and code mixed), the same steps, seeds and cores; the one
difference is history resampling (``SF_TRAJECTORY_DATA_FILTERS``: ``staleness,
history_resampling`` against ``staleness``). Each run is a real ``seamlessflow up``.

Per arm it prints the held-out score of each task (the trainer's own evaluation: greedy,
each task's held-out split, reasoning-gym's scorer) before the first step and after the
last, as the mean and spread (sample standard deviation) over the seeds, the wall time,
and for SRPO the share of prompts history resampling kept at its epoch boundaries.

    python loadtests/srpo_compare.py --seeds 0,1,2 --out runs/srpo_compare.json
    just bench-srpo 0,1,2

The arms run one after another, each seed in turn (so a machine that slows down halfway
slows both arms alike); run it alone on the machine (every run uses every core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN_FILE = Path(__file__).resolve().parent.parent / "examples" / "run_files" / "srpo.toml"

ARMS: dict[str, dict[str, str]] = {
    "srpo": {},  # the run file's own filters: staleness, history_resampling
    "grpo": {"SF_TRAJECTORY_DATA_FILTERS": "staleness"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="Seeds, comma-separated.")
    parser.add_argument("--arms", default="srpo,grpo", help=f"Of {', '.join(ARMS)}.")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=0, help="0: the run file's.")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/srpo-compare"))
    parser.add_argument("--out", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    args.seed_list = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    args.arm_list = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arm_list if arm not in ARMS]
    if unknown or not args.seed_list:
        parser.error(f"unknown arms {unknown} (known: {', '.join(ARMS)}) or no seed")
    return args


def run_one(args: argparse.Namespace, arm: str, seed: int) -> dict[str, Any]:
    run_id = f"srpo-compare-{arm}-{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = [
        sys.executable, "-m", "sf_app", "up",
        "--model", args.model,
        "--config", str(RUN_FILE),
        "--seed", str(seed),
        "--run-id", run_id,
        "--runs-dir", str(args.runs_dir),
        "--no-live",
        *(["--steps", str(args.steps), "--eval-every", str(args.steps)] if args.steps else []),
    ]  # fmt: skip
    started = time.monotonic()
    completed = subprocess.run(
        command, env={**os.environ, **ARMS[arm]}, capture_output=True, text=True, check=False
    )
    wall_s = time.monotonic() - started
    run_dir = args.runs_dir / run_id
    summary_path = run_dir / "summary.json"
    if completed.returncode != 0 or not summary_path.exists():
        tail = (completed.stdout + completed.stderr).strip().splitlines()[-5:]
        return {"arm": arm, "seed": seed, "status": "failed", "tail": tail}
    summary = json.loads(summary_path.read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    first, last = summary.get("eval_first") or {}, summary.get("eval_last") or {}
    epochs = summary.get("data_filters", {}).get("epochs", [])
    boundaries = [e for e in epochs if e["epoch"] > 0]
    kept = sum(sum(e["kept"].values()) for e in boundaries)
    dropped = sum(sum(e["dropped"].values()) for e in boundaries)
    return {
        "arm": arm,
        "seed": seed,
        "status": summary["status"],
        "steps": summary["steps"],
        "wall_s": round(wall_s, 1),
        "before": first.get("by_task") or {first.get("task"): first.get("mean_reward")},
        "after": last.get("by_task") or {last.get("task"): last.get("mean_reward")},
        "mean_before": first.get("mean_reward"),
        "mean_after": last.get("mean_reward"),
        "epochs": epochs,
        "prompts_kept_at_boundaries": kept,
        "prompts_dropped_at_boundaries": dropped,
        "groups_dropped": summary.get("data_filters", {}).get("groups_dropped", {}),
    }


def spread(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def short(task: str) -> str:
    """``rg:basic_arithmetic?...`` -> ``basic_arithmetic``."""
    return task.removeprefix("rg:").split("?")[0]


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_arm: dict[str, Any] = {}
    for arm in dict.fromkeys(row["arm"] for row in rows):
        done = [r for r in rows if r["arm"] == arm and r["status"] == "finished"]
        if not done:
            continue
        tasks = list(done[0]["after"])
        figures: dict[str, Any] = {"runs": len(done), "by_task": {}}
        for task in tasks:
            before = spread([r["before"][task] for r in done])
            after = spread([r["after"][task] for r in done])
            figures["by_task"][short(task)] = {"before": before, "after": after}
        figures["mean_after"] = spread([r["mean_after"] for r in done])
        figures["wall_s"] = spread([r["wall_s"] for r in done])
        judged = sum(r["prompts_kept_at_boundaries"] + r["prompts_dropped_at_boundaries"]
                     for r in done)  # fmt: skip
        kept = sum(r["prompts_kept_at_boundaries"] for r in done)
        figures["share_kept_at_boundaries"] = kept / judged if judged else None
        by_arm[arm] = figures
    return by_arm


def table(by_arm: dict[str, Any]) -> str:
    lines = []
    for arm, figures in by_arm.items():
        lines.append(f"{arm} ({figures['runs']} seeds), wall {figures['wall_s'][0]:.0f} s "
                     f"+- {figures['wall_s'][1]:.0f}")  # fmt: skip
        for task, score in figures["by_task"].items():
            (b, bs), (a, as_) = score["before"], score["after"]
            lines.append(f"  {task:<18} held-out before {b:.3f} +- {bs:.3f}  after "
                         f"{a:.3f} +- {as_:.3f}  gain {a - b:+.3f}")  # fmt: skip
        mean, sd = figures["mean_after"]
        lines.append(f"  {'mean of tasks':<18} after {mean:.3f} +- {sd:.3f}")
        share = figures["share_kept_at_boundaries"]
        if share is not None:
            lines.append(f"  history resampling kept {share:.1%} of the prompts it judged")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for seed in args.seed_list:
        for arm in args.arm_list:
            print(f"[srpo-compare] {arm} seed {seed}", flush=True)
            row = run_one(args, arm, seed)
            print(json.dumps({k: v for k, v in row.items() if k != "epochs"}), flush=True)
            rows.append(row)
    by_arm = aggregate(rows)
    print(table(by_arm))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": rows, "by_arm": by_arm}, indent=2) + "\n")
    return 0 if all(row["status"] == "finished" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
