"""One choice of a completion as its tokens arrive: exact ids, visible text, stop strings.

The ids are the record (what the engine produced); the text is derived from them by
decoding all ids so far (never by concatenating per-token strings, which breaks on
multi-byte characters split across tokens).

Stop strings: after each token the decoded text is searched; at the first occurrence
of any stop string the choice is ``stopped``: its text ends just before the stop string
and its ids end with the token that completed it (possibly carrying text past the stop
string; the ids stay exactly what the engine produced). Tokens after that are ignored.

Streaming: ``safe_text()`` is the prefix of the text that can no longer change or be
cut: it excludes an incomplete UTF-8 character at the end, any tail that could still
grow into a stop string, and (with ``hold_from``, a tool parser's start marker)
everything from that marker on, which is only sent once the answer is parsed. What was
streamed is therefore always a prefix of the final content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from seamlessflow.protocol import TopLogprob

Decode = Callable[[list[int]], str]


@dataclass
class Choice:
    index: int
    decode: Decode
    stop: Sequence[str] = ()
    hold_from: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    text: str = ""
    stopped: bool = False
    """A stop string matched: the answer is complete, whatever the engine still sends."""
    engine_id: str = ""
    finish_reason: str = ""
    sent_chars: int = 0
    """How much of ``text`` has been streamed to the agent."""
    sent_tokens: int = 0
    """How many tokens' logprobs have been streamed to the agent."""

    def extend(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        top_logprobs: Sequence[list[TopLogprob]],
    ) -> bool:
        """Append tokens (up to a stop string); True if this call matched a stop string."""
        if self.stopped or not token_ids:
            return False
        tops = list(top_logprobs) or [[] for _ in token_ids]
        if not self.stop:
            self._append(token_ids, logprobs, versions, tops)
            self.text = self.decode(self.token_ids)
            return False
        for i in range(len(token_ids)):
            self._append(token_ids[i : i + 1], logprobs[i : i + 1], versions[i : i + 1],
                         tops[i : i + 1])  # fmt: skip
            self.text = self.decode(self.token_ids)
            cut = self._first_stop(self.text)
            if cut is not None:
                self.text = self.text[: max(cut, self.sent_chars)]
                self.stopped = True
                return True
        return False

    def safe_text(self) -> str:
        """The part of ``text`` that is final (see the module docstring)."""
        text = self.text.rstrip("\ufffd")
        if self.hold_from:
            marker = text.find(self.hold_from)
            text = text[:marker] if marker >= 0 else _drop_partial(text, [self.hold_from])
            if not text.strip():
                return ""  # whitespace alone may turn out to be no content at all
        if self.stop and not self.stopped:
            text = _drop_partial(text, self.stop)
        return text

    def _append(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        tops: Sequence[list[TopLogprob]],
    ) -> None:
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.top_logprobs.extend(tops)

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None


def _drop_partial(text: str, markers: Sequence[str]) -> str:
    """``text`` without its longest tail that is a proper prefix of one of ``markers``."""
    for length in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-length:]
        if any(m.startswith(tail) for m in markers):
            return text[:-length]
    return text
