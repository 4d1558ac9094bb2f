"""The "openenv_tools" agent: one episode in an OpenEnv environment whose actions are its
MCP tools, played by the model's tool calls.

OpenEnv environments built on ``MCPEnvironment`` (OpenEnv's RFC 003) offer their actions
as MCP tools. The harness and the agent share the episode's ``/ws`` session
(``seamlessflow.envs.openenv_client``): the harness resets it, and the agent reaches
the tools of that same environment instance with the session's ``mcp`` messages
(JSON-RPC ``tools/list`` and ``tools/call``). Why not OpenEnv's ``list_tools`` /
``call_tool`` step actions: openenv 0.10 routes those only for servers whose action
class is the generic one, and a server that also takes its own actions (TextArena's
here: moves as messages) refuses them. One episode:

1. ``reset`` with the task's seed (as the ``openenv`` agent: every sample of a group
   plays the same game); the first observation is the first user message, after the
   task's messages;
2. ``tools/list``: the environment's tools become the request's OpenAI ``tools``
   (name, description, input schema as parameters), less those named in
   ``task.env_hidden_tools`` (``SF_AGENTS_ENV_HIDDEN_TOOLS``): tools that belong to the
   harness, such as a tool that starts a new game, which would let the model leave the
   episode it is scored on;
3. each turn asks with ``tool_choice="required"`` (an action is a tool call here: an
   answer without one would be no move at all) and runs every call the answer holds,
   in order, as one ``tools/call``; each result is a ``tool`` message. A call the
   environment cannot run (a name it did not offer, arguments that are not a JSON
   object: the gateway's ``tool_call_errors``) is not sent; the agent answers it with
   a ``tool`` message saying what was wrong, and the model may correct itself in its
   next turn (docs/environments.md, "Malformed tool calls"). A tool error the
   environment reports (a bad argument, a move after the end) comes back the same way;
4. until the environment says ``done``, or the episode is cut and keeps the rewards it
   got: after ``task.env_max_steps`` turns, an answer without a tool call (a model
   that writes none although one is required, a cut answer), or when the next prompt
   no longer fits the context (as the ``openenv`` agent).

A call's reward and ``done`` are the ``reward`` and ``done`` fields of the tool's
structured result (MCP has no reward of its own: an environment whose tools are its
actions reports the outcome in their result, as TextArena's server here does; a tool
without them scores 0 and does not end the episode). Returns an
:class:`EpisodeReturn`: the sum of the calls' rewards and each of them. Failures of the
environment (timeout, lost, unreachable) fail the episode with their reason, as in the
``openenv`` agent: they are kept out of the group's advantages.
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI, BadRequestError

from seamlessflow.agents import AgentTask, EpisodeFailed, EpisodeReturn, register_agent
from seamlessflow.agents.openenv_agent import episode_in_session, reset_arguments
from seamlessflow.agents.tool_agent import assistant_message
from seamlessflow.envs.openenv_client import EnvFailed, OpenEnvSession, observation_text


def openai_tools(listing: dict[str, Any], hidden: tuple[str, ...]) -> list[dict[str, Any]]:
    """The tools of a ``tools/list`` reply as OpenAI function tools, less ``hidden``."""
    result = listing.get("result")
    tools = result.get("tools") if isinstance(result, dict) else None
    if not isinstance(tools, list):
        raise EnvFailed("env_error", f"tools/list answered no tools: {json.dumps(listing)[:200]}")
    offered = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("name") in hidden:
            continue
        schema = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object"}
        function = {"name": tool["name"], "description": tool.get("description", "")}
        offered.append({"type": "function", "function": {**function, "parameters": schema}})
    if not offered:
        raise EnvFailed("env_error", "the environment offers no tool the agent may call")
    return offered


def call_arguments(call: Any, offered: set[str]) -> tuple[dict[str, Any] | None, str]:
    """A tool call's arguments to send, or None and why it cannot be sent."""
    name = call.function.name
    if name not in offered:
        return None, f"error: there is no tool {name!r}; the tools are {sorted(offered)}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        return None, f"error: the arguments of {name} are not JSON: {call.function.arguments!r}"
    if not isinstance(arguments, dict):
        return None, f"error: the arguments of {name} must be a JSON object"
    return arguments, ""


def tool_outcome(reply: dict[str, Any]) -> tuple[str, float, bool]:
    """A ``tools/call`` reply as the tool message's text, the call's reward and whether
    the episode ended (see the module). An error, the server's or the tool's, is text
    for the model to read."""
    error = reply.get("error")
    if error is not None:
        message = error.get("message", error) if isinstance(error, dict) else error
        return f"error: {message}", 0.0, False
    result = reply.get("result")
    result = result if isinstance(result, dict) else {}
    content = result.get("content")
    text = "\n".join(
        str(part.get("text", "")) for part in content if isinstance(part, dict)
    ) if isinstance(content, list) else ""  # fmt: skip
    if result.get("is_error") or result.get("isError"):
        return f"error: {text}", 0.0, False
    structured = result.get("structured_content", result.get("structuredContent"))
    if isinstance(structured, dict) and set(structured) == {"result"}:
        structured = structured["result"]  # a plain return value, wrapped by FastMCP
    if not isinstance(structured, dict):
        return text, 0.0, False
    reward = structured.get("reward", 0.0)
    reward = float(reward) if isinstance(reward, int | float) else 0.0
    return observation_text(structured), reward, bool(structured.get("done", False))


@register_agent("openenv_tools")
async def openenv_tools_episode(client: AsyncOpenAI, task: AgentTask) -> EpisodeReturn:
    """Play one episode at ``task.env_url`` through its MCP tools (see the module)."""
    return await episode_in_session("openenv_tools", play, client, task)


async def play(client: AsyncOpenAI, task: AgentTask, env: OpenEnvSession) -> EpisodeReturn:
    """The episode, from its reset to ``done`` (or a cut: see the module)."""
    state = await env.reset(**reset_arguments(task))
    tools = openai_tools(await env.mcp("tools/list", {}), task.env_hidden_tools)
    offered = {tool["function"]["name"] for tool in tools}
    messages: list[dict[str, Any]] = list(task.messages)
    messages.append({"role": "user", "content": observation_text(state.observation)})
    step_rewards: list[float] = []
    done = state.done
    for _turn in range(task.env_max_steps):
        if done:
            break
        try:
            response = await client.chat.completions.create(  # type: ignore[call-overload]
                model=task.model,
                messages=messages,
                tools=tools,
                tool_choice="required",
                max_tokens=task.max_tokens,
                temperature=task.temperature,
            )
        except BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            if len(messages) == len(task.messages) + 1:
                raise EpisodeFailed("context_exceeded", str(exc.message)) from None
            break  # the conversation outgrew the context: cut
        message = response.choices[0].message
        if not message.tool_calls:
            break  # no move: the episode ends with what it earned
        messages.append(assistant_message(message))
        for call in message.tool_calls:
            arguments, refusal = call_arguments(call, offered)
            if arguments is None or done:
                text = refusal or "error: the episode is over"
            else:
                call_tool = {"name": call.function.name, "arguments": arguments}
                text, reward, done = tool_outcome(await env.mcp("tools/call", call_tool))
                step_rewards.append(reward)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return EpisodeReturn(reward=sum(step_rewards), step_rewards=tuple(step_rewards))
