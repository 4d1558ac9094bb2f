"""What one trained token costs in memory, and the micro-batch that fits the memory found.

A micro-batch's activations, saved for its backward, grow with its tokens: per token and
decoder layer, the layer's input, the q/k/v and attention outputs, the MLP's gate, up,
activation and product (compute dtype; attention through SDPA keeps no [tokens, tokens]
matrix), and the RMSNorms' float32 copies. With gradient checkpointing only each layer's
input is kept, plus one layer's activations being recomputed. ``seamlessflow plan``
reports the same figure.

``SF_TRAINER_MICRO_BATCH_TOKENS=0`` (the default) sizes the micro-batch from that and the
memory free once the model and optimizer are placed (``auto_micro_batch_tokens``): the
fixed 16384 of before needed about 24 GB of activations for SmolLM2-135M in float32, and
a run of long multi-turn episodes (700-token samples) was killed for memory on a 24 GB
machine, its trainer restarted into the same death.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and psutil are imported where memory is read: the plan needs neither
    import torch

AUTO_SHARE = 0.3
"""Of the memory free at the start, what one micro-batch's activations may take by the
estimate. The trainer holds more than the estimate (measured on this CPU, SmolLM2 in
float32 through SDPA: 2.3 MB a token at 350- and 700-token rows against 1.47 estimated,
1.55x); the rest of the memory is for that, the logits, the optimizer's first step, and
other processes of the machine growing. At 0.5 the trainer of a run of 700-token
episodes reached 16.3 GB of 23 and the machine had 1 GB left."""
AUTO_BOUNDS = (256, 16384)
"""The smallest and largest automatic budget, in tokens; a sample longer than the
budget is still trained, alone in its micro-batch."""
AUTO_ROUNDING = 256


@dataclass(frozen=True)
class LayerShape:
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """Key (and value) width: key-value heads x head size."""

    @classmethod
    def of(cls, config: Any) -> LayerShape:
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            kv_width=getattr(text, "num_key_value_heads", heads) * head_dim,
        )


def activation_bytes_per_token(
    shape: LayerShape, compute_bytes: int, gradient_checkpointing: bool
) -> int:
    """Bytes one token's activations hold from its forward to its backward (see the
    module's doc)."""
    per_layer = (
        compute_bytes * (6 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate)
        + 4 * 4 * shape.hidden
    )
    if gradient_checkpointing:
        return shape.layers * compute_bytes * shape.hidden + per_layer
    return shape.layers * per_layer


def free_memory_bytes(device: torch.device, ranks_on_the_host: int) -> int:
    """Memory free to one rank now: the GPU's free memory, or on a CPU the host's
    available memory shared by the ranks that run on it."""
    import psutil
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available) // max(1, ranks_on_the_host)


def auto_micro_batch_tokens(per_token: int, free_bytes: int) -> int:
    """The largest budget (a multiple of ``AUTO_ROUNDING`` within ``AUTO_BOUNDS``) whose
    activations take at most ``AUTO_SHARE`` of ``free_bytes``."""
    low, high = AUTO_BOUNDS
    tokens = int(AUTO_SHARE * free_bytes) // max(1, per_token)
    return max(low, min(high, tokens // AUTO_ROUNDING * AUTO_ROUNDING))
