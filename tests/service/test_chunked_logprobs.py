"""Logprobs from the final hidden states chunk by chunk (``SF_TRAINER_LOGPROB_CHUNK_TOKENS``)
in the trainer: its own step (tied and untied models, with the base model's tokenizer)
has the whole logits' gradients, and two FSDP2 ranks chunking step as one process on
whole logits. The head alone and tiny models' heads are
tests/unit/test_chunked_logprobs_head.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from seamlessflow.protocol import TrainBatch
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from tests.support.ranks import (
    BATCHES,
    SETTINGS,
    assert_same_checkpoint,
    assert_same_results,
    run_one_process,
    run_ranks,
    spec,
)
from tests.support.tiny_models import FLOAT64_REORDERING, tiny_model

# whole models: tied and untied, the trainer's own path ---------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(
    request: pytest.FixtureRequest, base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny random Qwen2 (tied or untied) with the base model's tokenizer."""
    out = tmp_path_factory.mktemp("tied" if request.param else "untied")
    for name in base_model_dir.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    tiny_model(request.param).save_pretrained(out)
    return out


def with_temperatures(batch: TrainBatch) -> TrainBatch:
    """Every sample's completion sampled at 0.7 on its first half, 1.3 after (greedy on
    one sample): tokens of one row at different temperatures."""
    groups = []
    for g_index, group in enumerate(batch.groups):
        samples = []
        for s_index, sample in enumerate(group.samples):
            n = len(sample.token_ids)
            temps = [0.7 if i < n // 2 else 1.3 for i in range(n)]
            if g_index == 0 and s_index == 0:
                temps = [0.0] * n
            samples.append(msgspec.structs.replace(sample, temperatures=temps))
        groups.append(msgspec.structs.replace(group, samples=samples))
    return msgspec.structs.replace(batch, groups=groups)


def test_a_step_with_chunked_logprobs_has_the_whole_logits_gradients(model_dir: Path) -> None:
    """The trainer's own step (policy and KL reference, per-token temperatures, several
    micro-batches and chunks per micro-batch), run in float64 so that the only
    difference left is summation order; lr 0 keeps the gradients on the parameters."""
    batch = with_temperatures(BATCHES[0])
    steps = {}
    for chunk in (0, 5):
        overrides = {"lr": 0.0, "kl_coef": 0.1, "logprob_chunk_tokens": chunk}
        settings = TrainerSettings(**{**SETTINGS, **overrides})  # type: ignore[arg-type]
        learner = Learner(settings, TrainGroup(device=torch.device("cpu")), model_dir)
        assert learner.reference is not None
        learner.model.double()
        learner.reference.double()
        # the policy a little away from the reference, the same way in both runs: the KL
        # term (and its gradient) is not zero
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in learner.model.parameters():
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_(0.05 * noise)
        result = learner.step(batch, version=0)
        parameters = learner.model.named_parameters()
        grads = {n: p.grad.clone() for n, p in parameters if p.grad is not None}
        steps[chunk] = (result, grads)
    (whole, whole_grads), (chunked, chunked_grads) = steps[0], steps[5]
    assert whole_grads.keys() == chunked_grads.keys()
    assert len(whole_grads) == len(list(learner.model.parameters()))
    for key in ("loss", "logprob_abs_diff", "kl_mean", "grad_norm", "entropy_mean"):
        assert getattr(chunked, key) == pytest.approx(getattr(whole, key), rel=FLOAT64_REORDERING)
    assert whole.kl_mean > 1e-4  # the reference's logprobs entered the loss
    for name, expected in whole_grads.items():
        gap = (chunked_grads[name] - expected).abs().max()
        assert gap <= FLOAT64_REORDERING * expected.abs().max(), name


# two FSDP2 ranks --------------------------------------------------------------------------


def test_two_ranks_with_chunked_logprobs_step_as_one_process_with_whole_logits(
    model_dir: Path, tmp_path: Path
) -> None:
    """FSDP2 shards the head with the root; the chunks use the root's gathered output
    embedding after the forward, and its gradient is reduce-scattered with the root's
    (tied: with the embedding's, one parameter). With the KL reference (sharded too)
    and checkpointed layers, per-token temperatures, 2 ranks chunking equal one process
    on whole logits up to float summation order."""
    common = {**SETTINGS, "kl_coef": 0.1, "gradient_checkpointing": True}
    batches = [with_temperatures(b) for b in BATCHES]
    chunked = {**common, "logprob_chunk_tokens": 5}
    whole = {**common, "logprob_chunk_tokens": 0}
    ranks = run_ranks(2, spec(model_dir, batches, tmp_path / "ranks", settings=chunked))
    alone = run_one_process(spec(model_dir, batches, tmp_path / "alone", settings=whole))
    assert_same_results(ranks, alone, tmp_path / "alone")
    assert_same_checkpoint(tmp_path / "ranks" / "checkpoint", tmp_path / "alone")
