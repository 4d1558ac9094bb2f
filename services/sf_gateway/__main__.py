"""``python -m sf_gateway``: the rollout-gateway."""

from seamlessflow.service import main
from sf_gateway.gateway import GatewayService

main(GatewayService())
