"""``python -m sf_trajectory``: the trajectory service (``seamlessflow serve trajectory``)."""

from seamlessflow.service_table import run_process

run_process("trajectory")
