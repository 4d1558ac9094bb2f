"""Train a model in a third-party environment and score it on held-out games, before and
after: what docs/benchmarks.md, "Third-party environments", reports.

The environment runs as its own process from its own virtual environment
(``just env-venv NAME``; ``environments/NAME/server.py``), as a user serves it; the run is
``seamlessflow up --env URL`` (the ``openenv`` agent, the ``episodes`` task: each group
plays one game, seeded); the held-out score is the mean return of the model on the
first ``--heldout`` games of the ``episodes`` task's eval split (seeds the run never
trains on; an environment that plays the rows of a dataset plays them from a second
server, on rows the run never sees: ``EnvSpec.heldout_options``), played greedily
turn by turn with the model's own chat template (``peer_env.EpisodePlayer``), before
the run on the base model and after it on the run's final checkpoint.

    .venv/bin/python loadtests/env_train.py --env textarena --game GuessTheNumber-v0 \\
        --model smollm2-135m-instruct --steps 10
    .venv/bin/python loadtests/env_train.py --env skyrl_gym --steps 20
    .venv/bin/python loadtests/env_train.py --env verifiers --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peer_env

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class EnvSpec:
    """A third-party environment under ``environments/``, served from its own venv."""

    game: str
    """The game (the environment's own id) played unless ``--game`` names another."""
    train_options: tuple[str, ...] = ()
    """Its server's options for the run."""
    heldout_options: tuple[str, ...] | None = None
    """Its server's options for the held-out score; None: the same server. (An
    environment whose seeds generate its problems holds out the ``episodes`` task's eval
    seeds by itself; one that plays rows of a dataset needs rows the run never sees.)"""


ENVIRONMENTS = {
    "textarena": EnvSpec("GuessTheNumber-v0"),
    "skyrl_gym": EnvSpec("gsm8k_multi_turn"),
    # falsepass's toy draws its 200 sums from its seed: another seed, other sums
    "verifiers": EnvSpec(
        "falsepass._demo.falsepass_toy_env", ("--env-arg", "seed=0"), ("--env-arg", "seed=1")
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=sorted(ENVIRONMENTS), default="textarena")
    parser.add_argument("--game", default="", help="the environment's game id (ENVIRONMENTS)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a packaged model")
    parser.add_argument("--model-dir", type=Path, default=None, help="a model directory as is")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-batch", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="budget of one turn")
    parser.add_argument("--max-turns", type=int, default=12, help="steps before a cut")
    parser.add_argument("--lr", type=float, default=1e-4, help="the run default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=64, help="held-out games")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/load/env_train.json")
    args = parser.parse_args(argv)
    args.game = args.game or ENVIRONMENTS[args.env].game
    return args


@contextlib.contextmanager
def env_server(name: str, game: str, *options: str) -> Iterator[str]:
    """``environments/NAME/server.py`` from its venv (installed first if it is not), on a
    free port; its URL. The server gets none of this interpreter's ``PYTHON*`` variables:
    its venv is another Python's."""
    just = ROOT / ".venv" / "bin" / "just"
    subprocess.run([str(just) if just.exists() else "just", "env-venv", name], cwd=ROOT, check=True)
    python = ROOT / f".venv-env-{name}" / "bin" / "python"
    command = [str(python), str(ROOT / "environments" / name / "server.py"),
               "--game", game, "--port", "0", *options]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            if not line.startswith("listening on http://"):
                raise RuntimeError(f"the {name} server did not start: {line!r}")
            yield line.removeprefix("listening on ")
        finally:
            process.terminate()
            process.wait(timeout=30)


def heldout_games(count: int, seed: int) -> tuple[list[int], str]:
    """The first ``count`` games of the episodes task's eval split, and its system prompt."""
    from seamlessflow.tasks import get_task_source

    items = get_task_source("episodes", seed=seed).items("eval")[:count]
    return [int(item.reference) for item in items], items[0].messages[0]["content"]


def heldout_score(
    model_dir: Path, env_url: str, seeds: list[int], system: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The model's greedy play of ``seeds``: mean return, share won, mean turns."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = peer_env.eos_ids(model_dir, tokenizer)
    greedy = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)  # fmt: skip
    player = peer_env.EpisodePlayer(env_url, tokenizer, eos, system, args.max_turns)

    def generate(sequences: list[list[int]]) -> list[list[int]]:
        return peer_env.sampled_turns(model, sequences, greedy, tokenizer.pad_token_id, eos)

    began = time.perf_counter()
    episodes = player.play(seeds, generate, peer_env.Timing())
    return {
        "games": len(episodes),
        "mean_return": sum(e.env_return for e in episodes) / len(episodes),
        "won_share": sum(e.won for e in episodes) / len(episodes),
        "mean_turns": sum(e.turns for e in episodes) / len(episodes),
        "seconds": round(time.perf_counter() - began, 1),
        "first_actions": [e.actions[:3] for e in episodes[:3]],
    }


def train(args: argparse.Namespace, model_dir: Path, env_url: str) -> dict[str, Any]:
    run_id = f"env-{args.env.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    run, summary, started, finished = peer_env.env_run(args, model_dir, env_url, run_id)
    rewards = [m.mean_reward for m in run.state.metrics]
    return {
        "run_dir": str(run.run_dir),
        "wall_s": round(finished - started, 1),
        "mean_step_s": summary.mean_step_s,
        "reward_by_step": [round(r, 3) for r in rewards],
        "final_checkpoint": str(run.run_dir / "checkpoints" / "final"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = peer_env.model_directory(
        argparse.Namespace(model_dir=args.model_dir, model=args.model, model_size="small")
    )
    seeds, system = heldout_games(args.heldout, args.seed)
    report: dict[str, Any] = {"env": args.env, "game": args.game, "model": str(model_dir),
                              "steps": args.steps, "heldout_games": len(seeds)}  # fmt: skip
    spec = ENVIRONMENTS[args.env]
    with contextlib.ExitStack() as servers:
        url = servers.enter_context(env_server(args.env, args.game, *spec.train_options))
        heldout_url = url
        if spec.heldout_options is not None:
            heldout_url = servers.enter_context(
                env_server(args.env, args.game, *spec.heldout_options)
            )
        report["before"] = heldout_score(model_dir, heldout_url, seeds, system, args)
        print("held-out before:", json.dumps(report["before"]), flush=True)
        report["run"] = train(args, model_dir, url)
        print("run:", json.dumps(report["run"]), flush=True)
        trained = Path(report["run"]["final_checkpoint"])
        report["after"] = heldout_score(trained, heldout_url, seeds, system, args)
        print("held-out after:", json.dumps(report["after"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
