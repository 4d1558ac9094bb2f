"""Agents: plain async functions that talk to an OpenAI-compatible endpoint.

An agent is ``async def agent(client: AsyncOpenAI, task: AgentTask) -> AgentReward``.
It uses ``client`` exactly as it would use OpenAI (the client's ``base_url`` is the
session's); it returns a reward, or None to let the task's verifier score the last
answer of the task's policy. A multi-policy agent picks a policy per call by the
request's ``model`` (``task.policies``) and returns a reward per policy (a dict).
Agents are registered by name or given as a dotted path (``package.module:function``);
they never import anything from seamlessflow's training side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI

from seamlessflow.plugins import Registry


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


AgentReward = float | Mapping[str, float] | None
"""A reward for the session, one per policy (model name -> reward), or None."""

AgentFn = Callable[[AsyncOpenAI, AgentTask], Awaitable[AgentReward]]

AGENTS: Registry[AgentFn] = Registry(
    "agent",
    "SF_AGENTS_AGENT, --agent",
    dotted_paths=True,
    builtins=("seamlessflow.agents.builtin", "seamlessflow.agents.tool_agent"),
)
register_agent = AGENTS.register
get_agent = AGENTS.get
"""A registered agent by name, else the function at a dotted path, imported."""
