"""``python -m seamlessflow.agents``: the agent runner (``seamlessflow serve agents``)."""

from seamlessflow.agents.runner import AgentRunner
from seamlessflow.service import run_service_process

run_service_process("agents", AgentRunner)
