"""An engine of either kind (transformers, vLLM; vLLM skipped where it does not import)
on a model folder, and the trainer's recomputation of its tokens' logprobs, with the
tolerance between two float32 implementations at the same weights
(tests/service/test_model_families.py derives it)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from sf_engine.backends import InferenceEngine
from sf_trainer.grpo import token_logprobs

U_FP32 = 2.0**-24


def import_vllm_or_skip() -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (CUDA triton etc.)
        pytest.skip(f"vLLM engine skipped: `import vllm` failed ({exc!r})")


@contextlib.asynccontextmanager
async def started_engine(kind: str, model_dir: Path) -> AsyncIterator[InferenceEngine]:
    engine: InferenceEngine
    if kind == "hf":
        from sf_engine.backends import TransformersEngine

        engine = TransformersEngine(model_dir, max_batch_size=4, max_context=256)
    else:
        import_vllm_or_skip()
        from sf_engine.backends.vllm_engine import VllmEngine

        engine = VllmEngine(model_dir, max_batch_size=4, max_context=256)
    async with engine:
        yield engine


def trainer_logprobs_and_logits(
    model: PreTrainedModel, prompt: list[int], tokens: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's recomputation (`token_logprobs`) of each generated token, and the
    logits at those positions."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    targets = torch.tensor(tokens)
    return token_logprobs(logits, targets, temperature), logits


def tol_same(logits: torch.Tensor) -> float:
    """Two fp32 implementations at the same weights (the bound is derived in
    tests/service/test_model_families.py's docstring)."""
    k = logits.shape[-1]
    return 2 * k * U_FP32 * (1 + logits.abs().max().item())
