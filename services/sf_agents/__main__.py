"""``python -m sf_agents``: the agent runner (``seamlessflow serve agents``)."""

from seamlessflow.service import run_service_process
from sf_agents.service import AgentRunner

run_service_process("agents", AgentRunner)
