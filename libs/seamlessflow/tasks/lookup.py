"""The task "lookup": a multi-turn, tool-using task only a tool can answer.

"What is the code of item 17?" -> the agent calls the tool ``lookup(item=17)``, gets the
item's code (e.g. "lemon") in a ``tool`` message, and answers with it ("lemon"). Codes
are words of a small fixed list (``CODE_WORDS``), drawn once per item from a fixed seed
(``DATABASE_SEED``): they are the "world" the tool reads, the same in every process (the
agent runner runs the tool, the trajectory service checks the answer) whatever the run
seed. The run seed only shuffles the items into a disjoint train / eval split (80% / 20%
of ``N_ITEMS``).

Why words from a list: the base model is tiny (2 layers), and copying a code it has
never seen, split into arbitrary BPE pieces, is beyond it (random four-letter codes: 0/32
copied after SFT). Each word here is one token of the locally trained tokenizer (its
training text includes ``TOKENIZER_TEXT``; the build checks it), and the tool's answer
and the final answer are both the bare word on its own line, so they are the *same*
token: copying is a single attention look-up.

Reward "code_match": 1 iff the final answer contains the code as a whole word.

The module also holds the tool's OpenAI schema (``TOOLS``), its pure implementation
(``lookup``, ``call_tool``) and the noisy teacher the base model's SFT warm-up imitates
(``LookupTask.sft_conversation``; the built-in base model, docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from seamlessflow.tasks import TaskItem, seeded_split, split_of

N_ITEMS = 200
DATABASE_SEED = 20261122
# 48 short lowercase words, none of which occurs in the chat template or the tool schema.
CODE_WORDS: tuple[str, ...] = (
    "apple", "bear", "bird", "boat", "cake", "cat", "cloud", "corn",
    "cow", "desk", "dog", "drum", "duck", "egg", "fish", "flag",
    "frog", "goat", "gold", "grape", "hat", "horse", "ice", "jam",
    "key", "kite", "lamp", "leaf", "lemon", "lion", "milk", "moon",
    "mouse", "nest", "owl", "pear", "pig", "plum", "rain", "ring",
    "rose", "salt", "ship", "snow", "star", "sun", "tree", "wolf",
)  # fmt: skip
TOKENIZER_TEXT: tuple[str, ...] = tuple("\n".join([w] * 50) + "\n" for w in CODE_WORDS)
"""Extra tokenizer training text: each code word often enough to become one token."""
EVAL_FRACTION = 0.2

TOOL_NAME = "lookup"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Code of an item.",
            "parameters": {
                "type": "object",
                "properties": {"item": {"type": "integer"}},
                "required": ["item"],
            },
        },
    }
]


def random_code(rng: random.Random, *, other_than: str | None = None) -> str:
    return rng.choice([w for w in CODE_WORDS if w != other_than])


def _codes() -> tuple[str, ...]:
    rng = random.Random(DATABASE_SEED)
    return tuple(random_code(rng) for _ in range(N_ITEMS))


CODES = _codes()


def lookup(item: int) -> str:
    """The tool: the code of ``item``, or an error text for an unknown item."""
    if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < N_ITEMS:
        return f"error: no item {item!r}"
    return CODES[item]


def call_tool(name: str, arguments: str | dict[str, Any]) -> str:
    """Run a tool call as the model wrote it (arguments as a JSON string or a dict).

    Never raises: a bad call gets an error text back, as a real tool server would send.
    """
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: arguments are not JSON"
    if not isinstance(arguments, dict) or set(arguments) != {"item"}:
        return 'error: expected arguments {"item": <integer>}'
    return lookup(arguments["item"])


def prompt_text(item: int) -> str:
    return f"What is the code of item {item}?"


def make_item(item: int) -> TaskItem:
    return TaskItem(
        task_id=f"lookup-{item}",
        messages=({"role": "user", "content": prompt_text(item)},),
        reference=CODES[item],
    )


def item_number(task: TaskItem) -> int:
    return int(task.task_id.rpartition("-")[2])


def tool_call_message(item: int, call_id: str = "call_0") -> dict[str, Any]:
    """The assistant message that calls ``lookup(item)`` (OpenAI format)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps({"item": item})},
            }
        ],
    }


@dataclass
class LookupTask:
    seed: int = 0
    name: str = "lookup"
    reward_fn: str = "code_match"
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)
    max_tokens: int = 32
    """Completion budget per agent call that fits a tool call (embedded runs use it)."""
    teacher_p_skip_tool: float = 0.5
    """Noisy teacher: of its wrong first turns, this share answers without calling the
    tool (a random code); the rest call the tool with a random wrong item."""
    tokenizer_text: tuple[str, ...] = TOKENIZER_TEXT
    """Extra text the base model's tokenizer is trained on (one token per code word)."""
    single_token_words: tuple[str, ...] = CODE_WORDS
    """Words the base model's build checks are single tokens."""
    _splits: dict[str, list[TaskItem]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._splits = seeded_split(
            [make_item(i) for i in range(N_ITEMS)], self.seed, EVAL_FRACTION
        )

    def items(self, split: str) -> list[TaskItem]:
        return split_of(self._splits, split)

    @property
    def sft_version(self) -> str:
        """Everything about the teacher the base model's build hash must see."""
        words = hashlib.sha256(" ".join(CODE_WORDS).encode()).hexdigest()[:8]
        return f"lookup-3:{N_ITEMS}:{DATABASE_SEED}:{words}:{self.teacher_p_skip_tool}"

    def call_tool(self, name: str, arguments: str | dict[str, Any]) -> str:
        return call_tool(name, arguments)

    def sft_conversation(
        self, task: TaskItem, rng: random.Random, p_correct: float
    ) -> list[dict[str, Any]]:
        """One full chat for SFT: the question, the assistant's tool call, the tool's
        answer and the final answer; render it with ``tools=self.tools``.

        The teacher makes each of its two decisions right with probability `p_correct`:
        1. the first turn calls ``lookup`` with the asked item; else it either answers at
           once with a random code (share ``teacher_p_skip_tool``) or calls the tool with a
           random other item;
        2. the final answer copies the tool's answer; else it is a random other code.

        The tool's answer in these chats is a fresh random code, not the item's code in
        the database: a model that memorised codes would gain nothing, so the warm-up
        teaches reading the tool's answer, which is what generalises to unseen items.
        """
        item = item_number(task)
        messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
        if rng.random() >= p_correct:
            if rng.random() < self.teacher_p_skip_tool:
                return [*messages, {"role": "assistant", "content": random_code(rng)}]
            item = rng.choice([i for i in range(N_ITEMS) if i != item])
        result = random_code(rng)
        answer = result if rng.random() < p_correct else random_code(rng, other_than=result)
        return [
            *messages,
            tool_call_message(item),
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": answer},
        ]
