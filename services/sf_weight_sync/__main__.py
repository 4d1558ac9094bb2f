"""``python -m sf_weight_sync``: the weight-sync service (``seamlessflow serve weight-sync``)."""

from seamlessflow.service_table import run_process

run_process("weight-sync")
