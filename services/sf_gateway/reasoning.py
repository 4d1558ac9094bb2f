"""Reasoning parsers: split a thinking model's reasoning off its answer.

``SF_GATEWAY_REASONING_PARSER`` picks one; ``auto`` picks ``qwen3`` when the chat
template knows ``<think>`` blocks, else none. The reasoning is returned as the message's
``reasoning_content`` (as vLLM's reasoning parsers and the DeepSeek/Qwen APIs expose
it; the ``openai`` SDK keeps the field in ``model_extra``) and ``content`` is the rest.
The tool parser then reads tool calls from that rest only.

``qwen3``: an answer that starts (after whitespace) with ``<think>`` has its reasoning
up to ``</think>`` (newlines around it stripped, as the Qwen3 template renders it); the
content is what follows, leading newlines stripped. An answer cut by ``max_tokens``
inside the block is all reasoning (content ``None``). An answer that does not start with
``<think>`` has no reasoning. A template that opens the block in the generation prompt
(Qwen3-2507 thinking models, DeepSeek-R1 distills: the prompt ends with ``<think>``)
makes the answer start inside it: the gateway then parses the answer as if it started
with ``<think>`` (``ChatFormat.reasoning_opened``).

Only the split is the parser's: the recorded turn keeps the engine's exact tokens,
think block included.
"""

from __future__ import annotations

from typing import Protocol

from sf_gateway.tool_parsers import drop_partial

REASONING_PARSER_CHOICES = ("auto", "qwen3", "none")


class ReasoningParser(Protocol):
    start: str
    """What opens the reasoning (a prompt ending with it opened it for the answer)."""
    end: str
    """What closes it."""

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, the rest of the answer) of a complete answer."""
        ...

    def streamable(self, text: str) -> tuple[str, str | None]:
        """For a prefix ``text`` of an answer: the prefix of its reasoning that is
        final, and the prefix of the rest that is (None: the rest has not started)."""
        ...


class Qwen3ReasoningParser:
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        inner = self._inner(text)
        if inner is None:
            return None, text
        end = inner.find(self.end)
        if end < 0:
            return inner.strip("\n") or None, ""
        return inner[:end].strip("\n") or None, inner[end + len(self.end) :].lstrip("\n")

    def streamable(self, text: str) -> tuple[str, str | None]:
        body = text.lstrip()
        if not body or (self.start.startswith(body) and body != self.start):
            return "", None  # may still open a think block
        inner = self._inner(text)
        if inner is None:
            return "", text
        end = inner.find(self.end)
        if end < 0:
            return drop_partial(inner, [self.end]).strip("\n"), None
        return inner[:end].strip("\n"), inner[end + len(self.end) :].lstrip("\n")

    def _inner(self, text: str) -> str | None:
        body = text.lstrip()
        if not body.startswith(self.start):
            return None
        return body[len(self.start) :]


def reasoning_of(parser: ReasoningParser, completion_text: str) -> str | None:
    """The reasoning of a stored completion (its text with special tokens): a closing
    tag without an opening one means the prompt opened the block."""
    opened = parser.start not in completion_text and parser.end in completion_text
    return parser.split(parser.start + completion_text if opened else completion_text)[0]


def reasoning_parser_for(setting: str, chat_template: str) -> ReasoningParser | None:
    """The parser ``setting`` names (``auto``: ``qwen3`` if the template has ``<think>``
    blocks); None: reasoning stays in the content."""
    if setting == "none":
        return None
    if setting == "qwen3" or (setting == "auto" and "<think>" in chat_template):
        return Qwen3ReasoningParser()
    if setting == "auto":
        return None
    raise ValueError(f"unknown reasoning parser {setting!r} (known: {REASONING_PARSER_CHOICES})")
