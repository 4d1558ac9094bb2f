"""``auto`` against the best fixed mode, on this machine's cores as slots (``--pin-slots``).

Per workload, every mode runs the same steps, task and seed, ``--repeats`` times, the
modes interleaved within each repeat (colocated, disaggregated, multiplexed, auto; then
again) so that drift of the machine spreads over all of them. A mode's figure is its
mean steady seconds per step (``summary.json``'s ``steady_seconds_per_step``: start-up
left out; with a fixed number of steps, the figure that does not depend on how long the
answers were). The **noise** of a workload is the largest relative spread between the
repeats of one mode (max - min over mean); ``auto`` passes when its mean is at most the
best fixed mode's x (1 + noise). With one repeat there is no noise figure and no verdict
(``--real-repeats 1``: the real model's runs take minutes each).

Workloads (each a ``seamlessflow up`` on 2 slots, 1 dedicated engine):

- ``toy``: the built-in arithmetic task and model (3-token answers: rollout is the data
  plane's work);
- ``slow_env``: the built-in OpenEnv ``guess_number`` server at ``--env-latency-ms``
  per step (the ``openenv`` agent, episodes of several turns; 16 episodes a training
  step), on the built-in model:
  agents wait on the environment, engines and the trainer's slot idle;
- ``real``: SmolLM2-135M-Instruct on the main job's task, no held-out evaluation
  (the trainer's step is the long phase).

    .venv/bin/python loadtests/auto_mode.py --workloads toy,slow_env --repeats 2
    just bench-auto

Run it alone on the machine: every run uses every core.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

FIXED_MODES = ("colocated", "disaggregated", "multiplexed")
MODES = (*FIXED_MODES, "auto")


def workloads(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each workload's ``RunConfig`` fields (beyond the shared ones)."""
    return {
        "toy": {"steps": args.steps, "task": "arithmetic"},
        "slow_env": {
            "steps": max(args.steps // 2, 8),
            "env": "guess_number",
            "env_step_latency_ms": args.env_latency_ms,
            # 16 episodes a step (4 groups of 4): a step of 64 took ~22 s colocated
            "group_size": 4,
            "groups_per_batch": 4,
        },
        "real": {"steps": args.real_steps, "model": "smollm2-135m-instruct", "eval_every": 0},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="toy,slow_env,real")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="The toy's steps.")
    parser.add_argument("--real-steps", type=int, default=10)
    parser.add_argument("--real-repeats", type=int, default=None,
                        help="Repeats of the real model's runs (default: --repeats).")  # fmt: skip
    parser.add_argument("--env-latency-ms", type=float, default=300.0)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/auto-mode"))
    parser.add_argument("--out", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [w for w in args.workload_list if w not in workloads(args)]
    unknown += [m for m in args.mode_list if m not in MODES]
    if unknown:
        parser.error(f"unknown workloads or modes {unknown}")
    if "auto" not in args.mode_list or len(args.mode_list) < 2 or args.repeats < 1:
        parser.error("need auto, at least one fixed mode and --repeats >= 1")
    return args


def run_once(args: argparse.Namespace, fields: dict[str, Any], mode: str) -> dict[str, Any]:
    from sf_app.run.config import RunConfig
    from sf_app.run.embedded import run_embedded

    config = RunConfig(
        runs_dir=args.runs_dir, run_id="", live=False, mode=mode, pin_slots=True, **fields
    )
    summary = run_embedded(config)
    # a run's checkpoints measure nothing here and hold the model and its optimizer
    # several times (~2 GB a run of SmolLM2): two benches of 12 runs filled 44 GB
    shutil.rmtree(config.runs_dir / summary.run_id / "checkpoints", ignore_errors=True)
    return {
        "mode": mode,
        "run_id": summary.run_id,
        "status": summary.status,
        "steps": summary.steps,
        "seconds_per_step": round(summary.steady_seconds_per_step, 3),
        "bubble_ratio": summary.bubble_ratio,
        "lends": summary.lends,
        "switches": summary.lending_switches,
    }


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode the mean seconds per step, the noise, the best fixed mode and auto
    against it."""
    per_mode: dict[str, list[float]] = {}
    for run in runs:
        if run["status"] == "finished" and run["seconds_per_step"] > 0:
            per_mode.setdefault(run["mode"], []).append(run["seconds_per_step"])
    means = {mode: statistics.fmean(values) for mode, values in per_mode.items()}
    spreads = [
        (max(values) - min(values)) / statistics.fmean(values)
        for values in per_mode.values()
        if len(values) > 1
    ]
    noise = max(spreads) if spreads else None
    fixed = {mode: mean for mode, mean in means.items() if mode in FIXED_MODES}
    result: dict[str, Any] = {"seconds_per_step": means, "noise": noise}
    if not fixed or "auto" not in means:
        return {**result, "passed": None}
    best = min(fixed, key=lambda mode: fixed[mode])
    ratio = means["auto"] / fixed[best]
    result.update(best_fixed=best, auto_over_best=round(ratio, 3))
    result["passed"] = None if noise is None else ratio <= 1 + noise
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items()
                                           if isinstance(v, (int, float, str, list))}}  # fmt: skip
    report["settings"]["runs_dir"] = str(args.runs_dir)
    for workload in args.workload_list:
        fields = workloads(args)[workload]
        runs = []
        repeats = args.real_repeats if workload == "real" and args.real_repeats else args.repeats
        for repeat in range(repeats):
            for mode in args.mode_list:
                print(f"[auto-mode] {workload} {mode} (repeat {repeat + 1})", flush=True)
                runs.append(run_once(args, fields, mode))
                print(json.dumps(runs[-1]), flush=True)
        report[workload] = {"fields": fields, "runs": runs, **verdict(runs)}
        print(json.dumps({workload: verdict(runs)}), flush=True)
    lines = ["workload | mode | s/step (mean) | vs best fixed"]
    for workload in args.workload_list:
        row = report[workload]
        best = row.get("best_fixed")
        for mode, mean in sorted(row["seconds_per_step"].items()):
            against = f"{mean / row['seconds_per_step'][best]:.3f}" if best else "-"
            lines.append(f"{workload} | {mode} | {mean:.3f} | {against}")
        noise = row["noise"]
        lines.append(
            f"{workload}: best fixed {best}, auto/best {row.get('auto_over_best')}, noise "
            f"{'-' if noise is None else f'{noise:.3f}'}, passed {row['passed']}"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [w for w in args.workload_list if report[w]["passed"] is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
