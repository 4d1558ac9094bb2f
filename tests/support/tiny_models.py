"""Small real torch models for trainer tests: a Qwen2 of a few thousand weights (tied
or not), a one-layer policy with a rewarded batch of one-token answers, the float32
round-off bound ``gamma`` that tolerances are derived from, and
``FLOAT64_REORDERING``, how far two float64 summation orders of the tests' gradients may
differ."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen2Config

from seamlessflow.assets.loading import causal_lm_from_config
from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample

FP32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2

FLOAT64_REORDERING = 1e-9
"""Relative to a gradient's largest entry: in float64 two summation orders of n terms
differ by at most 2 n u sum|terms| (u = 1.1e-16); the longest sums of the chunked
logprobs' tests (tests/unit/test_chunked_logprobs_head.py,
tests/service/test_chunked_logprobs.py) have n < 10^4 terms (tokens x vocabulary
chunks, hidden sizes), so 1e-9 leaves the terms' magnitudes
room to exceed the gradient's by 10^2 through cancellation. A wrong position,
temperature or a missing gradient path moves gradients by far more (> 1e-3)."""


def gamma(terms: int, unit: float = FP32_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n: a float sum of n products, in any order, is within gamma_n x
    (the sum of the products' magnitudes) of the exact sum."""
    return terms * unit / (1 - terms * unit)


def tiny_model(tied: bool, vocab: int = 512, seed: int = 7) -> PreTrainedModel:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return causal_lm_from_config(config, torch.float32)


PROMPT = [1, 2, 3]


GOOD, BAD = 10, 11


def tiny_policy() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    return Qwen2ForCausalLM(config)


def next_token_logprob(model: torch.nn.Module, token: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    return torch.log_softmax(logits, -1)[token].item()


def rewarded_batch(model: torch.nn.Module) -> TrainBatch:
    """One group of four one-token answers: GOOD (reward 1) twice, BAD (0) twice."""
    samples = [
        TrainSample(
            session_id=f"s{i}",
            token_ids=[*PROMPT, tok],
            loss_mask=[0, 0, 0, 1],
            behaviour_logprobs=[0, 0, 0, next_token_logprob(model, tok)],
            versions=[-1, -1, -1, 0],
            reward=float(tok == GOOD),
        )
        for i, tok in enumerate([GOOD, BAD, GOOD, BAD])
    ]
    return TrainBatch(
        batch_index=0, groups=[SampleGroup(group_id="g", task_id="t", samples=samples)]
    )
