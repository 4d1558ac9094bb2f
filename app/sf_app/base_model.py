"""The tiny base model, built locally: tokenizer, random-init Qwen2-style model, SFT warm-up.

No model hub is reachable, so `build_base_model` makes everything from scratch, given a
seed: a byte-level BPE tokenizer trained on text from the "arithmetic" task, a small
untied Qwen2 model (tied ones and the other families: `seamlessflow.assets.families`), and a short
supervised warm-up, then writes a directory that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.

SFT recipe: a correct teacher, then a noisy one. The base model exists to show RL
working: it must already speak the format (a bare number, then `<|im_end|>`), yet be
right only part of the time when sampled, and what RL has to learn must be learnable
within minutes on a CPU. So the warm-up has two phases:
1. Correct teacher (the first `1 - sft_noisy_fraction` of the steps, cosine LR): the
   model learns the format and the sums (greedy accuracy on train ~0.8-1.0).
2. Noisy teacher (the rest, low constant LR): each time an example is drawn, the target
   is the correct sum with probability `teacher_p_correct`, else the answer of a random
   other prompt. The model learns a mixture "correct sum + a broad prior over sums",
   so sampled at temperature 1 it is right only ~0.1-0.2 of the time while its answers
   stay near the sum (greedy accuracy ~0.4-0.8, |error| <= 3 for ~90%). GRPO then mostly
   has to shrink the prior component, one direction shared by all prompts, so reward
   climbs fast and generalises across prompts (measured with seed 0: GRPO, 8 prompts x 8
   samples, lr 1e-4, 300 steps: mean reward 0.12 -> 0.60 between the first and last 10%).
What did not work (measured): noise from the start (the sums are never learned), stopping
SFT early (a wide distribution not centred on the answer: RL must then teach the
arithmetic itself, slowly), and near-miss noise (sum +-1..3) or a high LR in the noisy
phase (both blur the mode, greedy accuracy falls to ~0.35-0.6, and RL climbs slowly).

Invariants: the build is deterministic given the seed (torch runs single-threaded for
the duration of the build; a config with `build_threads` 0, the "medium" size, runs on
every core and repeats only on the same thread count and CPU kernels); the chat
template is prefix-stable (rendering messages[:k] with the generation prompt, then
appending the assistant's completion and "<|im_end|>\\n", renders messages[:k+1], token
for token).

It is application work (it trains a tokenizer and runs SFT), so it lives in the
application, not the library; the ChatML it speaks is the library's
(`seamlessflow.assets.chatml`).

CLI: `python -m sf_app.base_model --out DIR [--seed N] [--sft-steps N]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seamlessflow.assets.chatml import (
    CHAT_TEMPLATE,
    GENERIC_TEXT,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    TOOL_CALL,
    TOOL_CALL_END,
)
from seamlessflow.assets.loading import readable_by_all
from seamlessflow.rewards import get_reward
from seamlessflow.tasks import TaskItem, TaskSource, ToolTaskSource, get_task_source

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

# Bump when the build recipe changes in a way the config does not capture.
BUILD_VERSION = 1
TASK = "arithmetic"


@dataclass(frozen=True)
class BaseModelConfig:
    """Model size and SFT hyperparameters; all of it goes into the build hash."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    """The context the model states: the engines and the gateway allow it
    (``SF_*_MAX_CONTEXT`` 0). Multi-turn runs on this model (OpenEnv episodes, an MCP
    tool list in the prompt) reach 650-1000 tokens; it computed them before this field
    said so, under the old 1024-token cap."""
    sft_steps: int = 500
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_warmup_steps: int = 20
    sft_weight_decay: float = 0.01
    # The last `sft_noisy_fraction` of the steps imitate the noisy teacher; the first
    # ones a correct teacher (see the module docstring).
    sft_noisy_fraction: float = 0.3
    sft_noisy_lr: float = 2e-4  # low, so the noisy phase broadens but does not forget
    teacher_p_correct: float = 0.3
    # Post-SFT check: sampled reward at temperature 1 over the eval split.
    check_samples_per_prompt: int = 4
    check_max_new_tokens: int = 6
    check_prompts: int = 0
    """Eval prompts the check samples (0: all); long answers make the whole split slow."""
    build_threads: int = 1
    """torch threads of the build: 1 gives the same bytes on every machine; 0 = every
    core (faster, the same bytes only with the same thread count and CPU kernels)."""


def _split_on_specials(text: str) -> list[str]:
    pattern = "|".join(re.escape(t) for t in SPECIAL_TOKENS)
    return [part for part in re.split(pattern, text) if part]


def _render(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render with the chat template, without a tokenizer (used to make training text)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
        conversations=[messages],
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **({"tools": tools} if tools else {}),  # type: ignore[arg-type]
    )
    return rendered[0]


Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]
"""A full chat and the tools it is rendered with."""


def train_tokenizer(
    items: list[TaskItem],
    vocab_size: int,
    conversations: list[Conversation] | None = None,
    extra_text: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the task's conversations plus generic text.

    The conversations are `conversations` if given (a tool task's SFT chats), else each
    item's prompt answered with its reference. `extra_text` (a task's `tokenizer_text`)
    is added as is: e.g. "lookup" repeats its code words so that each becomes one token.

    Special tokens are cut out of the training text so that no merge spans one. They get
    the first ids; `<tool_call>`/`</tool_call>` are added tokens but not "special", so
    that decoding with `skip_special_tokens=True` keeps the tool calls (as Qwen2.5 does).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    corpus: list[str] = [*GENERIC_TEXT, *extra_text]
    if conversations is None:
        conversations = [
            ([*item.messages, {"role": "assistant", "content": item.reference}], None)
            for item in items
        ]
    for conversation, tools in conversations:
        corpus.extend(_split_on_specials(_render(conversation, tools=tools)))
    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's normalizer and pre-tokenizer (digits split one by one): the saved
    # config says qwen2, so AutoTokenizer (and vLLM) load the vocab and merges into a
    # `Qwen2Tokenizer`, which imposes these; anything else would tokenize differently
    # after loading than during SFT.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[:3]]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_model(config: BaseModelConfig, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    """A random-init, untied Qwen2-style causal LM (torch's RNG decides the weights)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),  # type: ignore[arg-type]
    )
    model = Qwen2ForCausalLM(model_config)
    # Only the stop and pad ids: engines that read generation_config (vLLM does) must not
    # pick up sampling defaults (top_k, top_p) that would bias RL sampling.
    model.generation_config = GenerationConfig(
        eos_token_id=model_config.eos_token_id, pad_token_id=model_config.pad_token_id
    )
    return model


def _teacher_answer(
    reference: str, rng: random.Random, p_correct: float, answers: list[str]
) -> str:
    """The reference with probability `p_correct`, else an answer to a random other prompt."""
    return reference if rng.random() < p_correct else rng.choice(answers)


def _sft_batches(
    items: list[TaskItem],
    tokenizer: PreTrainedTokenizerFast,
    config: BaseModelConfig,
    rng: random.Random,
    steps: int,
    source: TaskSource | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask, labels); labels only on the completion.

    The completion is the task's teacher's (``source.sft_completion``, a worked answer)
    if it has one, else the reference or, when the teacher errs, another prompt's."""
    import torch

    prompts = {
        item.task_id: tokenizer.apply_chat_template(
            list(item.messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for item in items
    }
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    answers = sorted({item.reference for item in items}, key=int)
    teacher = getattr(source, "sft_completion", None)
    clean_steps = round(steps * (1 - config.sft_noisy_fraction))
    for step in range(steps):
        p_correct = 1.0 if step < clean_steps else config.teacher_p_correct
        batch = [rng.choice(items) for _ in range(config.sft_batch_size)]
        rows = []
        for item in batch:
            if teacher is not None:
                text = teacher(item, rng, p_correct)
            else:
                text = _teacher_answer(item.reference, rng, p_correct, answers)
            answer = tokenizer.encode(text)
            prompt = prompts[item.task_id]
            rows.append((prompt + answer + [im_end], len(prompt)))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        yield input_ids, attention, labels


def assistant_labels(ids: list[int], tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """`ids` where the model speaks (every assistant turn's tokens and its `<|im_end|>`),
    -100 elsewhere: the SFT labels of a rendered multi-turn chat."""
    header = tokenizer.encode(IM_START + "assistant\n", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    labels = [-100] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i : i + len(header)] == header:
            i += len(header)
            while i < len(ids):
                labels[i] = ids[i]
                i += 1
                if ids[i - 1] == im_end:
                    break
        else:
            i += 1
    return labels


def _conversation_sft_batches(
    source: ToolTaskSource,
    items: list[TaskItem],
    tokenizer: PreTrainedTokenizerFast,
    config: BaseModelConfig,
    rng: random.Random,
    steps: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """As `_sft_batches`, for a tool task: each row is a full chat from the task's
    teacher (`source.sft_conversation`), labels on the assistant turns only."""
    import torch

    clean_steps = round(steps * (1 - config.sft_noisy_fraction))
    cache: dict[str, tuple[list[int], list[int]]] = {}
    for step in range(steps):
        p_correct = 1.0 if step < clean_steps else config.teacher_p_correct
        rows = []
        for _ in range(config.sft_batch_size):
            item = rng.choice(items)
            text = _render(source.sft_conversation(item, rng, p_correct), tools=source.tools)
            if text not in cache:
                ids = tokenizer.encode(text, add_special_tokens=False)
                cache[text] = (ids, assistant_labels(ids, tokenizer))
            rows.append(cache[text])
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (ids, row_labels) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.tensor(row_labels)
        yield input_ids, attention, labels


def sft(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    items: list[TaskItem],
    config: BaseModelConfig,
    steps: int,
    seed: int,
    source: TaskSource | None = None,
) -> float:
    """Noisy-teacher warm-up (see the module docstring); returns the last loss.

    With a tool task `source` (one with `sft_conversation`), the rows are its teacher's
    full multi-turn chats; otherwise prompt + noisy answer."""
    import torch

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.sft_lr, weight_decay=config.sft_weight_decay
    )

    clean_steps = round(steps * (1 - config.sft_noisy_fraction))

    def lr_scale(step: int) -> float:
        # Clean phase: linear warm-up, cosine decay to 10%. Noisy phase: constant, low.
        if step >= clean_steps:
            return config.sft_noisy_lr / config.sft_lr
        if step < config.sft_warmup_steps:
            return (step + 1) / config.sft_warmup_steps
        progress = (step - config.sft_warmup_steps) / max(1, clean_steps - config.sft_warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)
    model.train()
    loss = torch.tensor(float("nan"))
    if source is not None and is_tool_task(source):
        batches = _conversation_sft_batches(
            source,  # type: ignore[arg-type]  # narrowed by is_tool_task
            items,
            tokenizer,
            config,
            random.Random(seed),
            steps,
        )
    else:
        batches = _sft_batches(items, tokenizer, config, random.Random(seed), steps, source)
    for input_ids, attention, labels in batches:
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    return loss.item()


def _sample_completions(model: Any, tokenizer: Any, enc: Any, max_new_tokens: int) -> list[str]:
    """Decode completions sampled at temperature 1 with no top-k / top-p truncation."""
    import torch

    enc = enc.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
        )
    prompt_length = enc["input_ids"].shape[1]
    return list(tokenizer.batch_decode(out[:, prompt_length:], skip_special_tokens=True))


def sampled_reward(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    items: list[TaskItem],
    reward_fn: str,
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    seed: int,
) -> float:
    """Mean reward of completions sampled at temperature 1 (no top-k / top-p)."""
    import torch

    reward = get_reward(reward_fn)
    prompts = [list(item.messages) for item in items for _ in range(samples_per_prompt)]
    references = [item.reference for item in items for _ in range(samples_per_prompt)]
    enc = tokenizer.apply_chat_template(
        prompts,
        add_generation_prompt=True,
        tokenize=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
    torch.manual_seed(seed)
    texts = _sample_completions(model, tokenizer, enc, max_new_tokens)
    return sum(reward(t, r) for t, r in zip(texts, references, strict=True)) / len(texts)


_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.S)


def parse_tool_calls(text: str) -> list[tuple[str, Any]] | None:
    """`(name, arguments)` of each `<tool_call>{...}</tool_call>` block of a completion,
    or None if it has none or one is not `{"name": str, "arguments": ...}` JSON (the
    completion is then a final answer)."""
    calls = []
    for block in _TOOL_CALL_RE.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append((call["name"], call.get("arguments", {})))
    return calls or None


def tool_rollout_rewards(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    source: ToolTaskSource,
    items: list[TaskItem],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    seed: int,
    max_rounds: int = 3,
) -> list[float]:
    """Rewards of multi-turn tool rollouts sampled at temperature 1, as the `tool_user`
    agent runs them: ask; while the answer holds tool calls (at most `max_rounds`
    answers), append it and the tools' results and ask again; score the last answer."""
    import torch

    reward = get_reward(source.reward_fn)
    chats = [[dict(m) for m in item.messages] for item in items for _ in range(samples_per_prompt)]
    references = [item.reference for item in items for _ in range(samples_per_prompt)]
    last = [""] * len(chats)
    active = list(range(len(chats)))
    torch.manual_seed(seed)
    for _ in range(max_rounds):
        if not active:
            break
        enc = tokenizer.apply_chat_template(
            [chats[i] for i in active],
            tools=source.tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        texts = _sample_completions(model, tokenizer, enc, max_new_tokens)
        still = []
        for i, text in zip(active, texts, strict=True):
            last[i] = text
            calls = parse_tool_calls(text)
            if calls is None:
                continue
            chats[i].append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [  # type: ignore[dict-item]
                        {"type": "function", "function": {"name": n, "arguments": a}}
                        for n, a in calls
                    ],
                }
            )
            for n, a in calls:
                chats[i].append({"role": "tool", "content": source.call_tool(n, a)})
            still.append(i)
        active = still
    return [reward(t, r) for t, r in zip(last, references, strict=True)]


def _check_single_tokens(tokenizer: PreTrainedTokenizerFast, words: Any) -> None:
    """Raise unless each of `words` (a task's `single_token_words`) is one token."""
    split = [w for w in words if len(tokenizer.encode(w, add_special_tokens=False)) != 1]
    if split:
        raise ValueError(f"not single tokens (raise vocab_size?): {split}")


def is_tool_task(source: TaskSource) -> bool:
    return callable(getattr(source, "sft_conversation", None))


# Fields added after builds were cached, left out of the hash at these values so that
# those builds keep their key.
_HASHED_UNLESS = {"check_prompts": 0, "build_threads": 1}


def _build_hash(config: BaseModelConfig, seed: int, task: str = TASK) -> str:
    fields = {
        name: value
        for name, value in dataclasses.asdict(config).items()
        if not (name in _HASHED_UNLESS and value == _HASHED_UNLESS[name])
    }
    payload = {"version": BUILD_VERSION, "task": task, "seed": seed, **fields}
    if task != TASK:
        # A tool task's teacher lives in its module: its version goes in the hash too.
        payload["sft_version"] = getattr(get_task_source(task, seed=seed), "sft_version", None)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# Per-task defaults; a task not listed uses `BaseModelConfig()` (the arithmetic recipe).
# "lookup" (measured with seed 0; sampled = temperature 1, two-turn rollouts on eval):
# - vocab 640: room for each code word as one token (at 512, half of them are split);
# - 480 clean steps at 3e-3 (cosine): copying appears suddenly between steps ~200 and
#   ~350 (the item number in the call, then the code into the answer); at 480 greedy
#   item / copy 0.97 / 1.0, sampled reward 0.95;
# - 120 noisy steps (teacher right half the time, at each of its two decisions) at 2e-4:
#   sampled reward 0.16 (calls 0.69, right item 0.39, copies 0.32) while greedy stays
#   0.94, so RL only has to shrink the noise, not learn to copy.
# "counting" (worked answers of 60-500 tokens; measured with seed 0, 2 torch threads):
# - positions 1024: the longest prompt + the 512-token budget;
# - batches of 16 chats (~230 answer tokens each, and every line is a lesson): with the
#   correct teacher alone for 600 steps (0.56 s a step) the loss falls to 0.001 and 31 of
#   32 eval prompts are solved greedily, 28 of 32 sampled: two layers learn the carry;
# - the last quarter imitates a teacher that slips once in ~33 steps (0.97 per step), so
#   that sampled answers, 11-73 steps long, are often wrong while greedy ones stay right.
TASK_CONFIGS: dict[str, BaseModelConfig] = {
    "counting": BaseModelConfig(
        max_position_embeddings=1024,
        sft_steps=600,
        sft_batch_size=16,
        sft_noisy_fraction=0.25,
        teacher_p_correct=0.97,
        check_samples_per_prompt=2,
        check_max_new_tokens=512,
        check_prompts=16,
    ),
    "lookup": BaseModelConfig(
        vocab_size=640,
        sft_steps=600,
        sft_batch_size=32,
        sft_noisy_fraction=0.2,
        teacher_p_correct=0.5,
        check_samples_per_prompt=2,
        check_max_new_tokens=32,
    ),
}


def default_config(task: str = TASK) -> BaseModelConfig:
    return TASK_CONFIGS.get(task, BaseModelConfig())


# Model sizes besides a task's default ("small"): a shape, and a warm-up scaled to it
# (fields of BaseModelConfig over the task's recipe). "medium" is a Qwen2-style model of
# ~25M parameters (8 layers of width 512, grouped-query attention 8/4 heads), for
# workloads where the model's compute, not per-token overhead, dominates generation and
# training. A step of it costs ~40x a small one, so its warm-up takes fewer, smaller
# batches at a lower peak rate (a larger model needs fewer examples) and runs on every
# core (`build_threads` 0).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "small": {},
    "medium": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sft_steps": 200,
        "sft_batch_size": 8,
        "sft_lr": 1e-3,
        "sft_warmup_steps": 10,
        "sft_noisy_lr": 1e-4,
        "build_threads": 0,
    },
}


def built_model_name(task: str = TASK, size: str = "small") -> str:
    """The cache directory name of the built model for ``task`` at ``size``."""
    return f"base-{task}" if size == "small" else f"base-{task}-{size}"


def sized_config(task: str = TASK, size: str = "small") -> BaseModelConfig:
    """``task``'s recipe at ``size`` (a name of ``MODEL_SIZES``)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(MODEL_SIZES)}")
    return dataclasses.replace(default_config(task), **MODEL_SIZES[size])


def _resolve(
    config: BaseModelConfig | None, sft_steps: int | None, task: str = TASK
) -> BaseModelConfig:
    config = config or default_config(task)
    if sft_steps is not None:
        config = dataclasses.replace(config, sft_steps=sft_steps)
    return config


def build_base_model(
    out_dir: Path,
    *,
    seed: int = 0,
    sft_steps: int | None = None,
    config: BaseModelConfig | None = None,
    task: str = TASK,
) -> Path:
    """Build tokenizer + model + SFT warm-up for `task` into `out_dir` (overwriting).

    A tool task (one with `sft_conversation`, e.g. "lookup") trains the tokenizer on its
    teacher's chats rendered with its tools and warms up on full multi-turn chats, the
    loss on the assistant turns only; any other task gets the arithmetic recipe."""
    import torch

    config = _resolve(config, sft_steps, task)
    task_name = task
    out_dir = Path(out_dir)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    # one core: bit-for-bit the same weights on every machine (0: every core, faster)
    torch.set_num_threads(config.build_threads or len(os.sched_getaffinity(0)))
    try:
        source = get_task_source(task_name, seed=seed)
        train, evaluation = source.items("train"), source.items("eval")
        conversations: list[Conversation] | None = None
        if is_tool_task(source):
            tool_source: ToolTaskSource = source  # type: ignore[assignment]
            clean = random.Random(seed)
            conversations = [
                (tool_source.sft_conversation(item, clean, 1.0), tool_source.tools)
                for item in train + evaluation
            ]
        elif callable(teacher := getattr(source, "sft_completion", None)):
            clean = random.Random(seed)
            conversations = [
                ([*item.messages, {"role": "assistant", "content": answer}], None)
                for item in train + evaluation
                for answer in [teacher(item, clean, 1.0)]
            ]
        extra_text: tuple[str, ...] = tuple(getattr(source, "tokenizer_text", ()))
        tokenizer = train_tokenizer(
            train + evaluation, config.vocab_size, conversations, extra_text
        )
        _check_single_tokens(tokenizer, getattr(source, "single_token_words", ()))
        torch.manual_seed(seed)
        model = build_model(config, tokenizer)
        loss = sft(model, tokenizer, train, config, config.sft_steps, seed, source)
        if is_tool_task(source):
            rewards = tool_rollout_rewards(
                model,
                tokenizer,
                tool_source,
                evaluation,
                samples_per_prompt=config.check_samples_per_prompt,
                max_new_tokens=config.check_max_new_tokens,
                seed=seed,
            )
            reward = sum(rewards) / len(rewards)
        else:
            reward = sampled_reward(
                model,
                tokenizer,
                evaluation[: config.check_prompts or None],
                source.reward_fn,
                samples_per_prompt=config.check_samples_per_prompt,
                max_new_tokens=config.check_max_new_tokens,
                seed=seed,
            )
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(out_dir)
    info = {
        "build_hash": _build_hash(config, seed, task_name),
        "build_version": BUILD_VERSION,
        "task": task_name,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": config.sft_steps,
        "sft_final_loss": loss,
        "sampled_reward_after_sft": reward,
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return readable_by_all(out_dir)


def ensure_base_model(
    out_dir: Path,
    *,
    seed: int = 0,
    sft_steps: int | None = None,
    config: BaseModelConfig | None = None,
    task: str = TASK,
) -> Path:
    """`out_dir`, built only if it is missing or was built with other parameters."""
    out_dir = Path(out_dir)
    config = _resolve(config, sft_steps, task)
    info_path = out_dir / "build_info.json"
    if info_path.exists() and (out_dir / "model.safetensors").exists():
        info = json.loads(info_path.read_text())
        if info.get("build_hash") == _build_hash(config, seed, task):
            return out_dir
    return build_base_model(out_dir, seed=seed, config=config, task=task)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--task", default=TASK, help="task to warm up on (default: %(default)s)")
    args = parser.parse_args(argv)
    out = build_base_model(args.out, seed=args.seed, sft_steps=args.sft_steps, task=args.task)
    print((out / "build_info.json").read_text(), end="")


if __name__ == "__main__":
    main()
