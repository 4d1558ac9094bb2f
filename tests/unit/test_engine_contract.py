"""The `InferenceEngine` contract, run against every registered engine backend
(`sf_engine.backends.ENGINE_BACKENDS`: transformers, vLLM, the scripted engine, and any
backend added later), each built as a worker builds it, from `EngineSettings`.

One engine instance per backend is shared by the whole module (vLLM starts in
18-56 s), so tests that load weights restore the base weights before they return and
compare versions relative to `engine.version` at their start. What a backend declares
decides the rest: one that `starts_slowly` (vLLM) is marked `slow`; one whose optional
packages do not import is skipped with the reason its declaration gives (the main venv
has no vLLM; install the `vllm` extra, then remove torchvision/torchaudio/torchcodec/
triton, see STACK.md); only one with `structured_output` must honour a grammar.

A backend that does not `compute` (the scripted engine: no model compute, for load
tests) keeps every part of the contract except agreement with the model: the checks of
logprobs and top logprobs against a forward pass, and of tokens changing with the
weights, are skipped for it (its versions, lengths, stops, aborts, pauses, seeding and
weight-name checks are tested like any engine's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from sf_engine.backends import (
    ENGINE_BACKENDS,
    EngineBackend,
    GenerationResult,
    InferenceEngine,
    SamplingParams,
)
from sf_engine.settings import EngineSettings

torch.set_num_threads(1)

pytestmark = [
    # vLLM's own import-time chatter (torch deprecations seen from vllm modules).
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

MAX_CONTEXT = 256
MAX_BATCH_SIZE = 16
"""Every request of a test in one batch: `test_many_long_seeded_prompts_at_once` needs
its 16 prompts prefilled together."""
PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 9, [200, 13], list(range(100, 117))]
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(max_tokens=25, temperature=1.3, seed=2),
    SamplingParams(max_tokens=5, temperature=1.0, top_p=0.5, seed=3),
    SamplingParams(max_tokens=16, seed=4),
]


def _backend_params() -> list[Any]:
    """One test parameter per registered backend; a slow starter is marked ``slow``."""
    params = []
    for name in ENGINE_BACKENDS.names():
        slow = ENGINE_BACKENDS.get(name).starts_slowly
        params.append(pytest.param(name, marks=[pytest.mark.slow] if slow else []))
    return params


def _available_or_skip(backend: EngineBackend) -> None:
    reason = backend.unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real base model (tokenizer + untied Qwen2) with a short SFT."""
    from sf_app.base_model import build_base_model

    return build_base_model(tmp_path_factory.mktemp("contract") / "base", seed=0, sft_steps=8)


@pytest.fixture(scope="module")
def base_model(model_dir: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def base_weights(base_model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in base_model.state_dict().items()}


@pytest.fixture(scope="module")
def other_weights(base_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A complete, clearly different weight set of the same shapes."""
    gen = torch.Generator().manual_seed(1)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in base_weights.items()}


@pytest.fixture(scope="module")
def other_model(base_model: PreTrainedModel, other_weights) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_config(base_model.config)
    model.load_state_dict(other_weights)
    return model.eval()


@pytest.fixture(scope="module", params=_backend_params())
def backend(request: pytest.FixtureRequest) -> EngineBackend:
    """The declaration of the backend under test (skipped where it cannot run)."""
    declared = ENGINE_BACKENDS.get(request.param)
    _available_or_skip(declared)
    return declared


@pytest.fixture(scope="module")
async def engine(backend: EngineBackend, model_dir: Path) -> AsyncIterator[InferenceEngine]:
    settings = EngineSettings(max_batch_size=MAX_BATCH_SIZE, max_context=MAX_CONTEXT)
    async with backend.build(settings, str(model_dir)) as eng:
        yield eng


def _skip_unless_computes(backend: EngineBackend) -> None:
    if not backend.computes:
        pytest.skip(f"the {backend.name} engine does not compute with the model's weights")


def _reference_logprobs(
    model: PreTrainedModel, prompt: list[int], res: GenerationResult, params: SamplingParams
) -> list[float]:
    """The trainer's recomputation: one plain forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(res.token_ids)]


async def _generate_all(eng: InferenceEngine, tag: str) -> list[GenerationResult]:
    return await asyncio.gather(
        *(
            eng.generate(f"{tag}{i}", p, s)
            for i, (p, s) in enumerate(zip(PROMPTS, PARAMS, strict=True))
        )
    )


async def test_lengths_versions_and_logprobs_match_forward(
    engine: InferenceEngine, backend: EngineBackend, base_model: PreTrainedModel
) -> None:
    version = engine.version
    results = await _generate_all(engine, "lp")
    for prompt, params, res in zip(PROMPTS, PARAMS, results, strict=True):
        assert len(res.token_ids) == len(res.logprobs) == len(res.versions) == params.max_tokens
        assert res.finish_reason == "length"
        assert res.versions == [version] * params.max_tokens
        if backend.computes:
            ref = _reference_logprobs(base_model, prompt, res, params)
            assert res.logprobs == pytest.approx(ref, abs=1e-4)


async def test_top_logprobs_match_forward(
    engine: InferenceEngine, backend: EngineBackend, base_model: PreTrainedModel
) -> None:
    prompt = [4, 40, 400]
    cases = [
        SamplingParams(max_tokens=6, temperature=0, top_logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.5, seed=7, top_logprobs=5),
        SamplingParams(max_tokens=6, seed=7),
    ]
    results = await asyncio.gather(
        *(engine.generate(f"top{i}", prompt, p) for i, p in enumerate(cases))
    )
    assert results[2].top_logprobs == []  # not asked for
    for params, res in zip(cases[:2], results[:2], strict=True):
        assert len(res.top_logprobs) == len(res.token_ids)
        with torch.no_grad():
            logits = base_model(torch.tensor([prompt + res.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
        for j, (token, top) in enumerate(zip(res.token_ids, res.top_logprobs, strict=True)):
            assert len(top) == params.top_logprobs
            values = [lp for _, lp in top]
            assert values == sorted(values, reverse=True)
            if params.greedy:
                assert top[0][0] == token  # the greedy token is the most likely
            if token in dict(top):
                assert dict(top)[token] == pytest.approx(res.logprobs[j], abs=1e-6)
            if not backend.computes:
                continue
            ref_values = logp[len(prompt) - 1 + j].topk(params.top_logprobs).values
            assert values == pytest.approx(ref_values.tolist(), abs=1e-4)
            for token_id, lp in top:
                assert lp == pytest.approx(logp[len(prompt) - 1 + j, token_id].item(), abs=1e-4)


async def test_top_k_samples_among_the_k_most_likely_and_reports_full_logprobs(
    engine: InferenceEngine, backend: EngineBackend, base_model: PreTrainedModel
) -> None:
    """top_k (alone, and with top_p inside the k as vLLM applies them): every sampled
    token is among the k most likely (and in the nucleus of those k), while its logprob
    is still the untruncated one the trainer recomputes. A high temperature flattens the
    distribution, so ignoring top_k would sample outside the k."""
    _skip_unless_computes(backend)
    prompt = [4, 40, 400]
    cases = [SamplingParams(max_tokens=10, temperature=2.0, top_k=2, seed=s) for s in range(4)]
    cases.append(SamplingParams(max_tokens=10, temperature=2.0, top_k=6, top_p=0.5, seed=9))
    results = await asyncio.gather(
        *(engine.generate(f"topk{i}", prompt, p) for i, p in enumerate(cases))
    )
    margin = 1e-3  # far above the 1e-4 engine/forward agreement: ties cannot flip a rank
    for params, res in zip(cases, results, strict=True):
        assert res.logprobs == pytest.approx(
            _reference_logprobs(base_model, prompt, res, params), abs=1e-4
        )
        with torch.no_grad():
            logits = base_model(torch.tensor([prompt + res.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        for j, token in enumerate(res.token_ids):
            row = logp[len(prompt) - 1 + j]
            above = row > row[token] + margin  # surely more likely than the sampled token
            assert int(above.sum()) < params.top_k
            kept = row.topk(params.top_k).values.exp()
            before = float(row[above].exp().sum() / kept.sum())  # nucleus mass before it
            assert before < params.top_p + margin


async def test_structured_output_gives_schema_json_where_declared_and_is_refused_elsewhere(
    engine: InferenceEngine, backend: EngineBackend, model_dir: Path
) -> None:
    """response_format's constraint: a backend that declares structured outputs (vLLM)
    makes the completion JSON of the schema; one that cannot constrain raises ValueError
    naming the backend that can."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    params = SamplingParams(
        max_tokens=40,
        seed=3,
        stop_token_ids=(tokenizer.eos_token_id,),
        structured_output=json.dumps({"json": schema, "disable_any_whitespace": True}),
    )
    if not backend.structured_output:
        with pytest.raises(ValueError, match="SF_ENGINE_BACKEND=vllm"):
            engine.stream("so-refused", [1, 2, 3], params)
        return
    results = await asyncio.gather(
        *(engine.generate(f"so{i}", [1, 2, 3 + i], params) for i in range(3))
    )
    for res in results:
        assert res.finish_reason == "stop"
        text = tokenizer.decode(res.token_ids[:-1])
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3), text
        assert set(value) == {"ok", "n"}


async def test_seeded_and_greedy_are_reproducible(engine: InferenceEngine) -> None:
    prompt = [5, 6, 7]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    a = await engine.generate("g1", prompt, greedy)
    b = await engine.generate("g2", prompt, greedy)
    assert a.token_ids == b.token_ids
    seeded = [SamplingParams(max_tokens=16, seed=s) for s in (11, 11, 12)]
    c, d, e = await asyncio.gather(
        *(engine.generate(f"s{i}", prompt, p) for i, p in enumerate(seeded))
    )
    alone = await engine.generate("s-alone", prompt, seeded[0])
    assert c.token_ids == d.token_ids == alone.token_ids  # batched or not
    assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert c.token_ids != e.token_ids


async def test_many_long_seeded_prompts_at_once(engine: InferenceEngine) -> None:
    """More prompt tokens than one vLLM step takes by default (2048): vLLM 0.32 on CPU
    dies if it splits a seeded request's prefill over steps (chunked prefill)."""
    prompts = [[(7 * i + j) % 500 + 1 for j in range(200)] for i in range(16)]
    results = await asyncio.gather(
        *(
            engine.generate(f"long{i}", p, SamplingParams(max_tokens=4, seed=i))
            for i, p in enumerate(prompts)
        )
    )
    assert [r.finish_reason for r in results] == ["length"] * 16


async def test_release_and_rejoin_for_a_lent_slot(engine: InferenceEngine) -> None:
    """What an engine on a training slot goes through when reclaimed and lent again:
    pause("abort") ends requests with their tokens, sleep frees memory, wake + resume
    serve again with the same weights (a seeded answer is unchanged)."""
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=12, seed=21)
    before = await engine.generate("lend-before", prompt, params)
    running = engine.stream("lend-running", list(range(10, 30)), SamplingParams(max_tokens=200))
    await running.__anext__()  # decoding has started
    await engine.pause("abort")
    cut = await running.result()
    assert cut.finish_reason == "abort" and 1 <= len(cut.token_ids) < 200
    await engine.sleep()
    await engine.sleep()  # idempotent
    await engine.wake()
    await engine.resume()
    after = await engine.generate("lend-after", prompt, params)
    assert after.token_ids == before.token_ids and after.versions == before.versions


async def test_stop_token_and_length(engine: InferenceEngine) -> None:
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_tokens=12, seed=21)
    ref = await engine.generate("ref", prompt, params)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12
    stop = ref.token_ids[4]
    cut = ref.token_ids.index(stop) + 1
    stopping = SamplingParams(max_tokens=12, seed=21, stop_token_ids=(stop, 511))
    res = await engine.generate("stop", prompt, stopping)
    assert res.finish_reason == "stop"
    assert res.token_ids == ref.token_ids[:cut]  # the stop token is included
    assert len(res.logprobs) == len(res.versions) == cut


async def test_abort_returns_partial_tokens(engine: InferenceEngine) -> None:
    params = SamplingParams(max_tokens=200, seed=5)
    running = engine.stream("run", [1, 2, 3], params)
    async for _ in running:
        if len(running.tokens) == 3:
            break
    assert await engine.abort("run")
    assert not await engine.abort("run")
    assert not await engine.abort("never-submitted")
    res = await running.result()
    assert res.finish_reason == "abort" and 3 <= len(res.token_ids) < 200
    assert len(res.logprobs) == len(res.versions) == len(res.token_ids)
    full = await engine.generate("full", [1, 2, 3], SamplingParams(max_tokens=10, seed=5))
    assert res.token_ids[:3] == full.token_ids[:3]
    # Aborted before producing anything: no tokens, reason "abort".
    early = engine.stream("early", [1, 2, 3], params)
    assert await engine.abort("early")
    assert (await early.result()).finish_reason == "abort"


async def test_cancelled_generate_aborts(engine: InferenceEngine) -> None:
    task = asyncio.create_task(engine.generate("c", [1], SamplingParams(max_tokens=250)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await engine.abort("c")  # already gone


async def test_pause_abort_ends_in_flight_and_queues_new(engine: InferenceEngine) -> None:
    running = engine.stream("pa-r", [1, 2], SamplingParams(max_tokens=200))
    await running.__anext__()
    await engine.pause("abort")
    try:
        res = await running.result()
        assert res.finish_reason == "abort" and 1 <= len(res.token_ids) < 200
        held = engine.stream("pa-h", [1, 2], SamplingParams(max_tokens=3))
        await asyncio.sleep(0.3)  # a window in which nothing may happen: the test's subject
        assert held.tokens == [] and not held.finished
    finally:
        await engine.resume()
    done = await held.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 3


async def test_pause_wait_drains_and_holds_new(engine: InferenceEngine) -> None:
    running = engine.stream("pw-r", [1, 2], SamplingParams(max_tokens=30))
    await running.__anext__()
    await engine.pause("wait")
    try:
        assert (await running.result()).finish_reason == "length"
        held = engine.stream("pw-h", [1, 2], SamplingParams(max_tokens=3))
        await asyncio.sleep(0.3)  # a window in which nothing may happen: the test's subject
        assert held.tokens == [] and not held.finished
    finally:
        await engine.resume()
    assert len((await held.result()).token_ids) == 3


async def test_load_weights_changes_outputs_and_versions(
    engine: InferenceEngine,
    backend: EngineBackend,
    base_weights: dict[str, torch.Tensor],
    other_weights: dict[str, torch.Tensor],
    other_model: PreTrainedModel,
) -> None:
    v0 = engine.version
    prompt = [9, 8, 7]
    params = SamplingParams(max_tokens=16, seed=3)
    before = await engine.generate("lw-a", prompt, params)
    await engine.load_weights(other_weights, version=v0 + 1)
    try:
        assert engine.version == v0 + 1
        after = await engine.generate("lw-b", prompt, params)
        assert before.versions == [v0] * 16 and after.versions == [v0 + 1] * 16
        if backend.computes:
            assert before.token_ids != after.token_ids
            # Every weight was replaced: the new outputs are exactly the other model's.
            ref = _reference_logprobs(other_model, prompt, after, params)
            assert after.logprobs == pytest.approx(ref, abs=1e-4)
    finally:
        await engine.load_weights(base_weights, version=v0 + 2)
    again = await engine.generate("lw-c", prompt, params)
    assert again.token_ids == before.token_ids and again.versions == [v0 + 2] * 16
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-4)


async def test_weights_sent_in_bf16_are_served_as_their_rounded_values(
    engine: InferenceEngine,
    backend: EngineBackend,
    base_model: PreTrainedModel,
    base_weights: dict[str, torch.Tensor],
    other_weights: dict[str, torch.Tensor],
) -> None:
    """``SF_WEIGHTS_DTYPE=bfloat16`` hands engines bf16 tensors: each engine converts
    them to its own dtype, and serves exactly the rounded weights."""
    _skip_unless_computes(backend)
    rounded = {k: v.bfloat16() for k, v in other_weights.items()}
    reference: PreTrainedModel = AutoModelForCausalLM.from_config(base_model.config)
    reference.load_state_dict({k: v.float() for k, v in rounded.items()})
    reference.eval()
    v0 = engine.version
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=12, seed=4)
    await engine.load_weights(rounded, version=v0 + 1)
    try:
        after = await engine.generate("bf16-a", prompt, params)
        ref = _reference_logprobs(reference, prompt, after, params)
        assert after.logprobs == pytest.approx(ref, abs=1e-4)
    finally:
        await engine.load_weights(base_weights, version=v0 + 2)


async def test_load_during_generation_is_never_partial(
    engine: InferenceEngine,
    backend: EngineBackend,
    base_weights: dict[str, torch.Tensor],
    other_weights: dict[str, torch.Tensor],
    base_model: PreTrainedModel,
    other_model: PreTrainedModel,
) -> None:
    v0 = engine.version
    params = SamplingParams(max_tokens=60, seed=8)
    prompt = [1, 2, 3]
    long = engine.stream("ld-long", prompt, params)
    await long.__anext__()
    load = asyncio.create_task(engine.load_weights(other_weights, version=v0 + 1))
    await asyncio.sleep(0.05)
    late = engine.stream("ld-late", prompt, params)  # not admitted until the load is done
    try:
        res = await long.result()
        await load
        late_res = await late.result()
    finally:
        await engine.load_weights(base_weights, version=v0 + 2)
    # The running request finished on the old weights, the late one ran on the new.
    assert res.finish_reason == "length" and res.versions == [v0] * 60
    assert late_res.versions == [v0 + 1] * 60
    if not backend.computes:
        return
    ref_old = _reference_logprobs(base_model, prompt, res, params)
    ref_new = _reference_logprobs(other_model, prompt, late_res, params)
    assert res.logprobs == pytest.approx(ref_old, abs=1e-4)
    assert late_res.logprobs == pytest.approx(ref_new, abs=1e-4)


async def test_pause_keep_then_load_continues_on_new_version(
    engine: InferenceEngine,
    base_weights: dict[str, torch.Tensor],
    other_weights: dict[str, torch.Tensor],
) -> None:
    v0 = engine.version
    running = engine.stream("pk", [1, 2], SamplingParams(max_tokens=40, seed=9))
    await running.__anext__()
    await engine.pause("keep")
    try:
        frozen = len(running.tokens)
        await asyncio.sleep(0.2)  # a window in which nothing may happen: the test's subject
        assert len(running.tokens) == frozen and not running.finished
        await engine.load_weights(other_weights, version=v0 + 1)
    finally:
        await engine.resume()
    res = await running.result()
    await engine.load_weights(base_weights, version=v0 + 2)
    assert res.finish_reason == "length"
    assert res.versions == [v0] * frozen + [v0 + 1] * (40 - frozen)


async def test_bad_input_raises_value_error_and_changes_nothing(
    engine: InferenceEngine, base_weights: dict[str, torch.Tensor]
) -> None:
    v0 = engine.version
    ok = SamplingParams(max_tokens=4, seed=1)
    before = await engine.generate("bi-before", [1, 2], ok)
    for bad in (
        {"max_tokens": 0},
        {"max_tokens": 4, "temperature": -0.1},
        {"max_tokens": 4, "top_p": 0.0},
        {"max_tokens": 4, "stop_token_ids": (-1,)},
        {"max_tokens": 4, "seed": 2**64},  # a 64-bit generator's seeds end at 2**64 - 1
        {"max_tokens": 4, "seed": -(2**63) - 1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="context limit"):
        engine.stream("long", [1] * (MAX_CONTEXT - 5), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.stream("empty", [], ok)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.stream("oov", [1, 10**6], ok)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.stream("neg", [1, -1], ok)
    live = engine.stream("dup", [1], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="already running"):
        engine.stream("dup", [1], ok)
    await live.aclose()
    with pytest.raises(ValueError, match="unknown weight"):
        await engine.load_weights({"nope": torch.zeros(1)}, version=v0 + 1)
    # One bad tensor among good ones: nothing is loaded.
    broken = dict(base_weights)
    broken["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        await engine.load_weights(broken, version=v0 + 1)
    assert engine.version == v0
    after = await engine.generate("bi-after", [1, 2], ok)
    assert after.versions == [v0] * 4 and after.token_ids == before.token_ids


@pytest.mark.gpu
async def test_vllm_sleep_mode_frees_and_restores_the_gpu(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU only: with sleep mode a lent vLLM engine gives its device memory back while
    its slot trains, and serves the same answers after waking."""
    vllm = ENGINE_BACKENDS.get("vllm")
    _available_or_skip(vllm)
    monkeypatch.setenv("SF_ENGINE_VLLM_SLEEP_MODE", "true")  # the backend's own setting
    settings = EngineSettings(max_context=MAX_CONTEXT)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=12, temperature=0)
    async with vllm.build(settings, str(model_dir)) as eng:
        before = await eng.generate("gpu-before", prompt, params)
        await eng.pause("abort")
        free_awake = torch.cuda.mem_get_info()[0]
        await eng.sleep()
        free_asleep = torch.cuda.mem_get_info()[0]
        await eng.wake()
        await eng.resume()
        after = await eng.generate("gpu-after", prompt, params)
    assert free_asleep > free_awake  # weights offloaded, KV cache freed
    assert after.token_ids == before.token_ids
