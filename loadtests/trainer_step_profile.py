"""Our trainer's step against the plain GRPO step TRL takes, on the same batch and threads.

The batch is the built-in run's (``loadtests/peer_compare.py`` defaults): ``--groups``
prompts of the arithmetic task x ``--group-size`` samples, each the prompt as the chat
template renders it plus a short answer and ``<|im_end|>`` (``--answer-tokens`` engine
tokens). Behaviour logprobs are the model's own (one no-grad pass), so ratios start at 1
as in an on-policy step.

Timed, each ``--repeats`` times after ``--warmup`` untimed steps, interleaved so both
sides see the same machine load:

- ``sf_trainer.step.train_step`` as the trainer runs it (its settings' defaults);
- the same step split into phases (packing, forward + logprob head, loss, backward,
  gradient clip, optimizer), each phase run as ``train_step`` runs it;
- the yardstick: what TRL's GRPOTrainer does per optimizer step on the batch it
  generated: one forward over prompt + completion keeping logits of the completion
  positions only (``logits_to_keep``), log-softmax + gather, the token-mean clipped
  surrogate, backward, gradient clip, AdamW.

Both sides run on the same copy of the weights (each side's own optimizer), at
``--threads`` torch threads. Prints a table of medians and the ratio ours / plain.

    python loadtests/trainer_step_profile.py [--threads 2] [--repeats 30] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--answer-tokens", type=int, default=3, help="engine tokens per answer")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="default: the cached base model"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also print torch.profiler's top ops"
    )
    return parser.parse_args(argv)


def build_batch(model_dir: Path, model: torch.nn.Module, args: argparse.Namespace) -> Any:
    from peer_compare import dispatch_order
    from transformers import AutoTokenizer

    from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    generator = torch.Generator().manual_seed(0)
    groups = []
    for g, item in enumerate(dispatch_order(args.groups, seed=0)):
        prompt = tokenizer.apply_chat_template(
            [dict(m) for m in item.messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        samples = []
        for s in range(args.group_size):
            answer = torch.randint(3, 500, (args.answer_tokens - 1,), generator=generator).tolist()
            answer.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
            ids = list(prompt) + answer
            mask = [0] * len(prompt) + [1] * len(answer)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            chosen = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(ids[1:])[:, None]
            )
            old = [0.0] + [
                lp if m else 0.0 for lp, m in zip(chosen[:, 0].tolist(), mask[1:], strict=True)
            ]
            samples.append(
                TrainSample(
                    session_id=f"{g}-{s}",
                    token_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=old,
                    versions=[0 if m else -1 for m in mask],
                    reward=float((g + s) % 3 == 0),
                    temperatures=[1.0 if m else 0.0 for m in mask],
                )
            )
        groups.append(SampleGroup(group_id=str(g), task_id=item.task_id, samples=samples))
    return TrainBatch(batch_index=0, groups=groups)


def plain_grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    advantages: list[float],
    timings: dict[str, float] | None = None,
) -> float:
    """TRL's GRPOTrainer step on a generated batch: left-padded prompts + right-padded
    completions, logits of the completion positions only, token-mean clipped loss."""
    clock = _Clock(timings)
    samples = [s for group in batch.groups for s in group.samples]
    prompts = [s.token_ids[: s.loss_mask.index(1)] for s in samples]
    completions = [s.token_ids[s.loss_mask.index(1) :] for s in samples]
    p_len = max(map(len, prompts))
    c_len = max(map(len, completions))
    ids = torch.zeros(len(samples), p_len + c_len, dtype=torch.long)
    attention = torch.zeros_like(ids)
    c_mask = torch.zeros(len(samples), c_len)
    old = torch.zeros(len(samples), c_len)
    for row, (p, c, s) in enumerate(zip(prompts, completions, samples, strict=True)):
        ids[row, p_len - len(p) : p_len] = torch.tensor(p)
        ids[row, p_len : p_len + len(c)] = torch.tensor(c)
        attention[row, p_len - len(p) : p_len + len(c)] = 1
        c_mask[row, : len(c)] = 1
        old[row, : len(c)] = torch.tensor(s.behaviour_logprobs[len(p) :])
    adv = torch.tensor(advantages).unsqueeze(-1)
    optimizer.zero_grad(set_to_none=True)
    clock.lap("pack")
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=c_len + 1).logits
    logits = logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p_len:, None]).squeeze(-1)
    clock.lap("forward+head")
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    loss = (per_token * c_mask).sum() / c_mask.sum().clamp(min=1.0)
    clock.lap("loss")
    loss.backward()
    clock.lap("backward")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    clock.lap("grad clip")
    optimizer.step()
    clock.lap("optimizer")
    return float(loss.detach())


class _Clock:
    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.timings is None:
            return
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self.last
        self.last = now


def phased_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    settings: Any,
    timings: dict[str, float],
) -> None:
    """``train_step``'s work (single process), phase by phase."""
    from sf_trainer.advantages import batch_advantages
    from sf_trainer.distributed import TrainGroup
    from sf_trainer.losses import BatchTotals, LossInputs, chosen_loss
    from sf_trainer.memory import AUTO_BOUNDS
    from sf_trainer.step import _logprobs, pack, plan_micro_batches

    clock = _Clock(timings)
    group = TrainGroup(device=torch.device("cpu"))
    samples = [s for sample_group in batch.groups for s in sample_group.samples]
    advantages = batch_advantages(batch.groups, settings)
    totals = BatchTotals.of(s.loss_mask for s in samples)
    optimizer.zero_grad(set_to_none=True)
    loss_fn, loss_settings = chosen_loss(settings.loss)
    plan = plan_micro_batches(samples, 1, settings.micro_batch_tokens or AUTO_BOUNDS[1])
    clock.lap("advantages+plan")
    for micro in plan[0]:
        packed = pack(
            [samples[i] for i in micro.indices],
            [advantages[i] for i in micro.indices],
            unrecorded_temperature=settings.temperature,
        )
        clock.lap("pack")
        logprobs = _logprobs(model, packed, settings, group)
        clock.lap("forward+head")
        output = loss_fn(
            LossInputs(
                logprobs=logprobs,
                behaviour_logprobs=packed.old_logprobs,
                advantages=packed.advantages,
                mask=packed.loss_mask,
                reference_logprobs=None,
            ),
            loss_settings,
            totals,
        )
        clock.lap("loss")
        output.loss.backward()
        clock.lap("backward")
        float(((logprobs.detach() - packed.old_logprobs).abs() * packed.loss_mask).sum())
        clock.lap("metrics")
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    clock.lap("grad clip")
    optimizer.step()
    clock.lap("optimizer")


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from sf_trainer.advantages import batch_advantages
    from sf_trainer.settings import TrainerSettings
    from sf_trainer.step import train_step

    if args.model_dir is None:
        from peer_compare import default_model_dir

        args.model_dir = default_model_dir()
    base = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    base.eval()
    batch = build_batch(args.model_dir, base, args)
    settings = TrainerSettings(torch_threads=args.threads, lr=1e-4)
    advantages = batch_advantages(batch.groups, settings)
    tokens = sum(len(s.token_ids) for g in batch.groups for s in g.samples)

    def side() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base).train()
        return model, torch.optim.AdamW(
            model.parameters(), lr=1e-4, betas=settings.betas, weight_decay=settings.weight_decay
        )

    ours_model, ours_opt = side()
    phased_model, phased_opt = side()
    plain_model, plain_opt = side()
    runs: dict[str, Callable[[], object]] = {
        "train_step": lambda: train_step(ours_model, ours_opt, batch, settings, current_version=0),
        "plain GRPO step": lambda: plain_grpo_step(plain_model, plain_opt, batch, advantages),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    ours_phases: dict[str, float] = {}
    plain_phases: dict[str, float] = {}
    for repeat in range(args.warmup + args.repeats):
        timed = repeat >= args.warmup
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if timed:
                times[name].append(time.perf_counter() - started)
        phased_train_step(phased_model, phased_opt, batch, settings, ours_phases if timed else {})
        plain_grpo_step(plain_model, plain_opt, batch, advantages, plain_phases if timed else None)

    ours, plain = median_ms(times["train_step"]), median_ms(times["plain GRPO step"])
    print(
        f"batch: {args.groups} groups x {args.group_size} samples, {tokens} tokens; "
        f"torch threads {args.threads}; {args.repeats} repeats (medians)"
    )
    print(f"{'':<22}{'ours ms':>10}{'plain ms':>10}{'ours/plain':>12}")
    print(f"{'whole step':<22}{ours:>10.1f}{plain:>10.1f}{ours / plain:>12.2f}")
    print("phases (means over repeats):")
    for name in sorted(set(ours_phases) | set(plain_phases), key=lambda n: -ours_phases.get(n, 0)):
        o = 1000 * ours_phases.get(name, 0.0) / args.repeats
        p = 1000 * plain_phases.get(name, 0.0) / args.repeats
        print(f"  {name:<20}{o:>10.1f}{p:>10.1f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runs["train_step"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
