"""A session's conversation as a tree of token prefixes: history is never re-tokenized.

Every answer the gateway returns becomes a node: the messages of the request plus the
reply as the agent received it (normalised), and the exact token ids the engine saw and
produced (prompt + completion). A new request is matched structurally against the
nodes; for the deepest node whose messages are a prefix of the request's, the prompt
is that node's stored ids followed by the tokens of only what is new:

    prompt = node.ids + encode(junction + template(new messages))

``junction`` is what the chat template puts after the end of the stored assistant turn
that the engine did not produce itself (``"\\n"`` after ``<|im_end|>`` in ChatML; the
whole end-of-turn marker if the answer was cut by ``max_tokens``).

An agent that edits or truncates its history matches a shallower node (or none): the
new turn then starts a new branch (a fork) instead of silently mixing a re-tokenized
history with engine tokens. n > 1 choices become sibling nodes.

A node is matched by its *branch digest*: a sha256 chain over the tools and each
message of its path (the request's messages, then the reply), so what the tree keeps of
a node fits in a TurnRecorded (``node_digest``, ``node_depth``) and a restarted gateway
rebuilds the tree from the stream with ``restore``.

Requirements on the chat template (checked per request, with a fork as the fallback):
rendering is prefix-stable (rendering the first k messages is a prefix of rendering
more), and an assistant turn ends with the tokenizer's end-of-turn token.

Templates that rewrite history (Qwen3 drops an earlier turn's ``<think>`` block once a
later user message follows): whether the template keeps a stored reply as the engine
wrote it is checked by rendering the reply *with* the reasoning the engine produced
(``reasoning``: the reasoning parser's split of the stored completion), whatever the
agent sent back. If the template rewrites it, continuing from the node's ids would give
the engine a history the template never renders; the prompt is then the node's own
*prompt* ids followed by the rest of the template's rendering (the rewritten reply and
the new messages), and the reply's exact tokens fork off (``Prompt.rewritten``). The
node is still this request's parent by messages (``Prompt.parent``); the trajectory
service trains such forked turns as samples of their own (``sf_trajectory.grouping``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], str]
Encode = Callable[[str], list[int]]


def normalize_message(message: dict[str, Any]) -> str:
    """A canonical key for a chat message: what matters to the template, nothing else.

    Tool-call arguments are compared as JSON values, so an agent that re-serialises
    them with other spacing still continues the same branch.
    """
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append({"name": function.get("name"), "arguments": arguments})
    key = {
        "role": message.get("role"),
        "content": message.get("content") or "",
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }
    return json.dumps(key, sort_keys=True, ensure_ascii=False)


def tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True, ensure_ascii=False)


def branch_digests(tools: str, keys: Sequence[str]) -> list[str]:
    """Digest of each prefix of a path (``keys``: normalised messages) under ``tools``:
    element k covers the first k messages. A chain: each is sha256(previous, message)."""
    digest = hashlib.sha256(b"tools\0" + tools.encode()).hexdigest()
    digests = [digest]
    for key in keys:
        digest = hashlib.sha256(f"{digest}\0{key}".encode()).hexdigest()
        digests.append(digest)
    return digests


@dataclass(frozen=True)
class NodeKey:
    """Where a node sits: its path's length (messages + reply) and branch digest."""

    depth: int
    digest: str


@dataclass
class Node:
    """One answer: the request's messages + the reply (as a ``NodeKey``), and the exact
    ids behind them."""

    key: NodeKey
    ids: list[int]
    completion_text: str
    """The engine's completion decoded with special tokens (what ``ids`` end with)."""
    prompt_length: int = 0
    """How many leading ``ids`` are the request's prompt (0: unknown)."""


@dataclass
class Prompt:
    ids: list[int]
    reused_tokens: int
    """How many leading ids come from a stored node (0 = a new root or a fork)."""
    parent_path_length: int
    parent: NodeKey | None = None
    """The node whose messages (request + reply) this request continues."""
    rewritten: bool = False
    """The template rewrites the parent's reply: the prompt continues the parent's prompt
    ids, not its completion's (which fork off)."""


@dataclass
class Conversation:
    render: Render
    encode: Encode
    end_of_turn: str
    reasoning: Callable[[str], str | None] | None = None
    """The reasoning the engine wrote in a stored completion (its text with special
    tokens), None if none; None: the model has no reasoning format."""
    nodes: list[Node] = field(default_factory=list)
    forks: int = 0
    rewrites: int = 0
    """Requests whose parent's reply the template rewrites (see the module docstring)."""

    def prompt_for(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> Prompt:
        digests = branch_digests(tools_key(tools), [normalize_message(m) for m in messages])
        full = self.render(messages, tools, True)
        for node in self._matches(digests):
            if self._keeps_reply(node, messages, tools):
                ids = self._extend(node, messages, tools, full)
                if ids is not None:
                    return Prompt(ids, len(node.ids), node.key.depth, node.key)
            ids = self._continue_prompt(node, messages, tools, full)
            if ids is not None:
                self.rewrites += 1
                return Prompt(ids, node.prompt_length, node.key.depth, node.key, rewritten=True)
        if self.nodes:
            self.forks += 1  # history edited, truncated or new: a new branch
        return Prompt(self.encode(full), 0, 0)

    @staticmethod
    def node_key(
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        reply: dict[str, Any],
    ) -> NodeKey:
        """The key of the node an answer ``reply`` to ``messages`` becomes."""
        path = [*(normalize_message(m) for m in messages), normalize_message(reply)]
        return NodeKey(len(path), branch_digests(tools_key(tools), path)[-1])

    def record(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        reply: dict[str, Any],
        prompt_ids: list[int],
        completion_ids: list[int],
        completion_text: str,
    ) -> None:
        key = self.node_key(messages, tools, reply)
        self.restore(key, [*prompt_ids, *completion_ids], completion_text, len(prompt_ids))

    def restore(
        self, key: NodeKey, ids: list[int], completion_text: str, prompt_length: int = 0
    ) -> None:
        """Add a node as recorded (by ``record``, or in a TurnRecorded)."""
        self.nodes.append(Node(key, ids, completion_text, prompt_length))

    def _matches(self, digests: list[str]) -> list[Node]:
        """The nodes whose path is a prefix of the request's messages (``digests``: of
        each prefix of them), deepest first (the latest first among equals)."""
        found = [
            (node.key.depth, i, node)
            for i, node in enumerate(self.nodes)
            if node.key.depth < len(digests) and digests[node.key.depth] == node.key.digest
        ]
        return [node for _, _, node in sorted(found, key=lambda f: (-f[0], -f[1]))]

    def _keeps_reply(
        self, node: Node, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> bool:
        """Whether the template renders the node's reply, with the reasoning the engine
        wrote, the same when more messages follow (False: it rewrites history)."""
        reasoning = self.reasoning(node.completion_text) if self.reasoning else None
        if not reasoning:
            return True
        k = node.key.depth
        produced = [*messages[: k - 1], {**messages[k - 1], "reasoning_content": reasoning}]
        alone = self.render(produced, tools, False)
        followed = self.render([*produced, *messages[k:]], tools, True)
        return followed.startswith(alone)

    def _continue_prompt(
        self,
        node: Node,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        full: str,
    ) -> list[int] | None:
        """The node's prompt ids + the tokens of the rest of ``full`` (the reply as the
        template renders it now, then the new messages); None if the node's prompt is
        not a prefix of ``full``."""
        if not node.prompt_length:
            return None
        before_reply = self.render(messages[: node.key.depth - 1], tools, True)
        if not full.startswith(before_reply):
            return None
        return [*node.ids[: node.prompt_length], *self.encode(full[len(before_reply) :])]

    def _extend(
        self,
        node: Node,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        full: str,
    ) -> list[int] | None:
        k = node.key.depth
        before_reply = self.render(messages[: k - 1], tools, True)
        through_reply = self.render(messages[:k], tools, False)
        if not (through_reply.startswith(before_reply) and full.startswith(through_reply)):
            log.warning("chat template is not prefix-stable here; the stored reply forks off")
            return None
        reply_rendered = through_reply[len(before_reply) :]
        end = reply_rendered.rfind(self.end_of_turn)
        if end < 0:
            log.warning("assistant turn has no %r; the stored reply forks off", self.end_of_turn)
            return None
        if node.completion_text.endswith(self.end_of_turn):
            junction = reply_rendered[end + len(self.end_of_turn) :]
        else:  # cut by max_tokens: the engine never produced the end of turn
            junction = reply_rendered[end:]
        new_text = junction + full[len(through_reply) :]
        return [*node.ids, *self.encode(new_text)] if new_text else list(node.ids)
