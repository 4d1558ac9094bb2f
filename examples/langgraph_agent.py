"""An agent written with LangChain and LangGraph, trained by seamlessflow unchanged but
for its base URL and key.

The agent (``build_graph``/``solve``) is an ordinary LangGraph graph: a chat model node
(``ChatOpenAI`` with a bound tool) and a tool node, looping until the model answers
without a tool call. What seamlessflow adds is only around it: open a session (its
``base_url`` and ``api_key`` go to ``ChatOpenAI``), run the graph, finish the session.

Against a local run (``just up`` prints the gateway URL and where its key is):

    python examples/langgraph_agent.py --gateway http://127.0.0.1:PORT \\
        --key <gateway_key from the run's connection file> --question "What is 7 + 12?"
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def build_graph(
    base_url: str, api_key: str, model: str = "policy", *, responses_api: bool = False
) -> Any:
    """``responses_api``: ChatOpenAI talks the Responses API instead of chat completions."""
    llm = ChatOpenAI(
        model=model, base_url=base_url, api_key=api_key, use_responses_api=responses_api
    ).bind_tools([add])

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # a tool call -> "tools", else end
    graph.add_edge("tools", "agent")
    return graph.compile()


async def solve(base_url: str, api_key: str, question: str, *, responses_api: bool = False) -> str:
    """Run the graph on ``question`` to its final answer."""
    messages = [
        SystemMessage("You add numbers. Use the add tool, then state the result."),
        HumanMessage(question),
    ]
    graph = build_graph(base_url, api_key, responses_api=responses_api)
    state = await graph.ainvoke({"messages": messages})
    return str(state["messages"][-1].text)


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
        opened = await http.post("/sessions", json={"task_id": "langgraph"}, headers=operator)
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
