"""``python -m sf_gateway``: the gateway service (``seamlessflow serve gateway``)."""

from seamlessflow.service_table import run_process

run_process("gateway")
