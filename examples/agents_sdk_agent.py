"""An agent written with the OpenAI Agents SDK, trained by seamlessflow unchanged but for
its base URL and key.

The agent (``build_agent``/``solve``) is ordinary Agents SDK code: a calculator agent
with one function tool, run by ``Runner`` until it answers (multi-turn tool use, through
the Responses API, ``/v1/responses``). What seamlessflow adds is only around it: open a
session (its ``base_url`` and ``api_key`` go to the agent's OpenAI client), run the
agent, report a reward if you have one, finish the session.

Against a local run (``just up`` prints the gateway URL and where its key is):

    python examples/agents_sdk_agent.py --gateway http://127.0.0.1:PORT \\
        --key <gateway_key from the run's connection file> --question "What is 7 + 12?"

The Agents SDK's tracing export (to the OpenAI platform) is turned off: nothing leaves
for anywhere but the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import httpx
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def build_agent(client: AsyncOpenAI, model: str = "policy") -> Agent:
    return Agent(
        name="calculator",
        instructions="You add numbers. Use the add tool, then state the result.",
        tools=[add],
        model=OpenAIResponsesModel(model=model, openai_client=client),
    )


async def solve(base_url: str, api_key: str, question: str, *, stream: bool = False) -> str:
    """Run the agent on ``question`` to its final answer."""
    set_tracing_disabled(True)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        agent = build_agent(client)
        if stream:
            result = Runner.run_streamed(agent, question)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question)
    return str(result.final_output)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gateway", default=os.environ.get("SF_GATEWAY_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument(
        "--key",
        default=os.environ.get("SF_GATEWAY_KEY", ""),
        help="an operator key of the gateway (the run's gateway_key)",
    )
    parser.add_argument("--question", default="What is 7 + 12?")
    args = parser.parse_args()
    operator = {"authorization": f"Bearer {args.key}"} if args.key else {}
    async with httpx.AsyncClient(base_url=args.gateway, timeout=60) as http:
        opened = await http.post("/sessions", json={"task_id": "agents-sdk"}, headers=operator)
        opened.raise_for_status()
        session = opened.json()
        answer = await solve(session["base_url"], session["api_key"], args.question)
        print(answer)
        mine = {"authorization": f"Bearer {session['api_key']}"}
        await http.post(f"/sessions/{session['session_id']}/finish", headers=mine)
        sid = session["session_id"]
        print(f"session {sid}, its samples: GET {args.gateway}/sessions/{sid}/export")


if __name__ == "__main__":
    asyncio.run(main())
