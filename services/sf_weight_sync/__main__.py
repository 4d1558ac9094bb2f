from seamlessflow.service import main
from sf_weight_sync.service import WeightSync

main(WeightSync())
