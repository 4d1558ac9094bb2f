"""``python -m sf_engine``: the engine service (``seamlessflow serve engine``)."""

from seamlessflow.service import run_service_process
from sf_engine.service import EngineService

run_service_process("engine", EngineService)
