"""The learning rate of each step: linear warmup, then constant, linear or cosine decay.

A pure function of the step's index in the run (0-based, counting the steps a resume
lost) and the settings; the Learner sets it on the optimizer before each step. So a
resumed trainer continues the schedule where the run stands, with no scheduler state in
the checkpoint, and a restart with other schedule settings takes them from its next step.
"""

from __future__ import annotations

import math

from sf_trainer.settings import TrainerSettings


def lr_at(step: int, settings: TrainerSettings) -> float:
    """Learning rate of step ``step`` (0-based) of a run of ``settings.steps`` steps.

    - warmup (``step < warmup_steps``): ``lr x (step + 1) / warmup_steps``, so the first
      step already learns and the last warmup step uses ``lr``;
    - then, with ``p = (step - warmup_steps) / (steps - warmup_steps)`` in [0, 1] (the
      fraction of the decay done, 0 at the first step after the warmup):
      ``constant``: ``lr``; ``linear``: ``lr x (m + (1 - m)(1 - p))``; ``cosine``:
      ``lr x (m + (1 - m)(1 + cos(pi p)) / 2)``, with ``m = min_lr_ratio``.
    """
    peak = settings.lr
    if step < settings.warmup_steps:
        return peak * (step + 1) / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return peak
    decay_steps = max(settings.steps - settings.warmup_steps, 1)
    progress = min(max((step - settings.warmup_steps) / decay_steps, 0.0), 1.0)
    if settings.lr_schedule == "linear":
        remaining = 1.0 - progress
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = settings.min_lr_ratio
    return peak * (floor + (1.0 - floor) * remaining)
