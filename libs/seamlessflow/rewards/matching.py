"""Exact-match rewards of the built-in tasks: "integer_match" and "code_match"."""

from __future__ import annotations

import re

from seamlessflow.rewards.registry import register_reward

_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


@register_reward("integer_match")
def integer_match(completion_text: str, reference: str) -> float:
    """1.0 iff the first integer in the completion equals the reference integer."""
    expected = first_integer(reference)
    got = first_integer(completion_text)
    return 1.0 if expected is not None and got == expected else 0.0


@register_reward("code_match")
def code_match(completion_text: str, reference: str) -> float:
    """1.0 iff the completion contains the reference code as a whole word (case-sensitive:
    "QZKT" counts in "The code is QZKT.", not in "QZKTA" or "qzkt")."""
    code = reference.strip()
    if not code:
        return 0.0
    pattern = rf"(?<![A-Za-z0-9_]){re.escape(code)}(?![A-Za-z0-9_])"
    return 1.0 if re.search(pattern, completion_text) else 0.0
