"""Inference engines behind the engine-worker role of the rollout gateway.

`base` defines the interface (`InferenceEngine`) and its data types; `hf_engine` holds
the transformers implementation. Importing this package does not import torch; the
engine implementations are imported lazily by attribute access.
"""

from typing import TYPE_CHECKING, Any

from .base import (
    MAX_TOP_LOGPROBS,
    EngineError,
    EngineNotRunningError,
    FinishReason,
    GeneratedToken,
    GenerationResult,
    GenerationStream,
    InferenceEngine,
    PauseMode,
    SamplingParams,
    TopLogprobs,
)

if TYPE_CHECKING:
    from .hf_engine import TransformersEngine

__all__ = [
    "MAX_TOP_LOGPROBS",
    "EngineError",
    "EngineNotRunningError",
    "FinishReason",
    "GeneratedToken",
    "GenerationResult",
    "GenerationStream",
    "InferenceEngine",
    "PauseMode",
    "SamplingParams",
    "TopLogprobs",
    "TransformersEngine",
]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        from .hf_engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
