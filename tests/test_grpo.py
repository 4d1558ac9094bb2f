import math

import pytest
import torch

from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample
from sf_trainer.config import TrainerSettings
from sf_trainer.grpo import clipped_policy_loss, group_advantages, token_logprobs
from sf_trainer.step import micro_batches, pack


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 1: mean 0.5, population std 0.5 -> +-1
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # group 2: no variance -> no signal
    assert adv[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0])
    # group 3: mean 0.25, std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert adv[2].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])


def test_clipped_loss_by_hand() -> None:
    # two sequences, three token slots; the last slot of row 1 is masked out
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.5, 0.7, 0.9]]))
    adv = torch.tensor([[1.0], [-2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, clipped = clipped_policy_loss(new, old, adv, mask, clip_eps=0.2)
    # ratios: row0 = 1.5, 1.0, 0.5 with A=+1 -> min(r, clip(r)) = 1.2, 1.0, 0.5
    # row1 = 1.0, 1.4 with A=-2 -> min(-2r, -2clip(r)) = -2.0, -2.8 (unclipped is smaller)
    expected = -(1.2 + 1.0 + 0.5 + (-2.0) + (-2.8)) / 5
    assert loss.item() == pytest.approx(expected)
    # clipped tokens: row0 token0 (1.5 -> 1.2) and token2 (0.5 -> 0.8: clip differs),
    # row1 token1 (1.4 -> 1.2); masked token excluded
    assert clipped.item() == 3


def test_normalizer_makes_micro_batches_sum_to_the_full_batch_loss() -> None:
    torch.manual_seed(0)
    new, old = torch.randn(4, 5), torch.randn(4, 5)
    adv = torch.randn(4, 1)
    mask = (torch.rand(4, 5) > 0.3).float()
    full, _ = clipped_policy_loss(new, old, adv, mask, 0.2)
    total = mask.sum().item()
    parts = sum(
        clipped_policy_loss(
            new[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], 0.2, normalizer=total
        )[0]
        for i in (0, 2)
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


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
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sf_trainer.step import train_step

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompt = [1, 2, 3]

    def logprob(token: int) -> float:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        return torch.log_softmax(logits, -1)[token].item()

    good, bad = 10, 11
    samples = [
        TrainSample(
            session_id=f"s{i}",
            token_ids=[*prompt, tok],
            loss_mask=[0, 0, 0, 1],
            behaviour_logprobs=[0, 0, 0, logprob(tok)],
            versions=[-1, -1, -1, 0],
            reward=float(tok == good),
        )
        for i, tok in enumerate([good, bad, good, bad])
    ]
    batch = TrainBatch(
        batch_index=0, groups=[SampleGroup(group_id="g", task_id="t", samples=samples)]
    )
    before_good, before_bad = logprob(good), logprob(bad)
    result = train_step(model, optimizer, batch, TrainerSettings(), current_version=0)
    assert result.tokens_trained == 4 and result.mean_reward == 0.5
    assert logprob(good) > before_good
    assert logprob(bad) < before_bad


def test_decoupled_loss_weights_tokens_by_truncated_behaviour_ratio() -> None:
    from sf_trainer.losses import get_loss

    settings = TrainerSettings(is_cap=2.0, clip_eps=0.2)
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.25, 0.1, 1.0]]))  # weights 2.0, 5.0 -> 2.0, 0.5
    advantages = torch.tensor([[1.0, -1.0, 2.0]])  # per token here, to test each weight
    mask = torch.ones(1, 3)
    out = get_loss("grpo_decoupled")(logprobs, behaviour, advantages, mask, settings, 3.0)
    # at the proximal policy the ratio is 1: loss = -sum(w * A) / n
    assert out.loss.item() == pytest.approx(-(2.0 * 1 + 2.0 * -1 + 0.5 * 2) / 3)
    assert out.truncated_tokens == 1 and out.clipped_tokens == 0
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == pytest.approx([-2.0 / 3, 2.0 / 3, -1.0 / 3])


def test_plain_grpo_loss_is_ppo_clip_against_behaviour() -> None:
    from sf_trainer.losses import get_loss

    settings = TrainerSettings(clip_eps=0.2)
    logprobs = torch.log(torch.tensor([[0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.5]]))  # ratios 2.0 (clipped to 1.2), 1.0
    out = get_loss("grpo")(
        logprobs, behaviour, torch.tensor([[1.0]]), torch.ones(1, 2), settings, 2.0
    )
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert out.clipped_tokens == 1
    with pytest.raises(KeyError, match="unknown loss"):
        get_loss("nope")
