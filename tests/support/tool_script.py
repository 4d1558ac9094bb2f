"""A scripted engine that plays an agent's tool-using model, for tests of real agents.

Random or tiny weights never call a tool, so agent frameworks' tool loops cannot be
exercised with them. `ToolScriptEngine` keeps every contract of `ScriptedEngine`
(batching, budgets, stop ids, abort, weights) but chooses its tokens from the prompt's
text, like a model that learnt one habit:

- the last turn is a user question with two integers and the prompt offers tools: call
  the first tool, its first two properties set to those integers (a Hermes
  ``<tool_call>`` block, as the template's families emit);
- the last turn is a tool response: answer ``"The result is <response>."``;
- otherwise: answer ``"No tool needed."``.

Each answer is the tokenizer's encoding of that text then the end-of-turn token, with
logprob log(0.9) per token, so what the agent receives is exactly known.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

import sf_engine.service
from sf_engine.backends.base import GeneratedToken, GenerationStream, SamplingParams
from sf_engine.backends.scripted_engine import ScriptedEngine, _Request

USER_TURN = "<|im_start|>user\n"
END_OF_TURN = "<|im_end|>"


def scripted_reply(prompt: str) -> str:
    """The text the scripted model answers to a templated prompt (see module doc)."""
    last_user = prompt.rsplit(USER_TURN, 1)[-1]
    response = re.match(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S)
    if response is not None:
        return f"The result is {response.group(1)}."
    numbers = [int(n) for n in re.findall(r"-?\d+", last_user.split(END_OF_TURN)[0])]
    tools = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.S)
    if tools is None or len(numbers) < 2:
        return "No tool needed."
    tool: dict[str, Any] = json.loads(tools.group(1).splitlines()[0])
    function = tool.get("function", tool)
    names = list(function.get("parameters", {}).get("properties", {}))[:2]
    arguments = dict(zip(names, numbers, strict=False))
    call = json.dumps({"name": function["name"], "arguments": arguments})
    return f"<tool_call>\n{call}\n</tool_call>"


class ToolScriptEngine(ScriptedEngine):
    def __init__(self, model_dir: str | Path, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._planned: dict[str, list[int]] = {}

    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        prompt = self._tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = scripted_reply(prompt) + END_OF_TURN
        self._planned[request_id] = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return super().stream(request_id, prompt_ids, params)

    def _draw(self, req: _Request, version: int) -> GeneratedToken:
        planned = self._planned[req.request_id]
        token = planned[min(req.produced, len(planned) - 1)]
        return GeneratedToken(token, math.log(0.9), version, ())


def use_tool_script_engine(monkeypatch: Any) -> None:
    """Engine workers started after this (backend ``scripted``) run `ToolScriptEngine`."""

    def build(settings: Any, model_dir: str) -> ToolScriptEngine:
        return ToolScriptEngine(model_dir, max_batch_size=settings.max_batch_size)

    monkeypatch.setattr(sf_engine.service, "build_engine", build)


@contextlib.asynccontextmanager
async def tool_script_gateway(
    nats_url: str, run_id: str, model_dir: Path, monkeypatch: Any
) -> AsyncIterator[str]:
    """A live mesh (scheduler, weight-sync, trajectory, a `ToolScriptEngine` worker,
    gateway) on ``nats_url``; yields the gateway's URL."""
    from sf_engine.service import EngineService
    from sf_engine.settings import EngineSettings
    from sf_gateway.service import GatewayService
    from sf_gateway.settings import GatewaySettings
    from sf_tag_scheduler.service import TagSchedulerService
    from sf_trajectory.service import TrajectoryService
    from sf_weight_sync.service import WeightSyncService
    from tests.support import InProcessMesh

    use_tool_script_engine(monkeypatch)
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    try:
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        await mesh.start(TrajectoryService())
        engine = await mesh.start(
            EngineService(EngineSettings(engine_id="engine-tools", backend="scripted"))
        )
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(60):
            await engine.ready.wait()
            await gateway.ready.wait()
        yield f"http://127.0.0.1:{gateway.bound_port}"
    finally:
        await mesh.stop()
