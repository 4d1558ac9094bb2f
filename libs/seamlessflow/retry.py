"""Trying an operation again after a transient failure, under a named policy.

A process of the mesh often asks something that may not be there yet or for a moment:
a scheduler that starts after it, a broker restarting under a durable publish, a
gateway restarting under an agent runner's call. Each of these waits is a
:class:`RetryPolicy` constant named after its use, next to the code that uses it
(``bus.JS_PUBLISH_RETRY``, ``resources.REGISTER_RETRY``, ...), and :func:`retry`
applies it. One loop for all of them: the rules below hold everywhere, and a policy's
delays can be read in one line instead of from a hand-written loop.

The rules: only the policy's ``retry_on`` exceptions are retried, anything else raises
at once; when the policy gives up, the last attempt's own exception propagates,
unwrapped, with its traceback (fail loudly: the caller sees what went wrong, not that
retrying stopped).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How an operation is tried again.

    The wait before the second attempt is ``first_delay_s``; each later wait is the one
    before it times ``backoff``, at most ``max_delay_s``. The operation is tried until it
    succeeds, unless ``attempts`` or ``deadline_s`` stops it (both None: it is tried as
    long as it fails with a ``retry_on`` exception)."""

    retry_on: tuple[type[BaseException], ...]
    """The exceptions that mean "try again"; any other one raises at once."""
    first_delay_s: float
    """Wait before the second attempt (0: none, e.g. when ``on_retry`` does the waiting)."""
    backoff: float = 1.0
    """Factor from one wait to the next (1: every wait is ``first_delay_s``)."""
    max_delay_s: float = math.inf
    """No wait is longer than this."""
    attempts: int | None = None
    """At most this many attempts in all (None: no limit)."""
    deadline_s: float | None = None
    """Give up on a failure that ends this long or longer after the first attempt
    started (None: no limit). An attempt that starts before it runs to its end."""

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"a retry policy makes at least one attempt, not {self.attempts}")
        if self.first_delay_s < 0 or self.backoff < 1 or self.max_delay_s < 0:
            raise ValueError(
                f"retry delays start at 0 s or more and do not shrink: {self.first_delay_s}, "
                f"x{self.backoff}, up to {self.max_delay_s}"
            )

    def delays(self) -> Iterator[float]:
        """The waits between attempts, in order (endless: ``attempts`` and
        ``deadline_s`` are checked by :func:`retry`)."""
        delay = min(self.first_delay_s, self.max_delay_s)
        while True:
            yield delay
            delay = min(delay * self.backoff, self.max_delay_s)


async def retry(
    operation: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], Awaitable[None]] | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """The result of ``operation()``, called again after each failure ``policy`` retries.

    ``on_retry`` is awaited with each retried failure, before the wait: to log it, or to
    wait for what failed to come back (then ``first_delay_s`` is 0). ``sleep`` and
    ``clock`` are the waiting and the time that ``deadline_s`` is measured with
    (replaced in tests: no test waits for real)."""
    started = clock()
    delays = policy.delays()
    attempt = 1
    while True:
        try:
            return await operation()
        except policy.retry_on as failure:
            out_of_attempts = policy.attempts is not None and attempt >= policy.attempts
            out_of_time = policy.deadline_s is not None and clock() - started >= policy.deadline_s
            if out_of_attempts or out_of_time:
                raise
            if on_retry is not None:
                await on_retry(failure)
        delay = next(delays)
        if delay > 0:
            await sleep(delay)
        attempt += 1
