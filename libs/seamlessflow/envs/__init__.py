"""Environments an agent plays episodes in, reached over the network.

An environment is a server of its own (an OpenEnv server: ``reset`` and ``step`` over a
WebSocket); the library holds only the client side (:mod:`.openenv_client`), so it works
without any environment framework installed. The built-in servers live in the
``sf_envs`` package (``python -m sf_envs``).
"""

from seamlessflow.envs.openenv_client import EnvFailed, EnvStep, OpenEnvSession, observation_text

__all__ = ["EnvFailed", "EnvStep", "OpenEnvSession", "observation_text"]
