"""`BatchingEngine`: the scheduling both in-process engines share.

`TransformersEngine` (torch) and `ScriptedEngine` (no compute) differ only in what one
decode step computes and in what loading weights copies; what a request goes through
is the same and lives here, once:

- one scheduler task (created by `_start_scheduler`, cancelled in `close`) owns the
  running batch; every other method only touches queues and flags on the event loop;
- admission is closed while paused or while a weight load is pending, so a running
  batch drains on the weights it started with (unless paused with "keep": the batch
  freezes at a token boundary, `_hold_if_kept`, and the load swaps the weights under it);
- `abort`, the three pause modes and `resume`; a step's tokens go to their streams
  through `_emit`, which ends a request on a stop id or at its budget;
- a failed step fails the requests it carried, not the engine.

A subclass implements `start` (then calls `_start_scheduler`), `stream` (builds its
request, then `_admit`), `_run_batch` (the decode loop), `_check_weights` and
`_swap_weights`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .base import (
    EngineError,
    EngineNotRunningError,
    FinishReason,
    GeneratedToken,
    GenerationStream,
    InferenceEngine,
    PauseMode,
    SamplingParams,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class BatchedRequest(Protocol):
    request_id: str
    params: SamplingParams
    stream: GenerationStream
    produced: int

    @property
    def done(self) -> bool: ...


R = TypeVar("R", bound=BatchedRequest)


class BatchingEngine(InferenceEngine, Generic[R]):
    def __init__(self, *, max_batch_size: int, max_context: int | None, version: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._max_batch_size = max_batch_size
        self._max_context_arg = max_context
        self._max_context = 0
        self._version = version

        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._live: dict[str, R] = {}
        self._queue: deque[R] = deque()
        self._running: list[R] = []
        self._batch_running = False
        self._frozen = False
        self._paused: PauseMode | None = None
        self._loads_pending = 0
        self._wakeup = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def _check_startable(self) -> None:
        if self._task is not None or self._closed:
            raise EngineError("engine already started")

    def _check_running(self) -> None:
        if self._task is None or self._closed:
            raise EngineNotRunningError("engine is not running")

    def _start_scheduler(self, name: str) -> None:
        self._task = asyncio.create_task(self._scheduler(), name=name)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in list(self._live.values()):
            self._finish(req, "abort")
        self._queue.clear()
        self._notify()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    # -- requests --------------------------------------------------------------------
    def _admit(self, req: R) -> GenerationStream:
        """Queue a request built by `stream` (after `check_request`)."""
        self._live[req.request_id] = req
        self._queue.append(req)
        self._notify()
        return req.stream

    async def abort(self, request_id: str) -> bool:
        req = self._live.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        if req in self._queue:
            self._queue.remove(req)
        self._notify()
        return True

    async def pause(self, mode: PauseMode) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._paused = mode
        self._notify()
        if mode == "abort":
            for req in list(self._live.values()):
                self._finish(req, "abort")
            self._queue.clear()
            await self._wait_until(lambda: not self._batch_running)
        elif mode == "wait":
            await self._wait_until(lambda: not self._batch_running)
        else:
            await self._wait_until(lambda: not self._batch_running or self._frozen)

    async def resume(self) -> None:
        self._paused = None
        self._notify()

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._check_running()
        self._check_weights(state_dict)
        self._loads_pending += 1  # closes admission: the running batch drains
        try:
            await self._wait_until(lambda: not self._batch_running or self._paused == "keep")
            await self._swap_weights(state_dict, version)
        finally:
            self._loads_pending -= 1
            self._notify()

    @abc.abstractmethod
    def _check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError for an unknown name or a wrong shape, before any copy."""

    @abc.abstractmethod
    async def _swap_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Install the weights and ``version``; no decode step runs meanwhile."""

    # -- scheduler (event loop side) -------------------------------------------------
    def _notify(self) -> None:
        """Wake every `_wait_until`; each re-checks its own predicate."""
        event, self._wakeup = self._wakeup, asyncio.Event()
        event.set()

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._wakeup.wait()

    def _may_admit(self) -> bool:
        return bool(self._queue) and self._paused is None and self._loads_pending == 0

    def _finish(self, req: R, reason: FinishReason) -> None:
        req.stream.finish(reason)
        self._live.pop(req.request_id, None)

    async def _hold_if_kept(self) -> None:
        """Between steps: paused with "keep" and requests unfinished, the batch freezes
        here (a weight load may swap under it) until the pause ends."""
        if self._paused == "keep" and any(not req.done for req in self._running):
            self._frozen = True
            self._notify()
            await self._wait_until(lambda: self._paused != "keep")
            self._frozen = False

    def _emit(self, req: R, token: GeneratedToken) -> None:
        """Hand one generated token to its request; end it on a stop id or its budget."""
        if req.done:  # aborted while the step ran
            return
        req.produced += 1
        req.stream.put(token)
        if token.token_id in req.params.stop_token_ids:
            self._finish(req, "stop")
        elif req.produced >= req.params.max_tokens:
            self._finish(req, "length")

    async def _scheduler(self) -> None:
        while True:
            await self._wait_until(self._may_admit)
            self._batch_running = True
            try:
                await self._run_batch()
            except Exception as exc:
                # A failed step fails the requests it carried, not the engine.
                log.exception("engine step failed; failing %d requests", len(self._running))
                for req in self._running:
                    req.stream.fail(EngineError(f"engine step failed: {exc!r}"))
                    self._live.pop(req.request_id, None)
            finally:
                self._running = []
                self._batch_running = False
                self._frozen = False
                self._notify()

    @abc.abstractmethod
    async def _run_batch(self) -> None:
        """Decode until no request is left: at each token boundary `_hold_if_kept`,
        drop finished rows, admit queued requests while `_may_admit`, run one step and
        `_emit` its tokens. Return when the batch is empty."""
