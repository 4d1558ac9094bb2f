"""``python -m sf_gateway``: the gateway service (``seamlessflow serve gateway``)."""

from seamlessflow.service import run_service_process
from sf_gateway.service import GatewayService

run_service_process("gateway", GatewayService)
