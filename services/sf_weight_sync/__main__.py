"""``python -m sf_weight_sync``: the weight-sync service (``seamlessflow serve weight-sync``)."""

from seamlessflow.service import run_service_process
from sf_weight_sync.service import WeightSyncService

run_service_process("weight-sync", WeightSyncService)
