from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.machine import engine_dtype
from seamlessflow.plugins import ChosenFrom
from seamlessflow.runfile import RunFileSettings, shared


def _moved(field: str, backend: str, new_field: str = "") -> str:
    """The line that refuses an engine setting that is now ``backend``'s own."""
    prefix = f"SF_ENGINE_{backend.upper()}_"
    new_field = new_field or field
    return (
        f"SF_ENGINE_{field.upper()} ([engine] {field}) is no longer read: the {backend} "
        f"backend's own setting is {prefix}{new_field.upper()} ([engine_{backend}] "
        f"{new_field})"
    )


class EngineSettings(RunFileSettings):
    """engine-worker settings (env prefix ``SF_ENGINE_``), those of every backend; each
    backend's own are its settings class (``SF_ENGINE_<BACKEND>_``: ``HfSettings``,
    ``VllmSettings``, the scripted engine's ``ScriptedSettings``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_ENGINE_", extra="ignore", use_attribute_docstrings=True
    )

    retired: ClassVar[Mapping[str, str]] = {
        "device": _moved("device", "hf"),
        "prefix_cache_mb": _moved("prefix_cache_mb", "hf"),
        "tensor_parallel": _moved("tensor_parallel", "vllm"),
        "cuda_graphs": _moved("cuda_graphs", "vllm"),
    }
    """Settings that became a backend's own (``SF_ENGINE_VLLM_SLEEP_MODE`` kept its
    variable; in a run file it moved from ``[engine] vllm_sleep_mode`` to
    ``[engine_vllm] sleep_mode``)."""

    engine_id: str = ""
    """Unique id of this worker; default ``engine-<host>-<pid>``."""

    backend: Annotated[str, ChosenFrom("sf_engine.backends.registry:ENGINE_BACKENDS")] = "hf"
    """Inference engine backend (``sf_engine.backends``), by its registered name."""

    max_batch_size: int = shared("engine_batch_size")
    """Requests decoded together."""

    max_context: int = 0
    """Prompt plus completion tokens per request; 0: the model's context (config.json),
    which the vLLM backend on a CPU lowers to one sequence of what its KV cache holds
    (``VLLM_CPU_KVCACHE_SPACE``, 1 GiB unless set)."""

    dtype: str = "auto"
    """Weights dtype of the engine: a torch dtype name, or ``auto``
    (``seamlessflow.machine.engine_dtype``, resolved when the settings are read):
    ``bfloat16`` on a CUDA device that computes it natively (the ``hf`` backend's
    ``SF_ENGINE_HF_DEVICE``; vLLM's GPU), ``float32`` on every CPU (float32 keeps
    logprobs comparable with the trainer, and an AVX2-only CPU computes bf16 ~40x
    slower)."""

    torch_threads: int = 1
    """torch intra-op threads (processes share a few cores in embedded mode)."""

    compact_heap: bool = True
    """Tune glibc's heap for tensors of megabytes before the engine is built, as the
    trainer does (``SF_TRAINER_COMPACT_HEAP``, ``seamlessflow.heap``): a fixed mmap
    threshold (freed blocks go back to the kernel) and one arena. An engine receives a
    whole weight set per version and frees the last one: with glibc's defaults the
    freed blocks stay in the heap. Measured with SmolLM2-135M-Instruct on the hf engine
    (docs/benchmarks.md, "An engine's heap"). This process only: vLLM's engine core is
    a process of its own. Off: glibc's defaults (``MALLOC_*`` variables still apply)."""

    interrupt_mode: Literal["keep", "abort", "wait"] = "keep"
    """How a new weight version reaches requests in flight (partial rollout):
    ``keep`` freezes them at a token boundary, swaps the weights under them and lets
    them continue (later tokens carry the new version); ``abort`` ends them with their
    partial tokens, which the gateway re-submits (prompt + partial ids) to any engine;
    ``wait`` loads only after the running batch finished (no interruption)."""

    trace_token_ids: bool = False
    """Audit mode: put the prompt and completion token ids on each ``engine.generate``
    span, so what the engine consumed and produced can be checked offline."""

    release_timeout_s: float = 10.0
    """Reclaimed: longest wait for the replies of the requests it handed back before it
    frees its slot anyway (the gateway's first-chunk and reply time-outs cover them)."""

    min_version_wait_s: float = 10.0
    """An engine lent back to rollout waits up to this long for weight-sync to announce
    the version the trainer just published before it serves."""

    version_poll_s: float = 5.0
    """How often to ask weight-sync for the current version (catches missed broadcasts)."""

    @model_validator(mode="after")
    def _dtype_from_the_hardware(self) -> EngineSettings:
        # resolved once, here: backends see a torch dtype name, never "auto"
        if self.dtype == "auto":
            own = BACKEND_SETTINGS.get(self.backend)
            self.dtype = engine_dtype("auto", own().model_device() if own else "cpu")
        return self


class HfSettings(RunFileSettings):
    """The ``hf`` backend's own settings (env prefix ``SF_ENGINE_HF_``; the backend is
    ``sf_engine.backends.hf_engine``, which imports torch and transformers: its settings
    live here, where reading them imports neither)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_ENGINE_HF_", extra="ignore", use_attribute_docstrings=True
    )

    device: str = "cpu"
    """torch device of the model (``cpu``, ``cuda``, ``cuda:1``). Several engines may
    share one GPU with the trainer: each process allocates only what its model and KV
    cache need."""

    prefix_cache_mb: int = Field(default=1024, ge=0)
    """MiB of finished requests' KV cache kept so that the next turn of a conversation
    (its prompt starts with the last turn's prompt and answer) prefills only its new
    tokens; cleared by every weight load. 0 turns reuse off. Size it to
    hold every concurrent conversation: sessions x context tokens x (layers x 2 x KV
    heads x head dim x dtype bytes), e.g. 64 x 500 x 46 KB = 1.5 GB for SmolLM2-135M in
    float32; the engine logs its hit rate at each weight load. (The ``vllm`` backend
    runs without prefix caching.)"""

    offload_asleep: Literal["auto", "on", "off"] = "auto"
    """While its slot is lent to training, the engine moves its weights to host memory
    and frees its kept KV, and brings the weights back when lent to rollout again
    (``seamlessflow.residency``); the kept KV is freed either way. ``auto``: on a CUDA
    device (a CPU engine's weights are in host memory already)."""

    def model_device(self) -> str:
        """Where the model computes (what ``dtype = "auto"`` is resolved for)."""
        return self.device


ENGINES_GPU_SHARE = 0.5
"""The part of one GPU's memory that a run's vLLM engines take together when its trainer
shares the card (vLLM's own default, 0.9 each, would leave the trainer a tenth)."""


class VllmSettings(RunFileSettings):
    """The ``vllm`` backend's own settings (env prefix ``SF_ENGINE_VLLM_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_ENGINE_VLLM_", extra="ignore", use_attribute_docstrings=True
    )

    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs one engine spans, its weights split across them (vLLM's
    ``tensor_parallel_size``): a model too large for one GPU, or a faster decode of a
    large one. Only vLLM splits a model: the other backends have no such setting."""

    cuda_graphs: bool | None = None
    """On a GPU: compile the model and capture CUDA graphs (vLLM without
    ``enforce_eager``): faster decode steps, a slower start. Unset: on where vLLM runs
    on a GPU (what a GPU deployment runs), off on a CPU, where vLLM's backend runs
    eagerly anyway (measured here for the test model: ~18 s eager against ~56 s
    compiled, cold)."""

    sleep_mode: bool | None = None
    """GPU + vLLM: put the engine to sleep (vLLM's level 1: weights to host memory, KV
    cache freed) while its slot is lent to training, and wake it when lent back
    (``enable_sleep_mode``). Unset: on where vLLM runs on a GPU. No effect on CPU."""

    prefix_caching: bool | None = None
    """Reuse the KV cache of prompts' common prefixes (the next turn of a conversation,
    a group's shared prompt); reset at every weight load, so no cached block computed
    with old weights is reused (requests frozen across a ``keep`` load are preempted and
    recomputed on the new weights). Unset: on where vLLM runs on a GPU, off on a CPU."""

    gpu_memory_utilization: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of the GPU's memory this engine may take for weights, activations and
    its KV cache (vLLM's ``gpu_memory_utilization``). 0: with ``colocated_engines`` set,
    ``ENGINES_GPU_SHARE`` (half the card) over those engines, the rest left to the
    trainer; else vLLM's default, 0.9 of the card."""

    colocated_engines: int = Field(default=0, ge=0)
    """Engines of this run that share the GPU with its trainer (``seamlessflow up`` sets
    it: its engines and trainer share the host's GPU); 0: none known."""

    def memory_utilization(self) -> float:
        """What vLLM is given (0: its own default)."""
        if self.gpu_memory_utilization or not self.colocated_engines:
            return self.gpu_memory_utilization
        return round(ENGINES_GPU_SHARE / self.colocated_engines, 3)

    def on_gpu(self) -> bool:
        return self.model_device() == "cuda"

    def resolved(self, setting: bool | None) -> bool:
        """A GPU-default setting, resolved: unset means on where vLLM runs on a GPU."""
        return self.on_gpu() if setting is None else setting

    def model_device(self) -> str:
        """vLLM places itself: on the GPU where there is one."""
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


BACKEND_SETTINGS: dict[str, type[HfSettings] | type[VllmSettings]] = {
    "hf": HfSettings,
    "vllm": VllmSettings,
}
"""The built-in backends' own settings that decide where their model computes (the
backends declare them too: ``EngineBackend.settings``)."""
