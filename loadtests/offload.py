"""What lending a slot moves: the trainer's offload and reload, and an engine's sleep and
wake, on models users train, beside the copy bound measured in the same run.

Per model (a shape from its published config, ``seamlessflow.assets.shapes``, random
weights made on the device; nothing is downloaded):

- ``trainer``: the model in float32 with AdamW after one optimizer step (its moments
  exist; the gradients are random, no forward is run), offloaded and reloaded as the
  trainer does while its slots are lent (``seamlessflow.residency`` over the parameters
  and the optimizer state, one residency kept from lend to lend as the trainer keeps
  it). Seconds (the median and the first: a first touch of fresh memory costs more),
  bytes moved and GB/s each way, and the device memory before and after every
  transition (CUDA: the allocator's count).
- ``engine``: ``TransformersEngine`` with ``offload_asleep`` (its dtype: bf16 on CUDA,
  float32 on a CPU) put to sleep and woken as a reclaimed and re-lent engine is, after
  one request. The same figures.
- ``bound``: the same bytes copied to a host buffer and back in one piece, its
  allocation counted (pinned on CUDA; what the residency does per storage) and not.

On a CPU the "device" is host memory, so an offload frees nothing there: the figures
say what the mechanism costs, which the GPU run (``gpu_run.py --only offload``)
measures where it frees memory.

    .venv/bin/python loadtests/offload.py [--shapes tiny,qwen2.5-0.5b] [--device cpu] \
        [--repeats 3] [--out runs/load/offload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
"""A Qwen2 of a few hundred thousand parameters: the CPU forms' model (this script's and
the GPU run's)."""


def build_model(shape: str, device: str, dtype: Any) -> Any:
    """A causal LM of ``shape`` (``tiny`` or a name in ``seamlessflow.assets.shapes``)
    with random weights, made on ``device``."""
    import torch
    from transformers import AutoConfig

    from seamlessflow.assets.loading import causal_lm_from_config
    from seamlessflow.assets.shapes import shape_config

    if shape == "tiny":
        config = AutoConfig.for_model("qwen2", **TINY_SHAPE)
    else:
        config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        return causal_lm_from_config(config, dtype)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def transition_row(transitions: list[Any]) -> dict[str, Any]:
    """The median transition of a kind, its figures, and its rate."""
    seconds = statistics.median(t.seconds for t in transitions)
    moved = transitions[0].device_bytes_moved
    return {
        "seconds": seconds,
        "bytes": moved,
        "gb_per_s": moved / seconds / GB if seconds else None,
        "first_seconds": transitions[0].seconds,
        "runs": [t.seconds for t in transitions],
        "first": asdict(transitions[0]),
    }


def trainer_case(shape: str, device: str, repeats: int) -> dict[str, Any]:
    import torch

    from seamlessflow.residency import Residency

    model = build_model(shape, device, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors: list[torch.Tensor] = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    offloads, reloads = [], []
    # as the trainer keeps it from one lend to the next (its host copies on CUDA only)
    residency = Residency(tensors, torch.device(device), keep_host_copies=device == "cuda")
    if residency.nbytes == 0:
        raise RuntimeError(f"nothing of the model is held on {device}")
    for _ in range(repeats):
        offloads.append(residency.offload())
        reloads.append(residency.reload())
    out = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "offload": transition_row(offloads),
        "reload": transition_row(reloads),
    }
    del model, optimizer, tensors, residency
    out["bound"] = copy_bound(device, repeats)
    return out


BOUND_BYTES = 1 << 30
"""The copy bound's buffer: past a few hundred MB a copy's rate no longer depends on its
size, and three buffers of the trainer's state would not fit beside it on a 24 GB host."""


def copy_bound(device: str, repeats: int) -> dict[str, Any]:
    """Seconds per GB to the host and back in one piece: into a buffer allocated for it
    (as an offload allocates its host copies) and into one that exists."""
    import torch

    nbytes = BOUND_BYTES
    pinned = device == "cuda"
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    rows: dict[str, list[float]] = {"to_host_alloc": [], "to_host": [], "back": []}
    for _ in range(repeats):
        started = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        fresh.copy_(source, non_blocking=pinned)
        synchronize(device)
        rows["to_host_alloc"].append(time.perf_counter() - started)
        del fresh
        started = time.perf_counter()
        host.copy_(source, non_blocking=pinned)
        synchronize(device)
        rows["to_host"].append(time.perf_counter() - started)
        started = time.perf_counter()
        source.copy_(host, non_blocking=pinned)
        synchronize(device)
        rows["back"].append(time.perf_counter() - started)
    return {
        f"{key}_s_per_gb": statistics.median(values) * GB / nbytes for key, values in rows.items()
    }


def engine_case(shape: str, device: str, repeats: int) -> dict[str, Any]:
    import torch

    from sf_engine.backends import SamplingParams, TransformersEngine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(shape, device, dtype)
    engine = TransformersEngine(
        model, dtype=dtype, device=device, max_batch_size=4, offload_asleep=True
    )
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def drive() -> list[Any]:
        await engine.start()
        try:
            for index in range(repeats):
                await engine.generate(f"r{index}", [5, 6, 7, 8], params)
                await engine.pause("abort")
                await engine.sleep()
                await engine.wake()
                await engine.resume()
            return list(engine.transitions)
        finally:
            await engine.close()

    transitions = asyncio.run(drive())
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "sleep": transition_row([t for t in transitions if t.name == "offload"]),
        "wake": transition_row([t for t in transitions if t.name == "reload"]),
    }


def measure(shape: str, device: str, repeats: int) -> dict[str, Any]:
    import gc

    import torch

    out = {"trainer": trainer_case(shape, device, repeats)}
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    out["engine"] = engine_case(shape, device, repeats)
    return out


def lines(shape: str, row: dict[str, Any]) -> list[str]:
    trainer, engine, bound = row["trainer"], row["engine"], row["trainer"]["bound"]
    gb = trainer["offload"]["bytes"] / GB

    def per_gb(case: dict[str, Any]) -> str:
        return (
            f"{case['seconds']:.3f} s ({case['seconds'] / (case['bytes'] / GB):.3f} s/GB; "
            f"first {case['first_seconds']:.3f} s)"
        )

    return [
        f"{shape}: trainer {gb:.3f} GB (fp32 weights + AdamW): offload "
        f"{per_gb(trainer['offload'])}, reload {per_gb(trainer['reload'])}; one-piece copy "
        f"to the host {bound['to_host_alloc_s_per_gb']:.3f} s/GB with its allocation "
        f"({bound['to_host_s_per_gb']:.3f} without), back {bound['back_s_per_gb']:.3f}",
        f"{shape}: engine {engine['sleep']['bytes'] / GB:.3f} GB ({engine['dtype']}): sleep "
        f"{per_gb(engine['sleep'])}, wake {per_gb(engine['wake'])}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,qwen2.5-0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "load" / "offload.json")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"device": args.device, "date": time.strftime("%Y-%m-%d")}
    for shape in args.shapes.split(","):
        figures[shape] = measure(shape, args.device, args.repeats)
        print("\n".join(lines(shape, figures[shape])), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
