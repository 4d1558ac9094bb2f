"""Exact-match rewards of the built-in tasks: "integer_match" and "code_match", and a
verifier's "verdict_match" (``verify:<task>``, ``solve_and_verify``)."""

from __future__ import annotations

import re

from seamlessflow.rewards.registry import register_reward

_INTEGER = re.compile(r"-?\d+")
_VERDICT = re.compile(r"(?<![A-Za-z0-9_])(yes|no)(?![A-Za-z0-9_])", re.IGNORECASE)


def first_integer(text: str) -> int | None:
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def first_verdict(text: str) -> str | None:
    """The first whole word "yes" or "no" in the text (any case), lower-cased; None if
    neither occurs ("Nobody" and "eyes" hold neither)."""
    match = _VERDICT.search(text)
    return match.group().lower() if match else None


@register_reward("verdict_match")
def verdict_match(completion_text: str, reference: str) -> float:
    """1.0 iff the completion's first verdict word ("yes"/"no") is the reference's."""
    expected = first_verdict(reference)
    return 1.0 if expected is not None and first_verdict(completion_text) == expected else 0.0


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
