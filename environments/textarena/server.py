"""TextArena's single-player games, unmodified, served by OpenEnv's current server.

Runs in its own virtual environment (``requirements.txt``; ``just env-venv textarena``),
not the project's: it imports only openenv and textarena. One environment instance per
WebSocket session, as OpenEnv serves every environment::

    .venv-env-textarena/bin/python environments/textarena/server.py \\
        --game GuessTheNumber-v0 --port 8012

prints ``listening on http://HOST:PORT`` once serving. Two ways to play one episode over
``/ws`` (``{"type": "reset", "data": {"seed": S}}`` first, either way):

- **a message per move**: ``{"type": "step", "data": {"message": "[10]"}}`` (what the
  project's ``openenv`` agent sends);
- **MCP tools** (OpenEnv's MCP support, JSON-RPC ``tools/list`` / ``tools/call``):
  ``new_game(seed)`` and ``move(action)``, each answering ``{"prompt", "reward",
  "done"}``. On the ``/mcp`` WebSocket each connection has an environment of its own, so
  an MCP client plays a whole episode there: ``new_game``, then ``move`` until ``done``.

What the adapter decides, and nothing else (the game's rules, prompts and rewards are
TextArena's own):

- the reset's seed seeds the game (``reset(num_players=1, seed=S)``), so every sample of
  a GRPO group plays the same game;
- an observation's ``prompt`` is what the game said since the player's last move (the
  first one: its rules), not TextArena's whole growing history: a chat agent already
  holds the earlier turns in its conversation;
- the reward is 0 until the game ends, then the player's reward from the game's
  ``close()`` (GuessTheNumber: 1 for the number found, else the share of the game
  completed);
- a move after the game ended is refused with an error (a new game needs a reset).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import textarena
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serving import StepLatency, serve_main  # environments/serving.py, beside this folder

PLAYER = 0
"""The one player of a single-player game."""
OUTCOME = {"prompt", "reward", "done"}
"""What a tool answers of an observation."""


class GameMove(Action):
    message: str = Field(description="The player's reply; the game reads its move from it")


class GameObservation(Observation):
    prompt: str = Field(default="", description="What the game said since the last move")


class GameOver(RuntimeError):
    """A move sent after the game ended: the client's mistake; a reset starts a game."""


class TextArenaGame(MCPEnvironment):
    """One TextArena game per session; moves as messages or as the MCP tool ``move``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, game: str, latency: StepLatency | None = None) -> None:
        tools = FastMCP(f"textarena-{game}")

        @tools.tool()
        def new_game(seed: int | None = None) -> dict[str, Any]:
            """Start a game (the same seed: the same game); returns its rules."""
            return self.reset(seed=seed).model_dump(include=OUTCOME)

        @tools.tool()
        def move(action: str) -> dict[str, Any]:
            """Make your move; returns what the game says next, the reward and whether
            the game is over."""
            return self._move(action).model_dump(include=OUTCOME)

        super().__init__(tools)
        self.game_name = game
        self.latency = latency or StepLatency()
        self.game: Any = None
        self.shown = 0
        self.over = True
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GameObservation:
        self.game = textarena.make(env_id=self.game_name)
        self.game.reset(num_players=1, seed=seed)
        self.shown, self.over = 0, False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GameObservation(prompt=self._news(), reward=0.0, done=False)

    def _news(self, action: str = "") -> str:
        """What the game said since it was last asked (its observation grows), without
        its echo of the player's own move."""
        _, seen = self.game.get_observation()
        news, self.shown = seen[self.shown :].strip(), len(seen)
        return news.removeprefix(f"[Player] {action}").strip() if action else news

    def _move(self, action: str) -> GameObservation:
        if self.over:
            raise GameOver("the game is over: start another (reset, or new_game)")
        self._state.step_count += 1
        time.sleep(self.latency.draw_s())  # on this session's own thread
        done, _ = self.game.step(action=action)
        if not done:
            return GameObservation(prompt=self._news(action), reward=0.0, done=False)
        self.over = True
        rewards, info = self.game.close()
        reason = str((info or {}).get(PLAYER, {}).get("reason", "the game ended"))
        return GameObservation(prompt=reason, reward=float(rewards[PLAYER]), done=True)

    def _step_impl(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        if not isinstance(action, GameMove):
            raise TypeError(f"expected a message, got {type(action).__name__}")
        return self._move(action.message)

    @property
    def state(self) -> State:
        return self._state


def app_for(game: str, max_sessions: int, latency: StepLatency) -> Any:
    textarena.make(env_id=game)  # an unknown game fails here, before anything is served
    return create_app(
        lambda: TextArenaGame(game, latency),
        GameMove,
        GameObservation,
        env_name=f"textarena-{game}",
        max_concurrent_envs=max_sessions,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="GuessTheNumber-v0", help="a TextArena env id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8012, help="0: any free port")
    parser.add_argument("--max-sessions", type=int, default=256)
    StepLatency.add_arguments(parser)
    args = parser.parse_args(argv)
    latency = StepLatency.of(args)
    return serve_main(
        "textarena", lambda: app_for(args.game, args.max_sessions, latency), args.host, args.port
    )


if __name__ == "__main__":
    sys.exit(main())
