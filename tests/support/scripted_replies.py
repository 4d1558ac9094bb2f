"""An engine whose answers a test scripts: the scripted engine (every contract of the
engine interface: batching, stop ids, budgets, aborts, versions) with the tokens of
given texts instead of its pseudo-random draws.

``scripted_engine(monkeypatch, replies)`` makes every ``EngineService`` of the test build
a ``ReplyEngine``; request k (in arrival order) is answered with ``replies[k]``
tokenized by the model's tokenizer, then the chat's end-of-turn token (a stop id). A
random-weights model cannot be made to write a tool call or a think block; this can,
and the tokens still go through the real worker, NATS, gateway and trajectory stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from sf_engine.backends.base import GeneratedToken, GenerationStream, SamplingParams
from sf_engine.backends.scripted_engine import ScriptedEngine


class ReplyEngine(ScriptedEngine):
    def __init__(self, model_dir: str, replies: list[list[int]], **kwargs: object) -> None:
        super().__init__(model_dir, **kwargs)  # type: ignore[arg-type]
        self._replies = replies
        self._scripts: dict[str, list[int]] = {}

    def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> GenerationStream:
        stream = super().stream(request_id, prompt_ids, params)
        if not self._replies:
            raise AssertionError("the test scripted fewer answers than were asked for")
        self._scripts[request_id] = self._replies.pop(0)
        return stream

    def _draw(self, req, version: int) -> GeneratedToken:  # type: ignore[no-untyped-def]
        drawn = super()._draw(req, version)
        script = self._scripts[req.request_id]
        token_id = script[min(req.produced, len(script) - 1)]
        top = ((token_id, drawn.logprob),) if req.params.top_logprobs else ()
        return GeneratedToken(token_id, drawn.logprob, version, top)


def script_tokens(model_dir: Path, texts: Sequence[str]) -> list[list[int]]:
    """Each text's tokens followed by the tokenizer's eos (the chat's end of turn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    return [[*tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]


def scripted_engine(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, texts: Sequence[str]
) -> list[list[int]]:
    """Workers started from now on answer with ``texts`` in order; returns their ids."""
    import sf_engine.service as engine_service

    replies = script_tokens(model_dir, texts)
    queue = list(replies)
    monkeypatch.setattr(
        engine_service,
        "build_engine",
        lambda settings, model_dir: ReplyEngine(
            model_dir, queue, max_batch_size=settings.max_batch_size, step_s=0.0
        ),
    )
    return replies
