"""Multi-policy on the real model: a solver and a verifier trained together in one run,
against the same two policies trained in two separate runs, one after the other, on the
same cores. Each run is a real ``seamlessflow up`` on SmolLM2-135M-Instruct.

- **together**: ``--policies solver,verifier --agent solve_and_verify``. The solver
  answers reasoning-gym's ``basic_arithmetic`` (the main job's task); the verifier judges
  each answer (yes or no) and is rewarded when its verdict agrees with the task's
  scorer. Each policy has its own trainer, engine and version line.
- **solver alone**: the main job (one policy, the same task).
- **verifier alone**: one policy on ``verify:<task>`` (``seamlessflow.tasks.verify``): the
  same questions, with a fixed solver's proposed answers (half right, half near misses).

Both verifiers are scored on the same held-out items, ``verify:<task>``'s eval split (the
together run's verifier through ``--eval-tasks verifier=verify:<task>``), and both
solvers on the task's eval split: greedy answers, the task's own scorer. A policy's
**target** is its base model's held-out score plus ``--gain``; its **time to target** is
the wall time from the run's start to the first evaluation at or above it. The ratio is
(solver alone + verifier alone) / together, each arm's time being when its last policy
reached its target (its whole wall time when one never did).

    python loadtests/multi_policy_compare.py --out runs/multi_policy_compare.json
    just bench-multi-policy

Run it alone on the machine: every run uses every core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from seamlessflow.assets.pretrained import SMOLLM2_TASK

SOLVER, VERIFIER = "solver", "verifier"
VERIFY_TASK = f"verify:{SMOLLM2_TASK}"


def arms(task: str) -> dict[str, list[str]]:
    """Each arm's ``seamlessflow up`` options (beyond the shared ones)."""
    verify = f"verify:{task}"
    return {
        "together": [
            "--task", task,
            "--policies", f"{SOLVER},{VERIFIER}",
            "--agent", "solve_and_verify",
            "--eval-tasks", f"{VERIFIER}={verify}",
        ],
        "solver_alone": ["--task", task, "--policies", SOLVER],
        "verifier_alone": ["--task", verify, "--policies", VERIFIER],
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default=SMOLLM2_TASK, help="The solver's task.")
    parser.add_argument("--steps", type=int, default=16, help="Each policy's steps.")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--gain", type=float, default=0.10,
                        help="A policy's target: its base held-out score plus this.")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="together,solver_alone,verifier_alone")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/multi-policy-compare"))
    parser.add_argument("--out", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    args.arm_list = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arm_list if arm not in arms(args.task)]
    if unknown:
        parser.error(f"unknown arms {unknown} (known: {', '.join(arms(args.task))})")
    return args


def evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """The run's held-out evaluations (``metrics.jsonl``), in the order they came."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("type") == "train.eval"]


def time_to_target(evals: list[dict[str, Any]], started: float, gain: float) -> dict[str, Any]:
    """One policy's base score, target, and the first evaluation that reached it (its
    step and the seconds since the run started), or None for both."""
    ordered = sorted(evals, key=lambda e: e["step"])
    base = ordered[0]["mean_reward"]
    target = round(base + gain, 6)
    reached = next((e for e in ordered if e["mean_reward"] >= target), None)
    return {
        "base": base,
        "target": target,
        "scores": {e["step"]: round(e["mean_reward"], 4) for e in ordered},
        "reached_at_step": reached["step"] if reached else None,
        "seconds_to_target": round(reached["timestamp"] - started, 1) if reached else None,
    }


def run_arm(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    run_id = f"mp-compare-{arm.replace('_', '-')}-{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = [
        sys.executable, "-m", "sf_app", "up",
        "--model", args.model,
        *arms(args.task)[arm],
        "--steps", str(args.steps),
        "--eval-every", str(args.eval_every),
        "--seed", str(args.seed),
        "--run-id", run_id,
        "--runs-dir", str(args.runs_dir),
        "--no-live",
    ]  # fmt: skip
    started = time.time()
    completed = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True,
                               check=False)  # fmt: skip
    wall_s = time.time() - started
    run_dir = args.runs_dir / run_id
    if completed.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = (completed.stdout + completed.stderr).strip().splitlines()[-5:]
        return {"arm": arm, "status": "failed", "wall_s": round(wall_s, 1), "tail": tail}
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    evals = evaluations(run_dir)
    policies = {
        policy: {
            **time_to_target([e for e in evals if e["policy"] == policy], started, args.gain),
            "steps": record["steps"],
            "reward_first": record["reward_first"],
            "reward_last": record["reward_last"],
        }
        for policy, record in summary["policies"].items()
    }
    reached = [p["seconds_to_target"] for p in policies.values()]
    return {
        "arm": arm,
        "status": summary["status"],
        "wall_s": round(wall_s, 1),
        "mean_step_s": round(summary["mean_step_s"], 2),
        "policies": policies,
        # the arm is done with its targets when its last policy reached its own
        "seconds_to_targets": max(reached) if None not in reached else None,
    }


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The together arm against the two separate runs, one after the other: by time to
    the targets (each arm's whole wall time where a target was not reached, marked), and
    by wall time for the same steps."""

    def to_targets(row: dict[str, Any]) -> tuple[float, bool]:
        seconds = row["seconds_to_targets"]
        return (seconds, True) if seconds is not None else (row["wall_s"], False)

    together, solver, verifier = rows["together"], rows["solver_alone"], rows["verifier_alone"]
    (t, t_ok), (s, s_ok), (v, v_ok) = map(to_targets, (together, solver, verifier))
    return {
        "time_to_targets_ratio": round((s + v) / t, 3),
        "targets_all_reached": t_ok and s_ok and v_ok,
        "wall_ratio_same_steps": round(
            (solver["wall_s"] + verifier["wall_s"]) / together["wall_s"], 3
        ),
        "separate_s": round(s + v, 1),
        "together_s": round(t, 1),
    }


def table(rows: dict[str, dict[str, Any]], comparison: dict[str, Any] | None) -> str:
    lines = []
    for arm, row in rows.items():
        if row["status"] != "finished":
            lines.append(f"{arm}: {row['status']} {row.get('tail')}")
            continue
        lines.append(f"{arm}: wall {row['wall_s']:.0f} s, {row['mean_step_s']:.1f} s a step")
        for policy, p in row["policies"].items():
            seconds = p["seconds_to_target"]
            reached = (f"reached at step {p['reached_at_step']} after {seconds:.0f} s"
                       if seconds is not None else "not reached")  # fmt: skip
            lines.append(
                f"  {policy:<9} held-out {p['scores']}  target {p['target']:.3f}: {reached}"
            )
    if comparison:
        missed = "" if comparison["targets_all_reached"] else " (a target missed: its wall time)"
        lines.append(
            f"separate / together, time to every target: {comparison['separate_s']:.0f} s / "
            f"{comparison['together_s']:.0f} s = {comparison['time_to_targets_ratio']:.2f}x{missed}"
        )
        lines.append(f"wall time for the same steps: {comparison['wall_ratio_same_steps']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = {}
    for arm in args.arm_list:
        print(f"[multi-policy-compare] {arm}", flush=True)
        rows[arm] = run_arm(args, arm)
        print(json.dumps(rows[arm]), flush=True)
    finished = all(row["status"] == "finished" for row in rows.values())
    comparison = compare(rows) if finished and len(rows) == 3 else None
    print(table(rows, comparison))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {"seed": args.seed, "steps": args.steps, "gain": args.gain, "runs": rows,
                   "comparison": comparison}  # fmt: skip
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
