"""``python -m sf_engine``: one engine worker."""

from seamlessflow.service import main
from sf_engine.worker import EngineWorker

main(EngineWorker())
