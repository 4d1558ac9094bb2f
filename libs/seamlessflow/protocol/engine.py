"""Engine messages: generate (with streamed chunks), abort, shed, load weights.

The gateway asks an engine worker of a policy to generate; the tag-scheduler asks one to
hand requests over to a freshly lent engine; weight-sync tells engines which weights to
load. Also the sampling limits every engine applies the same way (``GREEDY_BELOW``,
``SEEDS``, ``TOP_P_MIN``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from seamlessflow.protocol.base import Message
from seamlessflow.protocol.weights import WeightManifest


class GenerateRequest(Message, tag="engine.generate"):
    """rollout-gateway -> engine worker (queue group): generate a continuation of prompt_ids."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    """0 = greedy; so is any temperature below ``GREEDY_BELOW``."""
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens (0 = all); like top_p, it does not change
    the reported logprobs (taken before truncation)."""
    structured_output: str = ""
    """Constrained decoding (``response_format``), as the fields of vLLM's
    ``StructuredOutputsParams`` in JSON; empty: none. Engines that cannot constrain
    answer it with a bad_request error."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None
    """In ``SEEDS``."""
    top_logprobs: int = 0
    """How many most likely alternatives to report per generated token (0-20)."""
    stream_subject: str = ""
    """If set, the engine also publishes GenerateChunk messages here as tokens appear;
    the final GenerateReply still carries every token."""
    chunk_every_s: float = 0.0
    """Token chunks at most this often (0: one per decode step; chunk 0, which names
    the engine, is always sent at once). A caller that does not stream the answer
    needs the tokens so far only to re-route a dead engine's request: fewer messages."""
    min_version: int = 0
    """The engine starts this request only on weights of at least this version: one
    that holds older ones first catches up (waiting up to ``SF_ENGINE_MIN_VERSION_WAIT_S``
    for weight-sync to announce it). 0: any version."""


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily, as in vLLM: logits divided by a temperature
that small overflow float32 and the logprobs become NaN or -inf."""

SEEDS = range(-(2**63), 2**64)
"""The seeds a request may carry: what a 64-bit generator takes (torch's reads a
negative seed modulo 2**64)."""

TOP_P_MIN = 2.0**-126
"""float32's smallest normal value: a smaller ``top_p`` is raised to it, since float32
(an engine's sampler) would round it to 0, a nucleus of no token. Either keeps only the
most likely token."""


UNRECORDED_TEMPERATURE = -1.0
"""The temperature of a token whose turn was recorded before turns carried their
sampling temperature (a replay of an older run's streams): the trainer recomputes its
logprob at ``SF_TRAINER_TEMPERATURE``, as trainers did then."""


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class GenerateChunk(Message, tag="engine.generate.chunk"):
    """engine worker -> rollout-gateway (core, on ``stream_subject``): new tokens so far.

    Chunks of one request are numbered from 0; chunk 0 has no tokens and only names the
    engine. A gateway that misses one falls back to the final GenerateReply, which is
    authoritative.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[TopLogprob]] = msgspec.field(default_factory=list)
    engine_id: str = ""
    """Which engine is generating: lets the gateway re-route if that engine dies."""


class GenerateReply(Message, tag="engine.generate.reply"):
    """engine worker -> rollout-gateway: the tokens, their behaviour logprobs and versions."""

    request_id: str
    engine_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    top_logprobs: list[list[TopLogprob]] = msgspec.field(default_factory=list)
    resume_on: str = ""
    """With ``abort``: the engine to re-submit the rest to (the request was shed onto a
    freshly lent engine, ``ShedRequests``); empty: any engine of the queue group."""


class ShedRequests(Message, tag="engine.shed"):
    """tag-scheduler -> engine worker (request; rebalance on lend): end up to ``count``
    of your requests in flight at a token boundary, the most recently started first,
    and name ``to_engine`` in their replies, so the gateway resumes them there."""

    to_engine: str
    count: int


class ShedReport(Message, tag="engine.shed.report"):
    """engine worker -> tag-scheduler: how many requests it handed over."""

    engine_id: str
    handed_over: int


class AbortGeneration(Message, tag="engine.abort"):
    """rollout-gateway -> engine workers (broadcast): stop a request at a token boundary."""

    request_id: str
    reason: str


class LoadWeights(Message, tag="engine.load"):
    """weight-sync -> engine workers (broadcast): load this payload. An engine whose
    weights are not ``manifest.base_version`` (a delta after a gap) asks
    ``weights.current`` for the whole chain instead."""

    manifest: WeightManifest


class WeightsLoaded(Message, tag="engine.loaded"):
    """engine worker -> weight-sync: the version this engine now serves."""

    engine_id: str
    version: int
