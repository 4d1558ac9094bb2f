"""The "openenv" agent: one episode in an OpenEnv environment server, turn by turn.

The environment is a server (``task.env_url``, from ``SF_AGENTS_ENV_URL``) that speaks
OpenEnv's WebSocket protocol (``seamlessflow.envs.openenv_client``). One episode:

1. ``reset`` with the task's seed (``task.reference``, when it is a whole number: every
   sample of a group plays the same game, which GRPO compares them on);
2. the conversation is the task's messages (a system prompt) and then the observation as
   a user message; the model answers through the session's OpenAI client, as any agent
   asks, so every turn is recorded with the exact tokens;
3. ``step`` with the answer as the action (``{"message": text}``); the next observation
   is the next user message; until the environment says ``done``, or the episode is
   cut and keeps the rewards it got: after ``task.env_max_steps`` steps, or when the
   next turn's prompt no longer fits the model's context (the gateway's 400 with code
   ``context_length_exceeded``; a first turn that does not fit fails the episode,
   ``context_exceeded``: there is nothing to score).

Returns an :class:`EpisodeReturn`: the sum of the step rewards and each of them. An
environment that times out, answers an error or goes away mid-episode (or cannot be
reached for ``ENV_CONNECT_RETRY``'s minute) raises :class:`EpisodeFailed` (via
``EnvFailed``): the runner finishes the session with that
reason and the trajectory service drops the sample with it. The model's context grows
with every turn and stays prefix-stable (the history is sent back as it was answered),
so each turn's prompt extends the previous one's and the trajectory records the episode
as one sample.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from openai import AsyncOpenAI, BadRequestError

from seamlessflow.agents import AgentTask, EpisodeFailed, EpisodeReturn, register_agent
from seamlessflow.envs.openenv_client import (
    EnvFailed,
    EnvUnreachable,
    OpenEnvSession,
    observation_text,
)
from seamlessflow.retry import RetryPolicy, retry

ENV_CONNECT_RETRY = RetryPolicy(
    retry_on=(EnvUnreachable,), first_delay_s=0.25, backoff=2.0, max_delay_s=4.0, deadline_s=60.0
)
"""An environment server that does not take the episode's WebSocket is asked again for
up to a minute (0.25 s doubling to 4 s): a supervised server restarting is back within
seconds, and nothing of the episode happened yet. After that the episode fails
(``env_unreachable``)."""


def reset_arguments(task: AgentTask) -> dict[str, Any]:
    """The reset's arguments: the task's seed when its reference is a whole number
    (the ``episodes`` task source's are), else none (the environment picks)."""
    reference = task.reference.strip()
    if reference.lstrip("-").isdigit():
        return {"seed": int(reference)}
    return {}


@register_agent("openenv")
async def openenv_episode(client: AsyncOpenAI, task: AgentTask) -> EpisodeReturn:
    """Play one episode of the environment at ``task.env_url`` (see the module)."""
    return await episode_in_session("openenv", play, client, task)


Play = Callable[[AsyncOpenAI, AgentTask, OpenEnvSession], Awaitable[EpisodeReturn]]
"""An episode played on an open session (the ``openenv`` and ``openenv_tools`` agents)."""


async def episode_in_session(
    agent: str, play: Play, client: AsyncOpenAI, task: AgentTask
) -> EpisodeReturn:
    """``play`` on a session with the environment at ``task.env_url``, closed after; a
    failure of the environment fails the episode with its reason (``EpisodeFailed``)."""
    if not task.env_url:
        raise ValueError(
            f"the {agent} agent plays in an environment server: set SF_AGENTS_ENV_URL "
            "(seamlessflow up --env URL or a built-in environment's name)"
        )
    try:
        async with aiohttp.ClientSession() as http:
            env = await open_session(task, http)
            try:
                return await play(client, task, env)
            finally:
                await env.close()
    except EnvFailed as exc:  # the environment's failure, not the agent's: the reason
        raise EpisodeFailed(exc.reason, exc.detail) from None


async def open_session(task: AgentTask, http: aiohttp.ClientSession) -> OpenEnvSession:
    """A WebSocket session with the environment; one that cannot be opened is tried
    again (``ENV_CONNECT_RETRY``: the server may be restarting) before the episode fails
    with ``env_unreachable``."""

    async def connect() -> OpenEnvSession:
        session = OpenEnvSession(task.env_url, http=http, step_timeout_s=task.env_step_timeout_s)
        return await session.__aenter__()

    return await retry(connect, ENV_CONNECT_RETRY)


async def play(client: AsyncOpenAI, task: AgentTask, env: OpenEnvSession) -> EpisodeReturn:
    """The episode, from its reset to ``done`` (or ``task.env_max_steps`` steps)."""
    messages: list[dict[str, Any]] = list(task.messages)
    step_rewards: list[float] = []
    state = await env.reset(**reset_arguments(task))
    while not state.done and len(step_rewards) < task.env_max_steps:
        messages.append({"role": "user", "content": observation_text(state.observation)})
        try:
            response = await client.chat.completions.create(
                model=task.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=task.max_tokens,
                temperature=task.temperature,
            )
        except BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            if not step_rewards:
                raise EpisodeFailed("context_exceeded", str(exc.message)) from None
            break  # the conversation outgrew the context: cut, as at env_max_steps
        answer = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        state = await env.step({"message": answer})
        step_rewards.append(float(state.reward or 0.0))
    return EpisodeReturn(reward=sum(step_rewards), step_rewards=tuple(step_rewards))
