"""The trainer's process entry: one process per rank, and only rank 0 joins the mesh.

- One process (no torchrun environment): ``python -m sf_trainer`` or
  ``seamlessflow serve trainer``, exactly the single-process trainer.
- Several ranks on one host: ``torchrun --nproc-per-node N -m sf_trainer`` (or
  ``torchrun --nproc-per-node N --no-python seamlessflow serve trainer``); across hosts,
  torchrun's ``--nnodes`` and ``--rdzv-endpoint`` as usual. Every rank reads the same
  ``SF_*`` settings and loads the base model from ``SF_MODEL_DIR``.

Rank 0 is the trainer service (``sf_trainer.service``): it pulls batches, claims slots,
publishes weights and metrics, writes checkpoints. The other ranks never touch NATS:
they build the same model shard and run rank 0's commands (``sf_trainer.learner``)
until rank 0 sends Stop. They ignore SIGINT and SIGTERM, which torchrun forwards to
every rank: rank 0 needs them to gather its final checkpoint before it stops them. If
rank 0 dies instead, its collectives fail on the others (or torchrun kills them).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from seamlessflow.service import configure_logging
from seamlessflow.service import main as run_service_process
from seamlessflow.settings import MeshSettings
from sf_trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from sf_trainer.distributed import TrainGroup


def main() -> None:
    settings = TrainerSettings()
    # torch, transformers and the model code (about 9 CPU-seconds) only once the settings
    # are known good: a bad variable ends the process with its one line at once
    from sf_trainer.distributed import TrainGroup
    from sf_trainer.service import TrainerService

    group = TrainGroup.from_env(settings.device, settings.collective_timeout_s)
    try:
        if group.is_leader:
            run_service_process(TrainerService(settings, group))
        else:
            follow_rank_zero(settings, group, MeshSettings())
    finally:
        group.close()
    if not group.is_leader:
        exit_now()


def exit_now() -> None:
    """End a follower rank without the interpreter's teardown. Its work is done and it
    holds nothing to flush but logs, and on the way out torch's and gloo's C++ threads
    can be destroyed while still joinable ("terminate called without an active
    exception", SIGABRT): seen in about one run in ten on CPU, after a clean stop."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def follow_rank_zero(settings: TrainerSettings, group: TrainGroup, mesh: MeshSettings) -> None:
    configure_logging(f"trainer-rank{group.rank}", mesh.log_level)
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    if mesh.model_dir is None:
        raise RuntimeError("the trainer needs SF_MODEL_DIR")
    from sf_trainer.learner import Learner

    Learner(settings, group, mesh.model_dir, seed=mesh.seed).follow()
