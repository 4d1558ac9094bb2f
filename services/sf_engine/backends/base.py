"""The inference-engine interface that every engine worker wraps.

Over 400 lines: the interface, its data types, their validation (`SamplingParams`,
`check_request`) and the stream every implementation returns form one contract, the one
`tests/unit/test_engine_contract.py` checks.

An engine turns (prompt token ids, sampling params) into a stream of generated tokens,
each carrying its token id, its behaviour logprob and the weight version that produced
it. Implementations: `TransformersEngine` (tests, tiny models, CPU), `VllmEngine` (over
vLLM's `AsyncLLM`) and `ScriptedEngine` (no compute, load tests); each declares itself in
`registry`. The shape follows `AsyncLLM`:

    engine.stream(request_id, prompt_ids, params)   ~ AsyncLLM.generate(...)
    await engine.abort(request_id)                  ~ AsyncLLM.abort(request_id)
    await engine.pause(mode) / engine.resume()      ~ AsyncLLM.pause_generation(mode=...)
                                                      / resume_generation()
    await engine.load_weights(state_dict, version)  ~ in-place weight update
    await engine.sleep() / engine.wake()            ~ AsyncLLM.sleep(level=1) / wake_up()

Logprob definition (the trainer recomputes exactly this from a plain forward pass over
prompt + completion, so engines must match it to ~1e-4 in fp32):

    temperature > 0:  log_softmax(logits / temperature)[token]   (before top-p truncation)
    temperature == 0: log_softmax(logits)[token]                  (greedy)

(top-k and top-p truncate what is sampled from, not what is reported.)

`top_logprobs` (if asked for) are the k largest entries of that same distribution, so
the chosen token's logprob equals its entry whenever it is among the k.

Invariants every engine keeps:
- `abort` ends a request at a token boundary: its stream finishes with reason "abort"
  and keeps every token delivered so far (the gateway re-submits prompt + partial ids).
- No decode step runs on a partially loaded weight set; each token's `version` is the
  version of the complete weight set that computed it.
- Bad input (invalid params, over-long prompt, unknown weight names) raises ValueError
  and changes no engine state.
"""

from __future__ import annotations

import abc
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Self

from seamlessflow.protocol import GREEDY_BELOW, SEEDS, TOP_P_MIN

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]

PauseMode = Literal["abort", "wait", "keep"]
"""How `InferenceEngine.pause` treats requests in flight (the `AsyncLLM` modes):

- "abort": every queued or running request finishes now with reason "abort" (partial
  tokens kept); requests submitted while paused wait for `resume`.
- "wait": stop admitting; requests already decoding run to completion; `pause` returns
  once none is decoding.
- "keep": freeze running requests at the next token boundary, keeping their state (KV
  cache); they continue after `resume`. A `load_weights` while kept swaps the weights
  under them: later tokens carry the new version (the KV cache of earlier tokens was
  computed with the old weights, like vLLM's `clear_cache=False`).
"""


MAX_TOP_LOGPROBS = 20

TopLogprobs = tuple[tuple[int, float], ...]
"""(token id, logprob) of the most likely tokens at one step, most likely first."""


class EngineError(RuntimeError):
    """Base of the errors an engine raises besides ValueError for bad input."""


class EngineNotRunningError(EngineError):
    """A request was submitted to an engine that is not started or already closed."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Invalid values raise ValueError at construction."""

    max_tokens: int
    """Maximum number of tokens to generate (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below ``GREEDY_BELOW``) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables truncation. Ignored when greedy.
    Below ``TOP_P_MIN`` it is raised to it (the nucleus is the most likely token)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (then top-p within them, as vLLM
    does); 0 (or -1, made 0) disables it. Ignored when greedy. Like top-p it does not
    change the reported logprobs, which are taken before truncation."""
    structured_output: str = ""
    """Constrained decoding, as the fields of vLLM's ``StructuredOutputsParams`` in JSON
    (``{"json_object": true}``, ``{"json": <schema>}``); empty: none. Only engines that
    constrain (vLLM) accept it; the others raise ValueError. Under a constraint the
    reported logprobs are of the constrained distribution, which the trainer cannot
    recompute: such turns are recorded as ``constrained`` and not trained."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these ids; the stop token is part of the output."""
    seed: int | None = None
    """Seed of this request's own RNG: same seed, prompt and weights give the same
    tokens regardless of which other requests share the batch."""
    top_logprobs: int = 0
    """Also report the ids and logprobs of the k most likely tokens at each step
    (0..MAX_TOP_LOGPROBS; 0 = none)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < TOP_P_MIN:
            object.__setattr__(self, "top_p", TOP_P_MIN)  # float32 would make it 0
        if self.structured_output:
            try:
                constraint = json.loads(self.structured_output)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output is not JSON: {exc}") from None
            if not isinstance(constraint, dict) or not constraint:
                raise ValueError("structured_output must be a non-empty JSON object")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {k!r}")
        if k == -1:
            object.__setattr__(self, "top_k", 0)
        stop = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and self.seed not in SEEDS:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncated(self) -> bool:
        """Sampled from a top-k and/or top-p truncation of the distribution."""
        return not self.greedy and (self.top_p < 1 or self.top_k > 0)


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    logprob: float
    """Behaviour logprob, see the module docstring for the exact definition."""
    version: int
    """Version of the weight set that produced this token."""
    top_logprobs: TopLogprobs = ()
    """The `SamplingParams.top_logprobs` most likely tokens of this step (same
    distribution as `logprob`); empty when none were asked for."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per token, as `GeneratedToken.top_logprobs` (empty if none were asked for)."""


def check_request(
    request_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    live: Container[str],
    vocab_size: int,
    max_context: int,
    constrains: str = "",
) -> list[int]:
    """Validate one submission for any engine; returns the prompt as a list.

    ``constrains``: empty for an engine that applies ``structured_output``, else the
    engine's name, for the error that refuses it.

    Raises ValueError (and so changes no engine state) for a wrong params type, an empty
    or duplicate request id, an empty prompt, ids outside the vocabulary, or a prompt +
    budget beyond the context.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if not request_id or not isinstance(request_id, str):
        raise ValueError("request_id must be a non-empty string")
    if request_id in live:
        raise ValueError(f"request {request_id!r} is already running")
    if params.structured_output and constrains:
        raise ValueError(
            f"response_format json_object/json_schema (constrained decoding) is not "
            f"supported by the {constrains} engine; use SF_ENGINE_BACKEND=vllm"
        )
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    bad: list[object] = [
        t
        for t in prompt
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
    ]
    if bad:
        raise ValueError(f"prompt_ids must be ints in [0, {vocab_size}), got e.g. {bad[0]!r}")
    if len(prompt) + params.max_tokens > max_context:
        raise ContextTooLong(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the context limit of {max_context} tokens"
        )
    return prompt


class ContextTooLong(ValueError):
    """The prompt and ``max_tokens`` exceed the engine's context (``check_request``)."""


class GenerationStream(AsyncIterator[GeneratedToken]):
    """Handle on one submitted request.

    Consumer side: `async for token in stream` yields every generated token once and
    ends when the request finishes; then `finish_reason` is set. `await result()` waits
    for the end and returns everything (whether or not the stream was iterated). A
    consumer that stops early calls `aclose()` (or uses `async with`), which aborts the
    request if it is still running. An engine failure is re-raised to the consumer.

    Producer side (engine implementations, on the event loop): `put`, `finish`, `fail`.
    After the request finished, further `put`/`finish` calls are ignored, so an abort
    is final the moment `abort()` returns even if a decode step was in flight.
    """

    def __init__(self, request_id: str, abort: Callable[[str], Awaitable[bool]]) -> None:
        self.request_id = request_id
        self.tokens: list[GeneratedToken] = []
        self.finish_reason: FinishReason | None = None
        self._abort = abort
        self._error: BaseException | None = None
        self._next = 0
        self._changed = asyncio.Event()
        self._done = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    # -- producer side ---------------------------------------------------------------
    def put(self, token: GeneratedToken) -> None:
        if not self.finished:
            self.tokens.append(token)
            self._changed.set()

    def finish(self, reason: FinishReason) -> None:
        if not self.finished:
            self.finish_reason = reason
            self._done.set()
            self._changed.set()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self._done.set()
            self._changed.set()

    # -- consumer side ---------------------------------------------------------------
    async def __anext__(self) -> GeneratedToken:
        while self._next >= len(self.tokens):
            if self._error is not None:
                raise self._error
            if self.finished:
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()
        token = self.tokens[self._next]
        self._next += 1
        return token

    async def batches(self) -> AsyncIterator[list[GeneratedToken]]:
        """Like iterating, but each item is every token that arrived since the last one
        (one decode step's worth while the consumer keeps up). Shares the cursor with
        `__anext__`."""
        while True:
            if self._next < len(self.tokens):
                batch = self.tokens[self._next :]
                self._next = len(self.tokens)
                yield batch
                continue
            if self._error is not None:
                raise self._error
            if self.finished:
                return
            self._changed.clear()
            await self._changed.wait()

    async def result(self) -> GenerationResult:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self.finish_reason is not None
        return GenerationResult(
            token_ids=[t.token_id for t in self.tokens],
            logprobs=[t.logprob for t in self.tokens],
            versions=[t.version for t in self.tokens],
            finish_reason=self.finish_reason,
            top_logprobs=[t.top_logprobs for t in self.tokens]
            if any(t.top_logprobs for t in self.tokens)
            else [],
        )

    async def aclose(self) -> None:
        """Abort the request if it is still running; idempotent."""
        if not self.finished:
            await self._abort(self.request_id)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class InferenceEngine(abc.ABC):
    """One inference engine behind the engine-worker role of the rollout gateway.

    Lifecycle: `await start()` ... `await close()` (or `async with engine:`). `close` is
    idempotent and finishes every live request with reason "abort".
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Version of the weight set the next decode step will use."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        """Submit a request and return its stream; the request is queued immediately.

        Raises ValueError (nothing submitted) for an empty/out-of-vocabulary prompt, a
        prompt + max_tokens over the context limit, or a request_id already live; and
        EngineNotRunningError if the engine is not started or closed. While the engine
        is paused, the request is accepted and waits for `resume`.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End a queued or running request with reason "abort", keeping its tokens so
        far. Returns False if the request is unknown or already finished."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> None:
        """Stop generation (see `PauseMode`); returns once the mode's effect holds."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo `pause`; idempotent."""

    @abc.abstractmethod
    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace weights in place and set `version`; returns once loaded.

        Unless paused with mode "keep", a request already decoding finishes on the old
        weights: no new request is admitted until the load is done, and the load waits
        for the running batch. No decode step runs while the copy is in progress, so
        no token is ever computed from a partially loaded set. Unknown names or shape
        mismatches raise ValueError before anything is copied.
        """

    async def sleep(self) -> None:  # noqa: B027 (an optional hook; default: nothing held)
        """Release what the engine holds between requests (KV cache; on GPU, weights
        offloaded) so its slot can train. Called with nothing in flight, after
        ``pause("abort")``. The default holds nothing between requests: a no-op."""

    async def wake(self) -> None:  # noqa: B027 (an optional hook)
        """Undo `sleep`; the engine serves again after `resume`. Idempotent."""

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationResult:
        """Run one request to the end. Cancelling the caller aborts the request."""
        stream = self.stream(request_id, prompt_ids, params)
        try:
            return await stream.result()
        finally:
            await stream.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
