"""`ScriptedEngine`: an `InferenceEngine` that computes nothing, for load tests.

It keeps every contract of the interface except agreement with a model: tokens and
logprobs are a deterministic function of (prompt ids, seed), not of any weights. It
serves the gateway's data plane at the cost of a real engine's bookkeeping only, so a
load test measures the gateway, the bus and the trajectory write rather than torch.

What is real: continuous batching of up to `max_batch_size` requests, one token per
running request per decode step of `step_s` seconds; `max_tokens`, stop token ids,
`abort` at a token boundary (partial tokens kept), the three pause modes, and
`load_weights`, which checks names and shapes against the model's safetensors headers
(read without loading a tensor; torch is never imported) and then serves the new
version from the next step on. The weight values themselves are ignored.

What is scripted: each request owns a `random.Random` seeded from a hash of its prompt
ids and seed (the prompt alone when greedy; fresh entropy when the seed is None), and
draws exactly two numbers per step: so the same prompt and seed give the same tokens
batched or alone, and a different seed gives different tokens. Tokens come from the
tokenizer's ordinary vocabulary (added and special tokens, such as stop and tool-call
markers, are never drawn), so completions decode to plain text and run to their budget
unless a caller names an ordinary token as a stop id. A token's logprob is log(p) of a
scripted distribution in which it has mass p (>= 0.5 when greedy, so it is the argmax);
`top_logprobs` lists it with the k-1 next ordinary ids at geometrically smaller masses,
so the chosen token's entry equals its logprob. Temperature and top-p do not change the
draws.

Declared as the ``scripted`` backend (``SF_ENGINE_BACKEND=scripted``) at the end of this
module: its own settings are ``ScriptedSettings`` (``SF_ENGINE_SCRIPTED_``); it reads
only weight shapes, so any architecture will do, and it does not compute.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import math
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic_settings import SettingsConfigDict

from seamlessflow.assets.model_check import SHAPES_ONLY
from seamlessflow.runfile import RunFileSettings

from .base import (
    EngineError,
    GeneratedToken,
    GenerationStream,
    SamplingParams,
    TopLogprobs,
    check_request,
)
from .batching import BatchingEngine
from .registry import EngineBackend, declare

if TYPE_CHECKING:
    import torch

    from sf_engine.settings import EngineSettings


class ScriptedSettings(RunFileSettings):
    """scripted-engine settings (env prefix ``SF_ENGINE_SCRIPTED_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_ENGINE_SCRIPTED_", extra="ignore", use_attribute_docstrings=True
    )

    step_s: float = 0.001
    """Seconds one decode step takes; every running request gets one token per step
    (0 = as fast as the event loop turns)."""


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know of a model directory, read from its JSON files."""

    vocab_size: int
    max_context: int
    ordinary_ids: tuple[int, ...]
    """Ids the engine draws: the tokenizer's vocabulary minus added/special tokens."""
    weight_shapes: dict[str, tuple[int, ...]]
    """Name -> shape of every weight; empty when the directory has no safetensors."""


def read_model_shape(model_dir: Path) -> ModelShape:
    """config.json, tokenizer.json and the safetensors headers of ``model_dir``."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    vocab_size = int(text_config["vocab_size"])
    max_context = int(text_config.get("max_position_embeddings", 0)) or 2048
    ordinary: list[int] = list(range(vocab_size))
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():
        tokenizer = json.loads(tokenizer_file.read_text())
        added = {int(token["id"]) for token in tokenizer.get("added_tokens", [])}
        vocab = tokenizer.get("model", {}).get("vocab")
        if isinstance(vocab, dict):  # BPE / WordPiece: token -> id
            known = set(vocab.values())
        elif isinstance(vocab, list):  # Unigram: [piece, score] by id
            known = set(range(len(vocab)))
        else:
            known = set(ordinary)
        ordinary = sorted(i for i in known - added if 0 <= i < vocab_size)
    shapes = _safetensors_shapes(model_dir)
    tied = config.get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]  # in state_dict()
    return ModelShape(vocab_size, max_context, tuple(ordinary), shapes)


def _safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Each file's header: 8 bytes little-endian length, then JSON name -> dtype/shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(entry["shape"])
    return shapes


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    stream: GenerationStream
    rng: random.Random
    produced: int = 0

    @property
    def done(self) -> bool:
        return self.stream.finished


def _rng(prompt: list[int], params: SamplingParams) -> random.Random:
    if not params.greedy and params.seed is None:
        return random.Random()  # seeded from the OS: a fresh sample each time
    digest = hashlib.blake2b(array.array("q", prompt).tobytes(), digest_size=16)
    if not params.greedy:
        digest.update(f"seed:{params.seed}".encode())
    return random.Random(int.from_bytes(digest.digest(), "little"))


class ScriptedEngine(BatchingEngine[_Request]):
    """Continuous batching without compute; see the module docstring.

    Args:
        model_dir: a model directory; its config.json gives the vocabulary size and
            context, its tokenizer.json the ordinary ids, its safetensors headers the
            weight names and shapes `load_weights` accepts.
        shape: used instead of reading ``model_dir`` (tests without a model).
        max_batch_size: most requests decoded together; the rest wait in order.
        max_context: limit on len(prompt) + max_tokens; default the model's.
        step_s: seconds per decode step; default ``SF_ENGINE_SCRIPTED_STEP_S``.
        version: version of the initial weights.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        shape: ModelShape | None = None,
        max_batch_size: int = 64,
        max_context: int | None = None,
        step_s: float | None = None,
        version: int = 0,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, max_context=max_context, version=version)
        if (model_dir is None) == (shape is None):
            raise ValueError("give exactly one of model_dir and shape")
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._shape = shape
        self._step_s = ScriptedSettings().step_s if step_s is None else step_s
        if self._step_s < 0:
            raise ValueError(f"step_s must be >= 0, got {self._step_s}")

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._check_startable()
        if self._shape is None:
            assert self._model_dir is not None
            self._shape = await asyncio.to_thread(read_model_shape, self._model_dir)
        if len(self._shape.ordinary_ids) < 2:
            raise EngineError("the vocabulary has fewer than two ordinary tokens")
        self._max_context = self._max_context_arg or self._shape.max_context
        self._start_scheduler("scripted-engine")

    # -- requests --------------------------------------------------------------------
    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        self._check_running()
        assert self._shape is not None
        prompt = check_request(
            request_id,
            prompt_ids,
            params,
            live=self._live,
            vocab_size=self._shape.vocab_size,
            max_context=self._max_context,
            constrains="scripted",
        )
        req = _Request(
            request_id=request_id,
            params=params,
            stream=GenerationStream(request_id, self.abort),
            rng=_rng(prompt, params),
        )
        return self._admit(req)

    async def _swap_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        # Nothing to copy; steps read `version` only between steps, like a real swap.
        self._version = version

    def _check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        assert self._shape is not None
        known = self._shape.weight_shapes
        if not known:
            return  # no safetensors to check against: any names are accepted
        for name, tensor in state_dict.items():
            expected = known.get(name)
            if expected is None:
                raise ValueError(f"unknown weight {name!r}")
            shape = getattr(tensor, "shape", None)
            if shape is None or tuple(shape) != expected:
                got = type(tensor).__name__ if shape is None else tuple(shape)
                raise ValueError(f"weight {name!r}: expected shape {expected}, got {got}")

    # -- scheduler -------------------------------------------------------------------
    async def _run_batch(self) -> None:
        while True:
            await self._hold_if_kept()
            running = [req for req in self._running if not req.done]
            if self._may_admit():
                while self._queue and len(running) < self._max_batch_size:
                    running.append(self._queue.popleft())
            self._running = running
            if not running:
                return
            # Loads wait for `_batch_running` to drop (or a "keep" freeze, which only
            # happens between steps), so the version cannot change during the step.
            version = self._version
            await asyncio.sleep(self._step_s)
            for req in running:
                if not req.done:  # not aborted during the step
                    self._emit(req, self._draw(req, version))

    def _draw(self, req: _Request, version: int) -> GeneratedToken:
        """One step of ``req``: always two draws from its own generator."""
        assert self._shape is not None
        ordinary = self._shape.ordinary_ids
        index = req.rng.randrange(len(ordinary))
        u = req.rng.random()
        p = 0.5 + 0.45 * u if req.params.greedy else 0.05 + 0.9 * u
        token, logprob = ordinary[index], math.log(p)
        top: TopLogprobs = ()
        k = min(req.params.top_logprobs, len(ordinary))
        if k:
            entries = [(token, logprob)] + [
                (ordinary[(index + j) % len(ordinary)], math.log((1 - p) * 0.5**j))
                for j in range(1, k)
            ]
            top = tuple(sorted(entries, key=lambda entry: -entry[1]))
        return GeneratedToken(token, logprob, version, top)


def _build(settings: EngineSettings, model_dir: str) -> ScriptedEngine:
    return ScriptedEngine(
        model_dir, max_batch_size=settings.max_batch_size, max_context=settings.max_context
    )


BACKEND = declare(
    EngineBackend(
        name="scripted",
        build=_build,
        architecture=SHAPES_ONLY,
        settings=ScriptedSettings,
        computes=False,
    )
)
