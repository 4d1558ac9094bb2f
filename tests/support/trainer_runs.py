"""A trainer service's life in a test's event loop (``run_trainer``, joining an
``InProcessMesh`` with ``trainer_mesh``), the tiny settings and batches those tests train
on, and a ``learner`` to compute what that training must give (one CPU process)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from seamlessflow.bus import connect
from seamlessflow.protocol import Subjects
from seamlessflow.service import ServiceContext
from seamlessflow.settings import MeshSettings
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.service import TrainerService
from sf_trainer.settings import TrainerSettings
from tests.support import InProcessMesh
from tests.support.trainer_batches import make_batch

SETTINGS = TrainerSettings(lr=1e-3, micro_batch_tokens=48)
BATCHES = [
    make_batch(0, [[6, 9, 14, 20], [8, 11, 5, 17]], seed=1),
    make_batch(1, [[12, 7, 19, 10], [9, 15, 6, 13]], seed=2),
    make_batch(2, [[10, 16, 7, 9], [14, 6, 12, 8]], seed=4),
]


def learner(model_dir: Path, settings: TrainerSettings = SETTINGS) -> Learner:
    return Learner(settings, TrainGroup(device=torch.device("cpu")), model_dir)


def trainer_mesh(mesh: InProcessMesh, model_dir: Path, run_dir: Path) -> MeshSettings:
    """The mesh settings of a trainer joining ``mesh``'s run."""
    return MeshSettings(
        nats_url=mesh.mesh.nats_url, run_id=mesh.mesh.run_id, model_dir=model_dir, run_dir=run_dir
    )


async def run_trainer(mesh: MeshSettings, settings: TrainerSettings) -> None:
    """One trainer process's life, in this event loop, until it finishes its steps."""
    trainer_bus = await connect(mesh.nats_url, Subjects(mesh.run_id), name="trainer")
    try:
        trainer = TrainerService(settings)
        await asyncio.wait_for(trainer.run(ServiceContext(mesh=mesh, bus=trainer_bus)), 60)
    finally:
        await trainer_bus.drain()
