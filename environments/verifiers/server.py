"""A verifiers environment, loaded with ``load_environment`` and run by its own rollout
loop, served by OpenEnv's current server.

Runs in its own virtual environment (``requirements.txt``; ``just env-venv verifiers``),
not the project's: it imports only openenv, verifiers and the environment's package::

    .venv-env-verifiers/bin/python environments/verifiers/server.py \\
        --game falsepass._demo.falsepass_toy_env --env-arg seed=0 --port 8014

prints ``listening on http://HOST:PORT`` once serving. An episode over ``/ws``:
``{"type": "reset", "data": {"seed": S}}``, then ``{"type": "step", "data":
{"message": "..."}}`` until ``done``.

A verifiers environment is not a server that waits for moves: it drives the model
itself, calling an OpenAI client from its own rollout loop (``run_rollout``), and its
rubric scores the finished rollout. So the adapter hands each rollout a client of its
own, pointed at an OpenAI-compatible endpoint inside this server (``/bridge/v1``). A
call the environment makes there is a turn of the episode: the messages it added since
its last call are the observation, and the next ``step``'s message is the completion
the call returns. When the rollout ends, its reward (the rubric's, on the rollout as the
environment kept it) is the step's reward and the episode is done. The environment's
loop, parsing, turn limit and scoring run as its package ships them.

What the adapter decides, and nothing else:

- the reset's seed picks the row: ``dataset[seed % len(dataset)]`` of the environment's
  evaluation dataset (``get_eval_dataset()``, which is its training data when it has no
  other), so every sample of a GRPO group plays the same row. Which rows are held out is
  the environment's arguments' choice (``--env-arg``): a server for training and one for
  the held-out score load different data;
- an observation is the text of the messages the environment sent since its last call,
  joined (the first: its system prompt and the row's prompt);
- the environment's sampling arguments for the model are ignored: the player decides;
- a move after the episode ended is refused with an error (a new one needs a reset).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import verifiers as vf
from fastapi import Request
from fastapi.responses import JSONResponse
from openai import AsyncOpenAI
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serving import (
    StepLatency,
    message_text,
    serve_main,
)  # environments/serving.py, beside this folder

BRIDGE = "/bridge/v1"
"""Where the environments' own OpenAI clients call this server."""
MODEL_CALL_TIMEOUT_S = 3600.0
"""How long a rollout's model call waits for the player's move: as long as a turn of a
model on a busy CPU may take (the player's own step timeout fails the episode first)."""


class Reply(Action):
    message: str = Field(description="The model's completion of the environment's turn")


class Turn(Observation):
    prompt: str = Field(default="", description="What the environment said since its last call")


class EpisodeOver(RuntimeError):
    """A move sent when the environment waits for none: a reset starts an episode."""


@dataclass
class Episode:
    """One rollout in flight: its model calls and its end, in the order they happen."""

    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    waiting: asyncio.Future[str] | None = None  # the model call the next move answers
    seen: int = 0  # messages of the conversation already shown
    rollout: asyncio.Task[Any] | None = None

    def abandon(self) -> None:
        """Stop the rollout, and the model call it waits in (its HTTP handler would
        otherwise wait for a move that never comes)."""
        if self.waiting is not None and not self.waiting.done():
            self.waiting.cancel()
        if self.rollout is not None:
            self.rollout.cancel()


EPISODES: dict[str, Episode] = {}
"""Episodes in flight, by the key their rollout's client sends (one per reset)."""


class VerifiersEpisode(Environment):
    """One verifiers rollout per reset, its model calls turned into steps."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(
        self, env: Any, rows: Any, address: list[str], latency: StepLatency | None = None
    ) -> None:
        super().__init__()
        self.latency = latency or StepLatency()
        self.env, self.rows = env, rows
        self.address = address  # the bridge's base URL, once the server listens
        self.key = ""
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Turn:
        raise NotImplementedError("served on the event loop: reset_async")

    def step(self, action: Action, timeout_s: float | None = None, **kw: Any) -> Turn:
        raise NotImplementedError("served on the event loop: step_async")

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> Turn:
        self._end_episode()
        index = (seed if seed is not None else int(time.time_ns())) % len(self.rows)
        row = dict(self.rows[index])
        row.setdefault("example_id", index)
        self.key = uuid.uuid4().hex
        episode = EPISODES[self.key] = Episode()
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(
                base_url=self.address[0],
                api_key=self.key,
                timeout=MODEL_CALL_TIMEOUT_S,
                max_retries=0,
            )
        )
        episode.rollout = asyncio.create_task(
            self.env.run_rollout(row, client, model="player", sampling_args={})
        )
        episode.rollout.add_done_callback(lambda done: episode.events.put_nowait(("end", done)))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return await self._next(episode)

    async def step_async(self, action: Action, timeout_s: float | None = None, **kw: Any) -> Turn:
        if not isinstance(action, Reply):
            raise TypeError(f"expected a message, got {type(action).__name__}")
        episode = EPISODES.get(self.key)
        if episode is None or episode.waiting is None:
            raise EpisodeOver("the episode is over: reset to start another")
        self._state.step_count += 1
        await asyncio.sleep(self.latency.draw_s())
        episode.waiting.set_result(action.message)
        episode.waiting = None
        return await self._next(episode)

    async def _next(self, episode: Episode) -> Turn:
        """The environment's next model call (a turn) or its end (the reward)."""
        kind, payload = await episode.events.get()
        if kind == "call":
            messages, answer = payload
            news = messages[episode.seen :]
            episode.seen = len(messages) + 1  # and the reply the call gets
            episode.waiting = answer
            return Turn(prompt=message_text(news), reward=0.0, done=False)
        self._end_episode()
        output = payload.result()  # a rollout that raised: the step answers the error
        return Turn(prompt="", reward=float(output["reward"] or 0.0), done=True)

    def _end_episode(self) -> None:
        episode = EPISODES.pop(self.key, None)
        if episode is not None:
            episode.abandon()

    def close(self) -> None:
        episode = EPISODES.pop(self.key, None)
        if episode is not None and episode.rollout is not None:  # maybe on another thread
            episode.rollout.get_loop().call_soon_threadsafe(episode.abandon)

    @property
    def state(self) -> State:
        return self._state


async def model_call(request: Request) -> JSONResponse:
    """The environments' OpenAI endpoint: a call waits for the player's move, which is
    its completion."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    episode = EPISODES.get(key)
    if episode is None:
        error = {"message": "no episode has this key", "type": "invalid_request_error"}
        return JSONResponse({"error": error}, status_code=401)
    body = await request.json()
    answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    episode.events.put_nowait(("call", (list(body.get("messages", [])), answer)))
    text = await answer
    return JSONResponse(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "player")),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
    )


def env_args_of(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` arguments of ``load_environment``; whole numbers typed."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        args[key] = int(value) if value.lstrip("-").isdigit() else value
    return args


def app_for(
    game: str, env_args: dict[str, Any], sessions: int, address: list[str], latency: StepLatency
) -> Any:
    """The server; ``address`` receives the base URL of the bridge once it listens."""
    env = vf.load_environment(game, **env_args)  # a missing package: one line, and exit
    rows = env.get_eval_dataset()
    if len(rows) == 0:
        raise ValueError(f"{game} has no rows")
    app = create_app(
        lambda: VerifiersEpisode(env, rows, address, latency),
        Reply,
        Turn,
        env_name=f"verifiers-{game}",
        max_concurrent_envs=sessions,
    )
    app.add_api_route(f"{BRIDGE}/chat/completions", model_call, methods=["POST"])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="falsepass._demo.falsepass_toy_env",
                        help="a verifiers environment id (load_environment's)")  # fmt: skip
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument of load_environment")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8014, help="0: any free port")
    parser.add_argument("--max-sessions", type=int, default=256)
    StepLatency.add_arguments(parser)
    args = parser.parse_args(argv)
    address: list[str] = []

    def listening(host: str, port: int) -> None:
        address.append(f"http://{host}:{port}{BRIDGE}")

    return serve_main(
        "verifiers",
        lambda: app_for(
            args.game, env_args_of(args.env_arg), args.max_sessions, address, StepLatency.of(args)
        ),
        args.host,
        args.port,
        on_listening=listening,
    )


if __name__ == "__main__":
    sys.exit(main())
