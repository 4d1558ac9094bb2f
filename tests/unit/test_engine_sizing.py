"""The engine's size from its settings: tensor parallelism and CUDA graphs, the vllm
backend's own settings (``VllmSettings``, ``SF_ENGINE_VLLM_``), reach vLLM's engine
arguments; the engine settings they used to be refuse their old spelling."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sf_engine.backends.vllm_engine import BACKEND, VllmEngine
from sf_engine.settings import EngineSettings, HfSettings, VllmSettings


def vllm_args(tmp_path: Path) -> dict[str, object]:
    engine = BACKEND.build(EngineSettings(backend="vllm", dtype="float32"), str(tmp_path))
    assert isinstance(engine, VllmEngine)
    return engine.engine_args()  # what start() hands vLLM (no vLLM import needed)


def on_a_gpu(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """vLLM's placement as the settings see it (this machine may have no GPU)."""
    monkeypatch.setattr(VllmSettings, "model_device", lambda self: "cuda" if gpu else "cpu")


def test_on_a_cpu_the_engine_runs_eagerly_without_prefix_caching_or_sleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_a_gpu(monkeypatch, False)
    args = vllm_args(tmp_path)
    assert args["tensor_parallel_size"] == 1
    assert args["enforce_eager"] is True
    assert args["enable_prefix_caching"] is False
    assert "enable_sleep_mode" not in args and "gpu_memory_utilization" not in args


def test_on_a_gpu_the_engine_runs_as_a_gpu_deployment_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_a_gpu(monkeypatch, True)
    args = vllm_args(tmp_path)
    # CUDA graphs, prefix caching (reset at every load) and sleep mode for colocation
    assert args["enforce_eager"] is False
    assert args["enable_prefix_caching"] is True
    assert args["enable_sleep_mode"] is True
    assert "gpu_memory_utilization" not in args  # vLLM's own default


def test_gpu_defaults_yield_to_explicit_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_a_gpu(monkeypatch, True)
    monkeypatch.setenv("SF_ENGINE_VLLM_CUDA_GRAPHS", "false")
    monkeypatch.setenv("SF_ENGINE_VLLM_PREFIX_CACHING", "false")
    monkeypatch.setenv("SF_ENGINE_VLLM_SLEEP_MODE", "false")
    monkeypatch.setenv("SF_ENGINE_VLLM_GPU_MEMORY_UTILIZATION", "0.35")
    args = vllm_args(tmp_path)
    assert args["enforce_eager"] is True
    assert args["enable_prefix_caching"] is False
    assert "enable_sleep_mode" not in args
    assert args["gpu_memory_utilization"] == 0.35
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        VllmSettings(gpu_memory_utilization=1.5)


def test_tensor_parallelism_and_cuda_graphs_are_the_backends_own_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_ENGINE_VLLM_TENSOR_PARALLEL", "4")
    monkeypatch.setenv("SF_ENGINE_VLLM_CUDA_GRAPHS", "true")
    args = vllm_args(tmp_path)
    assert args["tensor_parallel_size"] == 4
    assert args["enforce_eager"] is False
    assert BACKEND.settings is VllmSettings
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        VllmSettings(tensor_parallel=0)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("SF_ENGINE_TENSOR_PARALLEL", "SF_ENGINE_VLLM_TENSOR_PARALLEL"),
        ("SF_ENGINE_CUDA_GRAPHS", "SF_ENGINE_VLLM_CUDA_GRAPHS"),
        ("SF_ENGINE_DEVICE", "SF_ENGINE_HF_DEVICE"),
        ("SF_ENGINE_PREFIX_CACHE_MB", "SF_ENGINE_HF_PREFIX_CACHE_MB"),
    ],
)
def test_a_setting_that_became_a_backends_own_names_its_new_variable(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(old, "1")
    with pytest.raises(ValidationError, match=f"{old} .* is no longer read: .* is {new}"):
        EngineSettings(dtype="float32")


def test_the_hf_backends_device_decides_what_auto_computes_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SF_ENGINE_HF_DEVICE", "cpu")
    assert HfSettings().model_device() == "cpu"
    assert EngineSettings(backend="hf").dtype == "float32"  # every CPU computes in fp32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_cpu_vllm_s_default_context_is_one_sequence_of_its_kv_cache(dtype: str) -> None:
    """Qwen2.5-1.5B's 32k context does not fit 1 GiB of KV cache in float32 (keys and
    values of 28 layers x 2 heads x 128 dims: 57,344 bytes a token), so the engine's
    default context is what fits, in whole 16-token blocks; in bf16 twice as many tokens
    fit, the whole context among them."""
    from seamlessflow.assets.shapes import SHAPES
    from sf_engine.backends.vllm_engine import kv_cache_tokens

    qwen = SHAPES["qwen2.5-1.5b"]  # its config.json
    per_token = 2 * 28 * 2 * 128 * (4 if dtype == "float32" else 2)
    held = kv_cache_tokens(qwen, dtype, 1.0)
    assert held % 16 == 0 and held * per_token <= 2**30 < (held + 16) * per_token
    assert (held < qwen["max_position_embeddings"]) == (dtype == "float32")
