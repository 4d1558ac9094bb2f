"""``python -m sf_trainer``: the trainer service (``seamlessflow serve trainer``)."""

from seamlessflow.service import run_process
from sf_trainer.launch import main

run_process("trainer", main)
