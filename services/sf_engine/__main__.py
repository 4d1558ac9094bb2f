"""``python -m sf_engine``: the engine service (``seamlessflow serve engine``)."""

from seamlessflow.service_table import run_process

run_process("engine")
