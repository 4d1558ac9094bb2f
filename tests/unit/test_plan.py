"""``seamlessflow plan``: counts from the meta-device model, and how settings move memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from seamlessflow.assets.loading import causal_lm_from_config
from seamlessflow.assets.shapes import SHAPES, shape_config
from sf_app.plan import PlanSettings, model_sizes, plan_memory

TINY = {
    **SHAPES["qwen2.5-0.5b"],
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}


def test_the_counts_are_the_built_models(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    config = shape_config(str(tmp_path))
    sizes = model_sizes(config)
    model = causal_lm_from_config(config, torch.float32)
    layers = model.model.layers
    assert sizes.parameters == sum(p.numel() for p in model.parameters())  # tied once
    assert sizes.layers == 3
    assert sizes.layer_parameters == sum(p.numel() for p in layers[0].parameters())
    assert sizes.root_parameters == sizes.parameters - 3 * sizes.layer_parameters
    assert sizes.root_parameters == 1000 * 64 + 64  # tied embedding + final norm
    assert sizes.kv_width == 2 * 16


def test_the_published_shapes_have_their_published_sizes() -> None:
    # the model cards' counts: 0.49B, 1.54B, 7.61B, 32.5B (within their rounding)
    expected = {
        "qwen2.5-0.5b": 0.49,
        "qwen2.5-1.5b": 1.54,
        "qwen2.5-7b": 7.62,
        "qwen2.5-32b": 32.76,
    }
    for name, billions in expected.items():
        assert model_sizes(shape_config(name)).parameters / 1e9 == pytest.approx(billions, abs=0.01)


def test_state_shards_checkpointing_and_offload_move_what_they_should() -> None:
    sizes = model_sizes(shape_config("qwen2.5-7b"))
    base = PlanSettings(ranks=1)
    one = plan_memory(sizes, base)
    assert one.state_gb == pytest.approx(16 * sizes.parameters / 1e9)
    eight = plan_memory(sizes, replace(base, ranks=8))
    assert eight.state_gb == pytest.approx(one.state_gb / 8)
    assert eight.gathered_gb > 0 == one.gathered_gb
    bf16 = plan_memory(sizes, replace(base, ranks=8, master_dtype="bfloat16"))
    assert bf16.state_gb == pytest.approx(eight.state_gb / 2)
    checkpointed = plan_memory(sizes, replace(base, ranks=8, gradient_checkpointing=True))
    assert checkpointed.activations_gb < eight.activations_gb / 5
    offloaded = plan_memory(sizes, replace(base, ranks=8, cpu_offload=True))
    assert offloaded.host_gb == pytest.approx(eight.state_gb)
    # offloaded shards keep the embeddings in FSDP2 (the trainer splits them only on the device)
    gathered = plan_memory(sizes, replace(base, ranks=8, vocab_parallel=False))
    assert offloaded.device_gb == pytest.approx(gathered.device_gb - gathered.state_gb)


def test_split_embeddings_leave_the_root_unit_and_a_vocabulary_share_of_logits() -> None:
    sizes = model_sizes(shape_config("qwen2.5-0.5b"))  # tied: 136M of 494M
    assert sizes.embedding_parameters == 151936 * 896
    base = PlanSettings(ranks=2, compute_dtype="float32", micro_batch_tokens=256)
    split = plan_memory(sizes, base)
    whole = plan_memory(sizes, replace(base, vocab_parallel=False))
    assert split.state_gb == whole.state_gb and split.activations_gb == whole.activations_gb
    # FSDP2 gathers the root (embedding + norm) in float32 and its gradient twice over
    root = sizes.root_parameters
    assert whole.gathered_gb - split.gathered_gb == pytest.approx(
        (root + root * 2 - (root - sizes.embedding_parameters) - sizes.layer_parameters * 2)
        * 4
        / 1e9
    )
    # 512 rows (both ranks') x half the vocabulary, against 256 rows x all of it, 3 times
    assert split.logits_gb == pytest.approx(512 * 75968 * 4 / 1e9)
    assert whole.logits_gb == pytest.approx(3 * 256 * 151936 * 4 / 1e9)
    assert plan_memory(sizes, replace(base, ranks=1)).gathered_gb == 0


def test_the_command_prints_a_row_per_rank_count_and_refuses_an_unknown_shape() -> None:
    from sf_app.cli import app

    result = CliRunner().invoke(app, ["plan", "qwen2.5-7b", "--gpus", "2,8"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1 and "GB" in rows[0]
    assert "| 8 " in result.output
    refused = CliRunner().invoke(app, ["plan", "qwen9-1t"])
    assert refused.exit_code == 2
    assert "unknown model shape 'qwen9-1t'" in refused.output
