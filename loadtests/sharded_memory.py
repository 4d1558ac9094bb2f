"""The trainer on two CPU ranks with models users train: peak memory per rank, time to the
first step, and the cost of gathering a version, loaded whole or sharded from the first byte.

Each model is a shape from its published config (``seamlessflow.assets.shapes``: the
Qwen2.5-0.5B and Qwen2.5-1.5B shapes) with random bf16 weights written once as
safetensors files of 1 GB with their index (cached under ``--cache``). Per
configuration, two gloo ranks (one torch thread each) build the trainer's ``Learner``
exactly as ``torchrun -m sf_trainer`` does, take two steps on a small batch (the
second is the steady state: AdamW's state exists from the first step's end), publish a
version three ways, rank 0's high-water mark reset before each: as the trainer does
(``Learner.stream_weights``: bucket by bucket as it is gathered, in bf16), into one
whole payload (``encode_weights``, kept for deltas) and by gathering the whole state dict
first (how versions were published before). Each rank reports its
peak resident memory (``VmHWM``), which the table sets beside the bound of the
issue: 0.6x the full model in float32 plus its AdamW state (16 bytes a parameter).

``--loading whole`` is the path before sharded loading (every rank loads the whole
model with ``from_pretrained``, then FSDP2 shards it), kept here as the yardstick by
swapping the two loading functions in the worker; ``sharded`` is the product's path.

``--vocab-parallel on,off`` runs each loading with the embeddings split by vocabulary
rows (``SF_TRAINER_VOCAB_PARALLEL``, the default) and gathered by FSDP2;
``--gradient-checkpointing`` recomputes the decoder layers' activations.

    .venv/bin/python loadtests/sharded_memory.py [--shapes qwen2.5-0.5b] \
        [--loadings whole,sharded] [--master float32] [--vocab-parallel on,off] \
        [--gradient-checkpointing] [--out runs/load/sharded.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
BOUND_RATIO = 0.6
BYTES_PER_PARAMETER = 16
"""float32 weights (4), gradients (4) and AdamW's two moments (8): a model's full
training state, unsharded."""


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (``VmHWM``). Not ``ru_maxrss``: Linux
    carries a parent's peak across fork and exec into it."""
    return _status_kib("VmHWM") * 1024


BUCKET_BYTES = 64 << 20
"""The weights' default bucket (``SF_WEIGHTS_BUCKET_MB``)."""


class CountingSink:
    """A ``BucketSink`` that only counts what it is handed."""

    def __init__(self) -> None:
        self.bytes = 0

    def begin(self, payload_bytes: int, bucket_bytes: int) -> None:
        pass

    def put(self, index: int, bucket: memoryview) -> None:
        self.bytes += len(bucket)

    def end(self) -> None:
        pass


@contextlib.contextmanager
def publish_peak(figures: dict[str, Any], way: str) -> Iterator[None]:
    """``<way>_s`` and ``<way>_extra_gb``: how far rank 0's resident memory rose above
    where it stood when the block began (its high-water mark reset: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes()
    started = time.perf_counter()
    yield
    figures[f"{way}_s"] = time.perf_counter() - started
    figures[f"{way}_extra_gb"] = (peak_rss_bytes() - before) / GB


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_main(job: dict[str, Any]) -> None:
    """One rank: build the Learner, step once, gather once; write its figures."""
    import torch

    from seamlessflow.weights.codec import WeightEncoder
    from sf_trainer import learner as learner_module
    from sf_trainer.distributed import TrainGroup
    from sf_trainer.settings import TrainerSettings

    figures: dict[str, Any] = {"rss_before_model_gb": rss_bytes() / GB}
    if job["loading"] == "whole":
        from seamlessflow.assets.loading import load_causal_lm

        learner_module.model_on_meta = load_causal_lm
        learner_module.materialize_own_shards = lambda *args: None
    settings = TrainerSettings(
        torch_threads=1,
        master_dtype=job["master"],
        precision="fp32",
        eval_every=0,
        vocab_parallel=job.get("vocab_parallel", "on") == "on",
        gradient_checkpointing=job.get("gradient_checkpointing", False),
    )
    group = TrainGroup.from_env("cpu", timeout_s=1800)
    started = time.perf_counter()
    learner = learner_module.Learner(settings, group, Path(job["model_dir"]))
    figures["load_s"] = time.perf_counter() - started
    figures["rss_after_load_gb"] = peak_rss_bytes() / GB
    if group.is_leader:
        step_started = time.perf_counter()
        if job["step"]:
            # the first step allocates AdamW's state after its backward; the second is the
            # steady state, whose forward and backward run with that state allocated
            learner.step(one_batch(job["samples"], job["tokens"]), version=0)
            figures["first_step_s"] = time.perf_counter() - step_started
            figures["to_first_step_s"] = time.perf_counter() - started
            learner.step(one_batch(job["samples"], job["tokens"]), version=1)
        figures["rss_after_step_gb"] = peak_rss_bytes() / GB
        # a version as the trainer publishes it: bucket by bucket as it is gathered (the
        # sink counts; the stores and the wire are measured in weight_sync.py); rank 0's
        # high-water mark is reset before each way, so each one's extra memory shows
        with publish_peak(figures, "streamed"):
            counted = CountingSink()
            encoder = WeightEncoder(bucket_bytes=BUCKET_BYTES)
            learner.stream_weights(encoder, 1, torch.bfloat16, counted)
            figures["payload_gb"] = counted.bytes / GB
            del encoder
        # ... into one whole payload first (the path kept for deltas)
        with publish_peak(figures, "whole_payload"):
            whole = WeightEncoder(bucket_bytes=BUCKET_BYTES)
            encoded = learner.encode_weights(whole, 1, torch.bfloat16)
            del encoded, whole
        # ... the whole state dict gathered first, as versions were published before
        with publish_peak(figures, "gather"):
            weights = learner.full_weights(torch.bfloat16)
            figures["gathered_gb"] = (
                sum(t.numel() * t.element_size() for t in weights.values()) / GB
            )
            del weights
        learner.stop()
    else:
        learner.follow()
    figures["peak_rss_gb"] = peak_rss_bytes() / GB
    Path(job["out"], f"rank{group.rank}.json").write_text(json.dumps(figures))
    group.close()


def one_batch(count: int, tokens: int) -> Any:
    """``count`` samples of ``tokens`` tokens (a quarter prompt), ids under 500."""
    from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample

    prompt = tokens // 4
    samples = [
        TrainSample(
            session_id=f"s{index}",
            token_ids=[(index * 37 + t * 11) % 500 for t in range(tokens)],
            loss_mask=[0] * prompt + [1] * (tokens - prompt),
            behaviour_logprobs=[-1.0] * tokens,
            versions=[0] * tokens,
            reward=float(index % 2),
        )
        for index in range(count)
    ]
    return TrainBatch(
        batch_index=0, groups=[SampleGroup(group_id="g", task_id="t", samples=samples)]
    )


def parameter_count(model_dir: Path) -> int:
    import torch

    from sf_trainer.sharded_loading import model_on_meta

    model = model_on_meta(model_dir, torch.float32)
    return sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_configuration(job: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "job.json"
    spec.write_text(json.dumps(job))
    port = free_port()
    processes = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        with (out / f"rank{rank}.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank-job", str(spec)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [process.wait(timeout=timeout_s) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if codes != [0, 0]:
        tail = (out / "rank0.log").read_text()[-2000:]
        raise SystemExit(f"{job['shape']} {job['loading']}: ranks ended with {codes}\n{tail}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="qwen2.5-0.5b")
    parser.add_argument("--loadings", default="whole,sharded")
    parser.add_argument("--master", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--vocab-parallel",
        default="on",
        help="on, off or both (on,off): the embeddings split by vocabulary rows",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--no-step", action="store_true", help="load and gather only (no optimizer state)"
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/seamlessflow/shapes")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/load/sharded_memory.json")
    parser.add_argument("--timeout-s", type=float, default=1800)
    args = parser.parse_args()
    if args.rank_job:
        rank_main(json.loads(Path(args.rank_job).read_text()))
        return
    from seamlessflow.assets.shapes import write_random_model

    results = []
    for shape in args.shapes.split(","):
        model_dir = args.cache / shape
        if not (model_dir / "model.safetensors.index.json").is_file():
            started = time.perf_counter()
            write_random_model(shape, model_dir)
            print(f"{shape}: random bf16 weights written in {time.perf_counter() - started:.0f} s")
        parameters = parameter_count(model_dir)
        bound_gb = BOUND_RATIO * BYTES_PER_PARAMETER * parameters / GB
        configurations = [
            (loading, vocab_parallel)
            for loading in args.loadings.split(",")
            for vocab_parallel in args.vocab_parallel.split(",")
        ]
        for loading, vocab_parallel in configurations:
            job = {
                "shape": shape,
                "loading": loading,
                "master": args.master,
                "vocab_parallel": vocab_parallel,
                "gradient_checkpointing": args.gradient_checkpointing,
                "model_dir": str(model_dir),
                "samples": args.samples,
                "tokens": args.tokens,
                "step": not args.no_step,
                "out": str(
                    args.out.parent / "sharded_memory" / f"{shape}-{loading}-vp-{vocab_parallel}"
                ),
            }
            ranks = run_configuration(job, args.timeout_s)
            result = {**job, "parameters": parameters, "bound_gb": bound_gb, "ranks": ranks}
            results.append(result)
            peak = max(rank["peak_rss_gb"] for rank in ranks)
            leader = ranks[0]
            step = (
                f"peak after two steps {leader['rss_after_step_gb']:.2f} GB, first step "
                f"{leader['first_step_s']:.1f} s (start to step {leader['to_first_step_s']:.1f} s)"
                if job["step"]
                else "no step"
            )
            print(
                f"{shape} ({parameters / 1e9:.2f}B) {loading:>7} {args.master} vocabulary split "
                f"{vocab_parallel}{', checkpointed' if args.gradient_checkpointing else ''}: "
                f"before the model "
                f"{leader['rss_before_model_gb']:.2f} GB, after loading "
                f"{leader['rss_after_load_gb']:.2f} GB in {leader['load_s']:.1f} s; {step}; "
                f"peak of rank 0 / 1 with the gather {ranks[0]['peak_rss_gb']:.2f} / "
                f"{ranks[1]['peak_rss_gb']:.2f} GB ({peak / bound_gb * BOUND_RATIO:.2f}x the "
                f"fp32 model + AdamW; bound {bound_gb:.2f} GB = {BOUND_RATIO}x); a "
                f"{leader['payload_gb']:.2f} GB version, time and rank 0's memory above where "
                f"it stood: streamed {leader['streamed_s']:.1f} s +"
                f"{leader['streamed_extra_gb']:.3f} GB, whole payload "
                f"{leader['whole_payload_s']:.1f} s +{leader['whole_payload_extra_gb']:.3f} GB, "
                f"state dict gathered {leader['gather_s']:.1f} s "
                f"+{leader['gather_extra_gb']:.3f} GB",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
