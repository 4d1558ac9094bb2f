"""Sweep the pretrained model's run defaults one at a time: each variant is a real
``seamlessflow up --model <name>`` run that changes one setting from the defaults
(``PackagedModel.run_defaults``), so every figure is the same task, prompts, seed and
deployment but for that setting.

Per variant it prints and writes (``--out``, JSON): held-out accuracy before the first
step and after the last (the trainer's own evaluation: greedy, the task's held-out
split, the dataset's scorer), the training reward curve by step (mean of each batch),
mean trainer step seconds, the step period (first to last step), weight publish
seconds, wall seconds, tokens generated, thread-seconds trained on lent rollout cores,
weight bytes sent, the trainer-engine logprob gap, and the KL when the variant has a
KL term. Variants run one after another; run it alone on the machine
(every run uses every core).

    python loadtests/defaults_sweep.py --steps 10 --variants default,kl,temp07
    just sweep-defaults 10

One run is one seed and 64 held-out prompts: one standard error of an accuracy near
0.45 is about 0.06, so a difference below ~0.12 between two variants is not a finding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One setting changed from the model's defaults: ``up`` options and environment."""

    name: str
    what: str
    options: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("default", "the model's defaults"),
        Variant(
            "kl",
            "a KL term to the base model, coefficient 0.05",
            env={"SF_TRAINER_KL_COEF": "0.05"},
        ),
        Variant(
            "temp07", "sampling temperature 0.7 (default 1.0)", env={"SF_AGENTS_TEMPERATURE": "0.7"}
        ),
        Variant(
            "group4",
            "groups of 4 samples, 8 prompts a step (same 32 samples)",
            options=("--group-size", "4", "--groups-per-batch", "8"),
        ),
        Variant(
            "group16",
            "groups of 16 samples, 2 prompts a step (same 32 samples)",
            options=("--group-size", "16", "--groups-per-batch", "2"),
        ),
        Variant("tokens128", "max_tokens 128 (default 64)", options=("--max-tokens", "128")),
        Variant("lr3e-5", "learning rate 3e-5 (default 1e-5)", options=("--lr", "3e-5")),
        # what a step costs beyond compute (the same learning expected; compare the times)
        Variant(
            "no-core-lending",
            "idle rollout cores not lent to training",
            env={"SF_TAG_SCHEDULER_LEND_CORES_TO_TRAINING": "false"},
        ),
        Variant(
            "bf16-wire",
            "weights travel and are served in bfloat16 (deltas between versions)",
            env={"SF_WEIGHTS_DTYPE": "bfloat16"},
        ),
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=10, help="trainer steps per variant")
    parser.add_argument(
        "--variants",
        default="default,kl,temp07,group4,group16",
        help=f"comma-separated, from: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/sweep"))
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each run's checkpoints (1.6 GB each for SmolLM2 with its optimizer "
        "state); by default they are deleted once the run's figures are read",
    )
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    args.variant_list = [VARIANTS[name] for name in names]
    return args


def up_command(args: argparse.Namespace, variant: Variant, run_id: str) -> list[str]:
    return [
        sys.executable, "-m", "sf_app", "up",
        "--model", args.model,
        "--steps", str(args.steps),
        "--eval-every", str(args.steps),
        "--run-id", run_id,
        "--runs-dir", str(args.runs_dir),
        "--no-live",
        *variant.options,
    ]  # fmt: skip


def figures(run_dir: Path, variant: Variant, wall_s: float) -> dict[str, Any]:
    """What the run's own files say: summary.json and metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("type") == "train.metrics"]
    evals = [r for r in records if r.get("type") == "train.eval"]
    return {
        "variant": variant.name,
        "what": variant.what,
        "status": summary["status"],
        "steps": summary["steps"],
        "eval": [{"step": r["step"], "accuracy": r["mean_reward"]} for r in evals],
        "eval_first": (summary.get("eval_first") or {}).get("mean_reward"),
        "eval_last": (summary.get("eval_last") or {}).get("mean_reward"),
        "reward_by_step": [round(r["mean_reward"], 4) for r in steps],
        "kl_by_step": [round(r.get("kl_mean", 0.0), 5) for r in steps],
        "mean_step_s": summary.get("mean_step_s"),
        "mean_publish_s": summary.get("mean_publish_s"),
        "steady_seconds_per_step": summary.get("steady_seconds_per_step"),
        "lent_thread_seconds": summary.get("lent_thread_seconds"),
        "phase_seconds": summary.get("phase_seconds"),
        "weights_bytes_sent": summary.get("weights_bytes_sent"),
        "logprob_abs_diff_mean": (
            sum(r.get("logprob_abs_diff", 0.0) for r in steps) / len(steps) if steps else None
        ),
        "tokens_generated": summary.get("tokens_generated"),
        "wall_s": round(wall_s, 1),
    }


def run_variant(args: argparse.Namespace, variant: Variant) -> dict[str, Any]:
    run_id = f"sweep-{variant.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.monotonic()
    completed = subprocess.run(
        up_command(args, variant, run_id),
        env={**os.environ, **variant.env},
        capture_output=True,
        text=True,
        check=False,
    )
    wall_s = time.monotonic() - started
    run_dir = args.runs_dir / run_id
    if completed.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = (completed.stdout + completed.stderr).strip().splitlines()[-5:]
        return {"variant": variant.name, "what": variant.what, "status": "failed",
                "returncode": completed.returncode, "tail": tail}  # fmt: skip
    row = figures(run_dir, variant, wall_s)
    if not args.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'variant':<16} {'held-out before':>15} {'after':>6} {'gain':>6} "
        f"{'step s':>7} {'period s':>8} {'publish s':>9} {'wall s':>7}  reward by step"
    ]
    for row in rows:
        if row["status"] != "finished":
            lines.append(f"{row['variant']:<16} {row['status']}: {' / '.join(row.get('tail', []))}")
            continue
        first, last = row["eval_first"], row["eval_last"]
        gain = last - first if first is not None and last is not None else float("nan")
        curve = " ".join(f"{r:.2f}" for r in row["reward_by_step"])
        lines.append(
            f"{row['variant']:<16} {first:>15.3f} {last:>6.3f} {gain:>+6.3f} "
            f"{row['mean_step_s']:>7.1f} {row.get('steady_seconds_per_step') or 0:>8.1f} "
            f"{row.get('mean_publish_s') or 0:>9.2f} {row['wall_s']:>7.0f}  {curve}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for variant in args.variant_list:
        print(f"[sweep] {variant.name}: {variant.what}", flush=True)
        rows.append(run_variant(args, variant))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.out:  # after every variant: a long sweep cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2))
    print(table(rows))
    return 0 if all(row["status"] == "finished" for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
