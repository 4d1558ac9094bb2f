"""``python -m sf_trajectory``: the trajectory service (``seamlessflow serve trajectory``)."""

from seamlessflow.service import run_service_process
from sf_trajectory.service import TrajectoryService

run_service_process("trajectory", TrajectoryService)
