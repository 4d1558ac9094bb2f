"""Tokenization at the gateway: the chat template is applied here and only here.

Engines and the trainer only ever see token ids; text exists at the agent boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class ChatTokenizer:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        for special in ("<|im_end|>", "<|endoftext|>"):
            token_id = self.tokenizer.convert_tokens_to_ids(special)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                stops.add(token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(t for t in stops if t is not None))
        self.vocab_size = len(self.tokenizer)
        template = self.tokenizer.chat_template
        self.chat_template: str = template if isinstance(template, str) else ""
        """The default chat template's source (tool and reasoning parsers are picked
        from its markers)."""
        self.model_type = _model_type(model_dir)

    @property
    def end_of_turn(self) -> str:
        """The token text that ends an assistant turn (the chat eos, e.g. ``<|im_end|>``)."""
        return str(self.tokenizer.eos_token)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        """The chat template's text for ``messages`` (no tokenization)."""
        return str(
            self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Template the conversation and open an assistant turn."""
        return self.encode_text(self.render(messages, None, True))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_completion(self, token_ids: list[int]) -> str:
        """The text an agent sees: without a trailing stop token."""
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def raw_text(self, token_ids: list[int]) -> str:
        """The ids decoded with special tokens kept (what the engine literally produced)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def _model_type(model_dir: Path) -> str:
    """``model_type`` of the directory's config.json ("" without one)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""
