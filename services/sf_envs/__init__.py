"""Built-in environments: OpenEnv environment servers an agent plays episodes in.

Each environment is a server of its own, written on openenv-core's server API (an
``Environment`` subclass with its ``Action``, ``Observation`` and ``State`` types,
served by its ``create_app`` under uvicorn): ``python -m sf_envs guess_number``
(options in ``sf_envs.cli``, the game in ``sf_envs.guess_number``). It is an
environment, not a mesh service: it consumes and produces no NATS subjects, and the
agents reach it through ``seamlessflow.envs.openenv_client``.

The protocol (openenv-core 0.2's, unchanged in 0.3):

- HTTP: ``POST /reset`` and ``POST /step`` (stateless: each request gets a fresh
  environment, so a game is played over the WebSocket and ``/step`` answers 409 "no
  game yet"), ``GET /state``, ``GET /health`` (200 ``{"status": "healthy"}``),
  ``GET /schema`` (the JSON schemas of the action, the observation and the state),
  ``GET /metadata``, ``GET /docs``.
- WebSocket ``/ws``: one session = one environment instance = one episode at a time.
  The client sends ``{"type": "reset", "data": {"seed": 3}}`` or ``{"type": "step",
  "data": {"message": "500"}}`` and gets ``{"type": "observation", "data":
  {"observation": {"prompt": ..., ...}, "reward": 0.1, "done": false}}``;
  ``{"type": "state"}`` gets ``{"type": "state", "data": {...}}``; ``{"type": "close"}``
  ends the session. A refused message is answered ``{"type": "error", "data":
  {"message": ..., "code": ...}}`` and the session goes on.
"""
