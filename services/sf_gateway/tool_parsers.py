"""Tool-call parsers: turn a completion's text into OpenAI ``tool_calls``, per model family.

A parser is a small class registered by name (``SF_GATEWAY_TOOL_PARSER``, default
``qwen``); another model family adds its own with ``@register_tool_parser("name")``.
Each parser says where a tool call starts (``start_marker``): while streaming, text from
that marker on is held back until the answer is complete and parsed.

Contract of ``parse(text)``: every well-formed call becomes a ``ToolCall`` (arguments as
a JSON string); a malformed block (bad JSON, no name, unclosed) stays in the content
untouched; the content is the text outside the well-formed blocks, ``None`` if that is
empty or only whitespace.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object, serialised (what OpenAI sends)."""
    id: str


@dataclass(frozen=True)
class ParsedCompletion:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(Protocol):
    start_marker: str

    def parse(self, text: str) -> ParsedCompletion: ...


class ForcesCalls(Protocol):
    """A parser that can also write the opening of a call, for a forced ``tool_choice``."""

    def call_opening(self, name: str | None) -> str:
        """The text that opens a call of ``name`` up to its arguments (None: up to the
        function's name, which the model writes)."""
        ...


_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[Any]], type[Any]]:
    def register(cls: type[Any]) -> type[Any]:
        _PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError (listing the known ones) if none."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (known: {sorted(_PARSERS)})") from None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@register_tool_parser("qwen")
class QwenToolParser:
    """Qwen2.5 / Hermes style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    start_marker: ClassVar[str] = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def call_opening(self, name: str | None) -> str:
        # as Qwen2.5's chat template writes an assistant's tool call, cut before a space
        # (a trailing space would be a token of its own, where the model writes " {")
        if name is None:
            return '<tool_call>\n{"name": "'
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'

    def parse(self, text: str) -> ParsedCompletion:
        calls: list[ToolCall] = []
        outside: list[str] = []
        position = 0
        for match in self._BLOCK.finditer(text):
            call = _call_from_json(match.group(1))
            if call is None:
                continue  # malformed: stays part of the content
            outside.append(text[position : match.start()])
            position = match.end()
            calls.append(call)
        outside.append(text[position:])
        content = "".join(outside)
        return ParsedCompletion(content if content.strip() else None, calls)


def _call_from_json(body: str) -> ToolCall | None:
    """``{"name": str, "arguments": object}`` (arguments may also be a JSON string of an
    object, or absent); anything else is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())
