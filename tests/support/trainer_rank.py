"""One rank of a trainer process group, without NATS: run by the distributed tests.

Started once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Every rank builds the Learner exactly as ``sf_trainer.launch`` does; rank
0 drives it through its commands (restore, steps, checkpoint, stop) and the others
follow. Usage: ``python trainer_rank.py SPEC.json``, where the spec names the model,
the trainer settings, the batches, an optional checkpoint to resume from and the
output directory (rank 0 writes ``results.json``, ``checkpoint/``, with
``eval_every`` ``eval.json``, with ``offload_between_steps`` each step's offload and
reload accounted in its results, and with ``save_loaded`` ``loaded.pt``, the weights
before any step, and ``published.pt``, the same published as a bf16 version, there). A
one-process run also writes ``adam_trace.pt``: its AdamW moments after every step, from
which the distributed tests derive how far float noise can move a weight.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch

from seamlessflow.protocol import TrainBatch
from seamlessflow.weights.codec import WeightEncoder, WeightMirror
from seamlessflow.weights.layout import bucket_digests, state_digest
from sf_trainer.checkpoint import TrainerState
from sf_trainer.distributed import TrainGroup
from sf_trainer.launch import exit_now
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    settings = TrainerSettings(**spec["settings"])
    group = TrainGroup.from_env(settings.device, timeout_s=120)
    try:
        learner = Learner(settings, group, Path(spec["model_dir"]))
        if group.is_leader:
            lead(learner, spec)
        else:
            learner.follow()
    finally:
        group.close()


def lead(learner: Learner, spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    version = 0
    if spec.get("save_loaded"):  # the weights as loaded, gathered from every rank
        out.mkdir(parents=True, exist_ok=True)
        torch.save(learner.full_weights(), out / "loaded.pt")
        # and as a version is published: gathered tensor by tensor into a bf16 payload
        encoded = learner.encode_weights(WeightEncoder(bucket_bytes=1 << 16), 1, torch.bfloat16)
        mirror = WeightMirror()
        mirror.apply(encoded.manifest, encoded.payload)
        torch.save(mirror.tensors(), out / "published.pt")
        # and packed where the leader computes (cuda_ipc), the buckets brought back here
        manifest, buckets = learner.pack_weights(
            WeightEncoder(bucket_bytes=1 << 16), 1, torch.bfloat16
        )
        payload = b"".join(bytes(bucket.cpu().numpy()) for bucket in buckets)
        digests = bucket_digests(payload, 1 << 16)
        packed = WeightMirror()
        packed.apply(
            msgspec.structs.replace(
                manifest, bucket_digests=digests, state_digest=state_digest(digests)
            ),
            memoryview(payload),
        )
        torch.save(packed.tensors(), out / "packed.pt")
    if spec.get("resume"):
        version = learner.restore(Path(spec["resume"])).version
    results = []
    # one process only: gathering the state is a collective the followers don't join
    trace = [] if not learner.group.distributed else None
    for encoded in spec["batches"]:
        batch = msgspec.json.decode(encoded.encode(), type=TrainBatch)
        results.append(dataclasses.asdict(learner.step(batch, version)))
        version += 1
        if trace is not None:
            state = learner.group.full_optimizer_state(learner.model, learner.optimizer)
            trace.append(
                {name: {k: v.clone() for k, v in s.items()} for name, s in state["state"].items()}
            )
        if spec.get("offload_between_steps"):  # as while the slots are lent
            offload = learner.offload()
            results[-1]["offload"] = dataclasses.asdict(offload) if offload else None
            # every other step reloads explicitly; the others by the next command
            reload = learner.reload() if version % 2 else None
            results[-1]["reload"] = dataclasses.asdict(reload) if reload else None
    if trace is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(trace, out / "adam_trace.pt")
    if learner.eval_set is not None:  # with eval_every: the trained policy, held out
        evaluated = learner.evaluate()
        (out / "eval.json").write_text(json.dumps(dataclasses.asdict(evaluated)))
    learner.save(out / "checkpoint", TrainerState(step=version, version=version, data_position=0))
    learner.stop()
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()  # as sf_trainer.launch ends a follower: no interpreter teardown
