"""Guess the number: a long-horizon text game as an OpenEnv environment.

The environment thinks of a whole number from 1 to ``upper``; each turn the player
replies with a number and is told "higher" or "lower", for up to ``max_turns`` guesses.
Binary search finds any secret within ceil(log2(upper + 1)) guesses (10 for 1000), so an
episode runs about ten turns: a long conversation whose every step is rewarded.

Rewards, per step:

- ``1.0``: the guess is the secret (the episode ends);
- ``0.1``: a useful guess, inside the interval the earlier answers still allow;
- ``0.0``: a wasted guess, one the earlier answers already ruled out (or out of range);
- ``-0.1``: a reply with no number in it (the turn is spent all the same).

The episode also ends when the guesses run out (the last observation tells the secret).
A reply's guess is the first whole number in it (``"I guess 512."`` -> 512).

Every observation carries the text the player reads under ``prompt``, and what is known
so far as fields of their own (``turn``, ``guesses_left``, ``low``, ``high``): OpenEnv
leaves an observation's ``metadata`` off the wire, so nothing the player may need is
kept there.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State
from pydantic import Field

REWARD_FOUND = 1.0
REWARD_USEFUL_GUESS = 0.1
REWARD_WASTED_GUESS = 0.0
REWARD_NO_NUMBER = -0.1

_FIRST_INTEGER = re.compile(r"-?\d+")
_LONGEST_PARSED = 18
"""Digits beyond which a number is past every upper bound: compared as 10**18 instead of
parsed (a reply of thousands of digits would otherwise hit Python's int-parsing limit)."""


class NotPlaying(RuntimeError):
    """A step with no game in play: before the first reset, or after the episode ended.
    Over the WebSocket it is an error reply (the session goes on); over HTTP a 409."""


class GuessAction(Action):
    """The player's reply, as the model wrote it."""

    message: str = Field(description="The reply text; its first whole number is the guess")


class GuessObservation(Observation):
    """What the player sees after a reset or a guess."""

    prompt: str = Field(description="The text the player reads: rules, feedback, turns left")
    turn: int = Field(default=0, description="Guesses made so far in this episode")
    guesses_left: int = Field(default=0, description="Guesses still allowed")
    low: int = Field(default=1, description="Smallest number the answers so far allow")
    high: int = Field(default=1, description="Largest number the answers so far allow")


class GuessNumberState(State):
    """The episode as the server keeps it (the secret stays out of it until the end)."""

    upper: int = 1000
    max_turns: int = 12
    low: int = 1
    high: int = 1000
    guesses: list[int | None] = Field(default_factory=list)
    """Each turn's guess; None for a reply without a number."""
    found: bool = False
    secret: int | None = None
    """Shown once the episode is over."""


class StepLatency:
    """How long each step waits: a log-normal draw with median ``median_ms`` and spread
    ``sigma``, from one seeded generator shared by every session of a server (draws
    happen on the event loop thread, one at a time)."""

    def __init__(self, median_ms: float, sigma: float, seed: int) -> None:
        if median_ms < 0 or sigma < 0:
            raise ValueError(
                f"step latency needs median_ms >= 0 and sigma >= 0, got {median_ms}, {sigma}"
            )
        self.median_ms = median_ms
        self.sigma = sigma
        self._rng = random.Random(seed)

    def draw_s(self) -> float:
        if self.median_ms == 0:
            return 0.0
        return self._rng.lognormvariate(math.log(self.median_ms / 1000), self.sigma)


NO_LATENCY = StepLatency(0.0, 0.0, 0)


def first_integer(text: str) -> int | None:
    """The first whole number written in ``text`` (a leading minus sign counts)."""
    match = _FIRST_INTEGER.search(text)
    if match is None:
        return None
    sign = -1 if match.group().startswith("-") else 1
    digits = match.group().lstrip("-").lstrip("0")
    if len(digits) > _LONGEST_PARSED:
        return sign * 10**_LONGEST_PARSED
    return sign * int(digits or "0")


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, GuessNumberState]):
    """One game per instance; the OpenEnv server makes one instance per WebSocket
    session, so sessions share nothing but the latency generator."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(
        self, *, upper: int = 1000, max_turns: int = 12, latency: StepLatency = NO_LATENCY
    ) -> None:
        super().__init__()
        if upper < 1 or max_turns < 1:
            raise ValueError(
                f"guess_number needs upper >= 1 and max_turns >= 1, got {upper}, {max_turns}"
            )
        self.upper = upper
        self.max_turns = max_turns
        self.latency = latency
        self._secret: int | None = None
        self._state = GuessNumberState(upper=upper, max_turns=max_turns, high=upper)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        # random.Random(None) seeds from the OS: an unseeded reset is a fresh game
        self._secret = random.Random(seed).randint(1, self.upper)
        self._state = GuessNumberState(
            episode_id=episode_id or str(uuid.uuid4()),
            upper=self.upper,
            max_turns=self.max_turns,
            high=self.upper,
        )
        return self._observation(
            f"I am thinking of a whole number from 1 to {self.upper}. Guess it: reply with "
            f"one number. After each guess I tell you whether my number is higher or "
            f"lower. You have {self.max_turns} guesses.",
            reward=None,
        )

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        # on the event loop: a reset is instant, and the server would otherwise hand it
        # to a thread of the session's own
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        # for callers in this process; the server always takes the async form below
        time.sleep(self.latency.draw_s())
        return self._play(action.message)

    async def step_async(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        # the server awaits this on its event loop (it calls the async form whenever a
        # subclass overrides it): the latency holds up this session alone, no thread
        await asyncio.sleep(self.latency.draw_s())
        return self._play(action.message)

    @property
    def state(self) -> GuessNumberState:
        return self._state

    def _play(self, message: str) -> GuessObservation:
        state = self._state
        if self._secret is None:
            raise NotPlaying("no game yet: reset first")
        if state.found or len(state.guesses) >= self.max_turns:
            raise NotPlaying("the episode is over: reset to play again")
        guess = first_integer(message)
        state.guesses = [*state.guesses, guess]
        state.step_count += 1
        left = self.max_turns - len(state.guesses)
        if left == 0:
            state.secret = self._secret
            closing = f"No guesses left: my number was {self._secret}."
        else:
            closing = f"{left} guess{'es' if left != 1 else ''} left."

        if guess is None:
            return self._observation(
                f"I found no number in your reply. Reply with one whole number from 1 to "
                f"{self.upper}. {closing}",
                reward=REWARD_NO_NUMBER,
            )
        if guess == self._secret:
            state.found = True
            state.low = state.high = guess
            state.secret = self._secret
            return self._observation(
                f"{guess} is correct! You found my number in {len(state.guesses)} "
                f"guess{'es' if len(state.guesses) != 1 else ''}.",
                reward=REWARD_FOUND,
            )
        # judged against what the earlier answers allowed, before this one narrows it
        useful = state.low <= guess <= state.high
        if guess < self._secret:
            state.low = max(state.low, guess + 1)
            feedback = f"{guess} is too low: my number is higher."
        else:
            state.high = min(state.high, guess - 1)
            feedback = f"{guess} is too high: my number is lower."
        return self._observation(
            f"{feedback} {closing}",
            reward=REWARD_USEFUL_GUESS if useful else REWARD_WASTED_GUESS,
        )

    def _observation(self, prompt: str, *, reward: float | None) -> GuessObservation:
        state = self._state
        over = state.found or len(state.guesses) >= self.max_turns
        return GuessObservation(
            prompt=prompt,
            done=over,
            reward=reward,
            turn=len(state.guesses),
            guesses_left=self.max_turns - len(state.guesses),
            low=state.low,
            high=state.high,
        )
