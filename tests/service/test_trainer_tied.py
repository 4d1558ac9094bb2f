"""A model with tied input and output embeddings (Qwen2 ``tie_word_embeddings=True``, as
Qwen2.5-0.5B/1.5B/3B and Llama-3.2-1B/3B) in the trainer: one parameter, trained once,
sent to engines and checkpointed once (as save_pretrained writes it), loadable, sharded
by FSDP2 as one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from seamlessflow.assets.loading import causal_lm_from_config
from sf_trainer.checkpoint import TrainerState, load_model_state, load_optimizer_state, read_state
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from tests.support.ranks import (
    BATCHES,
    adam_noise_bounds,
    assert_same_results,
    assert_within,
    run_one_process,
    run_ranks,
    spec,
)

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
SETTINGS = TrainerSettings(lr=1e-3, micro_batch_tokens=48)


@pytest.fixture(scope="module")
def tied_model_dir(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 with tied embeddings and the base model's tokenizer."""
    out = tmp_path_factory.mktemp("tied")
    for name in base_model_dir.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(11)
    causal_lm_from_config(config, torch.float32).save_pretrained(out)
    return out


def learner(model_dir: Path) -> Learner:
    return Learner(SETTINGS, TrainGroup(device=torch.device("cpu")), model_dir)


def assert_tied(model: torch.nn.Module) -> None:
    assert model.lm_head.weight is model.model.embed_tokens.weight  # type: ignore[union-attr]


def test_a_tied_policy_trains_one_matrix_publishes_both_names_and_checkpoints_loadably(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    policy = learner(tied_model_dir)
    assert_tied(policy.model)
    # the optimizer holds the shared matrix once (AdamW would step it twice otherwise)
    held = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert len(held) == len({id(p) for p in held}) == len(list(policy.model.parameters()))
    base = policy.full_weights()[EMBED]
    policy.step(BATCHES[0], version=0)
    policy.step(BATCHES[1], version=1)
    assert_tied(policy.model)

    # what the weight publisher sends: the shared matrix once, under its input name, as
    # save_pretrained writes a tied model (the engines tie it by their own registration)
    published = policy.full_weights()
    assert HEAD not in published and EMBED in published
    assert not torch.equal(published[EMBED], base)
    assert published.keys() == policy.model.state_dict().keys() - {HEAD}

    policy.save(tmp_path / "ck", TrainerState(step=2, version=2, data_position=1))
    assert load_model_state(tmp_path / "ck").keys() == published.keys()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck"))
    assert_tied(loaded)
    ids = torch.tensor([[1, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, policy.model(ids).logits)

    # resume: the tie survives a restore, and training continues as it would have
    resumed = learner(tied_model_dir)
    resumed.restore(tmp_path / "ck")
    assert_tied(resumed.model)
    policy.step(BATCHES[0], version=2)
    resumed.step(BATCHES[0], version=2)
    for name, tensor in resumed.full_weights().items():
        assert torch.equal(tensor, policy.full_weights()[name]), name


def test_two_fsdp_ranks_keep_the_tie_and_step_as_one_process(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    """FSDP2 shards the shared matrix once (the root unit holds it): its gradient sums
    both uses once per rank, as in one process; a 2-rank resume from the tied
    checkpoint continues the same way."""
    settings = {"lr": 1e-3, "micro_batch_tokens": 48, "torch_threads": 1}
    ranks = run_ranks(2, spec(tied_model_dir, BATCHES[:1], tmp_path / "ranks", settings=settings))
    resumed = run_ranks(
        2,
        spec(
            tied_model_dir,
            BATCHES[1:],
            tmp_path / "resumed",
            tmp_path / "ranks" / "checkpoint",
            settings=settings,
        ),
    )
    alone = run_one_process(spec(tied_model_dir, BATCHES, tmp_path / "alone", settings=settings))
    assert_same_results(ranks + resumed, alone, tmp_path / "alone")

    got = load_model_state(tmp_path / "resumed" / "checkpoint")
    expected = load_model_state(tmp_path / "alone" / "checkpoint")
    # gathered from one sharded parameter, written once, as from one process
    assert got.keys() == expected.keys() and HEAD not in got and EMBED in got
    # the optimizer knows the matrix by one name; the head's bound is the embedding's
    bounds = adam_noise_bounds(tmp_path / "alone")
    assert HEAD not in bounds and EMBED in bounds
    for name, tensor in got.items():
        assert_within(tensor, expected[name], bounds[name]["weight"], name)
    moments = load_optimizer_state(tmp_path / "resumed" / "checkpoint")["state"]
    assert moments.keys() == load_optimizer_state(tmp_path / "alone" / "checkpoint")["state"].keys()
    assert read_state(tmp_path / "resumed" / "checkpoint").step == 2
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "resumed" / "checkpoint"))
    assert_tied(loaded)
