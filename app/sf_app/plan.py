"""Memory per rank of the trainer before a run: ``seamlessflow plan``.

The model is built on the meta device from its config (a shape of
``seamlessflow.assets.shapes`` or a model directory), so its parameters are counted
exactly, per FSDP unit as ``TrainGroup.shard`` makes them (``fsdp_units``). What each
rank holds, with ``ranks`` ranks:

- **state** (sharded, ``1 / ranks`` each): master weights, their gradients and AdamW's
  two moments, all in the master dtype: 16 bytes a parameter in float32, 8 in bf16.
  With ``cpu_offload`` on GPUs it lives in host memory instead.
- **gathered units**: the root unit (embeddings, final norm, head) stays gathered from
  its forward to its backward (FSDP2 does not reshard the root after forward); decoder
  layers are gathered one at a time plus the one prefetched. Each in the compute
  dtype, and, while it is reduced, its unsharded gradient (compute dtype) and the
  float32 buffer FSDP2 copies it into for the reduce-scatter. The parts' peaks are
  added as if they coincided: an estimate from above. With the embeddings split by
  vocabulary rows (``vocab_parallel``, the trainer's default on several ranks) they are
  never gathered: the root unit is the final norm, and a rank holds its embedding rows
  once more in the compute dtype where that differs from the master dtype.
- **activations** of one micro-batch (``micro_batch_tokens``) saved for backward, per
  token and layer: the layer's input, the q/k/v and attention outputs, the MLP's gate,
  up, activation and product (compute dtype; attention through SDPA keeps no
  [tokens, tokens] matrix), and the RMSNorms' float32 copies. With gradient
  checkpointing only each layer's input is kept, plus one layer's activations being
  recomputed.
- **logits** of one chunk (``logprob_chunk_tokens``) x vocabulary in float32: the
  logits, their log-softmax and its gradient. Split by vocabulary rows, one chunk of
  every rank's rows x this rank's vocabulary rows in float32 (the forward shifts and
  exponentiates it in place, the backward makes it the gradient in place), plus the
  projection's output in the compute dtype where that is not float32.
- **runtime**: what the process holds before the model (interpreter, torch, CUDA
  context): measured, not modelled (``runtime_gb``).

The estimate is checked against two CPU ranks' peak resident memory in
``loadtests/sharded_memory.py`` (docs/benchmarks.md, "Models users train").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sf_trainer.memory import LayerShape, activation_bytes_per_token

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelSizes:
    """What memory depends on, counted from the model built on the meta device."""

    parameters: int
    root_parameters: int
    """Outside every decoder layer: embeddings, final norm, head (a tied head once)."""
    layer_parameters: int
    """The largest decoder layer."""
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """Key (and value) width: key-value heads x head size."""
    vocab: int
    embedding_parameters: int = 0
    """The input and output embeddings (a tied matrix once): what ``vocab_parallel``
    keeps out of the root unit."""


def model_sizes(config: Any) -> ModelSizes:
    import torch

    from seamlessflow.assets.loading import causal_lm_from_config
    from sf_trainer.distributed import fsdp_units

    with torch.device("meta"):
        model = causal_lm_from_config(config, torch.float32)
    units = fsdp_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    parameters = list(model.parameters())  # a tied matrix once
    embeddings: dict[int, int] = {}  # a tied matrix once
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            embeddings[id(weight)] = weight.numel()
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelSizes(
        parameters=sum(p.numel() for p in parameters),
        root_parameters=sum(p.numel() for p in parameters if id(p) not in in_units),
        layer_parameters=max(
            (sum(p.numel() for p in unit.parameters()) for unit in units), default=0
        ),
        layers=len(units),
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        kv_width=getattr(text, "num_key_value_heads", heads) * head_dim,
        vocab=text.vocab_size,
        embedding_parameters=sum(embeddings.values()),
    )


@dataclass(frozen=True)
class PlanSettings:
    """The trainer settings memory depends on (``SF_TRAINER_*`` of the same names)."""

    ranks: int = 1
    master_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    """bf16 with ``precision=bf16-mixed`` (the default on GPUs), float32 with fp32."""
    gradient_checkpointing: bool = False
    cpu_offload: bool = False
    micro_batch_tokens: int = 16384
    logprob_chunk_tokens: int = 1024
    vocab_parallel: bool = True
    """The embeddings split by vocabulary rows (``SF_TRAINER_VOCAB_PARALLEL``): with
    several ranks, chunked logprobs and no cpu offload, as the trainer applies it."""
    runtime_gb: float = 1.0
    """Held before the model: a CUDA context and torch on a GPU (about 1 GB); the
    interpreter, torch and transformers on a CPU (0.4-0.5 GB, measured)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Peak bytes per rank by part (GB); ``device_gb`` on the rank's device (with
    ``cpu_offload`` the state is in ``host_gb`` instead)."""

    state_gb: float
    gathered_gb: float
    activations_gb: float
    logits_gb: float
    runtime_gb: float
    device_gb: float
    host_gb: float


def plan_memory(sizes: ModelSizes, settings: PlanSettings) -> MemoryPlan:
    master = DTYPE_BYTES[settings.master_dtype]
    compute = DTYPE_BYTES[settings.compute_dtype]
    if settings.master_dtype == "bfloat16" and settings.ranks == 1:
        compute = 2  # one process computes bf16 masters in bf16; several gather them
        # into the policy's dtype (float32 with precision fp32)
    state = sizes.parameters * 4 * master / settings.ranks
    split = (
        settings.vocab_parallel
        and settings.ranks > 1
        and settings.logprob_chunk_tokens > 0
        and not settings.cpu_offload
    )
    gathered = 0.0
    if settings.ranks > 1:
        root = sizes.root_parameters - (sizes.embedding_parameters if split else 0)
        gathered_params = (root + 2 * sizes.layer_parameters) * compute
        # a unit's full gradient in the compute dtype, and the float32 buffer FSDP2
        # copies it into to reduce-scatter it (a copy in float32 too)
        largest_unit = max(root, sizes.layer_parameters)
        gathered = gathered_params + largest_unit * (compute + 4)
        if split and compute != master:
            gathered += sizes.embedding_parameters / settings.ranks * compute
    tokens = settings.micro_batch_tokens
    shape = LayerShape(sizes.layers, sizes.hidden, sizes.intermediate, sizes.kv_width)
    activations = tokens * activation_bytes_per_token(
        shape, compute, settings.gradient_checkpointing
    )
    if split:
        chunk = min(settings.logprob_chunk_tokens, tokens * settings.ranks)
        own_vocab = -(-sizes.vocab // settings.ranks)
        logits = chunk * own_vocab * (4 + (compute if compute != 4 else 0))
    else:
        chunk = min(settings.logprob_chunk_tokens or tokens, tokens)
        logits = 3 * chunk * sizes.vocab * 4
    offloaded = settings.cpu_offload and settings.ranks > 1
    device = (0 if offloaded else state) + gathered + activations + logits
    device_gb = device / GB + settings.runtime_gb
    host_gb = state / GB if offloaded else 0.0
    return MemoryPlan(
        state_gb=state / GB,
        gathered_gb=gathered / GB,
        activations_gb=activations / GB,
        logits_gb=logits / GB,
        runtime_gb=settings.runtime_gb,
        device_gb=device_gb,
        host_gb=host_gb,
    )


def plan_table(name: str, sizes: ModelSizes, settings: PlanSettings, ranks: list[int]) -> str:
    """A markdown table: one row per rank count."""
    lines = [
        f"{name}: {sizes.parameters / 1e9:.2f}B parameters ({sizes.layers} layers; root unit "
        f"{sizes.root_parameters / 1e6:.0f}M, largest layer {sizes.layer_parameters / 1e6:.0f}M);"
        f" master {settings.master_dtype}, compute {settings.compute_dtype}, micro-batch "
        f"{settings.micro_batch_tokens} tokens, gradient checkpointing "
        f"{'on' if settings.gradient_checkpointing else 'off'}, cpu offload "
        f"{'on' if settings.cpu_offload else 'off'}, embeddings split by vocabulary "
        f"{'on' if settings.vocab_parallel else 'off'}",
        "",
        "| ranks | state | gathered units | activations | logits | runtime | per rank | host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for count in ranks:
        plan = plan_memory(sizes, PlanSettings(**{**asdict(settings), "ranks": count}))
        lines.append(
            f"| {count} | {plan.state_gb:.1f} | {plan.gathered_gb:.1f} | {plan.activations_gb:.1f}"
            f" | {plan.logits_gb:.1f} | {plan.runtime_gb:.1f} | **{plan.device_gb:.1f} GB** |"
            f" {plan.host_gb:.1f} |"
        )
    return "\n".join(lines)
