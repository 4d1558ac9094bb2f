"""Tiny random-init models in the config shape of the families people train with RL.

`build_family_model(family, out_dir)` writes a directory that
`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` and vLLM load:

- "qwen2": Qwen2ForCausalLM, untied (as Qwen2.5-7B), q/k/v biases, ChatML with tools;
- "qwen2-tied": the same with tied embeddings (as Qwen2.5-0.5B/1.5B/3B);
- "qwen3": Qwen3ForCausalLM, tied (as Qwen3-0.6B/1.7B/4B), q/k RMSNorm, an explicit
  head_dim with heads x head_dim != hidden_size (as Qwen3-0.6B), Qwen3-style ChatML
  with `<think>` blocks;
- "llama3-tied": LlamaForCausalLM, tied (as Llama-3.2-1B/3B), "llama3" RoPE scaling,
  `<|begin_of_text|>` added on encode, a Llama 3.x header template ending turns with
  `<|eot_id|>`, eos ids a list (as Llama-3.2-1B-Instruct's config.json).

All have 2 layers, GQA (4 query heads, 2 KV heads) and head_dim 32 (a size vLLM's CPU
attention supports). The vocabulary is exactly the tokenizer's (real checkpoints pad it
to a multiple of 64-128; the padded rows are never sampled there, while here they would
be, as the weights are random). The weights are random (torch's init, seeded): these
models test plumbing (weight transfer, engines, templates), not learning.

Tokenizer: a byte-level BPE trained on the task's chats rendered with the family's
template plus generic text, with the family's pre-tokenizer regex (Qwen2's for the Qwen
families, Llama 3's for Llama) and special tokens. Saved as a plain `tokenizer.json`
(`TokenizersBackend`), so every loader tokenizes exactly as built.

Chat templates are prefix-stable for plain multi-turn chats (rendering messages[:k] with
the generation prompt, then appending the assistant's completion and the family's end of
turn, renders messages[:k+1]), with each tool message its own turn (the real Qwen
templates merge consecutive tool messages into one user turn). Exceptions, as in the
real templates:
- qwen3: a `<think>...</think>` block in an assistant message is kept only for the
  turns after the last user message; once a new user message follows, earlier turns are
  rendered without their reasoning. `enable_thinking=False` appends an empty think
  block to the generation prompt, which is then part of the prompt, not the completion.
- llama3-tied: the real template's default system prompt ("Cutting Knowledge Date...")
  is left out; message contents are not trimmed (trimming breaks prefix stability).

Deterministic given the seed (torch runs single-threaded while the weights are drawn).

CLI: `python -m seamlessflow.assets.families --family F --out DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seamlessflow.assets.chatml import CHAT_TEMPLATE as QWEN2_CHAT_TEMPLATE
from seamlessflow.assets.chatml import (
    GENERIC_TEXT,
    IM_END,
    IM_START,
    PAD,
    TOOL_CALL,
    TOOL_CALL_END,
    chat_template,
)
from seamlessflow.assets.loading import readable_by_all

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FAMILIES: tuple[str, ...] = ("qwen2", "qwen2-tied", "qwen3", "llama3-tied")

VOCAB_SIZE = 512
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 2048

# Qwen2's pre-tokenizer (digits one by one), as in transformers' Qwen2 tokenizer.
QWEN_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3's pre-tokenizer (digits in groups of up to three).
LLAMA3_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-style ChatML: as Qwen2.5's (tools in the system turn, <tool_call> JSON blocks),
# with Qwen3's wording of the tools' instructions and its <think> handling
# (``chatml.chat_template``'s ``reasoning``).
QWEN3_CHAT_TEMPLATE = chat_template(
    tools_preamble=r"""
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
        + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
""",
    tools_instructions=r"""
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and'
        + ' arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        + '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
""",
    reasoning=True,
)

# Llama 3.x style: `<|begin_of_text|>`, then one header block per message, each turn
# ending with `<|eot_id|>`; tools are listed in the system turn, a tool call is the
# assistant's JSON `{"name": ..., "parameters": ...}`, a tool result an `ipython` turn.
LLAMA3_CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- 'You have access to the following functions. To call a function, respond with'
        + ' JSON for a function call in the format {"name": function name, "parameters":'
        + ' dictionary of argument name and its value}.\n\n' }}
    {%- for tool in tools %}
        {{- (tool | tojson(indent=4)) + '\n\n' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + messages[0].content + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments + '}' }}
            {%- else %}
                {{- (tool_call.arguments | tojson) + '}' }}
            {%- endif %}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n'
            + (message.content or '') + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
""".strip()


@dataclass(frozen=True)
class FamilySpec:
    """What differs between families: architecture, tying, tokens, template."""

    architecture: str  # transformers class name
    tied: bool
    chat_template: str
    pretokenize: str
    special_tokens: tuple[str, ...]  # special (skipped when decoding), first ids
    added_tokens: tuple[str, ...]  # added but not special (kept when decoding)
    eos_token: str  # the tokenizer's eos: the chat's end of turn
    pad_token: str
    stop_tokens: tuple[str, ...]  # generation_config's eos ids, eos first
    bos_token: str | None  # added in front of every encode (Llama)
    end_of_turn: str  # what the template appends after an assistant's completion


_QWEN_SPECIALS = (PAD, IM_START, IM_END)
_LLAMA_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)

SPECS: dict[str, FamilySpec] = {
    "qwen2": FamilySpec(
        architecture="Qwen2ForCausalLM",
        tied=False,
        chat_template=QWEN2_CHAT_TEMPLATE,
        pretokenize=QWEN_PRETOKENIZE,
        special_tokens=_QWEN_SPECIALS,
        added_tokens=(TOOL_CALL, TOOL_CALL_END),
        eos_token=IM_END,
        pad_token=PAD,
        stop_tokens=(IM_END, PAD),
        bos_token=None,
        end_of_turn=IM_END + "\n",
    ),
    "qwen3": FamilySpec(
        architecture="Qwen3ForCausalLM",
        tied=True,
        chat_template=QWEN3_CHAT_TEMPLATE,
        pretokenize=QWEN_PRETOKENIZE,
        special_tokens=_QWEN_SPECIALS,
        added_tokens=(TOOL_CALL, TOOL_CALL_END, "<think>", "</think>"),
        eos_token=IM_END,
        pad_token=PAD,
        stop_tokens=(IM_END, PAD),
        bos_token=None,
        end_of_turn=IM_END + "\n",
    ),
    "llama3-tied": FamilySpec(
        architecture="LlamaForCausalLM",
        tied=True,
        chat_template=LLAMA3_CHAT_TEMPLATE,
        pretokenize=LLAMA3_PRETOKENIZE,
        special_tokens=_LLAMA_SPECIALS,
        added_tokens=(),
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        bos_token="<|begin_of_text|>",
        end_of_turn="<|eot_id|>",
    ),
}
SPECS["qwen2-tied"] = FamilySpec(**{**SPECS["qwen2"].__dict__, "tied": True})


def family_spec(family: str) -> FamilySpec:
    try:
        return SPECS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}") from None


def _render(spec: FamilySpec, messages: list[dict[str, Any]], tools: Any = None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
        conversations=[messages],
        chat_template=spec.chat_template,
        **({"tools": tools} if tools else {}),
        bos_token=spec.bos_token or "",
    )
    return rendered[0]


ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
"""A function tool in OpenAI's shape: in each family's tokenizer text, and what tests
offer agents."""
_TOOLS = [ADD_TOOL]


def _corpus(spec: FamilySpec) -> list[str]:
    """Tokenizer training text: the arithmetic task's chats and a tool chat, rendered
    with the family's template, plus generic text; special tokens cut out."""
    from seamlessflow.tasks import get_task_source

    source = get_task_source("arithmetic", seed=0)
    chats: list[tuple[list[dict[str, Any]], Any]] = [
        ([*item.messages, {"role": "assistant", "content": item.reference}], None)
        for item in source.items("train") + source.items("eval")
    ]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 12}}}
    chats.append(
        (
            [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 7 + 12?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "19"},
                {"role": "assistant", "content": "<think>\nThe tool says 19.\n</think>\n\n19"},
            ],
            _TOOLS,
        )
    )
    cut = re.compile("|".join(re.escape(t) for t in spec.special_tokens + spec.added_tokens))
    corpus = list(GENERIC_TEXT)
    for messages, tools in chats:
        corpus.extend(part for part in cut.split(_render(spec, messages, tools)) if part)
    return corpus


def build_tokenizer(spec: FamilySpec, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the family's pre-tokenizer, special tokens and template.

    Special tokens get the first ids and are skipped when decoding with
    `skip_special_tokens=True`; the added ones (`<tool_call>`, `<think>`) are single
    tokens that decoding keeps (as in Qwen2.5/Qwen3)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if spec.bos_token is None:
        tok.normalizer = normalizers.NFC()  # Qwen2 normalizes; Llama 3 does not
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.pretokenize), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*spec.special_tokens, *spec.added_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in spec.special_tokens]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added_tokens])
    if spec.bos_token is not None:
        bos_id = tok.token_to_id(spec.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos_token}:0 $A:0",
            pair=f"{spec.bos_token}:0 $A:0 {spec.bos_token}:1 $B:1",
            special_tokens=[(spec.bos_token, bos_id)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        padding_side="left",
        chat_template=spec.chat_template,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def _model_config(family: str, spec: FamilySpec, tokenizer: PreTrainedTokenizerFast) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    def ids(tokens: tuple[str, ...]) -> list[int]:
        return [int(tokenizer.convert_tokens_to_ids(t)) for t in tokens]  # type: ignore[arg-type]

    eos_id, pad_id = ids((spec.eos_token, spec.pad_token))
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": spec.tied,
        "pad_token_id": pad_id,
    }
    if family in ("qwen2", "qwen2-tied"):
        return Qwen2Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
            bos_token_id=ids(("<|endoftext|>",))[0],
            eos_token_id=eos_id,
        )
    if family == "qwen3":
        # As Qwen3-0.6B: heads x head_dim (128) != hidden_size (64).
        return Qwen3Config(
            **{**common, "hidden_size": HIDDEN_SIZE // 2},
            head_dim=HEAD_DIM,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
            bos_token_id=ids(("<|endoftext|>",))[0],
            eos_token_id=eos_id,
        )
    # Llama 3.2: RoPE theta 500000 with the "llama3" frequency scaling (scaled down to this
    # context: the frequencies with wavelengths above 256 positions are divided by 8, those
    # between 64 and 256 blended); eos ids a list.
    return LlamaConfig(
        **common,
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": MAX_POSITIONS // 8,
        },
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=ids((spec.bos_token or "",))[0],
        eos_token_id=ids(spec.stop_tokens),
    )


def build_family_model(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random-init model of `family` (one of FAMILIES) with its tokenizer and
    chat template to `out_dir` (overwriting); returns `out_dir`."""
    import torch
    from transformers import GenerationConfig

    from seamlessflow.assets.loading import causal_lm_from_config

    spec = family_spec(family)
    tokenizer = build_tokenizer(spec)
    config = _model_config(family, spec, tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-for-bit the same weights on every machine
    try:
        torch.manual_seed(seed)
        model = causal_lm_from_config(config, torch.float32)
    finally:
        torch.set_num_threads(threads)
    stop_ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in spec.stop_tokens]  # type: ignore[arg-type]
    # Only stop and pad ids: engines that read generation_config (vLLM does) must not pick
    # up sampling defaults (top_k, top_p) that would bias RL sampling.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=stop_ids,
        pad_token_id=config.pad_token_id,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {
        "family": family,
        "seed": seed,
        "architecture": spec.architecture,
        "tie_word_embeddings": spec.tied,
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return readable_by_all(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = build_family_model(args.family, args.out, seed=args.seed)
    print((out / "build_info.json").read_text(), end="")


if __name__ == "__main__":
    main()
