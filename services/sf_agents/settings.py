"""agent-runner settings (``SF_AGENTS_``)."""

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings, shared


class AgentRunnerSettings(RunFileSettings):
    """agent-runner settings (env prefix ``SF_AGENTS_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_AGENTS_", extra="ignore", use_attribute_docstrings=True
    )

    gateway_url: str = "http://127.0.0.1:8000"
    """Where the rollout gateway's HTTP API is."""

    agent: str = shared("agent")
    """The agent to run: a registered name or ``package.module:function``."""

    concurrency: int = shared("agent_concurrency")
    """Agent sessions run at once by this process."""

    model: str = ""
    """The model name single-policy agents ask the gateway for; empty = the run's first
    policy (``SF_POLICIES``)."""

    max_tokens: int = shared("max_tokens")
    """Completion budget per agent call."""

    temperature: float = 1.0
    """Sampling temperature the built-in agents ask for (``AgentTask.temperature``); an
    agent may pick its own per call. Each turn records the temperature it was sampled
    at and the trainer uses that one: nothing else has to match it."""

    gateway_wait_s: float = 60.0
    """How long the runner waits for the gateway to answer the first time; then it exits
    with one line saying so. Once reached, a gateway that goes away is waited for
    without limit (it is restarting)."""

    env_url: str = ""
    """The OpenEnv environment server agents play in (``AgentTask.env_url``; the
    ``openenv`` agent's): ``http://host:port``. Empty: none. ``seamlessflow up --env``
    sets it, to the built-in environment it starts or to the URL given."""

    env_step_timeout_s: float = Field(default=60.0, gt=0)
    """How long an agent waits for one reset or step of the environment before the
    episode fails (``env_timeout``)."""

    env_max_steps: int = Field(default=64, ge=1)
    """Steps after which an episode the environment has not ended is cut (it keeps the
    rewards it got)."""

    env_hidden_tools: list[str] = Field(default_factory=list)
    """Tools of an MCP environment the ``openenv_tools`` agent does not offer the model
    (a JSON list of names): the harness's own, e.g. ``["new_game"]`` for TextArena's
    server, whose ``new_game`` would let the model leave the game it is scored on."""

    gateway_key: SecretStr = SecretStr("")
    """Operator key for opening sessions at the gateway (one of its
    ``SF_GATEWAY_API_KEYS``); empty if the gateway needs none. Each agent's OpenAI
    client uses its own session's key, never this one."""
