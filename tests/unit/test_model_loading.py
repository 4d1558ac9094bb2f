"""Models built while others load in other threads stay tied (``seamlessflow.assets.
loading``): transformers switches tying off process-wide during ``from_pretrained``, and
concurrent plain loads left it off for good (measured: 36 of 36 concurrent loads of a
tied model came back with a new, random output matrix, and every model built after)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, Qwen2Config
from transformers.initialization import no_tie_weights

from seamlessflow.assets.loading import TiedWeightsLost, causal_lm_from_config, load_causal_lm

CONFIG = Qwen2Config(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def is_tied(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tied-load")
    causal_lm_from_config(CONFIG, torch.float32).save_pretrained(out)
    return out


def test_concurrent_loads_stay_tied_and_leave_tying_on(tied_dir: Path) -> None:
    tie_weights = PreTrainedModel.tie_weights
    reference = load_causal_lm(tied_dir, torch.float32)

    def load(_: int) -> PreTrainedModel:
        return load_causal_lm(tied_dir, torch.float32)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        models = list(pool.map(load, range(24)))
    assert all(is_tied(m) for m in models)
    # the loaded matrix, not a freshly initialised output layer
    assert all(torch.equal(m.lm_head.weight, reference.lm_head.weight) for m in models)
    assert PreTrainedModel.tie_weights is tie_weights
    assert is_tied(causal_lm_from_config(CONFIG, torch.float32))


def test_a_model_built_while_tying_is_off_is_refused() -> None:
    """What another thread's plain ``from_pretrained`` does to this one: refused loudly
    rather than trained or served with an untrained output matrix."""
    with no_tie_weights(), pytest.raises(TiedWeightsLost, match="tie_word_embeddings"):
        causal_lm_from_config(CONFIG, torch.float32)
