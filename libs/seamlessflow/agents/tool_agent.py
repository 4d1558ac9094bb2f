"""The "tool_user" agent: a multi-turn tool loop, written as any OpenAI SDK user would.

Ask with ``tools``; while the reply has ``tool_calls`` (at most ``MAX_ROUNDS`` requests),
append the assistant message as returned and one ``tool`` message per call, then ask
again. Returns None: the task's verifier scores the last answer.

The tools and their implementation come from the task module (``TOOLBOXES``): the task
assignment carries no tools (see the report on a ``TaskAssignment.tools`` field), and
an agent author ships the tools their agent can run anyway. Today that is the "lookup"
task's ``lookup(item)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

from seamlessflow.agents import AgentTask, register_agent
from seamlessflow.tasks import lookup

MAX_ROUNDS = 3

ToolRunner = Callable[[str, str | dict[str, Any]], str]

# tool schemas (OpenAI format) + the function that runs a call, per task
TOOLBOXES: dict[str, tuple[list[dict[str, Any]], ToolRunner]] = {
    "lookup": (lookup.TOOLS, lookup.call_tool),
}
DEFAULT_TOOLBOX = "lookup"


def toolbox_for(task_id: str) -> tuple[list[dict[str, Any]], ToolRunner]:
    """The toolbox of the task a sample belongs to ("lookup-17" -> "lookup"); the
    default toolbox for task ids that name none."""
    prefix = task_id.partition("-")[0]
    return TOOLBOXES.get(prefix, TOOLBOXES[DEFAULT_TOOLBOX])


def tool_messages(message: Any, run_tool: ToolRunner) -> list[dict[str, Any]]:
    """One ``tool`` message per tool call of an assistant reply, with the call's result.

    A call the tool cannot run (unknown name, bad JSON arguments) gets an error text:
    the model sees it and may retry in its next round."""
    return [
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": run_tool(call.function.name, call.function.arguments),
        }
        for call in message.tool_calls or []
    ]


def assistant_message(message: Any) -> dict[str, Any]:
    """The assistant reply as returned, to send back in the history."""
    return dict(message.model_dump(exclude_none=True))


@register_agent("tool_user")
async def tool_user(client: AsyncOpenAI, task: AgentTask) -> float | None:
    """Answer with the help of tools: call them as long as the model asks to (at most
    ``MAX_ROUNDS`` requests); the verifier scores the final answer."""
    tools, run_tool = toolbox_for(task.task_id)
    messages: list[dict[str, Any]] = list(task.messages)
    for _ in range(MAX_ROUNDS):
        response = await client.chat.completions.create(
            model=task.model,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            max_tokens=task.max_tokens,
            temperature=task.temperature,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(assistant_message(message))
        messages.extend(tool_messages(message, run_tool))
    return None
