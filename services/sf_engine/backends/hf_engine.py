"""`TransformersEngine`: the `InferenceEngine` over a Hugging Face causal LM.

Meant for tests, tiny models and CPU runs; vLLM serves real models behind the same
interface.

Over 400 lines: the scheduler's event-loop side, the compute it runs on the worker thread
and the sampling share one batch state (`_BatchState`) and its invariants (left padding,
position ids, the prefix holes); the prefix cache itself is `prefix_cache`.

Scheduling (`batching.BatchingEngine`, shared with the scripted engine): one scheduler
task owns the running batch. Batching is continuous: at each token boundary the
scheduler drops finished and aborted rows and admits queued requests up to
`max_batch_size` (their prompts are prefilled, left-padded, and their KV cache is
merged into the running one). Admission is closed while paused or while a weight load
is pending, so a running batch drains on the weights it started with. Each step's torch
compute (prune, prefill, one decode step, sampling) runs in `asyncio.to_thread`; the
event loop stays free for NATS heartbeats.

Weights. Steps and weight copies hold one `asyncio.Lock`, and a step reads `version`
under it, so every token is labelled with the complete weight set that computed it and
no step ever sees a partial copy (a cancelled holder still waits for its thread). A tied
model's one matrix is in `state_dict()` under two names (`lm_head.weight` and
`model.embed_tokens.weight`); a load may give either or both (both: equal values).

Prefix reuse (`prefix_cache.PrefixCache`). When a request ends, the keys and values of
the tokens it fed the model are kept; a later request whose prompt starts with them
(the next turn of the same conversation) prefills only its new tokens, its row's cache
being the kept one, left-padded, followed by the new tokens. A weight copy clears the
cache, and a request prefilled before a copy is not kept, so a hit never mixes weight
sets.

Padding. Rows are left-padded (a reused prefix leaves a hole of padding between it and
the new tokens); `attention_mask` marks real tokens and `position_ids`
count real tokens only, so a row's logits do not depend on its batch mates (up to float
rounding), and seeded requests give the same tokens batched or alone.

Declared as the ``hf`` backend (``SF_ENGINE_BACKEND=hf``, the default) at the end of this
module: built from ``SF_ENGINE_DTYPE`` and its own settings (``HfSettings``:
``SF_ENGINE_HF_DEVICE``, ``SF_ENGINE_HF_PREFIX_CACHE_MB``); it runs a transformers
causal LM.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from seamlessflow.assets.loading import load_causal_lm
from seamlessflow.residency import Residency, Transition, resizable_parameters
from seamlessflow.weights.tied import tied_aliases
from sf_engine.settings import HfSettings

from .base import (
    GeneratedToken,
    GenerationStream,
    SamplingParams,
    TopLogprobs,
    check_request,
)
from .batching import BatchingEngine
from .prefix_cache import LayerKV, PrefixCache, PrefixEntry
from .registry import EngineBackend, declare

if TYPE_CHECKING:
    from sf_engine.settings import EngineSettings

_T = TypeVar("_T")

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: GenerationStream
    generator: torch.Generator
    produced: int = 0
    sampled: list[int] = field(default_factory=list)
    """Every token sampled for this request, emitted or not (an abort may drop one)."""
    weights_epoch: int = -1
    """The engine's weights epoch when this request was prefilled."""

    @property
    def done(self) -> bool:
        return self.stream.finished


@dataclass(eq=False)
class _BatchState:
    """Tensors of the running batch; row i belongs to the i-th running request."""

    cache: DynamicCache
    mask: torch.Tensor
    """[B, S] 1 for real tokens in the cache, 0 for left padding."""
    next_ids: torch.Tensor
    """[B] last sampled token of each row; not yet in the cache."""
    next_pos: torch.Tensor
    """[B] position id of `next_ids`."""


async def _to_thread_to_completion(fn: Callable[..., _T], *args: Any) -> _T:
    """`asyncio.to_thread`, but a cancelled caller still waits for the thread to end,
    so a lock held around this call is only released once the compute really stopped."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class TransformersEngine(BatchingEngine[_Request]):
    """Continuous-batching engine over `AutoModelForCausalLM` with a KV cache.

    Args:
        model: a model directory (loaded in `start`) or a built causal LM (moved to
            `device`/`dtype` in place).
        dtype: compute dtype of the weights; logits are upcast to fp32 for sampling.
        device: torch device.
        max_batch_size: most requests decoded together.
        max_context: limit on len(prompt) + max_tokens; defaults to the model's
            `max_position_embeddings`.
        version: version of the initial weights.
        prefix_cache_bytes: most bytes of finished requests' KV kept for reuse by
            requests that continue them (0: none).
        offload_asleep: `sleep` also moves the weights to host memory, `wake` brings
            them back (``seamlessflow.residency``); without it `sleep` frees the kept KV
            only.
    """

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_context: int | None = None,
        version: int = 0,
        prefix_cache_bytes: int = 2**30,
        offload_asleep: bool = False,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, max_context=max_context, version=version)
        self._offload_asleep = offload_asleep
        self._sleeping = False
        self._residency: Residency | None = None
        """The weights' residency, made at the first `sleep` that moves them."""
        self.transitions: collections.deque[Transition] = collections.deque(maxlen=16)
        """The latest sleeps and wakes, accounted (newest last)."""
        self._source = model
        self._dtype = dtype
        self._device = torch.device(device)

        self._model: PreTrainedModel | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._tied: dict[str, str] = {}
        """{alias: name} of state-dict entries that are one tensor (tied embeddings)."""
        self._vocab_size = 0
        self._can_merge = False
        self._compute_lock = asyncio.Lock()
        self._prefix = PrefixCache(prefix_cache_bytes)
        self._weights_epoch = 0
        """Counts weight copies; KV computed in another epoch is not reused."""

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._prefix

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._check_startable()
        if isinstance(self._source, str | Path):
            model = await asyncio.to_thread(_load_pretrained, Path(self._source), self._dtype)
        else:
            model = self._source
        model.to(device=self._device, dtype=self._dtype)  # type: ignore[call-arg]
        model.eval()
        if self._offload_asleep:
            resizable_parameters(model)  # a CPU model in its file's dtype is the file's mapping
        self._model = model
        self._params = dict(model.state_dict())
        self._tied = tied_aliases(self._params)
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        self._max_context = self._max_context_arg or model.config.max_position_embeddings
        # Merging caches of different lengths edits plain per-layer K/V tensors; other
        # cache layouts (sliding window, linear attention) get dynamic batching instead.
        probe = DynamicCache(config=model.config)
        self._can_merge = bool(probe.layers) and all(
            type(layer) is DynamicLayer for layer in probe.layers
        )
        if not self._can_merge:  # reuse edits the same plain per-layer tensors
            self._prefix = PrefixCache(0)
        self._start_scheduler("transformers-engine")

    # -- requests --------------------------------------------------------------------
    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        self._check_running()
        prompt = check_request(
            request_id,
            prompt_ids,
            params,
            live=self._live,
            vocab_size=self._vocab_size,
            max_context=self._max_context,
            constrains="transformers",
        )
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        req = _Request(
            request_id=request_id,
            prompt_ids=prompt,
            params=params,
            stream=GenerationStream(request_id, self.abort),
            generator=generator,
        )
        return self._admit(req)

    async def _swap_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.wake()  # the copy goes into the weights where they live
        async with self._compute_lock:
            await _to_thread_to_completion(self._copy_weights, state_dict, version)

    # -- sleep (the slot lent to training) -------------------------------------------
    async def sleep(self) -> None:
        """Free the KV kept for reuse and, with ``offload_asleep``, move the weights to
        host memory. Called with nothing in flight (after ``pause("abort")``)."""
        async with self._compute_lock:
            self._sleeping = True
            self._prefix.clear()
            if not self._offload_asleep or self._weights_away() or self._model is None:
                return
            weights = self._residency
            if weights is None:  # once: loads copy into the same tensors
                tensors = [*self._model.parameters(), *self._model.buffers()]
                # pinned host copies are slow to allocate: kept on CUDA
                keep = self._device.type == "cuda"
                weights = self._residency = Residency(tensors, self._device, keep)
            transition = await _to_thread_to_completion(weights.offload)
        self.transitions.append(transition)
        log.info("asleep: %s", transition.in_words())

    async def wake(self) -> None:
        async with self._compute_lock:
            if not self._weights_away():
                self._sleeping = False
                return
            assert self._residency is not None
            # a failed reload raises with the weights still off the device: retryable
            transition = await _to_thread_to_completion(self._residency.reload)
            self._sleeping = False
        self.transitions.append(transition)
        log.info("awake: %s", transition.in_words())

    def _weights_away(self) -> bool:
        return self._residency is not None and self._residency.state == "offloaded"

    # -- scheduler (event loop side) -------------------------------------------------
    async def _run_batch(self) -> None:
        state: _BatchState | None = None
        while True:
            await self._hold_if_kept()
            keep = [i for i, req in enumerate(self._running) if not req.done]
            new: list[_Request] = []
            if self._may_admit() and (self._can_merge or not keep):
                while self._queue and len(keep) + len(new) < self._max_batch_size:
                    new.append(self._queue.popleft())
            ended = [(i, req) for i, req in enumerate(self._running) if req.done]
            if not keep and not new:
                if state is not None and ended:
                    async with self._compute_lock:
                        if not self._sleeping:  # asleep, nothing is kept
                            await _to_thread_to_completion(self._keep_prefixes, state, ended)
                return
            self._running = [self._running[i] for i in keep] + new
            async with self._compute_lock:
                version = self._version
                state, tokens, logprobs, tops = await _to_thread_to_completion(
                    self._step, state, keep, ended, new, self._running
                )
            for req, token, logprob, top in zip(self._running, tokens, logprobs, tops, strict=True):
                req.sampled.append(token)
                self._emit(req, GeneratedToken(token, logprob, version, top))

    # -- compute (worker thread; touches only tensors and the requests' generators) ---
    def _step(
        self,
        state: _BatchState | None,
        keep: list[int],
        ended: list[tuple[int, _Request]],
        new: list[_Request],
        rows: list[_Request],
    ) -> tuple[_BatchState, list[int], list[float], list[TopLogprobs]]:
        with torch.inference_mode():
            logits = []
            if state is not None and len(keep) < state.mask.shape[0]:
                self._keep_prefixes(state, ended)
                state = self._select(state, keep) if keep else None
            if state is not None:
                logits.append(self._decode(state))
            if new:
                new_state, new_logits = self._prefill(new)
                state = new_state if state is None else self._merge(state, new_state)
                logits.append(new_logits)
            assert state is not None
            tokens, logprobs, tops = _sample(torch.cat(logits), rows)
            state.next_ids = tokens
            return state, tokens.tolist(), logprobs.tolist(), tops

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any):
        assert self._model is not None
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _prefill(self, reqs: list[_Request]) -> tuple[_BatchState, torch.Tensor]:
        """Prefill `reqs` as new rows: each row's cache is its reused prefix (if any),
        left-padded to the longest one, then its remaining prompt, left-padded."""
        reused: list[PrefixEntry | None] = []
        for req in reqs:
            req.weights_epoch = self._weights_epoch
            reused.append(self._prefix.lookup(req.prompt_ids) if self._prefix.enabled else None)
        past = [len(entry.tokens) if entry else 0 for entry in reused]
        rest = [req.prompt_ids[p:] for req, p in zip(reqs, past, strict=True)]
        p_width, width = max(past), max(len(r) for r in rest)
        ids = torch.zeros(len(reqs), width, dtype=torch.long, device=self._device)
        mask = torch.zeros(len(reqs), p_width + width, dtype=torch.long, device=self._device)
        pos = torch.zeros_like(ids)
        for i, (p, tail) in enumerate(zip(past, rest, strict=True)):
            ids[i, width - len(tail) :] = torch.tensor(tail)
            mask[i, p_width - p : p_width] = 1
            mask[i, p_width + width - len(tail) :] = 1
            pos[i, width - len(tail) :] = torch.arange(p, p + len(tail))
        cache = DynamicCache(config=self._model.config if self._model else None)
        if p_width:
            for layer, kv in enumerate(_stack_prefixes(reused, p_width)):
                cache.update(*kv, layer)
        logits = self._forward(ids, mask, pos, cache)
        next_pos = torch.tensor(
            [len(req.prompt_ids) for req in reqs], dtype=torch.long, device=self._device
        )
        return _BatchState(cache, mask, ids[:, -1], next_pos), logits

    def _keep_prefixes(self, state: _BatchState, ended: list[tuple[int, _Request]]) -> None:
        """Offer the KV of ended rows (row index in `state`, request) to the prefix cache:
        every token each fed the model, i.e. its prompt and its sampled tokens but the
        last, computed in the current weights epoch only."""
        if not self._prefix.enabled:
            return
        layers = _kv_layers(state.cache)
        for row, req in ended:
            if req.weights_epoch != self._weights_epoch or not req.sampled:
                continue
            tokens = req.prompt_ids + req.sampled[:-1]
            real = state.mask[row].nonzero().squeeze(1)
            if real.numel() != len(tokens):  # never expected; reuse must be exact
                log.warning("request %s: KV of %d tokens for %d ids; not kept",
                            req.request_id, real.numel(), len(tokens))  # fmt: skip
                continue
            kept: list[LayerKV] = []
            for layer in layers:
                keys, values = _kv(layer)
                kept.append((keys[row].index_select(1, real), values[row].index_select(1, real)))
            self._prefix.insert(tokens, kept)

    def _decode(self, state: _BatchState) -> torch.Tensor:
        ones = state.mask.new_ones(state.mask.shape[0], 1)
        state.mask = torch.cat([state.mask, ones], dim=-1)
        logits = self._forward(
            state.next_ids[:, None], state.mask, state.next_pos[:, None], state.cache
        )
        state.next_pos = state.next_pos + 1
        return logits

    def _select(self, state: _BatchState, keep: list[int]) -> _BatchState:
        idx = torch.tensor(keep, dtype=torch.long, device=self._device)
        state.cache.batch_select_indices(idx)
        state.mask = state.mask[idx]
        state.next_ids = state.next_ids[idx]
        state.next_pos = state.next_pos[idx]
        if self._can_merge:  # drop columns that are padding in every remaining row
            first = int(state.mask.any(dim=0).to(torch.int8).argmax())
            if first > 0:
                state.mask = state.mask[:, first:]
                for layer in _kv_layers(state.cache):
                    keys, values = _kv(layer)
                    layer.keys, layer.values = keys[:, :, first:], values[:, :, first:]
        return state

    def _merge(self, old: _BatchState, new: _BatchState) -> _BatchState:
        """Stack `new` rows under `old` rows, left-padding the shorter cache."""
        width = max(old.mask.shape[1], new.mask.shape[1])

        def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            return F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0)) if missing else t

        for lo, ln in zip(_kv_layers(old.cache), _kv_layers(new.cache), strict=True):
            (ko, vo), (kn, vn) = _kv(lo), _kv(ln)
            lo.keys = torch.cat([pad(ko, 2), pad(kn, 2)])
            lo.values = torch.cat([pad(vo, 2), pad(vn, 2)])
        old.mask = torch.cat([pad(old.mask, 1), pad(new.mask, 1)])
        old.next_ids = torch.cat([old.next_ids, new.next_ids])
        old.next_pos = torch.cat([old.next_pos, new.next_pos])
        return old

    def _check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in state_dict.items():
            target = self._params.get(name)
            if target is None:
                raise ValueError(f"unknown weight {name!r}")
            if not isinstance(tensor, torch.Tensor) or tensor.shape != target.shape:
                shape = getattr(tensor, "shape", type(tensor).__name__)
                raise ValueError(
                    f"weight {name!r}: expected shape {tuple(target.shape)}, got {shape}"
                )
        # A tied matrix may come under one name or both; both must then be the same values
        # (else the one copied last would silently win).
        for alias, name in self._tied.items():
            if alias in state_dict and name in state_dict:
                if not torch.equal(state_dict[alias], state_dict[name]):
                    raise ValueError(
                        f"tied weights {alias!r} and {name!r} differ; "
                        "the model has one matrix for both"
                    )

    def _copy_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if self._tied.get(name) in state_dict:
                    continue  # the same tensor, copied under its first name
                self._params[name].copy_(tensor)
        # Written under the compute lock, which every step reads `version` under.
        self._version = version
        self._weights_epoch += 1
        stats = self._prefix.stats
        if stats.lookups:
            log.info(
                "prefix cache on the weights before version %d: %d of %d prompts continued "
                "a kept one, "
                "%d of %d prompt tokens not prefilled again", version, stats.hits,
                stats.lookups, stats.reused_tokens, stats.prompt_tokens,
            )  # fmt: skip
        self._prefix.clear()  # and its stats: each load starts a new count


def _load_pretrained(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    return load_causal_lm(path, dtype)


def _stack_prefixes(reused: list[PrefixEntry | None], width: int) -> list[LayerKV]:
    """Per layer, [rows, heads, width, head_dim] keys and values: each row's reused KV
    right-aligned, zeros (masked out) before it and in rows without one."""
    sample = next(entry for entry in reused if entry is not None)
    stacked: list[LayerKV] = []
    for layer, (keys0, values0) in enumerate(sample.layers):
        keys = keys0.new_zeros(len(reused), keys0.shape[0], width, keys0.shape[2])
        values = values0.new_zeros(len(reused), values0.shape[0], width, values0.shape[2])
        for row, entry in enumerate(reused):
            if entry is not None:
                k, v = entry.layers[layer]
                keys[row, :, width - k.shape[1] :] = k
                values[row, :, width - v.shape[1] :] = v
        stacked.append((keys, values))
    return stacked


def _kv_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, which `start` checked are all plain `DynamicLayer`s."""
    return cast(list[DynamicLayer], cache.layers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def _sample(
    logits: torch.Tensor, rows: list[_Request]
) -> tuple[torch.Tensor, torch.Tensor, list[TopLogprobs]]:
    """Pick one token per row; return (token ids [B], logprobs [B], top logprobs per row).

    Each sampled row draws exactly one uniform from its own generator and inverts the
    CDF of its own (top-p truncated) distribution, so its token depends only on its
    logits, params and seed, never on its batch mates.
    """
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    full = [i for i, r in enumerate(rows) if not r.params.greedy and not r.params.truncated]
    cut = [i for i, r in enumerate(rows) if r.params.truncated]
    if full:
        idx = torch.tensor(full, device=logits.device)
        tokens[idx] = _invert_cdf(logp[idx].exp(), [rows[i] for i in full])
    if cut:
        # vLLM's order: keep the k most likely, then the nucleus of that renormalised set
        idx = torch.tensor(cut, device=logits.device)
        probs, order = logp[idx].exp().sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        k = torch.tensor([rows[i].params.top_k or vocab for i in cut], device=logits.device)
        rank = torch.arange(vocab, device=logits.device)
        probs = probs * (rank[None, :] < k[:, None])
        top_p = torch.tensor([rows[i].params.top_p for i in cut], device=logits.device)
        mass = probs.sum(dim=-1, keepdim=True)
        probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p[:, None] * mass)  # keeps >= 1
        picked = _invert_cdf(probs, [rows[i] for i in cut])
        tokens[idx] = order.gather(1, picked[:, None]).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), _top_logprobs(logp, rows)


def _top_logprobs(logp: torch.Tensor, rows: list[_Request]) -> list[TopLogprobs]:
    """The k most likely (token, logprob) of each row's distribution (k per row)."""
    k_max = max(r.params.top_logprobs for r in rows)
    if k_max == 0:
        return [()] * len(rows)
    values, ids = logp.topk(min(k_max, logp.shape[-1]), dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [
        tuple(
            zip(
                ids_l[i][: r.params.top_logprobs], values_l[i][: r.params.top_logprobs], strict=True
            )
        )
        for i, r in enumerate(rows)
    ]


def _invert_cdf(probs: torch.Tensor, rows: list[_Request]) -> torch.Tensor:
    """Index drawn from each row of unnormalized `probs` with that row's generator."""
    cdf = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=r.generator, device=probs.device) for r in rows])
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def _build(settings: EngineSettings, model_dir: str) -> TransformersEngine:
    own = HfSettings()
    return TransformersEngine(
        model_dir,
        dtype=getattr(torch, settings.dtype),
        device=own.device,
        max_batch_size=settings.max_batch_size,
        max_context=settings.max_context,
        prefix_cache_bytes=own.prefix_cache_mb * 2**20,
        offload_asleep=own.offload_asleep == "on"
        or (own.offload_asleep == "auto" and torch.device(own.device).type == "cuda"),
    )


BACKEND = declare(EngineBackend(name="hf", build=_build, settings=HfSettings))
