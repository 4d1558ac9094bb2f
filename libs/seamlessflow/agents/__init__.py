"""Agents: plain async functions that talk to an OpenAI-compatible endpoint.

An agent is ``async def agent(client: AsyncOpenAI, task: AgentTask) -> AgentReward``.
It uses ``client`` exactly as it would use OpenAI (the client's ``base_url`` is the
session's); it returns a reward, or None to let the task's verifier score the last
answer of the task's policy. A multi-policy agent picks a policy per call by the
request's ``model`` (``task.policies``) and returns a reward per policy (a dict). An
agent that plays an episode in an environment (``openenv``, ``openenv_tools``) returns an
:class:`EpisodeReturn`, or raises :class:`EpisodeFailed` when the environment fails it.
Agents are registered by name or given as a dotted path (``package.module:function``);
they never import anything from seamlessflow's training side.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI

from seamlessflow.plugins import Registry
from seamlessflow.protocol import FAILURE_PATTERN


@dataclass(frozen=True)
class AgentTask:
    """What an agent gets to work on: OpenAI chat messages and the model to ask."""

    task_id: str
    messages: list[dict[str, Any]]
    model: str
    """The model a single-policy agent asks (the task's policy)."""
    reference: str
    max_tokens: int
    temperature: float
    reward_fn: str = ""
    """The task's reward function (``seamlessflow.rewards``), for agents that judge
    answers themselves (e.g. to reward a verifier policy)."""
    policies: tuple[str, ...] = ()
    """Every policy of the run, each a model name; the first is the task's policy."""
    env_url: str = ""
    """The environment server this task is played in (an OpenEnv server's URL,
    ``SF_AGENTS_ENV_URL``), for agents that act in one; empty: none."""
    env_step_timeout_s: float = 60.0
    """How long an agent waits for one reset or step of that environment."""
    env_max_steps: int = 64
    """Steps after which an agent ends an episode its environment has not ended."""
    env_hidden_tools: tuple[str, ...] = ()
    """Tools of the environment an agent does not offer the model (``openenv_tools``):
    the harness's own, such as one that starts a new game."""


@dataclass(frozen=True)
class EpisodeReturn:
    """What an agent that played an episode in an environment returns: the episode's
    return (what training uses) and the environment's reward at each step."""

    reward: float
    step_rewards: tuple[float, ...] = ()


class EpisodeFailed(Exception):
    """Raised by an agent whose episode cannot be scored (its environment timed out,
    answered an error or went away): the sample is dropped with ``reason``, a short
    identifier (``env_timeout``), and the run goes on."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if not reason or not re.fullmatch(FAILURE_PATTERN, reason):
            # the gateway would refuse it, and the session would never finish
            raise ValueError(
                f"a failure reason is a short identifier (env_timeout), not {reason!r}"
            )
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


AgentReward = float | Mapping[str, float] | EpisodeReturn | None
"""A reward for the session, one per policy (model name -> reward), an episode's return
with its step rewards, or None."""

AgentFn = Callable[[AsyncOpenAI, AgentTask], Awaitable[AgentReward]]

AGENTS: Registry[AgentFn] = Registry(
    "agent",
    "SF_AGENT, --agent",
    dotted_paths=True,
    builtins=(
        "seamlessflow.agents.builtin",
        "seamlessflow.agents.tool_agent",
        "seamlessflow.agents.openenv_agent",
        "seamlessflow.agents.openenv_tools_agent",
    ),
)
register_agent = AGENTS.register
get_agent = AGENTS.get
"""A registered agent by name, else the function at a dotted path, imported."""
