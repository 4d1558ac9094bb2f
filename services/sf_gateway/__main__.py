"""``python -m sf_gateway [gateway|engine]``: the gateway (default) or an engine worker."""

import sys

from seamlessflow.service import main

role = sys.argv[1] if len(sys.argv) > 1 else "gateway"
if role == "gateway":
    from sf_gateway.gateway import GatewayService

    main(GatewayService())
elif role == "engine":
    from sf_gateway.engine_worker import EngineWorker

    main(EngineWorker())
else:
    sys.exit(f"unknown role {role!r}: expected 'gateway' or 'engine'")
