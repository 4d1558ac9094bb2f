"""The model families built locally: each loads with transformers, tied ones share one
matrix and save no separate lm_head, builds are deterministic, templates prefix-stable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from seamlessflow.assets.families import (
    ADD_TOOL,
    FAMILIES,
    build_family_model,
    family_spec,
)
from seamlessflow.assets.tokenizer import CHOICES_DIR, load_tokenizer
from seamlessflow.weights.tied import tied_aliases

CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 7 + 12?"},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "And 1 + 2?"},
    {"role": "assistant", "content": " The answer is 3.\n"},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
TOOLS = [ADD_TOOL]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 12}}}
TOOL_CHAT = [
    {"role": "user", "content": "What is 7 + 12?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "19"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "19"},
]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_model(family, root / family, seed=0) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_ties_as_configured(family: str, family_dirs: dict[str, Path]) -> None:
    spec = family_spec(family)
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    assert type(model).__name__ == spec.architecture
    assert model.config.tie_word_embeddings is spec.tied
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with safe_open(str(family_dirs[family] / "model.safetensors"), "pt") as saved:
        saved_names = set(saved.keys())
    if spec.tied:
        assert head is embed
        assert tied_aliases(model.state_dict(keep_vars=True)) == {
            "lm_head.weight": "model.embed_tokens.weight"
        }
        # As transformers saves tied models: the shared matrix once, under its input name.
        assert "lm_head.weight" not in saved_names
        assert "model.embed_tokens.weight" in saved_names
    else:
        assert head.data_ptr() != embed.data_ptr()
        assert not torch.equal(head, embed)
        assert tied_aliases(model.state_dict(keep_vars=True)) == {}
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= saved_names
    if family == "qwen3":
        assert any(name.endswith("self_attn.q_norm.weight") for name in saved_names)
        assert model.config.num_attention_heads * model.config.head_dim != (
            model.config.hidden_size
        )
    if family == "llama3-tied":
        assert model.config.rope_parameters["rope_type"] == "llama3"
    # A forward pass runs and gives a distribution over the whole vocabulary.
    tokenizer = AutoTokenizer.from_pretrained(family_dirs[family])
    ids = tokenizer.apply_chat_template(
        CHAT[:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_ids_and_generation_config(family: str, family_dirs: dict[str, Path]) -> None:
    spec = family_spec(family)
    tokenizer = AutoTokenizer.from_pretrained(family_dirs[family])
    config = json.loads((family_dirs[family] / "config.json").read_text())
    generation = json.loads((family_dirs[family] / "generation_config.json").read_text())
    assert tokenizer.eos_token == spec.eos_token
    assert tokenizer.pad_token == spec.pad_token
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    assert tokenizer.eos_token_id in stop_ids
    assert generation["eos_token_id"] == stop_ids
    assert generation["pad_token_id"] == tokenizer.pad_token_id == config["pad_token_id"]
    # No sampling defaults that an engine reading generation_config would pick up.
    assert not {"top_k", "top_p", "temperature", "do_sample"} & set(generation)
    for token in spec.special_tokens + spec.added_tokens:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    text = "What is 123 + 4567? <tool_call> done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    if spec.bos_token is not None:
        assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
    else:
        assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chat", [CHAT, TOOL_CHAT], ids=["plain", "tools"])
def test_chat_template_is_prefix_stable(
    family: str, chat: list[dict], family_dirs: dict[str, Path]
) -> None:
    """Prompt for turn k + the assistant's completion + end of turn == render of k+1."""
    spec = family_spec(family)
    tokenizer = AutoTokenizer.from_pretrained(family_dirs[family])
    tools = TOOLS if chat is TOOL_CHAT else None
    completions = {
        # What the model emits for the tool-calling turn.
        1: '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 12}}\n</tool_call>'
        if not family.startswith("llama")
        else '{"name": "add", "parameters": {"a": 7, "b": 12}}'
    }
    checked = 0
    for k, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            chat[:k], tools=tools, add_generation_prompt=True, tokenize=False
        )
        full = tokenizer.apply_chat_template(chat[: k + 1], tools=tools, tokenize=False)
        completion = completions.get(k, message["content"]) if tools else message["content"]
        assert prompt + completion + spec.end_of_turn == full
        checked += 1
    assert checked >= 2


def test_qwen3_think_blocks_are_kept_only_after_the_last_user_turn(
    family_dirs: dict[str, Path],
) -> None:
    """The documented exception to prefix stability (as the real Qwen3 template)."""
    tokenizer = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    answer = "<think>\n7 plus 12.\n</think>\n\n19"
    chat = [
        {"role": "user", "content": "What is 7 + 12?"},
        {"role": "assistant", "content": answer},
    ]
    prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(chat, tokenize=False)
    assert prompt + answer + "<|im_end|>\n" == full
    later = tokenizer.apply_chat_template(
        [*chat, {"role": "user", "content": "ok"}], tokenize=False
    )
    assert "7 plus 12" not in later and "<|im_start|>assistant\n19<|im_end|>" in later
    no_think = tokenizer.apply_chat_template(
        chat[:1], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think == prompt + "<think>\n\n</think>\n\n"


def test_build_is_deterministic_given_the_seed(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> dict[str, torch.Tensor]:
        out = build_family_model("qwen3", tmp_path / name, seed=seed)
        with safe_open(str(out / "model.safetensors"), "pt") as saved:
            return {k: saved.get_tensor(k) for k in saved.keys()}

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_unknown_family_and_cli(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model family 'gpt2'.*qwen2-tied"):
        build_family_model("gpt2", tmp_path / "x")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "seamlessflow.assets.families",
            "--family",
            "llama3-tied",
            "--out",
            str(tmp_path / "llama"),
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    assert info["family"] == "llama3-tied" and info["seed"] == 3
    assert info["tie_word_embeddings"] is True
    assert (tmp_path / "llama" / "model.safetensors").exists()


# ------------------------------------------- the tokenizer AutoTokenizer picks, without torch


@pytest.mark.parametrize("family", [*FAMILIES, "base"])
def test_a_recorded_tokenizer_choice_loads_what_autotokenizer_loads(
    family: str,
    family_dirs: dict[str, Path],
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = base_model_dir if family == "base" else family_dirs[family]
    monkeypatch.setenv("SF_CACHE_DIR", str(tmp_path))
    expected = AutoTokenizer.from_pretrained(str(model_dir))
    first = load_tokenizer(model_dir)  # asks AutoTokenizer and records its class
    (record,) = (tmp_path / CHOICES_DIR).iterdir()
    second = load_tokenizer(model_dir)  # the recorded class, directly
    text = "What is 7 + 12? <|im_end|> caf\u00e9 \U0001f600\n\n  19"
    for tokenizer in (first, second):
        assert type(tokenizer) is type(expected)
        assert tokenizer.all_special_ids == expected.all_special_ids
        assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (
            expected.eos_token_id,
            expected.pad_token_id,
            expected.bos_token_id,
        )
        assert tokenizer(text)["input_ids"] == expected(text)["input_ids"]
        assert tokenizer.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=True
        ) == expected.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    # the recorded load imports no torch (the reason for the record)
    probe = (
        "import sys; from pathlib import Path; "
        "from seamlessflow.assets.tokenizer import load_tokenizer; "
        f"t = load_tokenizer(Path({str(model_dir)!r})); "
        "print(type(t).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "SF_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [type(expected).__name__, "False"]
    # a record naming a class that does not import is asked again and rewritten
    record.write_text(json.dumps({"module": "transformers", "name": "NoSuchTokenizer"}))
    assert type(load_tokenizer(model_dir)) is type(expected)
    assert json.loads(record.read_text())["name"] == type(expected).__qualname__


def test_a_tokenizer_with_remote_code_is_never_recorded(
    family_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "remote"
    shutil.copytree(family_dirs["qwen2"], model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_mine.MineTokenizer"]}
    config_path.write_text(json.dumps(config))
    monkeypatch.setenv("SF_CACHE_DIR", str(tmp_path / "cache"))
    # whatever AutoTokenizer makes of it, every time: remote code decides the class
    expected = AutoTokenizer.from_pretrained(str(model_dir))
    assert type(load_tokenizer(model_dir)) is type(expected)
    assert not (tmp_path / "cache").exists()
