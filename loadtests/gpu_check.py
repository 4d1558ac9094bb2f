"""GPU acceptance: what a user with one CUDA GPU runs to check the GPU paths (``just gpu-check``).

Checks (each in a process of its own, so a crash or a CUDA error fails that check only):

- ``reload/<family>``: vLLM on CUDA serves exactly the weights it was given. A tiny
  random model of each family (``seamlessflow.assets.families``; tied embeddings for
  all but ``qwen2``) is started in bf16, new weights are loaded as the trainer sends
  them (``named_parameters()``: a tied model's output matrix is its embedding, sent
  once, in bf16, through the weight codec), then greedy completions' logprobs are
  compared with a float64 forward pass over the same (bf16-rounded) weights. See
  "Bounds" below. ``reload/qwen2.5-0.5b`` and ``reload/qwen2.5-1.5b`` do the same at the
  sizes users train (random weights at those shapes), only when ``--only`` names them.
- ``sleep-wake``: a vLLM engine in sleep mode gives device memory back while asleep and,
  awake, serves the weights it held before (the reloaded ones, not the checkpoint's):
  the same greedy tokens, within the reload bound.
- ``cupy-nccl``: the CuPy NCCL layer of the push transport on one GPU: a communicator,
  an in-place broadcast, the bucketed send path (``seamlessflow.weights.collective``).
- ``cupy-nccl-2gpu``: a full and a delta payload from GPU 0 to GPU 1 over NCCL, received
  bit for bit (skipped with fewer than two GPUs).
- ``fsdp2-bf16-step``: FSDP2 on one rank (NCCL) sharded and run by the trainer's own
  code (``TrainGroup.shard`` with ``SF_PRECISION=bf16-mixed``'s policy: bf16
  compute, fp32 master weights and gradient reduction; the trainer's chunked logprobs):
  three optimizer steps on one batch, finite and falling loss, fp32 master weights, and
  a first gradient in the direction of an fp32 unsharded model's (cosine >=
  ``MIN_GRADIENT_COSINE``).

Bounds. The reload gap (largest |engine - reference| logprob over the generated
tokens) passes below ``bound = max(8 x reference_gap, 4 x eps(dtype) x max|logprob|)``,
where ``reference_gap`` is what computing in the engine's dtype costs by itself (HF's
forward in that dtype against float64, same weights, same tokens) and ``eps`` is the
dtype's machine epsilon. A check must also be able to fail: the gap a stale output
matrix would give (the new weights with the old head) must exceed 4 x bound, else the
check reports that the weights changed too little to tell.

Without CUDA every check is ``skipped: no CUDA`` and the exit code is 0; a failed check
makes it 1. ``--device cpu`` runs the checks that have a CPU form (reload on the HF
engine in fp32, FSDP2 on gloo in bf16) with the same comparisons: CI runs them.

    .venv/bin/python loadtests/gpu_check.py [--device auto|cpu] [--only NAME,...] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]

MIN_GRADIENT_COSINE = 0.99
"""bf16 keeps ~3 significant digits, so a gradient computed in bf16 points within about
a percent of the fp32 one; a wrong cast, a lost shard or a gradient divided twice does
not keep the direction."""
DISCRIMINATION = 4.0
"""A stale head's gap must exceed this many bounds for a pass to mean anything."""
CHECK_TIMEOUT_S = 900.0
RELOAD_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
"""Shapes users train (``seamlessflow.assets.shapes``) the reload check also runs at,
when named. Its float64 reference holds the weights twice in float64 on the host (8 GB
at 0.5B, 25 GB at 1.5B), which is what bounds the size."""
PROMPTS = ([5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37])
COMPLETION_TOKENS = 16


class Skipped(Exception):
    """The check cannot run here (the reason is reported)."""


class CheckFailed(Exception):
    """The check ran and what it compares is outside its bound."""


@dataclass
class Context:
    device: str
    """``cuda`` or ``cpu`` (the CPU forms of the checks)."""
    engine: str
    """``vllm`` or ``hf``: the engine the reload checks drive."""
    workdir: Path
    gpus: int = 0

    def model(self, family: str) -> Path:
        """A tiny random model of ``family``, or a model of a shape users train (``SHAPES``:
        random bf16 weights at that size), built once per workdir."""
        from seamlessflow.assets.families import build_family_model
        from seamlessflow.assets.shapes import write_random_model

        out = self.workdir / "models" / family
        if not (out / "config.json").exists():
            if family in RELOAD_SHAPES:
                write_random_model(family, out)
            else:
                build_family_model(family, out, seed=0)
        return out


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], dict[str, Any]]
    """Returns the figures; raises CheckFailed or Skipped."""
    cpu_form: bool = False
    """Runs with ``--device cpu`` too (CI); else skipped there."""
    min_gpus: int = 1
    named_only: bool = False
    """Runs only when ``--only`` names it (a model of a size users train: minutes)."""


@dataclass
class Outcome:
    name: str
    status: Status
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------- comparisons


def logprob_bound(reference_gap: float, max_abs_logprob: float, eps: float) -> float:
    """What a correct engine may differ from the float64 reference by (module docstring)."""
    return max(8.0 * reference_gap, 4.0 * eps * max_abs_logprob)


def reload_verdict(figures: dict[str, float]) -> tuple[bool, str]:
    """Pass/fail of a reload comparison from its figures (``engine_gap``, ``bound``,
    ``stale_head_gap``), and why."""
    gap, bound, stale = figures["engine_gap"], figures["bound"], figures["stale_head_gap"]
    if stale <= DISCRIMINATION * bound:
        return False, (
            f"inconclusive: a stale head would differ by {stale:.3g}, not more than "
            f"{DISCRIMINATION:g} x the bound {bound:.3g}"
        )
    if gap > bound:
        return False, (
            f"engine logprobs differ from a float64 forward pass at the loaded weights by "
            f"{gap:.3g} nats (bound {bound:.3g}; a stale head would give {stale:.3g})"
        )
    return True, f"gap {gap:.3g} <= bound {bound:.3g} (a stale head: {stale:.3g})"


# ---------------------------------------------------------------- weights and references


def new_weights(model_dir: Path, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(old, new) ``named_parameters()`` in fp32: ``new`` adds noise of 4x each tensor's
    spread (so the logits, and a stale head's error, are nats wide)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    old = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in old.items():
        spread = max(float(tensor.std()) if tensor.numel() > 1 else 0.0, 1e-2)
        new[name] = tensor + 4.0 * spread * torch.randn(tensor.shape, generator=generator)
    return old, new


def reference_logprobs(
    model_dir: Path,
    weights: dict[str, Any],
    sequences: list[tuple[list[int], list[int]]],
    *,
    dtype: Any,
    device: str = "cpu",
    head: Any = None,
) -> list[list[float]]:
    """Per sequence, log_softmax(logits)[token] of each completion token from a plain
    forward pass over prompt + completion with ``weights`` (``head``: another output
    matrix, e.g. the old one, as a stale engine would hold)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(weights[name].to(dtype))
        if head is not None:
            model.get_output_embeddings().weight = torch.nn.Parameter(head.to(dtype).to(device))
        model.eval()
        out = []
        for prompt, completion in sequences:
            ids = torch.tensor([prompt + completion], device=device)
            logits = model(input_ids=ids).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append([float(logprobs[p, t]) for p, t in zip(positions, completion, strict=True)])
    return out


class _Collected:
    """A ``BucketSink`` that keeps every bucket: the payload a store would hold."""

    def __init__(self) -> None:
        self.payload = bytearray()

    def begin(self, payload_bytes: int, bucket_bytes: int) -> None:
        self.payload = bytearray()

    def put(self, index: int, bucket: memoryview) -> None:
        self.payload += bucket

    def end(self) -> None:
        pass


def through_codec(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after the trip every weight payload makes: encoded bucket by bucket as
    the trainer streams a version (``WeightEncoder.encode_buckets``), bytes, then
    ``WeightMirror``, as pulled from the store or pushed over the group."""
    from seamlessflow.weights import WeightEncoder, WeightMirror
    from seamlessflow.weights.layout import plan_layout

    collected = _Collected()
    encoder = WeightEncoder(bucket_bytes=1 << 20)
    manifest = encoder.encode_buckets(1, plan_layout(state), iter(state.items()), collected)
    mirror = WeightMirror()
    mirror.apply(manifest, memoryview(collected.payload))
    return {name: tensor.clone() for name, tensor in mirror.tensors().items()}


def output_matrix_name(model_dir: Path, weights: dict[str, Any]) -> str:
    """The parameter that is the output matrix (the embedding of a tied model)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings") or "lm_head.weight" not in weights:
        return next(n for n in weights if n.endswith("embed_tokens.weight"))
    return "lm_head.weight"


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def make_engine(ctx: Context, model_dir: Path, *, sleep_mode: bool = False) -> Any:
    """The engine under test and its weight dtype: vLLM in bf16 on CUDA, else the HF
    engine (``--engine hf``) or vLLM on the CPU, in fp32."""
    import torch

    if ctx.engine == "vllm":
        try:
            from sf_engine.backends.vllm_engine import VllmEngine
        except ImportError as exc:
            raise CheckFailed(f"vLLM does not import ({exc}): install the gpu extra") from exc
        dtype = "bfloat16" if ctx.device == "cuda" else "float32"
        kwargs: dict[str, Any] = {"enable_sleep_mode": True} if sleep_mode else {}
        if ctx.device == "cuda":
            kwargs["gpu_memory_utilization"] = 0.3
            # The tiny models need little KV cache, and a share of the card is millions
            # of blocks for 2 layers of 2 KV heads (43 GB of an H200: 5.2M blocks of 16
            # tokens, against SmolLM2's 117k). On the H200 (2026-12-04) their engine
            # cores failed to start while SmolLM2's did not; the cause was not kept, and
            # this bound is the suspected difference. 4096 blocks hold 65k tokens.
            kwargs["num_gpu_blocks_override"] = 4096
        engine = VllmEngine(model_dir, dtype=dtype, max_context=256, engine_kwargs=kwargs)
        return engine, getattr(torch, dtype)
    from sf_engine.backends import TransformersEngine

    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    return TransformersEngine(model_dir, dtype=dtype, device=ctx.device, max_context=256), dtype


async def generate_greedy(engine: Any, tag: str) -> list[tuple[list[int], list[int], list[float]]]:
    from sf_engine.backends import SamplingParams

    params = SamplingParams(max_tokens=COMPLETION_TOKENS, temperature=0.0)
    results = await asyncio.gather(
        *(engine.generate(f"{tag}-{i}", list(p), params) for i, p in enumerate(PROMPTS))
    )
    return [(list(p), r.token_ids, r.logprobs) for p, r in zip(PROMPTS, results, strict=True)]


def compare_to_reference(
    ctx: Context,
    model_dir: Path,
    old: dict[str, Any],
    sent: dict[str, Any],
    engine_dtype: Any,
    generated: list[tuple[list[int], list[int], list[float]]],
) -> dict[str, float]:
    """The reload figures: the engine's gap to float64 at the weights it was sent, the
    bound, and the gap a stale output matrix would give."""
    import torch

    sequences = [(p, c) for p, c, _ in generated]
    engine_logprobs = [lp for _, _, lp in generated]
    exact = reference_logprobs(model_dir, sent, sequences, dtype=torch.float64)
    in_dtype = reference_logprobs(model_dir, sent, sequences, dtype=engine_dtype, device=ctx.device)
    head = old[output_matrix_name(model_dir, old)]
    stale = reference_logprobs(model_dir, sent, sequences, dtype=torch.float64, head=head)
    reference_gap = max_gap(in_dtype, exact)
    largest = max(abs(x) for row in exact for x in row)
    return {
        "engine_gap": max_gap(engine_logprobs, exact),
        "reference_gap": reference_gap,
        "bound": logprob_bound(reference_gap, largest, torch.finfo(engine_dtype).eps),
        "stale_head_gap": max_gap(stale, exact),
        "tokens_compared": sum(len(c) for _, c in sequences),
    }


# ---------------------------------------------------------------- the checks


async def reload_and_generate(
    engine: Any, sent: dict[str, Any]
) -> list[tuple[list[int], list[int], list[float]]]:
    await engine.start()
    try:
        await engine.load_weights(sent, version=1)
        return await generate_greedy(engine, "reload")
    finally:
        await engine.close()


def check_reload(family: str) -> Callable[[Context], dict[str, Any]]:
    def run(ctx: Context) -> dict[str, Any]:
        import torch

        model_dir = ctx.model(family)
        engine, dtype = make_engine(ctx, model_dir)
        old, new = new_weights(model_dir, seed=1)
        # the trainer's form: named_parameters (a tied head once), in the engine's dtype,
        # through the weight codec
        sent = through_codec({name: tensor.to(dtype) for name, tensor in new.items()})
        head_name = output_matrix_name(model_dir, old)
        old = {head_name: old[head_name]}  # all a stale engine's reference needs
        del new  # at the sizes users train, each copy of the weights is gigabytes

        generated = asyncio.run(reload_and_generate(engine, sent))
        del engine
        sent64 = {name: tensor.to(torch.float64) for name, tensor in sent.items()}
        del sent
        figures = compare_to_reference(ctx, model_dir, old, sent64, dtype, generated)
        ok, why = reload_verdict(figures)
        if not ok:
            raise CheckFailed(why)
        return {**figures, "why": why}

    return run


def check_sleep_wake(ctx: Context) -> dict[str, Any]:
    import torch

    if ctx.engine != "vllm":
        raise Skipped("sleep mode is vLLM's")
    model_dir = ctx.model("qwen2-tied")
    engine, dtype = make_engine(ctx, model_dir, sleep_mode=True)
    old, new = new_weights(model_dir, seed=2)
    sent = through_codec({name: tensor.to(dtype) for name, tensor in new.items()})

    async def drive() -> tuple[Any, Any, int, int]:
        await engine.start()
        try:
            await engine.load_weights(sent, version=1)
            before = await generate_greedy(engine, "awake")
            await engine.pause("abort")
            free_awake = torch.cuda.mem_get_info()[0]
            await engine.sleep()
            free_asleep = torch.cuda.mem_get_info()[0]
            await engine.wake()
            await engine.resume()
            after = await generate_greedy(engine, "woken")
            return before, after, free_awake, free_asleep
        finally:
            await engine.close()

    before, after, free_awake, free_asleep = asyncio.run(drive())
    sent64 = {name: tensor.to(torch.float64) for name, tensor in sent.items()}
    figures: dict[str, Any] = compare_to_reference(ctx, model_dir, old, sent64, dtype, after)
    figures["freed_mib"] = (free_asleep - free_awake) / 2**20
    problems = []
    if free_asleep <= free_awake:
        problems.append(f"asleep, free device memory did not grow ({figures['freed_mib']:.0f} MiB)")
    if [c for _, c, _ in after] != [c for _, c, _ in before]:
        problems.append("awake again, the greedy tokens differ from before sleep")
    ok, why = reload_verdict(figures)
    if not ok:
        problems.append(f"after wake: {why}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return {**figures, "why": f"freed {figures['freed_mib']:.0f} MiB asleep; awake: {why}"}


def check_cupy_nccl(ctx: Context) -> dict[str, Any]:
    import torch

    from seamlessflow.weights import WeightEncoder, collective

    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        raise CheckFailed(f"CuPy does not import ({exc}): install the gpu extra") from exc
    torch.cuda.set_device(0)
    group = collective.CupyNcclCollective(1, 0, collective.CupyNcclCollective.new_unique_id())
    tensor = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    expected = tensor.clone()
    group.broadcast(tensor, 0)
    if not torch.equal(tensor, expected):
        raise CheckFailed("an in-place broadcast on one rank changed the tensor")
    state = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).bfloat16()}
    encoded = WeightEncoder(bucket_bytes=1 << 16, deltas=False).encode(1, state)
    started = time.perf_counter()
    collective.send(group, encoded)
    collective.send_stop(group)
    buckets = -(-len(encoded.payload) // (1 << 16))
    return {
        "payload_bytes": len(encoded.payload),
        "buckets": buckets,
        "send_seconds": time.perf_counter() - started,
        "why": f"one rank: broadcast in place, {len(encoded.payload)} bytes in {buckets} buckets",
    }


def _two_gpu_rank(rank: int, unique_id: tuple[int, ...], out: str) -> None:
    import torch

    from seamlessflow.weights import WeightEncoder, WeightMirror, collective

    def state_at(version: int) -> dict[str, torch.Tensor]:
        weights = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
        if version == 2:
            weights.view(-1)[:100] += 1.0
        return {"w": weights}

    torch.cuda.set_device(rank)
    group = collective.CupyNcclCollective(2, rank, unique_id)
    if rank == 0:
        encoder = WeightEncoder(bucket_bytes=1 << 20, deltas=True)
        for version in (1, 2):
            collective.send(group, encoder.encode(version, state_at(version)))
        collective.send_stop(group)
        return
    mirror = WeightMirror()
    while (received := collective.receive(group)) is not None:
        mirror.apply(received.manifest, received.payload, received.bucket_digests)
    exact = torch.equal(mirror.tensors()["w"], state_at(2)["w"])
    Path(out).write_text(json.dumps({"version": mirror.version, "exact": exact}))


def check_cupy_nccl_two_gpus(ctx: Context) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from seamlessflow.weights import collective

    try:
        unique_id = collective.CupyNcclCollective.new_unique_id()
    except ImportError as exc:
        raise CheckFailed(f"CuPy does not import ({exc}): install the gpu extra") from exc
    out = ctx.workdir / "two_gpus.json"
    mp.spawn(_two_gpu_rank, args=(unique_id, str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    if result != {"version": 2, "exact": True}:
        raise CheckFailed(f"GPU 1 holds {result}, not version 2 bit for bit")
    return {**result, "why": "a full and a delta payload, version 2 bit for bit on GPU 1"}


def check_fsdp2_bf16_step(ctx: Context) -> dict[str, Any]:
    """The trainer's own code path: ``TrainGroup.shard(model, bf16_mixed=True)`` (what
    ``SF_PRECISION=bf16-mixed`` shards with), ``forward_precision`` and the
    trainer's logprobs (chunked from the final hidden states at its default
    ``SF_TRAINER_LOGPROB_CHUNK_TOKENS``); the loss is the targets' mean negative logprob."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from sf_trainer.distributed import TrainGroup, forward_precision
    from sf_trainer.logprobs import target_logprobs
    from sf_trainer.settings import TrainerSettings

    model_dir = ctx.model("qwen2-tied")
    device = torch.device("cuda", 0) if ctx.device == "cuda" else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = torch.randint(0, vocab, (4, 32), generator=generator).to(device)
    attention = torch.ones_like(batch)
    settings = TrainerSettings(precision="bf16-mixed")
    # several chunks per batch, so the chunked head is what the check exercises
    chunk = min(settings.logprob_chunk_tokens, 40)

    bf16_mixed = settings.precision == "bf16-mixed"

    def loss_of(model: torch.nn.Module, group: TrainGroup, chunk_tokens: int, bf16: bool) -> Any:
        logprobs = target_logprobs(
            model, batch, attention, batch[:, 1:], 1.0, chunk_tokens,
            lambda: forward_precision(bf16, group),
        )  # fmt: skip
        return -logprobs.mean()

    # the direction to compare with: float32, unsharded, whole logits
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    loss_of(reference, TrainGroup(device=device), 0, False).backward()
    reference_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )
    try:
        group = TrainGroup(device=device, mesh=init_device_mesh(device.type, (1,)))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = group.shard(model, bf16_mixed=bf16_mixed)
        compute_dtypes: set[str] = set()
        first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        first_linear.register_forward_hook(
            lambda module, inputs, output: compute_dtypes.add(str(module.weight.dtype))
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        cosine = float("nan")
        for step in range(3):
            loss = loss_of(model, group, chunk, bf16_mixed)
            loss.backward()
            if step == 0:
                grad = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
                cosine = float(torch.nn.functional.cosine_similarity(grad, reference_grad, dim=0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        master_dtypes = sorted({str(p.to_local().dtype) for p in model.parameters()})
    finally:
        dist.destroy_process_group()
    figures = {
        "losses": losses,
        "gradient_cosine": cosine,
        "master_dtypes": master_dtypes,
        "compute_dtypes": sorted(compute_dtypes),
    }
    problems = []
    if not all(torch.isfinite(torch.tensor(losses))):
        problems.append(f"losses not finite: {losses}")
    elif losses[-1] >= losses[0]:
        problems.append(f"three steps on one batch did not lower the loss: {losses}")
    if not cosine >= MIN_GRADIENT_COSINE:
        problems.append(f"gradient cosine to fp32 {cosine:.4f} < {MIN_GRADIENT_COSINE}")
    if figures["compute_dtypes"] != ["torch.bfloat16"]:
        problems.append(f"the layers computed in {figures['compute_dtypes']}, not bf16")
    if master_dtypes != ["torch.float32"]:
        problems.append(f"master weights are {master_dtypes}, not fp32")
    if problems:
        raise CheckFailed("; ".join(problems))
    why = f"losses {losses[0]:.3f} -> {losses[-1]:.3f}, gradient cosine to fp32 {cosine:.4f}"
    return {**figures, "why": f"{why}, bf16 compute, fp32 master weights"}


def registry() -> dict[str, Check]:
    from seamlessflow.assets.families import FAMILIES

    checks = [Check(f"reload/{f}", check_reload(f), cpu_form=True) for f in FAMILIES]
    checks += [
        Check(f"reload/{shape}", check_reload(shape), cpu_form=True, named_only=True)
        for shape in RELOAD_SHAPES
    ]
    checks += [
        Check("sleep-wake", check_sleep_wake),
        Check("cupy-nccl", check_cupy_nccl),
        Check("cupy-nccl-2gpu", check_cupy_nccl_two_gpus, min_gpus=2),
        Check("fsdp2-bf16-step", check_fsdp2_bf16_step, cpu_form=True),
    ]
    return {check.name: check for check in checks}


# ---------------------------------------------------------------- running and reporting


def run_check(check: Check, ctx: Context) -> Outcome:
    """Run one check here, in this process."""
    if ctx.device == "cpu" and not check.cpu_form:
        return Outcome(check.name, "skip", "needs CUDA (no CPU form)")
    if ctx.device == "cuda" and ctx.gpus < check.min_gpus:
        return Outcome(check.name, "skip", f"needs {check.min_gpus} GPUs, found {ctx.gpus}")
    started = time.perf_counter()
    try:
        figures = check.run(ctx)
    except Skipped as exc:
        return Outcome(check.name, "skip", str(exc), seconds=time.perf_counter() - started)
    except CheckFailed as exc:
        return Outcome(check.name, "fail", str(exc), seconds=time.perf_counter() - started)
    except Exception as exc:  # a crash is a failure of this check, reported with its cause
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
        traceback.print_exc()
        return Outcome(check.name, "fail", detail, seconds=time.perf_counter() - started)
    why = str(figures.pop("why", "")) if isinstance(figures.get("why"), str) else ""
    return Outcome(check.name, "pass", why, figures, time.perf_counter() - started)


def run_isolated(name: str, ctx: Context) -> Outcome:
    """Run one check in a child process (a crash, a hang or a CUDA fault stays there)."""
    # the child chooses CUDA itself (``auto``); ``cpu`` asks for the CPU forms
    device = "cpu" if ctx.device == "cpu" else "auto"
    command = [sys.executable, __file__, "--run-one", name, "--device", device]
    command += ["--engine", ctx.engine, "--workdir", str(ctx.workdir)]
    started = time.perf_counter()
    # the child's stderr (and its engine's: vLLM's engine core reports the root cause of
    # a failed start there) is kept in a file per check, and a failure names its cause
    log_path = ctx.workdir / "logs" / f"{name.replace('/', '-')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log_path.open("w") as log_file:
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=log_file, text=True,
                timeout=CHECK_TIMEOUT_S, check=False,
            )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Outcome(
            name, "fail", f"no result within {CHECK_TIMEOUT_S:.0f} s", seconds=CHECK_TIMEOUT_S
        )
    stderr = log_path.read_text(errors="replace")
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        outcome = Outcome(**json.loads(lines[-1]))
    else:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        outcome = Outcome(
            name,
            "fail",
            f"the check's process exited with {done.returncode}: {last}",
            seconds=time.perf_counter() - started,
        )
    cause = first_error(stderr)
    if outcome.status == "fail" and cause and cause not in outcome.detail:
        outcome = replace(outcome, detail=f"{outcome.detail} (first error: {cause})")
    return outcome


ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception)\b.*$")


def first_error(output: str) -> str | None:
    """The first line of ``output`` that states an exception (``SomeError: why``): with
    several processes, the root cause comes first, the wrappers that re-raise it after."""
    for line in output.splitlines():
        # a logger's prefix (vLLM's "(EngineCore pid=...) ERROR ... ") is not the cause
        text = line.rsplit("] ", 1)[-1].strip()
        if ERROR_LINE.match(text) and ":" in text:
            return text[:300]
    return None


def exit_code(outcomes: list[Outcome]) -> int:
    """1 if any check failed, else 0 (skipped checks do not fail the run)."""
    return 1 if any(o.status == "fail" for o in outcomes) else 0


def report(outcomes: list[Outcome]) -> str:
    width = max((len(o.name) for o in outcomes), default=0)
    lines = [
        f"{o.status.upper():4}  {o.name:{width}}  "
        + (f"skipped: {o.detail}" if o.status == "skip" else o.detail)
        + (f"  ({o.seconds:.0f} s)" if o.status != "skip" else "")
        for o in outcomes
    ]
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


def main(argv: list[str] | None = None, checks: dict[str, Check] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto: CUDA if there is one, else every check is skipped; cpu: the CPU forms",
    )
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--out", type=Path, default=None, help="also write the outcomes as JSON")
    parser.add_argument("--in-process", action="store_true", help="no child process per check")
    parser.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checks = checks if checks is not None else registry()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or [
        name for name, check in checks.items() if not check.named_only
    ]
    unknown = [n for n in names if n not in checks]
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {', '.join(checks)}")

    import torch

    cuda = torch.cuda.is_available() and args.device == "auto"
    device = "cuda" if cuda else "cpu"
    engine = args.engine if args.engine != "auto" else ("vllm" if cuda else "hf")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sf-gpu-check-"))
    ctx = Context(device, engine, workdir, torch.cuda.device_count() if cuda else 0)
    if args.run_one:
        outcome = run_check(checks[args.run_one], ctx)
        print(json.dumps(asdict(outcome)), flush=True)
        return 0
    if args.device == "auto" and not cuda:
        outcomes = [Outcome(name, "skip", "no CUDA") for name in names]
        print(report(outcomes))
    else:
        print(f"device {device}, engine {engine}, work directory {workdir}", flush=True)
        outcomes = []
        for name in names:
            outcome = run_check(checks[name], ctx) if args.in_process else run_isolated(name, ctx)
            outcomes.append(outcome)
            print(report([outcome]).splitlines()[0], flush=True)  # as each one ends
        print(report(outcomes).splitlines()[-1])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    return exit_code(outcomes)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
