"""``python -m sf_engine``: the engine service (``seamlessflow serve engine``)."""

from seamlessflow.service import run_service_process
from sf_engine.worker import EngineWorker

run_service_process("engine", EngineWorker)
