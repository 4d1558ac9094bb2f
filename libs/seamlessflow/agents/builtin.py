"""Built-in agents."""

from __future__ import annotations

from openai import AsyncOpenAI

from seamlessflow.agents import AgentTask, register_agent


@register_agent("single_turn")
async def single_turn(client: AsyncOpenAI, task: AgentTask) -> float | None:
    """Ask once; the task's verifier scores the answer."""
    await client.chat.completions.create(
        model=task.model,
        messages=task.messages,  # type: ignore[arg-type]
        max_tokens=task.max_tokens,
        temperature=task.temperature,
    )
    return None
