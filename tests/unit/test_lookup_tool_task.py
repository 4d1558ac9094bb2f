"""The "lookup" tool task, its reward, the tool-task SFT warm-up and the "tool_user"
agent's pure parts (toolbox, tool messages, the assistant message sent back). The agent
end to end against the real gateway is tests/service/test_lookup_task.py."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessage
from transformers import AutoTokenizer

from seamlessflow.agents import get_agent
from seamlessflow.agents.tool_agent import assistant_message, tool_messages, tool_user, toolbox_for
from seamlessflow.rewards import code_match, get_reward
from seamlessflow.tasks import get_task_source, task_names
from seamlessflow.tasks.lookup import (
    CODE_WORDS,
    CODES,
    N_ITEMS,
    TOOLS,
    call_tool,
    item_number,
    lookup,
)
from sf_app.base_model import (
    IM_END,
    TOOL_CALL,
    BaseModelConfig,
    _build_hash,
    assistant_labels,
    build_base_model,
    default_config,
    parse_tool_calls,
)


def test_task_is_deterministic_with_disjoint_splits() -> None:
    assert "lookup" in task_names()
    task = get_task_source("lookup", seed=0)
    assert get_reward(task.reward_fn) is code_match
    train, evaluation = task.items("train"), task.items("eval")
    assert train == get_task_source("lookup", seed=0).items("train")
    assert train != get_task_source("lookup", seed=1).items("train")
    assert len(train) + len(evaluation) == N_ITEMS and len(evaluation) == N_ITEMS // 5
    assert not {i.task_id for i in train} & {i.task_id for i in evaluation}
    # The database is the same whatever the run seed: agents and verifier agree.
    by_id = {i.task_id: i for i in train + evaluation}
    assert all(by_id[i.task_id] == i for i in get_task_source("lookup", seed=1).items("eval"))
    assert len(CODES) == N_ITEMS and set(CODES) <= set(CODE_WORDS)
    assert len(set(CODES)) > len(CODE_WORDS) // 2  # items do not share a handful of codes
    for item in train[:20]:
        n = item_number(item)
        assert item.messages == ({"role": "user", "content": f"What is the code of item {n}?"},)
        assert item.reference == lookup(n) == call_tool("lookup", json.dumps({"item": n}))
        assert code_match(lookup(n), item.reference) == 1.0
    with pytest.raises(ValueError, match="split"):
        task.items("test")


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("lookup", '{"item": 3}', CODES[3]),
        ("lookup", {"item": 0}, CODES[0]),
        ("lookup", '{"item": 200}', "error: no item 200"),
        ("lookup", '{"item": -1}', "error: no item -1"),
        ("lookup", '{"item": "3"}', "error: no item '3'"),
        ("lookup", '{"item": true}', "error: no item True"),
        ("lookup", '{"item": 3, "x": 1}', 'error: expected arguments {"item": <integer>}'),
        ("lookup", "{item: 3}", "error: arguments are not JSON"),
        ("search", '{"item": 3}', "error: unknown tool 'search'"),
    ],
)
def test_call_tool(name: str, arguments: str | dict[str, int], expected: str) -> None:
    assert call_tool(name, arguments) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("QZKT", 1.0),
        (" QZKT\n", 1.0),
        ("The code is QZKT.", 1.0),
        ("code: QZKT or ABCD", 1.0),
        ("qzkt", 0.0),
        ("QZKTA", 0.0),
        ("AQZKT", 0.0),
        ("QZK T", 0.0),
        ("QZKT9", 0.0),
        ('<tool_call>\n{"name": "lookup", "arguments": {"item": 1}}\n</tool_call>', 0.0),
        ("", 0.0),
    ],
)
def test_code_match(completion: str, expected: float) -> None:
    assert code_match(completion, "QZKT") == expected
    assert code_match(completion, "") == 0.0


def test_teacher_is_deterministic_and_noisy_as_configured() -> None:
    task = get_task_source("lookup", seed=0)
    item = task.items("train")[0]
    chats = [task.sft_conversation(item, random.Random(7), 0.5) for _ in range(3)]
    assert chats[0] == chats[1] == chats[2]
    rng = random.Random(0)
    clean = [task.sft_conversation(item, rng, 1.0) for _ in range(50)]
    for chat in clean:
        assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
        arguments = chat[1]["tool_calls"][0]["function"]["arguments"]
        assert json.loads(arguments) == {"item": item_number(item)}
        assert chat[3]["content"] == chat[2]["content"]  # copies the tool's answer
    # fresh codes, not the item's: nothing to memorise
    assert len({chat[2]["content"] for chat in clean}) > 20
    noisy = [task.sft_conversation(item, rng, 0.5) for _ in range(400)]
    skipped = [c for c in noisy if len(c) == 2]
    called = [c for c in noisy if len(c) == 4]
    right_item = [
        c for c in called if json.loads(c[1]["tool_calls"][0]["function"]["arguments"])["item"]
        == item_number(item)
    ]  # fmt: skip
    copied = [c for c in called if c[3]["content"] == c[2]["content"]]
    assert all(c[3]["content"] in CODE_WORDS for c in called)
    assert len(skipped) + len(called) == 400
    assert 0.15 < len(skipped) / 400 < 0.35  # (1 - 0.5) * teacher_p_skip_tool
    assert 0.55 < len(right_item) / len(called) < 0.8
    assert 0.4 < len(copied) / len(called) < 0.6


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_base_model(
        tmp_path_factory.mktemp("lookup") / "model", seed=0, sft_steps=4, task="lookup"
    )


def test_sft_conversations_render_prefix_stable(lookup_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(lookup_model)
    task = get_task_source("lookup", seed=0)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    rng = random.Random(0)
    for item in task.items("train")[:10]:
        for p_correct in (1.0, 0.3):
            chat = task.sft_conversation(item, rng, p_correct)
            full_ids = tokenizer.apply_chat_template(chat, tools=TOOLS, return_dict=False)
            full_text = tokenizer.apply_chat_template(chat, tools=TOOLS, tokenize=False)
            assert '"name": "lookup"' in full_text and "<tools>" in full_text
            labels = assistant_labels(full_ids, tokenizer)
            trained: list[int] = []
            for k, message in enumerate(chat):
                if message["role"] != "assistant":
                    continue
                prompt = tokenizer.apply_chat_template(
                    chat[:k], tools=TOOLS, add_generation_prompt=True, return_dict=False
                )
                through = tokenizer.apply_chat_template(
                    chat[: k + 1], tools=TOOLS, return_dict=False
                )
                assert through[: len(prompt)] == prompt == full_ids[: len(prompt)]
                completion = through[len(prompt) :]
                assert completion[-2] == im_end  # then "\n", not generated by the model
                trained += completion[:-1]
                text = tokenizer.decode(completion[:-2])
                if message.get("tool_calls"):
                    assert text.startswith(TOOL_CALL) and parse_tool_calls(text) == [
                        ("lookup", {"item": json.loads(
                            message["tool_calls"][0]["function"]["arguments"])["item"]})
                    ]  # fmt: skip
                else:
                    assert text == message["content"] and parse_tool_calls(text) is None
            # The SFT loss is on exactly the assistant turns (content + <|im_end|>).
            assert [t for t in labels if t != -100] == trained


def test_lookup_build_info(lookup_model: Path) -> None:
    info = json.loads((lookup_model / "build_info.json").read_text())
    assert info["task"] == "lookup" and info["sft_steps"] == 4
    assert 0.0 <= info["sampled_reward_after_sft"] <= 1.0
    config = default_config("lookup")
    assert config.check_max_new_tokens >= 32
    assert _build_hash(config, 0, "lookup") != _build_hash(config, 0, "arithmetic")
    # Copying is one token: each code word is a single token, the same in the tool's
    # answer and in the final answer (both on their own line).
    tokenizer = AutoTokenizer.from_pretrained(lookup_model)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in CODE_WORDS)
    chat = get_task_source("lookup", seed=0).sft_conversation(
        get_task_source("lookup", seed=0).items("train")[0], random.Random(0), 1.0
    )
    ids = tokenizer.apply_chat_template(chat, tools=TOOLS, return_dict=False)
    code = tokenizer.convert_tokens_to_ids(chat[2]["content"])
    assert ids.count(code) == 2 and ids[-3] == code  # tool's answer, final answer


def test_arithmetic_build_is_unchanged_and_reproducible(tmp_path: Path) -> None:
    # The cache key of the arithmetic build is the default config's (tool tasks left it
    # alone; it changed on 2026-12-03, when the model came to state the 1024 positions
    # it was already used at), so a cached base-arithmetic is rebuilt only for a reason
    # ...
    assert _build_hash(BaseModelConfig(), 0) == "72a1addfcd0b8856"
    assert _build_hash(default_config("arithmetic"), 0, "arithmetic") == "72a1addfcd0b8856"
    # ... and the build is a reproducible script: the same seed gives the same bytes.
    first = build_base_model(tmp_path / "first", seed=0, sft_steps=8)
    second = build_base_model(tmp_path / "second", seed=0, sft_steps=8)
    assert json.loads((first / "build_info.json").read_text())["build_hash"] == "ae6d660f4adfa490"

    def sha(root: Path, name: str) -> str:
        return hashlib.sha256((root / name).read_bytes()).hexdigest()

    for name in ("tokenizer.json", "model.safetensors"):
        assert sha(first, name) == sha(second, name), name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "lookup", "arguments": {"item": 7}}\n</tool_call>',
         [("lookup", {"item": 7})]),
        ('<tool_call>{"name": "lookup", "arguments": {"item": 7}}</tool_call>'
         '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
         [("lookup", {"item": 7}), ("x", {})]),
        ('<tool_call>\n{"name": "lookup", "arguments": {"item": 1 7}}\n</tool_call>', None),
        ("QZKT", None),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', None),
    ],
)  # fmt: skip
def test_parse_tool_calls(text: str, expected: list[tuple[str, object]] | None) -> None:
    assert parse_tool_calls(text) == expected


# ------------------------------------------------------------------ the agent's pure parts


def _reply(*calls: tuple[str, str, str]) -> ChatCompletionMessage:
    """An assistant message as the openai SDK parses it from a gateway reply."""
    return ChatCompletionMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
            or None,
        }
    )


def test_agent_is_registered_and_finds_the_lookup_tools() -> None:
    assert get_agent("tool_user") is tool_user
    tools, run_tool = toolbox_for("lookup-17")
    assert tools == TOOLS and run_tool("lookup", '{"item": 17}') == CODES[17]
    assert toolbox_for("adhoc")[0] == TOOLS


def test_agent_turns_tool_calls_into_messages() -> None:
    reply = _reply(("call_a", "lookup", '{"item": 5}'), ("call_b", "lookup", "{bad"))
    assert tool_messages(reply, call_tool) == [
        {"role": "tool", "tool_call_id": "call_a", "content": CODES[5]},
        {"role": "tool", "tool_call_id": "call_b", "content": "error: arguments are not JSON"},
    ]
    sent = assistant_message(reply)
    assert sent == {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "lookup", "arguments": '{"item": 5}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "lookup", "arguments": "{bad"}},
        ],
    }  # fmt: skip
    json.dumps(sent)  # what the SDK sends back: plain JSON
    assert tool_messages(_reply(), call_tool) == []
