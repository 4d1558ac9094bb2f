"""Agents: plain async functions that talk to an OpenAI-compatible endpoint.

An agent is ``async def agent(client: AsyncOpenAI, task: AgentTask) -> float | None``.
It uses ``client`` exactly as it would use OpenAI (the client's ``base_url`` is the
session's); it returns a reward, or None to let the task's verifier score the last
answer. Agents are registered by name or given as a dotted path
(``package.module:function``); they never import anything from seamlessflow's
training side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI

from seamlessflow.plugins import import_dotted


@dataclass(frozen=True)
class AgentTask:
    """What an agent gets to work on: OpenAI chat messages and the model to ask."""

    task_id: str
    messages: list[dict[str, Any]]
    model: str
    reference: str
    max_tokens: int
    temperature: float


AgentFn = Callable[[AsyncOpenAI, AgentTask], Awaitable[float | None]]

_REGISTRY: dict[str, AgentFn] = {}


def register_agent(name: str) -> Callable[[AgentFn], AgentFn]:
    def decorate(fn: AgentFn) -> AgentFn:
        if name in _REGISTRY:
            raise ValueError(f"agent {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorate


def get_agent(name_or_path: str) -> AgentFn:
    # registers the built-in agents
    from seamlessflow.agents import builtin, tool_agent  # noqa: F401

    if name_or_path in _REGISTRY:
        return _REGISTRY[name_or_path]
    fn = import_dotted(name_or_path)
    if fn is None:
        raise KeyError(f"unknown agent {name_or_path!r}; registered: {sorted(_REGISTRY)}")
    return fn
