import math

import pytest
import torch

from seamlessflow.protocol import TrainSample
from sf_trainer.grpo import token_logprobs
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import micro_batches, pack
from tests.support.tiny_models import BAD, GOOD, next_token_logprob, rewarded_batch, tiny_policy


def test_token_logprobs_apply_the_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0]]])
    target = torch.tensor([[0]])
    at_1 = token_logprobs(logits, target, 1.0).item()
    at_2 = token_logprobs(logits, target, 2.0).item()
    assert at_1 == pytest.approx(math.log(math.e**2 / (math.e**2 + 1)))
    assert at_2 == pytest.approx(math.log(math.e / (math.e + 1)))


def test_pack_shifts_targets_masks_and_behaviour_logprobs() -> None:
    a = TrainSample(
        session_id="a",
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -0.1, -0.2],
        versions=[-1, 0, 0],
        reward=1.0,
    )
    b = TrainSample(
        session_id="b",
        token_ids=[5, 8],
        loss_mask=[0, 1],
        behaviour_logprobs=[0.0, -0.3],
        versions=[-1, 0],
        reward=0.0,
    )
    packed = pack([a, b], [1.0, -1.0])
    assert packed.input_ids.tolist() == [[5, 6, 7], [5, 8, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert packed.targets.tolist() == [[6, 7], [8, 0]]
    assert packed.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert packed.old_logprobs.flatten().tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])


def test_micro_batches_respect_the_token_budget_and_cover_every_sample() -> None:
    samples = [
        TrainSample(
            session_id=str(n),
            token_ids=[1] * n,
            loss_mask=[1] * n,
            behaviour_logprobs=[0.0] * n,
            versions=[0] * n,
            reward=0.0,
        )
        for n in (3, 9, 4, 7, 2)
    ]
    groups = micro_batches(samples, token_budget=12)
    assert sorted(i for g in groups for i in g) == list(range(5))
    for group in groups:
        assert len(group) * max(len(samples[i].token_ids) for i in group) <= 12


def test_a_train_step_raises_the_probability_of_rewarded_tokens() -> None:
    from sf_trainer.step import train_step

    model = tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = rewarded_batch(model)
    before_good, before_bad = next_token_logprob(model, GOOD), next_token_logprob(model, BAD)
    result = train_step(model, optimizer, batch, TrainerSettings(), current_version=0)
    assert result.tokens_trained == 4 and result.mean_reward == 0.5
    assert next_token_logprob(model, GOOD) > before_good
    assert next_token_logprob(model, BAD) < before_bad
    assert result.kl_mean == 0.0  # no reference model


def test_the_kl_term_is_zero_at_the_reference_then_measures_the_drift() -> None:
    import copy

    from sf_trainer.step import train_step

    model = tiny_policy()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = TrainerSettings(kl_coef=0.5)
    batch = rewarded_batch(model)
    with pytest.raises(ValueError, match="KL_COEF"):
        train_step(model, optimizer, batch, settings, current_version=0)
    first = train_step(model, optimizer, batch, settings, 0, reference=reference)
    assert first.kl_mean == 0.0  # the policy is the reference: k3 = e^0 - 0 - 1
    # by hand, before the second step: each trained token's k3 = e^d - d - 1 with
    # d = ref - policy logprob, averaged over the batch's four trained tokens
    gaps = [
        next_token_logprob(reference, tok) - next_token_logprob(model, tok)
        for tok in (GOOD, BAD, GOOD, BAD)
    ]
    expected = sum(math.exp(d) - d - 1 for d in gaps) / 4
    second = train_step(model, optimizer, batch, settings, 1, reference=reference)
    assert expected > 1e-6  # the first step moved the policy
    assert second.kl_mean == pytest.approx(expected, rel=1e-4)
