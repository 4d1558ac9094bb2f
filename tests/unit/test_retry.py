"""``seamlessflow.retry``: which failures are retried, when it gives up, how long it waits.

No test waits for real: the helper's ``sleep`` and ``clock`` are replaced by a fake
clock that only moves when slept on (and, for deadline tests, when an attempt "takes"
time)."""

from __future__ import annotations

import itertools
import math

import pytest

from seamlessflow.bus import JS_PUBLISH_RETRY, NATS_CONNECT_RETRY
from seamlessflow.retry import RetryPolicy, retry


class Transient(Exception):
    pass


class OtherTransient(Exception):
    pass


class Fatal(Exception):
    pass


class FakeTime:
    """A clock that moves by what is slept, and by ``attempt_s`` per attempt."""

    def __init__(self, attempt_s: float = 0.0) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.attempt_s = attempt_s

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class Flaky:
    """An operation that raises each of ``failures`` in turn, then returns ``result``."""

    def __init__(self, time: FakeTime, *failures: BaseException, result: str = "done") -> None:
        self.time = time
        self.failures = list(failures)
        self.calls = 0
        self.result = result

    async def __call__(self) -> str:
        self.calls += 1
        self.time.now += self.time.attempt_s
        if self.failures:
            raise self.failures.pop(0)
        return self.result


POLICY = RetryPolicy(retry_on=(Transient, OtherTransient), first_delay_s=0.1, attempts=4)


async def test_retries_each_listed_exception_until_the_operation_succeeds() -> None:
    time = FakeTime()
    operation = Flaky(time, Transient(), OtherTransient(), Transient())
    result = await retry(operation, POLICY, sleep=time.sleep, clock=time.clock)
    assert result == "done"
    assert operation.calls == 4
    assert time.slept == [0.1, 0.1, 0.1]


async def test_gives_up_after_the_last_attempt_with_that_attempts_own_error() -> None:
    time = FakeTime()
    last = Transient("fourth")
    operation = Flaky(time, Transient("1"), Transient("2"), OtherTransient("3"), last, Transient())
    with pytest.raises(Transient) as raised:
        await retry(operation, POLICY, sleep=time.sleep, clock=time.clock)
    assert raised.value is last  # not wrapped: the caller sees what went wrong
    assert operation.calls == 4
    assert len(time.slept) == 3  # no wait after the last attempt


async def test_an_exception_not_listed_raises_at_once() -> None:
    time = FakeTime()
    fatal = Fatal("no")
    operation = Flaky(time, Transient(), fatal)
    with pytest.raises(Fatal) as raised:
        await retry(operation, POLICY, sleep=time.sleep, clock=time.clock)
    assert raised.value is fatal
    assert operation.calls == 2
    assert time.slept == [0.1]


async def test_delays_grow_by_the_backoff_up_to_the_maximum() -> None:
    time = FakeTime()
    policy = RetryPolicy(retry_on=(Transient,), first_delay_s=0.1, backoff=2.0, max_delay_s=1.0)
    operation = Flaky(time, *(Transient() for _ in range(7)))
    await retry(operation, policy, sleep=time.sleep, clock=time.clock)
    assert time.slept == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert list(itertools.islice(policy.delays(), 7)) == time.slept


async def test_without_a_limit_it_retries_as_long_as_the_failure_is_listed() -> None:
    time = FakeTime()
    policy = RetryPolicy(retry_on=(Transient,), first_delay_s=1.0)
    operation = Flaky(time, *(Transient() for _ in range(50)))
    assert await retry(operation, policy, sleep=time.sleep, clock=time.clock) == "done"
    assert operation.calls == 51
    assert time.slept == [1.0] * 50


@pytest.mark.parametrize(
    ("deadline_s", "calls"),
    [
        (3.0, 5),  # failures end at 0.25, 1.0, 1.75, 2.5, 3.25: the fifth is past it
        (2.5, 4),  # the fourth ends on it
    ],
)
async def test_a_deadline_gives_up_at_the_first_failure_that_ends_on_or_past_it(
    deadline_s: float, calls: int
) -> None:
    time = FakeTime(attempt_s=0.25)  # each attempt takes 0.25 s, each wait 0.5 s
    policy = RetryPolicy(retry_on=(Transient,), first_delay_s=0.5, deadline_s=deadline_s)
    operation = Flaky(time, *(Transient() for _ in range(100)))
    with pytest.raises(Transient):
        await retry(operation, policy, sleep=time.sleep, clock=time.clock)
    assert operation.calls == calls
    assert time.slept == [0.5] * (calls - 1)
    assert time.now == calls * 0.25 + (calls - 1) * 0.5


async def test_on_retry_sees_each_retried_failure_before_the_wait() -> None:
    time = FakeTime()
    seen: list[tuple[str, int]] = []

    async def on_retry(exc: BaseException) -> None:
        seen.append((str(exc), len(time.slept)))

    operation = Flaky(time, Transient("a"), Transient("b"))
    await retry(operation, POLICY, on_retry=on_retry, sleep=time.sleep, clock=time.clock)
    assert seen == [("a", 0), ("b", 1)]


async def test_on_retry_is_not_called_for_the_failure_that_gives_up() -> None:
    time = FakeTime()
    seen: list[BaseException] = []

    async def on_retry(exc: BaseException) -> None:
        seen.append(exc)

    policy = RetryPolicy(retry_on=(Transient,), first_delay_s=0.0, attempts=2)
    with pytest.raises(Transient):
        await retry(
            Flaky(time, Transient("1"), Transient("2")),
            policy,
            on_retry=on_retry,
            sleep=time.sleep,
            clock=time.clock,
        )
    assert [str(exc) for exc in seen] == ["1"]
    assert time.slept == []  # a zero delay does not sleep


async def test_one_attempt_means_no_retry() -> None:
    time = FakeTime()
    policy = RetryPolicy(retry_on=(Transient,), first_delay_s=1.0, attempts=1)
    operation = Flaky(time, Transient())
    with pytest.raises(Transient):
        await retry(operation, policy, sleep=time.sleep, clock=time.clock)
    assert operation.calls == 1
    assert time.slept == []


@pytest.mark.parametrize(
    "bad",
    [
        {"attempts": 0},
        {"first_delay_s": -1.0},
        {"backoff": 0.5},
        {"max_delay_s": -1.0},
    ],
)
def test_a_policy_that_cannot_work_is_refused(bad: dict[str, float]) -> None:
    settings: dict[str, float] = {"first_delay_s": 0.1, **bad}
    with pytest.raises(ValueError):
        RetryPolicy(retry_on=(Transient,), **settings)  # type: ignore[arg-type]


def test_the_named_policies_keep_their_delays() -> None:
    """The bus's policies are what its hand-written loops did: a durable publish every
    0.5 s for 30 s, a first connection every 0.5 s."""
    assert (JS_PUBLISH_RETRY.first_delay_s, JS_PUBLISH_RETRY.deadline_s) == (0.5, 30.0)
    assert JS_PUBLISH_RETRY.backoff == 1.0 and JS_PUBLISH_RETRY.attempts is None
    assert NATS_CONNECT_RETRY.first_delay_s == 0.5
    assert NATS_CONNECT_RETRY.max_delay_s == math.inf
