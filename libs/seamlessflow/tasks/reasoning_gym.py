"""reasoning-gym datasets as task sources: ``rg:<dataset>[?key=value&...]``.

reasoning-gym (the ``reasoning`` extra) has about a hundred procedural generators, each
with its own scorer. Any of them is a task by name, e.g. ``rg:chain_sum`` or
``rg:basic_arithmetic?max_digits=2&format_reward=0.1``.

**Options.** A key is one of the dataset's own configuration fields (its dataclass:
``max_digits``, ``operators``...; lists are comma-separated) or one of ours:
- ``size`` (default ``DEFAULT_SIZE``): train items generated (fewer after duplicates are
  dropped, below);
- ``eval_size`` (default ``DEFAULT_EVAL_SIZE``): held-out items;
- ``answer`` (default ``tag``): how the answer is read from a completion, ``tag`` (inside
  the last ``<answer>...</answer>``) or ``last_line`` (the last non-empty line). ``tag``
  is the default because it is what reasoning-gym and its users do (its own prompts and
  ``extract_answer``, so scores compare with theirs), the answer's ends are explicit
  (working written before it is never read as the answer), multi-line answers (grids,
  boards) work, and the format can be rewarded. ``last_line`` suits a model that answers
  directly and will not learn the tags; ``last_number`` (the last number written) suits
  numeric answers from a small model that works them out in sentences (what the
  SmolLM2-135M recipe uses: docs/models.md);
- ``format_reward`` (default 0): the weight ``w`` in [0, 1) of a format term, reward =
  ``(1 - w) * score + w * [answer stated as asked]`` (``answer=tag`` only; see
  ``seamlessflow.rewards.reasoning_gym_verifier``);
- ``max_tokens``: the completion budget this task asks for (the run's own default if
  not given; ``seamlessflow up``'s is made for the built-in tasks' few-token answers, too
  short for reasoning and a tagged answer).

``seed`` is not an option: the run's seed decides. Values are taken as written, except
``%XX`` escapes (a ``+`` stays a plus). Keys and values are checked when the source is
built (an unknown key or a bad value is a ValueError naming the dataset's keys), so a
typo fails at start. Inside ``SF_TRAJECTORY_STAGES``, where a comma separates stages and
a final ``:<digits>`` is a stage's length, write a comma in a value as ``%2C`` and a
colon as ``%3A``: ``rg:basic_arithmetic?max_digits=2:20,rg:chain_sum``.

**Items.** The question is the user message, after a short system message stating the
answer format (the model is tiny: ``SYSTEM_PROMPTS``). The reference is
``RgReference`` JSON: what the dataset's scorer needs (the reward functions are
``reasoning_gym`` for training and ``reasoning_gym_accuracy``, no format term, for the
trainer's held-out evaluation: ``eval_reward_fn``).

**Splits** are deterministic for a seed and disjoint: "eval" is generated with one seed
and "train" with another, both derived from the run's seed (far apart, since many
generators seed item ``i`` with ``seed + i``); any question seen before is dropped (a
duplicate within a split, and every train question that is also an eval question).
Items are generated on the first ``items`` call, not when the source is built.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import unquote

from seamlessflow.rewards.reasoning_gym_verifier import (
    ANSWER_FORMATS,
    RUN_CONTROLLED_FIELDS,
    RgReference,
    build_dataset,
    dataset_fields,
)
from seamlessflow.tasks import SPLITS, TaskItem, fraction_option

PREFIX = "rg:"
DEFAULT_SIZE = 2000
DEFAULT_EVAL_SIZE = 100
DEFAULT_ANSWER_FORMAT = "tag"
RESERVED_OPTIONS = ("size", "eval_size", "answer", "format_reward", "max_tokens")
TRAIN_REWARD_FN = "reasoning_gym"
EVAL_REWARD_FN = "reasoning_gym_accuracy"
SYSTEM_PROMPTS = {
    "tag": (
        "Solve the problem. End your reply with the final answer alone between "
        "<answer> and </answer>, in the form the question asks for."
    ),
    "last_line": (
        "Solve the problem. End your reply with the final answer alone on its own last "
        "line, in the form the question asks for."
    ),
    "last_number": "Solve the problem. End your reply with the final answer as a number.",
}
"""Per answer format: what the model is told (short: the base model has 135M weights)."""


@dataclass(frozen=True)
class RgTaskSpec:
    """An ``rg:`` task name, parsed."""

    dataset: str
    config: dict[str, str]
    """The dataset's own options, as written (%-decoded)."""
    size: int = DEFAULT_SIZE
    eval_size: int = DEFAULT_EVAL_SIZE
    answer_format: str = DEFAULT_ANSWER_FORMAT
    format_reward: float = 0.0
    max_tokens: int | None = None


def parse_rg_task_name(name: str) -> RgTaskSpec | None:
    """The spec of an ``rg:`` task name, None for other names; ValueError for a malformed
    one (the dataset's keys and values are checked by ``ReasoningGymTask``)."""
    if not name.startswith(PREFIX):
        return None
    dataset, _, query = name[len(PREFIX) :].partition("?")
    if not dataset:
        raise ValueError(f"task {name!r}: name a reasoning-gym dataset, rg:<dataset>[?k=v&...]")
    options: dict[str, str] = {}
    for pair in filter(None, query.split("&")):
        key, equals, value = pair.partition("=")
        key = unquote(key)
        if not key or not equals:
            raise ValueError(f"task {name!r}: expected key=value, got {pair!r}")
        if key in options:
            raise ValueError(f"task {name!r}: option {key!r} given twice")
        options[key] = unquote(value)
    reserved = {key: options.pop(key) for key in RESERVED_OPTIONS if key in options}
    for key in RUN_CONTROLLED_FIELDS:
        if key in options:
            raise ValueError(f"task {name!r}: {key!r} is not an option (the run's seed decides)")
    size = _count(name, reserved, "size", minimum=1)
    eval_size = _count(name, reserved, "eval_size", minimum=0)
    spec = RgTaskSpec(
        dataset=dataset,
        config=options,
        size=DEFAULT_SIZE if size is None else size,
        eval_size=DEFAULT_EVAL_SIZE if eval_size is None else eval_size,
        answer_format=reserved.get("answer", DEFAULT_ANSWER_FORMAT),
        format_reward=fraction_option(name, "format_reward", reserved.get("format_reward"), 0.0),
        max_tokens=_count(name, reserved, "max_tokens", minimum=1),
    )
    if spec.answer_format not in ANSWER_FORMATS:
        raise ValueError(
            f"task {name!r}: answer={spec.answer_format!r}; expected one of {ANSWER_FORMATS}"
        )
    if spec.format_reward and spec.answer_format == "last_line":
        raise ValueError(
            f"task {name!r}: format_reward needs answer=tag or last_number (every "
            "non-empty completion has a last line, so answer=last_line has no format to "
            "reward)"
        )
    return spec


def _count(name: str, options: dict[str, str], key: str, *, minimum: int) -> int | None:
    if key not in options:
        return None
    text = options[key]
    if not text.isdigit() or int(text) < minimum:
        raise ValueError(f"task {name!r}: {key} must be an integer >= {minimum}, got {text!r}")
    return int(text)


def split_seed(seed: int, split: str) -> int:
    """The generator seed of a split: derived from the run's seed, far from the other
    split's (and below 2**30, so ``seed + index`` suits numpy's 32-bit seeds)."""
    digest = hashlib.sha256(f"reasoning-gym/{seed}/{split}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 2**30


class ReasoningGymTask:
    """The task source of one ``rg:`` name (module docstring)."""

    reward_fn = TRAIN_REWARD_FN
    eval_reward_fn = EVAL_REWARD_FN
    max_tokens: int
    """Set only when the task name gives one (the run's default otherwise)."""

    def __init__(self, name: str, seed: int = 0) -> None:
        spec = parse_rg_task_name(name)
        if spec is None:
            raise ValueError(f"task {name!r} is not a reasoning-gym task ({PREFIX}<dataset>)")
        unknown = set(spec.config) - set(dataset_fields(spec.dataset))
        if unknown:
            raise ValueError(
                f"task {name!r}: unknown option {sorted(unknown)[0]!r}; options of "
                f"{spec.dataset}: {', '.join(dataset_fields(spec.dataset))}; ours: "
                f"{', '.join(RESERVED_OPTIONS)}"
            )
        build_dataset(spec.dataset, spec.config, seed=split_seed(seed, "train"), size=1)
        self.name = name
        self.seed = seed
        self.spec = spec
        if spec.max_tokens is not None:
            self.max_tokens = spec.max_tokens
        self._splits: dict[str, list[TaskItem]] = {}
        self._questions: set[str] = set()  # of the splits generated so far: none repeats

    def items(self, split: str) -> list[TaskItem]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if "eval" not in self._splits:  # first: train drops what eval holds
            self._splits["eval"] = self._split_items("eval", self.spec.eval_size)
        if split == "train" and "train" not in self._splits:
            train = self._split_items("train", self.spec.size)
            if not train:
                raise ValueError(f"task {self.name!r}: no train item is left after the eval split")
            self._splits["train"] = train
        return list(self._splits[split])

    def _split_items(self, split: str, size: int) -> list[TaskItem]:
        """``size`` generated entries of ``split``, less the questions already seen."""
        spec = self.spec
        if not size:
            return []
        dataset = build_dataset(spec.dataset, spec.config, split_seed(self.seed, split), size)
        system = {"role": "system", "content": SYSTEM_PROMPTS[spec.answer_format]}
        items = []
        for index in range(size):
            entry = dataset[index]
            question = str(entry["question"])
            if question in self._questions:
                continue
            self._questions.add(question)
            reference = RgReference(
                dataset=spec.dataset,
                config=spec.config,
                answer=entry["answer"],
                metadata=dict(entry.get("metadata") or {}),
                answer_format=spec.answer_format,
                format_reward=spec.format_reward,
            )
            items.append(
                TaskItem(
                    task_id=f"{self._id_prefix()}-{split}-{index}",
                    messages=(system, {"role": "user", "content": question}),
                    reference=reference.to_json(),
                )
            )
        return items

    def _id_prefix(self) -> str:
        """The dataset's name, and a digest of its options when it has any (two stages
        of one dataset with different options have different task ids)."""
        if not self.spec.config:
            return self.spec.dataset
        options = "&".join(f"{k}={v}" for k, v in sorted(self.spec.config.items()))
        return f"{self.spec.dataset}-{hashlib.sha256(options.encode()).hexdigest()[:8]}"
