"""SkyRL-Gym's text environments, unmodified, served by OpenEnv's current server.

Runs in its own virtual environment (``requirements.txt``; ``just env-venv skyrl_gym``),
not the project's: it imports only openenv, skyrl-gym and reasoning-gym. One environment
instance per WebSocket session, as OpenEnv serves every environment::

    .venv-env-skyrl_gym/bin/python environments/skyrl_gym/server.py \\
        --game gsm8k_multi_turn --task basic_arithmetic --port 8013

prints ``listening on http://HOST:PORT`` once serving. An episode over ``/ws``:
``{"type": "reset", "data": {"seed": S}}``, then ``{"type": "step", "data":
{"message": "... #### 42"}}`` until ``done``.

SkyRL-Gym ships environments, not data: its math environments (``gsm8k``,
``gsm8k_multi_turn``) score an answer written as ``#### N`` against a ground truth the
trainer's dataset supplies. Here the problems come from a reasoning-gym generator, a
package like the rest, so nothing is downloaded. What the adapter decides, and nothing
else (the turns, rewards and the end of the episode are SkyRL-Gym's own):

- the reset's seed picks the problem (reasoning-gym's ``create_dataset(task, seed=S,
  size=1)``), so every sample of a GRPO group answers the same one, and the seeds the
  ``episodes`` task holds out are seeds the run never trains on (a small problem space,
  such as the default's few hundred sums, still repeats problems across seeds);
- the first observation is the problem and one line on the answer's form (``#### N``:
  the form the environment scores, which the problem alone does not tell);
- later observations are the environment's own messages, joined;
- ``--max-turns`` reaches the environment as its ``max_turns`` extra;
- a move after the episode ended is refused with an error (a new one needs a reset).

``gsm8k_multi_turn``, the default, is multi-turn with a reward at every turn: a small
share of 0.2 for each answer in the right form, 1 for the right number, which ends the
episode; the episode's return is their sum.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import reasoning_gym
import skyrl_gym
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serving import (
    StepLatency,
    message_text,
    serve_main,
)  # environments/serving.py, beside this folder

ANSWER_FORM = 'Write your final answer as "####" followed by the number.'
"""The one line the adapter adds to a problem: how the environment reads an answer. No
example number: with '"#### 12"' as one, SmolLM2 learnt in 10 steps to answer 12 to
everything (each well-formed answer earns a share of the reward)."""


class Answer(Action):
    message: str = Field(description="The model's reply; the environment reads '#### N'")


class Reply(Observation):
    prompt: str = Field(default="", description="The problem, or the environment's message")


class EpisodeOver(RuntimeError):
    """A move sent after the episode ended: a reset starts another."""


class SkyRLGymEpisode(Environment):
    """One SkyRL-Gym environment per session, on a reasoning-gym problem per reset."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(
        self,
        env_id: str,
        task: str,
        task_config: dict[str, Any],
        max_turns: int,
        latency: StepLatency | None = None,
    ) -> None:
        super().__init__()
        self.latency = latency or StepLatency()
        self.env_id, self.task, self.task_config = env_id, task, task_config
        self.max_turns = max_turns
        self.env: Any = None
        self.over = True
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Reply:
        problem = problem_for(self.task, self.task_config, seed)
        extras = {"reward_spec": {"ground_truth": str(problem["answer"])},
                  "max_turns": self.max_turns, "extra_info": {}}  # fmt: skip
        self.env = skyrl_gym.make(self.env_id, env_config=None, extras=extras)
        question = f"{problem['question']}\n{ANSWER_FORM}"
        messages, _ = self.env.init([{"role": "user", "content": question}])
        self.over = False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Reply(prompt=message_text(messages), reward=0.0, done=False)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Reply:
        if not isinstance(action, Answer):
            raise TypeError(f"expected a message, got {type(action).__name__}")
        if self.over:
            raise EpisodeOver("the episode is over: reset to start another")
        self._state.step_count += 1
        time.sleep(self.latency.draw_s())  # on this session's own thread
        out = self.env.step(action.message)
        self.over = bool(out["done"])
        if self.over:
            self.env.close()
        return Reply(prompt=message_text(out["observations"]), reward=float(out["reward"]),
                     done=self.over)  # fmt: skip

    @property
    def state(self) -> State:
        return self._state


def problem_for(task: str, config: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """reasoning-gym's problem for ``seed`` (None: a fresh one)."""
    return dict(reasoning_gym.create_dataset(task, seed=seed, size=1, **config)[0])


def task_config_of(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` options of the reasoning-gym generator; numbers and booleans typed,
    a value with commas a list (``operators=+,-``)."""
    config: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        typed: Any = value
        if "," in value:
            typed = value.split(",")
        elif value in ("true", "false"):
            typed = value == "true"
        elif value.lstrip("-").isdigit():
            typed = int(value)
        config[key] = typed
    return config


def app_for(
    env_id: str,
    task: str,
    config: dict[str, Any],
    max_turns: int,
    sessions: int,
    latency: StepLatency,
) -> Any:
    # an unknown environment, task or option fails here, before anything is served
    SkyRLGymEpisode(env_id, task, config, max_turns).reset(seed=0)
    return create_app(
        lambda: SkyRLGymEpisode(env_id, task, config, max_turns, latency),
        Answer,
        Reply,
        env_name=f"skyrl-gym-{env_id}",
        max_concurrent_envs=sessions,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="gsm8k_multi_turn", help="a SkyRL-Gym env id")
    parser.add_argument("--task", default="basic_arithmetic", help="a reasoning-gym dataset")
    parser.add_argument("--task-option", action="append", metavar="KEY=VALUE",
                        default=["max_terms=2", "max_digits=1", "allow_parentheses=false",
                                 "allow_negation=false", "operators=+,-,*"],
                        help="an option of the dataset, over the defaults: two one-digit "
                             "terms, no division (reasoning-gym 0.1.25 states a one-digit "
                             "division with a wrong answer: '7 / 4' is '28')")  # fmt: skip
    parser.add_argument("--max-turns", type=int, default=3, help="the environment's max_turns")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8013, help="0: any free port")
    parser.add_argument("--max-sessions", type=int, default=256)
    StepLatency.add_arguments(parser)
    args = parser.parse_args(argv)
    config = task_config_of(args.task_option)
    latency = StepLatency.of(args)

    def build() -> Any:
        return app_for(args.game, args.task, config, args.max_turns, args.max_sessions, latency)

    return serve_main("skyrl_gym", build, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
