"""The shapes of models users train, from their published configs, and random-weight copies.

A shape is what memory and speed depend on (sizes, heads, vocabulary, tying), without
the weights. ``seamlessflow plan`` builds each on the meta device to count its bytes;
the benchmarks write a copy with random weights (:func:`write_random_model`) where a
real model would be downloaded, which nothing here does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN2_COMMON: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        **QWEN2_COMMON,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **QWEN2_COMMON,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **QWEN2_COMMON,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen2.5-32b": {
        **QWEN2_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
"""Qwen2.5's published configs (sizes, heads, vocabulary, tying, context)."""


def shape_config(name: str) -> Any:
    """The transformers config of shape ``name`` (one of SHAPES) or of a config.json path."""
    from transformers import AutoConfig

    if name in SHAPES:
        values = dict(SHAPES[name])
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name!r}: one of {', '.join(SHAPES)}, or a config")
    return AutoConfig.from_pretrained(str(path.parent))


def write_random_model(
    name: str, out_dir: Path, *, seed: int = 0, file_bytes: int = 1 << 30
) -> Path:
    """A model of shape ``name`` with random bf16 weights (as checkpoints ship: normal
    with std 0.02, norms at 1) in safetensors files of at most ``file_bytes`` with their
    index, plus a small tokenizer (token ids stay under 512), in ``out_dir``. Tensors
    are made one at a time, so memory peaks at one file, not the model in float32."""
    import torch
    from safetensors.torch import save_file

    from seamlessflow.assets.families import build_tokenizer, family_spec
    from seamlessflow.assets.loading import causal_lm_from_config

    config = shape_config(name)
    with torch.device("meta"):
        model = causal_lm_from_config(config, torch.bfloat16)
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    group_bytes = [0]
    for tensor_name, meta in model.named_parameters():  # a tied matrix once
        size = meta.numel() * 2
        if groups[-1] and group_bytes[-1] + size > file_bytes:
            groups.append([])
            group_bytes.append(0)
        groups[-1].append((tensor_name, meta))
        group_bytes[-1] += size
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        file_name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        values: dict[str, torch.Tensor] = {}
        for tensor_name, shape_of in group:
            if "norm" in tensor_name:
                values[tensor_name] = torch.ones(shape_of.shape, dtype=torch.bfloat16)
            else:
                random = torch.randn(shape_of.shape, generator=generator) * 0.02
                values[tensor_name] = random.bfloat16()
            weight_map[tensor_name] = file_name
        save_file(values, str(out_dir / file_name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(group_bytes)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out_dir)
    build_tokenizer(family_spec("qwen2-tied")).save_pretrained(out_dir)
    return out_dir
