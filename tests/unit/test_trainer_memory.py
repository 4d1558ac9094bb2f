"""The automatic micro-batch budget (``sf_trainer.memory``): the activations one token
holds, and the budget that fits the memory found."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoConfig

from sf_trainer.memory import (
    AUTO_BOUNDS,
    AUTO_ROUNDING,
    AUTO_SHARE,
    LayerShape,
    activation_bytes_per_token,
    auto_micro_batch_tokens,
)

SMOLLM2 = LayerShape(layers=30, hidden=576, intermediate=1536, kv_width=192)


def test_smollm2_in_float32_holds_about_1_5_mb_a_token() -> None:
    per_token = activation_bytes_per_token(SMOLLM2, 4, gradient_checkpointing=False)
    assert per_token == 30 * (4 * (6 * 576 + 2 * 192 + 4 * 1536) + 16 * 576)
    # the old fixed 16384-token micro-batch: about 24 GB of activations
    assert 23e9 < 16384 * per_token < 25e9
    checkpointed = activation_bytes_per_token(SMOLLM2, 4, gradient_checkpointing=True)
    assert checkpointed < per_token / 10
    assert activation_bytes_per_token(SMOLLM2, 2, False) < per_token


def test_the_shape_is_read_from_a_config() -> None:
    config = AutoConfig.for_model(
        "llama", num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3,
    )  # fmt: skip
    assert LayerShape.of(config) == SMOLLM2


@pytest.mark.parametrize("free_gb", [0.1, 1.0, 8.0, 18.0, 64.0, 1000.0])
def test_the_budget_takes_at_most_its_share_of_the_memory_free(free_gb: float) -> None:
    per_token = activation_bytes_per_token(SMOLLM2, 4, False)
    tokens = auto_micro_batch_tokens(per_token, int(free_gb * 1e9))
    low, high = AUTO_BOUNDS
    assert low <= tokens <= high and tokens % AUTO_ROUNDING == 0
    if low < tokens < high:
        assert tokens * per_token <= AUTO_SHARE * free_gb * 1e9
        assert (tokens + AUTO_ROUNDING) * per_token > AUTO_SHARE * free_gb * 1e9
    # 24 GB machine, ~18 GB free once the trainer holds SmolLM2: ~3600 tokens, not 16384
    if free_gb == 18.0:
        assert 3000 < tokens < 4000


def test_a_learner_without_a_budget_sizes_it_from_its_model_and_memory(
    base_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from sf_trainer.distributed import TrainGroup
    from sf_trainer.learner import Learner
    from sf_trainer.settings import TrainerSettings

    with caplog.at_level(logging.INFO, logger="sf_trainer.learner"):
        auto = Learner(TrainerSettings(lr=1e-3, precision="fp32"),
                       TrainGroup(device=torch.device("cpu")), base_model_dir)  # fmt: skip
    tokens = auto.settings.micro_batch_tokens
    assert AUTO_BOUNDS[0] <= tokens <= AUTO_BOUNDS[1] and tokens % AUTO_ROUNDING == 0
    per_token = activation_bytes_per_token(LayerShape.of(auto.model.config), 4, False)
    assert f"micro-batches of {tokens} tokens" in caplog.text
    assert f"{per_token / 1e6:.2f} MB of activations a token" in caplog.text
    fixed = Learner(TrainerSettings(lr=1e-3, micro_batch_tokens=48),
                    TrainGroup(device=torch.device("cpu")), base_model_dir)  # fmt: skip
    assert fixed.settings.micro_batch_tokens == 48
