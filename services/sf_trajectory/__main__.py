from seamlessflow.service import main
from sf_trajectory.service import TrajectoryService

main(TrajectoryService())
