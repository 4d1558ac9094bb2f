from typing import Annotated

from pydantic import SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.plugins import ChosenFrom
from seamlessflow.runfile import RunFileSettings

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
"""Bind addresses meaning "every interface": a session's ``base_url`` cannot use them."""


class GatewaySettings(RunFileSettings):
    """rollout-gateway settings (env prefix ``SF_GATEWAY_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_GATEWAY_", extra="ignore", use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Interface the HTTP server binds to (0.0.0.0 in containers)."""

    port: int = 8000
    """HTTP port (0 = pick a free one)."""

    public_url: str = ""
    """Base URL agents reach this gateway at (it is in every session's ``base_url``);
    default ``http://<host>:<port>``. Required when ``host`` is a wildcard (``0.0.0.0``,
    ``::``), which is no address to call: in compose ``http://gateway:8000``."""

    api_keys: SecretStr = SecretStr("")
    """Operator keys, comma-separated: opening a session and listing models need one of
    them (``Authorization: Bearer``), and they export any session. Empty = anyone who
    reaches the gateway may open sessions. Each session's own routes always take only
    the key the session was opened with."""

    keep_alive_s: float = 75.0
    """How long an idle HTTP keep-alive connection stays open. Longer than the clients'
    own idle expiry (httpx: 5 s), so a client never reuses a connection the gateway is
    closing at the same moment (connection resets under load)."""

    finished_sessions_kept: int = 100_000
    """Finished sessions the gateway still recognises (to answer 409 and check their key)
    after dropping their conversation; older ones answer 404. Their records live on in
    JetStream and their exports in the trajectory service."""

    max_context: int = 0
    """Prompt plus completion tokens may not exceed this; 0: the model's context, from its
    config.json (``max_position_embeddings`` or the like). An engine that holds less
    (``SF_ENGINE_MAX_CONTEXT``, or vLLM's cap on a CPU) refuses what exceeds its own
    with a 400 naming its limit."""

    default_max_tokens: int = 64
    """Completion budget when a request gives none."""

    generate_timeout_s: float = 300.0
    """Longest wait for one engine reply before the request fails with 503."""

    first_chunk_timeout_s: float = 10.0
    """An engine confirms a request at once (an empty first chunk naming itself); a
    request unconfirmed after this long is aborted and re-submitted, so a request lost
    with a dying engine never waits for ``generate_timeout_s``."""

    engine_wait_s: float = 60.0
    """How long a request waits for any engine to come up before failing with 503."""

    tool_parser: Annotated[str, ChosenFrom("sf_gateway.tool_parsers:TOOL_PARSERS")] = "auto"
    """How tool calls are read from chat answers: a tool parser registered in
    ``sf_gateway.tool_parsers``, by name; ``none`` (not parsed); or ``auto``: from the
    model's chat template (its tool-call markers), else its ``model_type``."""

    reasoning_parser: str = "auto"
    """How a thinking model's reasoning is split off its answer (``reasoning_content``):
    ``qwen3`` (a leading ``<think>...</think>`` block), ``none`` (reasoning stays in the
    content), or ``auto``: ``qwen3`` if the chat template has ``<think>`` blocks."""

    shared_sessions: bool = False
    """This is one of several gateway processes serving the same sessions (behind one
    address with ``reuse_port``, or behind a load balancer): each follows every session
    from the trajectory stream as it is stored, and before a session's request waits
    until it has what the others recorded for that session, so a turn may land on any
    process and the one that opened the session may die. One session's turns still
    come one after another (an agent loop's do): two at once on two processes are not
    ordered."""

    reuse_port: bool = False
    """Listen with ``SO_REUSEPORT``: several gateway processes on one host bind the same
    host and port, and the kernel spreads new connections among them (Linux). Needs a
    fixed ``port`` and implies ``shared_sessions``."""

    catch_up_timeout_s: float = 10.0
    """With ``shared_sessions``: the longest a request waits for this process to read what
    the others stored for its session before it fails with 503 (clients retry)."""

    @model_validator(mode="after")
    def _reuse_port_shares_sessions(self) -> "GatewaySettings":
        if self.reuse_port:
            if self.port == 0:
                raise ValueError(
                    "SF_GATEWAY_REUSE_PORT needs a fixed SF_GATEWAY_PORT: with 0 every "
                    "process would pick a port of its own"
                )
            self.shared_sessions = True
        return self

    @model_validator(mode="after")
    def _public_url_is_callable(self) -> "GatewaySettings":
        if not self.public_url and self.host in WILDCARD_HOSTS:
            raise ValueError(
                f"SF_GATEWAY_HOST={self.host} listens on every interface, which is no "
                "address for agents to call: set SF_GATEWAY_PUBLIC_URL to the URL they "
                "reach this gateway at (e.g. http://gateway:8000 in compose)"
            )
        return self

    def operator_keys(self) -> list[str]:
        return [k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip()]
