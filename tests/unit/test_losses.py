"""Advantage estimators, reward shaping and policy losses against hand-computed numbers.

The arithmetic is written next to each expected value. The shared example: two groups
of three rewards, and a batch of two sequences of three token slots whose last slot of
row 1 is not trained.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from pydantic import ValidationError

from seamlessflow.plugins import Registry
from seamlessflow.protocol import SampleGroup, TrainSample
from sf_trainer.advantages import (
    ESTIMATORS,
    batch_advantages,
    get_advantage_estimator,
    overlong_penalty,
)
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.losses import (
    LOSSES,
    BatchTotals,
    LossInputs,
    LossOutput,
    chosen_loss,
    get_loss,
    kl_k3,
)
from sf_trainer.settings import TrainerSettings

# advantages ----------------------------------------------------------------------------

# group 1: mean 1, population std sqrt(((1-1)^2 + (0-1)^2 + (2-1)^2) / 3) = sqrt(2/3)
# group 2: all equal, no spread
REWARDS = [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.5, 0.5])]


def advantages(name: str, groups: list[torch.Tensor] = REWARDS) -> list[list[float]]:
    return [a.tolist() for a in get_advantage_estimator(name)(groups)]


def test_grpo_advantages_divide_by_the_group_std() -> None:
    g1, g2 = advantages("grpo")
    # (r - 1) / sqrt(2/3): 0, -1.2247, +1.2247; group 2 carries no signal
    assert g1 == pytest.approx([0.0, -1 / math.sqrt(2 / 3), 1 / math.sqrt(2 / 3)], rel=1e-5)
    assert g2 == [0.0, 0.0, 0.0]


def test_dr_grpo_advantages_only_subtract_the_group_mean() -> None:
    g1, g2 = advantages("dr_grpo")
    assert g1 == pytest.approx([0.0, -1.0, 1.0])  # r - 1, not divided by sqrt(2/3)
    assert g2 == [0.0, 0.0, 0.0]


def test_rloo_advantages_leave_each_sample_out_of_its_baseline() -> None:
    g1, g2 = advantages("rloo")
    # 1 - (0 + 2)/2 = 0;  0 - (1 + 2)/2 = -1.5;  2 - (1 + 0)/2 = 1.5
    assert g1 == pytest.approx([0.0, -1.5, 1.5])
    assert g2 == [0.0, 0.0, 0.0]
    # a group of one has no other sample to be its baseline
    assert advantages("rloo", [torch.tensor([3.0])]) == [[0.0]]


def test_reinforce_pp_normalises_across_the_whole_batch() -> None:
    g1, g2 = advantages("reinforce_pp")
    # all six rewards: mean 4.5 / 6 = 0.75; deviations 0.25, -0.75, 1.25, -0.25 (x3);
    # variance (0.0625 + 0.5625 + 1.5625 + 3 x 0.0625) / 6 = 2.375 / 6, std 0.62915
    std = math.sqrt(2.375 / 6)
    assert g1 == pytest.approx([0.25 / std, -0.75 / std, 1.25 / std], rel=1e-5)
    # unlike GRPO, a group without spread is judged against the batch: below its mean
    assert g2 == pytest.approx([-0.25 / std] * 3, rel=1e-5)


def test_reinforce_pp_baseline_divides_group_differences_by_the_batch_std() -> None:
    g1, g2 = advantages("reinforce_pp_baseline")
    # r - group mean: 0, -1, 1 and 0, 0, 0; their std over the batch sqrt(2/6) = 0.57735
    # (group 1 alone would divide by sqrt(2/3), as GRPO does)
    assert g1 == pytest.approx([0.0, -math.sqrt(3), math.sqrt(3)], rel=1e-5)
    assert g2 == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_every_estimator_keeps_the_batch_shape(name: str) -> None:
    groups = [torch.tensor([1.0, 0.0]), torch.tensor([2.0]), torch.tensor([0.0, 3.0, 1.0])]
    assert [len(g) for g in advantages(name, groups)] == [2, 1, 3]
    assert advantages(name, []) == []


# reward shaping ------------------------------------------------------------------------


def test_the_overlong_penalty_is_zero_then_linear_then_minus_one() -> None:
    # max 10, cache 4: no penalty up to 10 - 4 = 6, then (6 - n) / 4, then -1 past 10
    assert [overlong_penalty(n, 10, 4) for n in (3, 6)] == [0.0, 0.0]
    assert [overlong_penalty(n, 10, 4) for n in (7, 8, 10)] == [-0.25, -0.5, -1.0]
    assert [overlong_penalty(n, 10, 4) for n in (11, 50)] == [-1.0, -1.0]
    assert overlong_penalty(10_000, 0, 0) == 0.0  # max 0: off
    assert overlong_penalty(11, 10, 0) == -1.0  # no cache: a hard limit


def sample(reward: float, trained: int) -> TrainSample:
    return TrainSample(
        session_id=f"s{reward}-{trained}",
        token_ids=[1] * (trained + 1),
        loss_mask=[0] + [1] * trained,
        behaviour_logprobs=[0.0] * (trained + 1),
        versions=[0] * (trained + 1),
        reward=reward,
    )


def test_the_overlong_penalty_shapes_rewards_before_the_advantages() -> None:
    groups = [SampleGroup(group_id="g", task_id="t", samples=[sample(1.0, 4), sample(1.0, 8)])]
    plain = TrainerSettings(advantage="dr_grpo")
    assert batch_advantages(groups, plain) == [0.0, 0.0]  # equal rewards, no signal
    shaped = TrainerSettings(advantage="dr_grpo", overlong_max_tokens=10, overlong_cache_tokens=4)
    # 8 tokens: 1 + (6 - 8)/4 = 0.5; 4 tokens: 1. Mean 0.75 -> +0.25, -0.25
    assert batch_advantages(groups, shaped) == pytest.approx([0.25, -0.25])


def test_the_overlong_window_must_fit_under_the_maximum() -> None:
    with pytest.raises(ValidationError, match="overlong_cache_tokens"):
        TrainerSettings(overlong_max_tokens=4, overlong_cache_tokens=5)


# losses --------------------------------------------------------------------------------

# behaviour probability 0.5 everywhere; the policy's give ratios
#   row 0: 1.5, 1.0, 0.5   (advantage +1)
#   row 1: 1.0, 1.4, 1.8   (advantage -2; the third slot is not trained)
BEHAVIOUR = torch.log(torch.full((2, 3), 0.5))
POLICY = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.5, 0.7, 0.9]]))
ADVANTAGES = torch.tensor([[1.0], [-2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TOTALS = BatchTotals(tokens=5, sequences=2, longest_response=3)


def run_loss(
    name: str,
    settings: dict[str, Any],
    logprobs: torch.Tensor = POLICY,
    kl_coef: float = 0.0,
    **inputs: Any,
) -> tuple[LossOutput, torch.Tensor]:
    """(output, gradient of the loss w.r.t. the policy logprobs); ``settings``: the
    loss's own (its defaults otherwise); ``inputs`` replace the shared example's fields
    (and ``totals``)."""
    logprobs = logprobs.clone().requires_grad_(True)
    fields: dict[str, Any] = {
        "behaviour_logprobs": BEHAVIOUR,
        "advantages": ADVANTAGES,
        "mask": MASK,
    }
    fields.update(inputs)
    totals = fields.pop("totals", TOTALS)
    loss = get_loss(name)
    output = loss(LossInputs(logprobs=logprobs, **fields), loss.settings(**settings), totals,
                  kl_coef)  # fmt: skip
    output.loss.backward()
    assert logprobs.grad is not None
    return output, logprobs.grad


def test_grpo_loss_is_ppo_clip_against_behaviour_averaged_over_tokens() -> None:
    out, _ = run_loss("grpo", {"clip_eps": 0.2})
    # row 0 (A=+1): min(r, clip(r, 0.8, 1.2)) = 1.2, 1.0, 0.5
    # row 1 (A=-2): min(-2r, -2 clip(r)) = -2.0, -2.8 (the unclipped side is lower)
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0 + 0.5 - 2.0 - 2.8) / 5)  # 0.42
    # ratios outside [0.8, 1.2]: 1.5, 0.5 (row 0), 1.4 (row 1); 1.8 is not trained
    assert out.clipped_tokens == 3 and out.truncated_tokens == 0 and out.kl_sum == 0


def test_decoupled_loss_weights_tokens_by_truncated_behaviour_ratio() -> None:
    settings = {"is_cap": 2.0, "clip_eps": 0.2}
    behaviour = torch.log(torch.tensor([[0.25, 0.1, 1.0]]))  # weights 2.0, 5.0 -> 2.0, 0.5
    advantages = torch.tensor([[1.0, -1.0, 2.0]])  # per token here, to test each weight
    out, grad = run_loss(
        "grpo_decoupled",
        settings,
        torch.log(torch.full((1, 3), 0.5)),
        behaviour_logprobs=behaviour,
        advantages=advantages,
        mask=torch.ones(1, 3),
        totals=BatchTotals(tokens=3, sequences=1, longest_response=3),
    )
    # at the proximal policy the ratio is 1: loss = -sum(w * A) / n
    assert out.loss.item() == pytest.approx(-(2.0 * 1 + 2.0 * -1 + 0.5 * 2) / 3)
    assert out.truncated_tokens == 1 and out.clipped_tokens == 0
    assert grad[0].tolist() == pytest.approx([-2.0 / 3, 2.0 / 3, -1.0 / 3])


def test_dapo_loss_clips_the_ratio_higher_above_than_below() -> None:
    settings = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    out, _ = run_loss("dapo", settings)
    # row 0: min(r, clip(r, 0.8, 1.28)) = 1.28, 1.0, 0.5; row 1 as in GRPO: -2.0, -2.8
    assert out.loss.item() == pytest.approx(-(1.28 + 1.0 + 0.5 - 2.0 - 2.8) / 5)  # 0.404
    assert out.clipped_tokens == 3  # 1.5, 0.5, 1.4 lie outside [0.8, 1.28]


def test_clip_higher_keeps_the_gradient_up_to_the_upper_bound_only() -> None:
    # ratios 1.25, 1.30 with A=+1 and 0.85, 0.75 with A=-1, one token each
    behaviour = torch.log(torch.full((1, 4), 0.5))
    policy = torch.log(torch.tensor([[0.625, 0.65, 0.425, 0.375]]))
    kwargs: dict[str, Any] = {
        "behaviour_logprobs": behaviour,
        "advantages": torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
        "mask": torch.ones(1, 4),
        "totals": BatchTotals(tokens=4, sequences=1, longest_response=4),
    }
    _, dapo = run_loss("dapo", {"clip_eps_low": 0.2, "clip_eps_high": 0.28}, policy, **kwargs)
    # d(-r A / 4)/d logp = -r A / 4 where the unclipped side is taken, else 0:
    # 1.25 < 1.28 trains, 1.30 > 1.28 does not; 0.85 > 0.8 trains, 0.75 < 0.8 does not
    assert dapo[0].tolist() == pytest.approx([-1.25 / 4, 0.0, 0.85 / 4, 0.0])
    _, grpo = run_loss("grpo", {"clip_eps": 0.2}, policy, **kwargs)
    assert grpo[0].tolist() == pytest.approx([0.0, 0.0, 0.85 / 4, 0.0])  # 1.25 > 1.2


def test_dr_grpo_loss_sums_tokens_over_a_constant() -> None:
    # GRPO's terms: row 0 -(1.2 + 1.0 + 0.5) = -2.7, row 1 -(-2.0 - 2.8) = 4.8; sum 2.1
    out, _ = run_loss("dr_grpo", {"clip_eps": 0.2})
    assert out.loss.item() == pytest.approx(2.1 / (2 * 3))  # C = longest response, 3
    out, _ = run_loss("dr_grpo", {"clip_eps": 0.2, "constant_tokens": 10})
    assert out.loss.item() == pytest.approx(2.1 / (2 * 10))


def test_dr_grpo_does_not_divide_by_the_sequence_length() -> None:
    # a 1-token and a 3-token sequence at ratio 1, A = +1, C = 4, 2 sequences: every
    # token's gradient is -1 / (2 x 4), whatever its sequence's length
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    kwargs: dict[str, Any] = {
        "behaviour_logprobs": BEHAVIOUR,
        "advantages": torch.tensor([[1.0], [1.0]]),
        "mask": mask,
        "totals": BatchTotals.of([[1, 0, 0], [1, 1, 1]]),
    }
    _, grad = run_loss("dr_grpo", {"constant_tokens": 4}, BEHAVIOUR, **kwargs)
    assert (grad * mask).flatten().tolist() == pytest.approx([-0.125, 0, 0] + [-0.125] * 3)
    # the per-sequence mean (GSPO's aggregation) would weigh them 1/1 and 1/3
    _, grad = run_loss("gspo", {}, BEHAVIOUR, **kwargs)
    assert (grad * mask).flatten().tolist() == pytest.approx([-0.5, 0, 0] + [-1 / 6] * 3)


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio() -> None:
    settings = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    # token ratios row 0: 1.5, 1.0 -> s = sqrt(1.5) = 1.2247 > 1.2: clipped (A = +1)
    #              row 1: 1.5, 0.5 -> s = sqrt(0.75) = 0.8660 within [0.8, 1.2]
    # the third slot is not trained: its ratio (0.2) is not in the mean
    policy = torch.log(torch.tensor([[0.75, 0.5, 0.1], [0.75, 0.25, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out, grad = run_loss(
        "gspo",
        settings,
        policy,
        advantages=torch.tensor([[1.0], [1.0]]),
        mask=mask,
        totals=BatchTotals(tokens=4, sequences=2, longest_response=2),
    )
    # -(min(s0, 1.2) + min(s1, clip(s1))) / 2 sequences
    assert out.loss.item() == pytest.approx(-(1.2 + math.sqrt(0.75)) / 2)
    assert out.clipped_tokens == 2  # both tokens of row 0, including its ratio-1 token
    # row 0 clipped as a whole: no gradient; row 1: d(-s/2)/d logp_t = -s / 2 / 2 tokens
    row_1 = -math.sqrt(0.75) / 4
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, row_1, row_1, 0.0])


def test_the_gspo_clip_defaults_are_the_papers() -> None:
    settings = get_loss("gspo").settings()
    assert (settings.clip_eps_low, settings.clip_eps_high) == (3e-4, 4e-4)
    # and so are the ones a trainer left at its defaults takes
    _, chosen = chosen_loss(TrainerSettings(loss="gspo").loss)
    assert chosen == settings


# KL to the reference -------------------------------------------------------------------


def test_k3_kl_by_hand_and_zero_when_equal() -> None:
    logprobs = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    reference = torch.log(torch.tensor([0.25, 1.0, 0.5]))
    # d = ref - logp: log 0.5 -> 0.5 + 0.6931 - 1 = 0.1931; log 2 -> 2 - 0.6931 - 1 = 0.3069
    assert kl_k3(logprobs, reference).tolist() == pytest.approx(
        [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1, 0.0]
    )
    assert kl_k3(logprobs, reference)[2].item() == 0.0  # equal: exactly 0


# k3 per token (row 0: 0.1931, 0, 0.3069; row 1: 0, 0.1931, not trained)
REFERENCE = torch.log(torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.25, 0.5]]))
K3 = 0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1


@pytest.mark.parametrize(
    ("name", "aggregated"),
    [
        # the sum K3[0] + 0 + K3[1] + 0 + K3[0] = 0.6931 over the 5 trained tokens
        ("grpo", (2 * K3[0] + K3[1]) / 5),
        # ... over 2 sequences x C = 3
        ("dr_grpo", (2 * K3[0] + K3[1]) / 6),
        # mean of the sequence means (K3[0] + K3[1]) / 3 and K3[0] / 2
        ("gspo", ((K3[0] + K3[1]) / 3 + K3[0] / 2) / 2),
    ],
)
def test_the_kl_term_is_aggregated_like_the_policy_loss(name: str, aggregated: float) -> None:
    # policy = behaviour, zero advantages: the policy terms vanish, the KL term remains
    out, _ = run_loss(
        name,
        {},
        BEHAVIOUR,
        kl_coef=0.1,
        advantages=torch.zeros(2, 1),
        reference_logprobs=REFERENCE,
    )
    assert out.loss.item() == pytest.approx(0.1 * aggregated)
    assert out.kl_sum == pytest.approx(2 * K3[0] + K3[1])


# every loss, the whole-batch invariants -------------------------------------------------


@pytest.mark.parametrize("name", LOSSES.names())
def test_every_loss_splits_exactly_over_micro_batches(name: str) -> None:
    """Loss and gradient of the whole batch = the sum over micro-batches, each divided
    by the whole batch's totals (also with a KL term and a row with no trained token)."""
    torch.manual_seed(0)
    behaviour = -torch.rand(4, 5) * 2
    policy = (behaviour + torch.randn(4, 5) * 0.1).requires_grad_(True)
    reference = behaviour + torch.randn(4, 5) * 0.1
    advantages = torch.randn(4, 1)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[0] = 0.0  # e.g. a padding row: adds nothing, is no sequence
    mask[1, 0] = 1.0
    totals = BatchTotals.of(mask.int().tolist())
    assert totals.sequences == 3
    loss = get_loss(name)
    gspo_clip = {"clip_eps_low": 0.05, "clip_eps_high": 0.05}
    settings = loss.settings(**(gspo_clip if name == "gspo" else {}))

    def loss_of(rows: slice) -> torch.Tensor:
        inputs = LossInputs(policy[rows], behaviour[rows], advantages[rows], mask[rows],
                            reference[rows])  # fmt: skip
        return loss(inputs, settings, totals, kl_coef=0.1).loss

    (whole_grad,) = torch.autograd.grad(loss_of(slice(0, 4)), policy)
    parts = loss_of(slice(0, 2)) + loss_of(slice(2, 4))
    (parts_grad,) = torch.autograd.grad(parts, policy)
    assert parts.item() == pytest.approx(loss_of(slice(0, 4)).item(), rel=1e-6)
    torch.testing.assert_close(parts_grad, whole_grad)
    assert whole_grad.abs().sum() > 0


def test_batch_totals_count_the_whole_batch() -> None:
    totals = BatchTotals.of([[0, 1, 1], [0, 0, 0], [1, 1, 1, 1]])
    assert totals == BatchTotals(tokens=6, sequences=2, longest_response=4)
    assert BatchTotals.of([]) == BatchTotals(tokens=1, sequences=1, longest_response=1)


# names ---------------------------------------------------------------------------------


def test_unknown_names_are_refused_with_the_known_ones_listed() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown loss 'nope' \(SF_TRAINER_LOSS\); known: dapo, dr_grpo, grpo, "
        r"grpo_decoupled, gspo; or a dotted path 'package.module:function'$",
    ):
        get_loss("nope")
    with pytest.raises(
        ValueError,
        match=r"unknown advantage estimator 'nope' \(SF_TRAINER_ADVANTAGE\); known: dr_grpo, "
        r"grpo, reinforce_pp, reinforce_pp_baseline, rloo; or a dotted path "
        r"'package.module:function'$",
    ):
        get_advantage_estimator("nope")


def test_a_misspelt_plugin_fails_the_learner_before_it_loads_a_model(tmp_path: Path) -> None:
    group = TrainGroup(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown loss 'gpso'"):
        Learner(TrainerSettings(loss="gpso"), group, tmp_path / "no-model")
    with pytest.raises(ValueError, match="unknown advantage estimator 'loo'"):
        Learner(TrainerSettings(advantage="loo"), group, tmp_path / "no-model")


def test_a_name_cannot_be_registered_twice() -> None:
    registry: Registry[int] = Registry("thing", "SF_THING")
    registry.add("a", 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.add("a", 2)
    assert registry.get("a") == 1


def test_a_session_with_several_samples_counts_once_in_its_group() -> None:
    """A session whose rewritten turns became samples of their own
    (``grouping.trained_branches``) is one member of its group: its samples share its
    advantage, and the other sessions' advantages are as if it had one sample."""

    def of(session: str, reward: float, trained: int) -> TrainSample:
        return msgspec.structs.replace(sample(reward, trained), session_id=session)

    several = [of("a", 1.0, 2), of("a", 1.0, 3), of("a", 1.0, 1), of("b", 0.0, 2)]
    once = [of("a", 1.0, 6), of("b", 0.0, 2)]
    grpo = TrainerSettings(advantage="grpo")
    a, b = batch_advantages([SampleGroup(group_id="g", task_id="t", samples=once)], grpo)
    assert a > 0 > b
    advantages = batch_advantages([SampleGroup(group_id="g", task_id="t", samples=several)], grpo)
    assert advantages == pytest.approx([a, a, a, b])
    # shaped over all of a session's trained tokens: 6 here as in ``once``
    shaped = TrainerSettings(advantage="dr_grpo", overlong_max_tokens=6, overlong_cache_tokens=4)
    a, b = batch_advantages([SampleGroup(group_id="g", task_id="t", samples=once)], shaped)
    advantages = batch_advantages([SampleGroup(group_id="g", task_id="t", samples=several)], shaped)
    assert advantages == pytest.approx([a, a, a, b])
