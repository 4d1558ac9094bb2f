"""Inference engines behind the engine-worker role of the rollout gateway.

`base` defines the interface (`InferenceEngine`) and its data types; `hf_engine` holds
the transformers implementation, `vllm_engine` the vLLM one, and `scripted_engine` one
without model compute (deterministic tokens, for load tests). Each of those modules
declares its backend (`registry.EngineBackend`: name, builder, model needs, settings,
optional packages) into `registry.ENGINE_BACKENDS`, which imports them on first lookup.
Importing this package does not import torch; the engine implementations are imported
lazily by attribute access.
"""

from typing import TYPE_CHECKING, Any

from .base import (
    MAX_TOP_LOGPROBS,
    ContextTooLong,
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
from .registry import ENGINE_BACKENDS, EngineBackend

if TYPE_CHECKING:
    from .hf_engine import TransformersEngine
    from .scripted_engine import ScriptedEngine

__all__ = [
    "ENGINE_BACKENDS",
    "MAX_TOP_LOGPROBS",
    "ContextTooLong",
    "EngineBackend",
    "EngineError",
    "EngineNotRunningError",
    "FinishReason",
    "GeneratedToken",
    "GenerationResult",
    "GenerationStream",
    "InferenceEngine",
    "PauseMode",
    "SamplingParams",
    "ScriptedEngine",
    "TopLogprobs",
    "TransformersEngine",
]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        from .hf_engine import TransformersEngine

        return TransformersEngine
    if name == "ScriptedEngine":
        from .scripted_engine import ScriptedEngine

        return ScriptedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
