"""The engine's size from its settings: tensor parallelism and CUDA graphs reach vLLM's
engine arguments; a backend that cannot split a model refuses to be asked to."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sf_engine.backends.vllm_engine import BACKEND, VllmEngine
from sf_engine.settings import EngineSettings


def vllm_args(tmp_path: Path, **settings: object) -> dict[str, object]:
    engine = BACKEND.build(
        EngineSettings(backend="vllm", dtype="float32", **settings), str(tmp_path)
    )
    assert isinstance(engine, VllmEngine)
    return engine.engine_args()  # what start() hands vLLM (no vLLM import needed)


def test_by_default_one_gpu_runs_eagerly(tmp_path: Path) -> None:
    args = vllm_args(tmp_path)
    assert args["tensor_parallel_size"] == 1
    assert args["enforce_eager"] is True


def test_tensor_parallelism_and_cuda_graphs_are_settings(tmp_path: Path) -> None:
    args = vllm_args(tmp_path, tensor_parallel=4, cuda_graphs=True)
    assert args["tensor_parallel_size"] == 4
    assert args["enforce_eager"] is False


@pytest.mark.parametrize("backend", ["hf", "scripted"])
def test_a_backend_that_runs_a_model_whole_refuses_tensor_parallelism(backend: str) -> None:
    with pytest.raises(
        ValidationError, match="SF_ENGINE_TENSOR_PARALLEL=2 needs SF_ENGINE_BACKEND=vllm"
    ):
        EngineSettings(backend=backend, dtype="float32", tensor_parallel=2)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        EngineSettings(backend="vllm", dtype="float32", tensor_parallel=0)
