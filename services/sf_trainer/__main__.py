from seamlessflow.service import main
from sf_trainer.service import Trainer

main(Trainer())
