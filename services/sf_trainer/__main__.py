"""``python -m sf_trainer``: the trainer service (``seamlessflow serve trainer``)."""

from seamlessflow.service_table import run_process

run_process("trainer")
