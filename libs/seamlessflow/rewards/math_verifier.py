"""The "math_answer" verifier: is the completion's final answer equal to the reference?

1. **Extract** the final answer from the completion, first rule that applies:
   the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces are matched), else the
   text after the last ``####`` (GSM8K style), else the last "answer is X" /
   "answer: X" (to the end of its line), else the last number in the text. The
   reference goes through the same rules when it holds ``\\boxed`` or ``####`` (a GSM8K
   solution can be the reference as it is); otherwise the whole reference is the answer.
2. **Normalise** both: drop ``$``, ``\\(``/``\\)``, ``\\left``/``\\right``, LaTeX spacing,
   ``\\text{...}`` wrappers, degree signs, a trailing period, a leading "x =", thousands
   separators (``1,000`` and ``1{,}000``), unicode minus, and trailing unit words after a
   number ("12 cm", "5 apples"); ``\\dfrac``/``\\tfrac`` are ``\\frac``. A trailing ``%``
   is remembered: "25%" equals both "25" and "0.25".
3. **Compare**: equal normalised strings match (answers that are not numbers: "(1,2)",
   "yes"); otherwise both sides are evaluated as numbers - integers, decimals, ``a/b``,
   ``\\frac{a}{b}``, mixed numbers ("3 1/2", ``3\\frac{1}{2}``), ``\\sqrt``, ``\\pi``,
   ``+ - * / ^`` - exactly with ``fractions.Fraction`` (so 0.5 == 1/2 == \\frac{2}{4},
   but 0.33 != 1/3: no rounding tolerance), or as floats within a relative 1e-9 when an
   irrational part (``\\sqrt{2}``, ``\\pi``) is involved.

The evaluator is a whitelist over Python's ``ast`` (never ``eval``; no sympy, whose
parser evaluates strings and whose simplification has no time bound), with bounded
input length and power sizes, so any completion is graded in microseconds and none
raises: the reward is 1.0 or 0.0. Answers with free variables ("x+1" vs "1+x") match
only as equal normalised strings.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

from seamlessflow.rewards.registry import register_reward

Number = Fraction | float

MAX_ANSWER_CHARS = 200
"""Longer extracted answers are not answers (and bound the evaluator's work)."""
MAX_RESULT_BITS = 4096
"""Exact powers larger than this many bits are refused (``9^9^9`` must not hang)."""
MAX_LITERAL_EXPONENT = 1000
"""Scientific literals beyond ``1e1000`` are refused for the same reason."""
RELATIVE_TOLERANCE = 1e-9
"""For answers with an irrational part, compared as floats."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_TRAILING_UNITS = re.compile(r"(?<=[\d)}])\s+[a-zA-Z]+(?:\s+[a-zA-Z]+)*$")
_LEADING_VARIABLE = re.compile(r"^[a-zA-Z]\w*\s*=\s*(?=\S)")
_MIXED_PLAIN = re.compile(r"^(-?)(\d+)\s+(\d+)/(\d+)$")
_MIXED_LATEX = re.compile(r"(-?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}")
_FRAC_SHORTHAND = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SQRT_SHORTHAND = re.compile(r"\\sqrt\s*(\d)")
_IMPLICIT_PRODUCT = re.compile(r"(?<=[\d)])\s*(?=pi\b|sqrt\(|\()")
_LATEX_NOISE = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle",
    "\\(", "\\)", "\\[", "\\]", "\\$", "$",
)  # fmt: skip
_DEGREES = ("^{\\circ}", "^\\circ", "°", "\\circ", "\\degree")


def matching_brace_end(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose content starts at ``start``."""
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``; None if there is none or it never closes
    (a truncated final box is a truncated answer, not an earlier one)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    end = matching_brace_end(text, starts[-1])
    return None if end is None else text[starts[-1] : end]


def marked_answer(text: str) -> str | None:
    """The answer a writer marked: boxed, after ``####``, or after "answer is"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rpartition("####")[2].strip().split("\n", 1)[0]
    phrases = _ANSWER_IS.findall(text)
    return phrases[-1] if phrases else None


def extract_answer(completion_text: str) -> str | None:
    """The completion's final answer (see the module docstring), not yet normalised."""
    marked = marked_answer(completion_text)
    if marked is not None:
        return marked
    numbers = _NUMBER.findall(completion_text.replace("−", "-"))
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    marked = marked_answer(reference) if ("\\boxed" in reference or "####" in reference) else None
    return reference if marked is None else marked


def normalise(answer: str) -> tuple[str, bool]:
    """The answer in canonical text, and whether it was a percentage."""
    text = (
        answer.strip().replace("−", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    )
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    text = _TEXT_WRAPPER.sub(r" \1", text)  # "12\text{cm}": the unit is a word of its own
    for degree in _DEGREES:
        text = text.replace(degree, "")
    text = text.replace("{,}", ",").strip().rstrip(".").strip()
    text = _LEADING_VARIABLE.sub("", text)
    text = _TRAILING_UNITS.sub("", text)
    is_percent = text.endswith("%")
    text = text.removesuffix("\\%").removesuffix("%").strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    text = _MIXED_PLAIN.sub(r"\1(\2+\3/\4)", text)  # before spaces go: "3 1/2" is 7/2
    return "".join(text.split()), is_percent


def latex_to_expression(text: str) -> str:
    """LaTeX arithmetic as a Python expression for ``evaluate`` (``\\frac{a}{b}`` ->
    ``((a)/(b))``, ``\\sqrt{x}`` -> ``sqrt(x)``, ``^`` -> ``**`` ...)."""
    text = _FRAC_SHORTHAND.sub(r"\\frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", text)
    text = _MIXED_LATEX.sub(r"\1(\2+\3/\4)", text)
    text = text.replace("\\frac", "frac").replace("\\sqrt", "sqrt").replace("\\pi", "pi")
    text = text.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    text = replace_fracs(text)
    text = text.replace("{", "(").replace("}", ")").replace("^", "**")
    return _IMPLICIT_PRODUCT.sub("*", text)


def replace_fracs(text: str) -> str:
    """``frac{a}{b}`` -> ``((a)/(b))``, innermost groups handled by the same pass."""
    while (start := text.find("frac{")) != -1:
        numerator_end = matching_brace_end(text, start + 5)
        if numerator_end is None or text[numerator_end + 1 : numerator_end + 2] != "{":
            return text  # malformed: the evaluator will refuse what is left
        denominator_end = matching_brace_end(text, numerator_end + 2)
        if denominator_end is None:
            return text
        numerator = text[start + 5 : numerator_end]
        denominator = text[numerator_end + 2 : denominator_end]
        text = f"{text[:start]}(({numerator})/({denominator})){text[denominator_end + 1 :]}"
    return text


class _NotANumber(ValueError):
    """The expression is outside the evaluator's whitelist or its bounds."""


def evaluate(expression: str) -> Number | None:
    """The value of an arithmetic expression: exact when rational, else a float; None
    for anything else (names, calls other than sqrt, huge powers, syntax errors)."""
    if not expression or len(expression) > MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
        return _evaluate(tree.body, expression)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError):
        # ValueError covers _NotANumber, math domain errors and malformed literals.
        return None


def _evaluate(node: ast.AST, source: str) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return exact_literal(ast.get_source_segment(source, node) or "")
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand, source)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _binary(node.op, _evaluate(node.left, source), _evaluate(node.right, source))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        return square_root(_evaluate(node.args[0], source))
    raise _NotANumber(ast.dump(node)[:40])


def exact_literal(literal: str) -> Fraction:
    """A number literal as written ("0.1" is exactly 1/10, which a float is not)."""
    _, _, exponent = literal.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_LITERAL_EXPONENT:
        raise _NotANumber("exponent too large")  # Fraction("1e999999999") would hang
    return Fraction(literal)


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Div):
        return left / right
    if isinstance(op, ast.Pow):
        return power(left, right)
    raise _NotANumber(type(op).__name__)


def power(base: Number, exponent: Number) -> Number:
    if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if bits * abs(exponent.numerator) > MAX_RESULT_BITS:
            raise _NotANumber("power too large")
        return base**exponent.numerator
    result = float(base) ** float(exponent)
    if isinstance(result, complex):
        raise _NotANumber("complex power")
    return result


def square_root(value: Number) -> Number:
    if isinstance(value, Fraction) and value >= 0:
        numerator, denominator = math.isqrt(value.numerator), math.isqrt(value.denominator)
        if numerator**2 == value.numerator and denominator**2 == value.denominator:
            return Fraction(numerator, denominator)
    return math.sqrt(value)


def numbers_equal(a: Number, b: Number) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12)


def answers_match(got: str, expected: str) -> bool:
    """Do two raw answers (extracted, not normalised) denote the same value?"""
    got_text, got_percent = normalise(got)
    expected_text, expected_percent = normalise(expected)
    if got_text == expected_text:
        return bool(got_text)
    got_value = evaluate(latex_to_expression(got_text))
    expected_value = evaluate(latex_to_expression(expected_text))
    if got_value is None or expected_value is None:
        return False
    candidates = [(got_value, expected_value)]
    if got_percent:
        candidates.append((got_value / 100, expected_value))
    if expected_percent:
        candidates.append((got_value, expected_value / 100))
    try:
        return any(numbers_equal(a, b) for a, b in candidates)
    except OverflowError:  # a huge exact value against an irrational one
        return False


@register_reward("math_answer")
def math_answer(completion_text: str, reference: str) -> float:
    """1.0 iff the completion's final answer equals the reference (module docstring)."""
    answer = extract_answer(completion_text)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if answers_match(answer, reference_answer(reference)) else 0.0
