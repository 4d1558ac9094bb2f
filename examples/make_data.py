"""Write the example task files in ``examples/data/`` (deterministic; no downloads).

    python examples/make_data.py                  # examples/data/{math,code}.jsonl
    python examples/make_data.py --out DIR --parquet   # also DIR/math.parquet

- ``math.jsonl``: 36 word problems (whole numbers, fractions, percentages, decimals),
  column ``prompt`` + ``answer``, ``reward_fn`` "math_answer";
- ``code.jsonl``: 12 small function-writing tasks, column ``messages`` (a system and a
  user message) + ``reference`` (``{"tests": [...]}``), ``reward_fn`` "code_tests", and
  ``solution`` (a correct answer, ignored by the loader; the tests check the data with it).

Parquet is not committed: its bytes depend on the pyarrow version, so it would change
on every regeneration. ``--parquet`` writes it from the same rows (the tests do).
Use them as tasks: ``seamlessflow up --task examples/data/math.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

SEED = 20261123
PROBLEMS_PER_TEMPLATE = 6
BOXED_INSTRUCTION = " Put the final answer in \\boxed{}."
CODE_SYSTEM = (
    "You write Python. Answer with one ```python code block that defines the requested "
    "function; use the standard library only."
)

Row = dict[str, Any]


def fraction_text(value: Fraction) -> str:
    return str(value)  # "17/14", or "2" when whole


def answer_text(value: Fraction) -> str:
    """An integer, else an exact decimal when there is one, else ``a/b``."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:  # a terminating decimal: Decimal division is exact here
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    return f"{value.numerator}/{value.denominator}"


def muffins(rng: random.Random) -> tuple[str, str]:
    trays, per_tray = rng.randint(2, 9), rng.randint(6, 12)
    sold = rng.randint(1, trays * per_tray - 1)
    return (
        f"A baker makes {trays} trays of {per_tray} muffins each and sells {sold} muffins. "
        "How many muffins are left?",
        answer_text(Fraction(trays * per_tray - sold)),
    )


def stickers(rng: random.Random) -> tuple[str, str]:
    each, friends = rng.randint(2, 8), rng.randint(2, 6)
    total = each * friends + rng.randint(1, 40)
    return (
        f"Mia has {total} stickers. She gives {each} stickers to each of her {friends} "
        "friends. How many stickers does she have left?",
        answer_text(Fraction(total - each * friends)),
    )


def fraction_sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 5), rng.randint(2, 9)
    c, d = rng.randint(1, 5), rng.randint(2, 9)
    return (
        f"What is {a}/{b} + {c}/{d}? Give the answer as a fraction in lowest terms.",
        fraction_text(Fraction(a, b) + Fraction(c, d)),
    )


def recipe(rng: random.Random) -> tuple[str, str]:
    numerator, denominator = rng.randint(1, 3), rng.choice((2, 3, 4, 8))
    batches = rng.randint(2, 7)
    return (
        f"A recipe needs {numerator}/{denominator} cup of sugar per batch. How many cups of "
        f"sugar are needed for {batches} batches?",
        answer_text(Fraction(numerator, denominator) * batches),
    )


def discount(rng: random.Random) -> tuple[str, str]:
    price, percent = rng.randint(8, 120), rng.choice((10, 15, 20, 25, 30, 40, 50))
    return (
        f"A jacket costs ${price} and is on sale for {percent}% off. What is the sale "
        "price in dollars?",
        answer_text(Fraction(price) * (100 - percent) / 100),
    )


def speed(rng: random.Random) -> tuple[str, str]:
    hours = rng.choice((2, 3, 4, 5, 8))
    distance = rng.randint(50, 400)
    return (
        f"A train travels {distance} km in {hours} hours at a constant speed. What is its "
        "speed in km per hour?",
        answer_text(Fraction(distance, hours)),
    )


MATH_TEMPLATES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    muffins, stickers, fraction_sum, recipe, discount, speed,
)  # fmt: skip


def math_rows() -> list[Row]:
    rng = random.Random(SEED)
    rows = []
    for template in MATH_TEMPLATES:
        for index in range(PROBLEMS_PER_TEMPLATE):
            question, answer = template(rng)
            rows.append(
                {
                    "id": f"math-{template.__name__}-{index}",
                    "prompt": question + BOXED_INSTRUCTION,
                    "answer": answer,
                    "reward_fn": "math_answer",
                }
            )
    return rows


# (name, signature, what it does, correct solution, tests)
CODE_TASKS: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("add", "add(a, b)", "returns the sum of two numbers",
     "def add(a, b):\n    return a + b\n",
     ("assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0.5, 0.25) == 0.75")),
    ("is_palindrome", "is_palindrome(text)",
     "tells whether a string reads the same backwards, ignoring case and spaces",
     "def is_palindrome(text):\n    letters = text.replace(' ', '').lower()\n"
     "    return letters == letters[::-1]\n",
     ("assert is_palindrome('Never odd or even')", "assert not is_palindrome('python')",
      "assert is_palindrome('')")),
    ("fizzbuzz", "fizzbuzz(n)",
     "returns 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for "
     "multiples of both, else the number as a string",
     "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
     "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
     "    return str(n)\n",
     ("assert fizzbuzz(9) == 'Fizz'", "assert fizzbuzz(10) == 'Buzz'",
      "assert fizzbuzz(30) == 'FizzBuzz'", "assert fizzbuzz(7) == '7'")),
    ("reverse_words", "reverse_words(sentence)",
     "returns the sentence with its words in reverse order, separated by single spaces",
     "def reverse_words(sentence):\n    return ' '.join(reversed(sentence.split()))\n",
     ("assert reverse_words('the quick fox') == 'fox quick the'",
      "assert reverse_words('  hello   world ') == 'world hello'",
      "assert reverse_words('') == ''")),
    ("count_vowels", "count_vowels(text)", "counts the vowels (a, e, i, o, u; any case)",
     "def count_vowels(text):\n    return sum(c in 'aeiou' for c in text.lower())\n",
     ("assert count_vowels('Hello World') == 3", "assert count_vowels('xyz') == 0",
      "assert count_vowels('AEIOU') == 5")),
    ("factorial", "factorial(n)", "returns n! for an integer n >= 0",
     "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n"
     "        result *= k\n    return result\n",
     ("assert factorial(0) == 1", "assert factorial(5) == 120",
      "assert factorial(20) == 2432902008176640000")),
    ("fibonacci", "fibonacci(n)",
     "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
     "    return a\n",
     ("assert fibonacci(0) == 0", "assert fibonacci(1) == 1", "assert fibonacci(10) == 55",
      "assert fibonacci(90) == 2880067194370816120")),
    ("gcd", "gcd(a, b)", "returns the greatest common divisor of two positive integers",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
     ("assert gcd(12, 18) == 6", "assert gcd(17, 5) == 1", "assert gcd(100, 75) == 25")),
    ("flatten", "flatten(nested)",
     "flattens a list of lists (of any depth) into one list, keeping the order",
     "def flatten(nested):\n    flat = []\n    for item in nested:\n"
     "        if isinstance(item, list):\n            flat.extend(flatten(item))\n"
     "        else:\n            flat.append(item)\n    return flat\n",
     ("assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]", "assert flatten([]) == []",
      "assert flatten([[['a']]]) == ['a']")),
    ("is_prime", "is_prime(n)", "tells whether an integer is a prime number",
     "def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n"
     "    while k * k <= n:\n        if n % k == 0:\n            return False\n"
     "        k += 1\n    return True\n",
     ("assert is_prime(2)", "assert not is_prime(1)", "assert is_prime(97)",
      "assert not is_prime(91)")),
    ("running_sum", "running_sum(numbers)",
     "returns the list of cumulative sums of a list of numbers",
     "def running_sum(numbers):\n    sums, total = [], 0\n    for x in numbers:\n"
     "        total += x\n        sums.append(total)\n    return sums\n",
     ("assert running_sum([1, 2, 3]) == [1, 3, 6]", "assert running_sum([]) == []",
      "assert running_sum([5, -5, 5]) == [5, 0, 5]")),
    ("second_largest", "second_largest(numbers)",
     "returns the second largest distinct value of a list, or None if there is none",
     "def second_largest(numbers):\n    distinct = sorted(set(numbers))\n"
     "    return distinct[-2] if len(distinct) > 1 else None\n",
     ("assert second_largest([3, 1, 4, 1, 5]) == 4", "assert second_largest([7, 7]) is None",
      "assert second_largest([-2, -1]) == -2")),
)  # fmt: skip


def code_rows() -> list[Row]:
    return [
        {
            "id": f"code-{name}",
            "messages": [
                {"role": "system", "content": CODE_SYSTEM},
                {"role": "user", "content": f"Write a function `{signature}` that {what}."},
            ],
            "reference": {"tests": list(tests)},
            "solution": solution,
            "reward_fn": "code_tests",
        }
        for name, signature, what, solution, tests in CODE_TASKS
    ]


def write_jsonl(path: Path, rows: list[Row]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_parquet(path: Path, rows: list[Row]) -> None:
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--parquet", action="store_true", help="also write math.parquet")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "math.jsonl", math_rows())
    write_jsonl(args.out / "code.jsonl", code_rows())
    if args.parquet:
        write_parquet(args.out / "math.parquet", math_rows())


if __name__ == "__main__":
    main()
