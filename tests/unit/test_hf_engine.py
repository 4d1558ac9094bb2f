"""TransformersEngine against a tiny random Qwen2 model (real torch, no mocks)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sf_engine.backends import (
    EngineNotRunningError,
    GenerationResult,
    SamplingParams,
    TransformersEngine,
)

torch.set_num_threads(1)

VOCAB = 300


def _tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # Peakier than the default 0.02 so greedy argmax has clear margins.
        initializer_range=0.1,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def base_model() -> Qwen2ForCausalLM:
    return _tiny_qwen2(seed=0)


@pytest.fixture(scope="session")
def other_weights() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _tiny_qwen2(seed=1).state_dict().items()}


@pytest.fixture
async def engine(base_model: Qwen2ForCausalLM) -> AsyncIterator[TransformersEngine]:
    # A copy per test: load_weights writes the model in place.
    async with TransformersEngine(copy.deepcopy(base_model), max_batch_size=8) as eng:
        yield eng


@pytest.fixture
async def engine1(base_model: Qwen2ForCausalLM) -> AsyncIterator[TransformersEngine]:
    async with TransformersEngine(copy.deepcopy(base_model), max_batch_size=1) as eng:
        yield eng


PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 9, [200, 13], list(range(100, 117))]
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(max_tokens=25, temperature=1.3, seed=2),
    SamplingParams(max_tokens=5, temperature=1.0, top_p=0.5, seed=3),
    SamplingParams(max_tokens=16, seed=4),
]


def _reference_logprobs(
    model: Qwen2ForCausalLM, prompt: list[int], res: GenerationResult, params: SamplingParams
) -> list[float]:
    """The trainer's recomputation: one plain forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(res.token_ids)]


async def _generate_all(eng: TransformersEngine, tag: str) -> list[GenerationResult]:
    return await asyncio.gather(
        *(
            eng.generate(f"{tag}{i}", p, s)
            for i, (p, s) in enumerate(zip(PROMPTS, PARAMS, strict=True))
        )
    )


async def test_logprobs_match_full_forward(
    engine: TransformersEngine, base_model: Qwen2ForCausalLM
) -> None:
    results = await _generate_all(engine, "lp")
    for prompt, params, res in zip(PROMPTS, PARAMS, results, strict=True):
        assert len(res.token_ids) == params.max_tokens
        assert res.finish_reason == "length"
        assert res.versions == [0] * len(res.token_ids)
        ref = _reference_logprobs(base_model, prompt, res, params)
        assert res.logprobs == pytest.approx(ref, abs=1e-4)


async def test_top_logprobs_are_the_same_distribution_as_logprob(
    engine: TransformersEngine, base_model: Qwen2ForCausalLM
) -> None:
    asks = [
        ([1, 2, 3], SamplingParams(max_tokens=10, temperature=0.7, seed=5, top_logprobs=5)),
        ([4, 5], SamplingParams(max_tokens=10, temperature=0, top_logprobs=20)),
        ([6, 7, 8], SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, seed=6)),
        ([9], SamplingParams(max_tokens=10, temperature=1.0, seed=7, top_logprobs=1)),
    ]
    results = await asyncio.gather(
        *(engine.generate(f"top{i}", p, s) for i, (p, s) in enumerate(asks))
    )
    for (prompt, params), res in zip(asks, results, strict=True):
        if params.top_logprobs == 0:
            assert res.top_logprobs == []  # nothing asked, nothing computed per token
            continue
        assert len(res.top_logprobs) == len(res.token_ids)
        with torch.no_grad():
            logits = base_model(torch.tensor([prompt + res.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
        for j, (token, logprob, top) in enumerate(
            zip(res.token_ids, res.logprobs, res.top_logprobs, strict=True)
        ):
            assert len(top) == params.top_logprobs
            values = [lp for _, lp in top]
            assert values == sorted(values, reverse=True)
            ref_values, ref_ids = logp[len(prompt) - 1 + j].topk(params.top_logprobs)
            assert values == pytest.approx(ref_values.tolist(), abs=1e-4)
            assert [t for t, _ in top][:1] == ref_ids.tolist()[:1]
            listed = dict(top)
            if token in listed:  # the chosen token's logprob is its listed one
                assert listed[token] == pytest.approx(logprob, abs=1e-6)
            if params.greedy:
                assert top[0][0] == token


async def test_stream_batches_deliver_every_token_once(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, top_logprobs=2)
    stream = engine.stream("batches", [1, 2, 3], params)
    seen = [token async for batch in stream.batches() for token in batch]
    res = await stream.result()
    assert [t.token_id for t in seen] == res.token_ids and len(seen) == 12
    assert [t.top_logprobs for t in seen] == res.top_logprobs


async def test_batched_equals_unbatched(
    engine: TransformersEngine, engine1: TransformersEngine
) -> None:
    # Two requests start alone, the rest join the running batch a few steps later
    # (continuous batching: prefill + cache merge at a token boundary).
    first = [engine.stream(f"b{i}", PROMPTS[i], PARAMS[i]) for i in (1, 2)]
    async for _ in first[0]:
        if len(first[0].tokens) == 3:
            break
    later = [engine.stream(f"b{i}", PROMPTS[i], PARAMS[i]) for i in (0, 3, 4)]
    batched = {i: await s.result() for i, s in zip((1, 2, 0, 3, 4), first + later, strict=True)}
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        alone = await engine1.generate(f"u{i}", prompt, params)
        assert batched[i].token_ids == alone.token_ids
        assert batched[i].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


async def test_greedy_and_seeded_are_reproducible(engine: TransformersEngine) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0)
    a = await engine.generate("g1", [5, 6, 7], greedy)
    b = await engine.generate("g2", [5, 6, 7], greedy)
    assert a.token_ids == b.token_ids
    seeded = [SamplingParams(max_tokens=16, seed=s) for s in (11, 11, 12)]
    c, d, e = await asyncio.gather(
        *(engine.generate(f"s{i}", [5, 6, 7], p) for i, p in enumerate(seeded))
    )
    assert c.token_ids == d.token_ids
    assert c.token_ids != e.token_ids


async def test_stop_token_and_length(engine: TransformersEngine) -> None:
    prompt = [3, 1, 4, 1, 5]
    ref = await engine.generate("ref", prompt, SamplingParams(max_tokens=12, temperature=0))
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12
    stop = ref.token_ids[4]
    cut = ref.token_ids.index(stop) + 1
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(999, stop))
    res = await engine.generate("stop", prompt, params)
    assert res.finish_reason == "stop"
    assert res.token_ids == ref.token_ids[:cut]  # the stop token is included


async def test_abort_queued_and_running(engine1: TransformersEngine) -> None:
    long = SamplingParams(max_tokens=200, temperature=0)
    running = engine1.stream("run", [1, 2, 3], long)
    queued = engine1.stream("queued", [4, 5], long)  # max_batch_size=1: waits
    async for _ in running:
        if len(running.tokens) == 3:
            break
    assert await engine1.abort("queued")
    assert await engine1.abort("run")
    assert not await engine1.abort("run")
    assert not await engine1.abort("never-submitted")
    q, r = await queued.result(), await running.result()
    assert (q.token_ids, q.finish_reason) == ([], "abort")
    assert r.finish_reason == "abort" and 3 <= len(r.token_ids) < 200
    full = await engine1.generate("full", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0))
    assert r.token_ids[:3] == full.token_ids[:3]


async def test_cancelled_generate_aborts(engine: TransformersEngine) -> None:
    task = asyncio.create_task(engine.generate("c", [1], SamplingParams(max_tokens=250)))
    await asyncio.sleep(0.01)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await engine.abort("c")  # already gone


async def test_load_weights_between_requests(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    before = await engine.generate("a", [9, 8, 7], params)
    await engine.load_weights(other_weights, version=1)
    assert engine.version == 1
    after = await engine.generate("b", [9, 8, 7], params)
    assert before.versions == [0] * 16 and after.versions == [1] * 16
    assert before.token_ids != after.token_ids
    reference = _tiny_qwen2(seed=1)
    ref = _reference_logprobs(reference, [9, 8, 7], after, params)
    assert after.logprobs == pytest.approx(ref, abs=1e-4)


async def test_load_during_generation_keeps_old_weights(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    params = SamplingParams(max_tokens=60, temperature=0)
    long = engine.stream("long", [1, 2, 3], params)
    load = None
    async for _ in long:
        if load is None:
            load = asyncio.create_task(engine.load_weights(other_weights, version=1))
            await asyncio.sleep(0)
            # Submitted after the load was requested: not admitted until it is done.
            late = engine.stream("late", [1, 2, 3], params)
        assert not load.done()
    assert load is not None
    res = await long.result()
    assert res.finish_reason == "length" and res.versions == [0] * 60
    await load
    late_res = await late.result()
    assert late_res.versions == [1] * 60
    assert engine.version == 1


async def test_pause_wait_holds_new_requests(engine: TransformersEngine) -> None:
    running = engine.stream("r", [1, 2], SamplingParams(max_tokens=30, temperature=0))
    await running.__anext__()
    await engine.pause("wait")
    assert (await running.result()).finish_reason == "length"
    held = engine.stream("h", [1, 2], SamplingParams(max_tokens=3))
    await asyncio.sleep(0.05)  # a window in which nothing may happen: the test's subject
    assert held.tokens == []
    await engine.resume()
    assert len((await held.result()).token_ids) == 3


async def test_pause_abort_returns_partials(engine: TransformersEngine) -> None:
    running = engine.stream("r", [1, 2], SamplingParams(max_tokens=200))
    await running.__anext__()
    await engine.pause("abort")
    res = await running.result()
    assert res.finish_reason == "abort" and 1 <= len(res.token_ids) < 200
    await engine.resume()
    assert (await engine.generate("n", [1], SamplingParams(max_tokens=2))).finish_reason == "length"


async def test_pause_keep_and_load_continue_on_new_version(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    running = engine.stream("r", [1, 2], SamplingParams(max_tokens=40, temperature=0))
    await running.__anext__()
    await engine.pause("keep")
    frozen = len(running.tokens)
    await asyncio.sleep(0.05)  # a window in which nothing may happen: the test's subject
    assert len(running.tokens) == frozen
    await engine.load_weights(other_weights, version=7)
    await engine.resume()
    res = await running.result()
    assert res.finish_reason == "length"
    assert res.versions == [0] * frozen + [7] * (40 - frozen)


async def test_invalid_input_raises_value_error(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    for bad in (
        {"max_tokens": 0},
        {"max_tokens": 4, "temperature": -0.1},
        {"max_tokens": 4, "top_p": 0.0},
        {"max_tokens": 4, "top_p": 1.5},
        {"max_tokens": 4, "stop_token_ids": (-1,)},
        {"max_tokens": 4, "top_logprobs": 21},
        {"max_tokens": 4, "top_logprobs": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="context limit"):
        engine.stream("long", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.stream("empty", [], ok)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.stream("oov", [1, VOCAB], ok)
    live = engine.stream("dup", [1], SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="already running"):
        engine.stream("dup", [1], ok)
    await live.aclose()
    with pytest.raises(ValueError, match="unknown weight"):
        await engine.load_weights({"nope": torch.zeros(1)}, version=1)
    name = "lm_head.weight"
    with pytest.raises(ValueError, match="shape"):
        await engine.load_weights({name: torch.zeros(3, 3)}, version=1)
    assert engine.version == 0
    assert (await engine.generate("after", [1], ok)).versions == [0] * 4


async def test_model_dir_and_lifecycle(base_model: Qwen2ForCausalLM, tmp_path) -> None:
    base_model.save_pretrained(tmp_path)
    eng = TransformersEngine(tmp_path, max_batch_size=2, max_context=64)
    with pytest.raises(EngineNotRunningError):
        eng.stream("x", [1], SamplingParams(max_tokens=1))
    await eng.start()
    res = await eng.generate("x", [1, 2], SamplingParams(max_tokens=3, temperature=0))
    assert len(res.token_ids) == 3
    with pytest.raises(ValueError, match="context limit"):
        eng.stream("y", [1] * 60, SamplingParams(max_tokens=5))
    pending = eng.stream("z", [1], SamplingParams(max_tokens=50))
    await eng.close()
    await eng.close()
    assert (await pending.result()).finish_reason == "abort"
    with pytest.raises(EngineNotRunningError):
        eng.stream("w", [1], SamplingParams(max_tokens=1))


# -- prefix reuse across a conversation's turns ---------------------------------------
async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """A request's KV is kept by the scheduler's next pass, just after its result."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (the engine's own bookkeeping)
            await asyncio.sleep(0.005)


async def _play_turns(
    eng: TransformersEngine, tag: str, turns: int, *, together: int = 1
) -> list[tuple[list[int], SamplingParams, GenerationResult]]:
    """`together` conversations of `turns` turns: each turn's prompt is the last turn's
    prompt and answer and three new tokens. Returns every (prompt, params, result)."""

    async def conversation(c: int) -> list[tuple[list[int], SamplingParams, GenerationResult]]:
        prompt = [5 + c, 6, 7, 8]
        played = []
        for turn in range(turns):
            params = SamplingParams(max_tokens=6 + turn % 3, temperature=1.0, seed=31 * c + turn)
            res = await eng.generate(f"{tag}{c}-{turn}", prompt, params)
            played.append((prompt, params, res))
            prompt = prompt + res.token_ids + [40 + turn, 41 + c, 42]
        return played

    runs = await asyncio.gather(*(conversation(c) for c in range(together)))
    return [turn for run in runs for turn in run]


async def test_a_continued_conversation_prefills_only_its_new_tokens(
    engine: TransformersEngine, base_model: Qwen2ForCausalLM
) -> None:
    played = await _play_turns(engine, "conv", turns=5, together=3)
    stats = engine.prefix_cache.stats
    # Every turn after the first continues the conversation's last turn.
    assert stats.hits == 3 * 4
    # The first prompt (4 tokens), then per turn the last answer's final token (sampled,
    # never fed to the model) and the 3 new ones.
    new_tokens = 4 + 4 * (1 + 3)
    assert stats.prompt_tokens - stats.reused_tokens == 3 * new_tokens
    for prompt, params, res in played:
        ref = _reference_logprobs(base_model, prompt, res, params)
        assert res.logprobs == pytest.approx(ref, abs=1e-4)


async def test_reuse_gives_the_tokens_a_cold_engine_gives(base_model: Qwen2ForCausalLM) -> None:
    async with TransformersEngine(copy.deepcopy(base_model), max_batch_size=8) as warm:
        reused = await _play_turns(warm, "warm", turns=4, together=2)
    async with TransformersEngine(
        copy.deepcopy(base_model), max_batch_size=8, prefix_cache_bytes=0
    ) as cold:
        fresh = await _play_turns(cold, "cold", turns=4, together=2)
        assert cold.prefix_cache.stats.hits == 0
    assert [r.token_ids for _, _, r in reused] == [r.token_ids for _, _, r in fresh]
    for (_, _, a), (_, _, b) in zip(reused, fresh, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


async def test_a_weight_load_ends_reuse_of_the_old_weights_kv(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    prompt = [9, 8, 7]
    first = await engine.generate("w0", prompt, SamplingParams(max_tokens=5, seed=1))
    await _until(lambda: len(engine.prefix_cache) == 1)
    await engine.load_weights(other_weights, version=3)
    assert len(engine.prefix_cache) == 0
    follow = prompt + first.token_ids + [11]
    params = SamplingParams(max_tokens=5, seed=2)
    res = await engine.generate("w1", follow, params)
    assert engine.prefix_cache.stats.hits == 0
    assert res.versions == [3] * 5
    model = _tiny_qwen2(seed=1)
    assert res.logprobs == pytest.approx(_reference_logprobs(model, follow, res, params), abs=1e-4)


async def test_a_request_that_spans_a_weight_load_is_not_kept(
    engine: TransformersEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    running = engine.stream("span", [1, 2], SamplingParams(max_tokens=30, temperature=0))
    await running.__anext__()
    await engine.pause("keep")
    await engine.load_weights(other_weights, version=7)
    await engine.resume()
    res = await running.result()
    assert 0 in res.versions and 7 in res.versions
    assert len(engine.prefix_cache) == 0  # its KV mixes two weight sets
    await engine.generate("after", [1, 2, *res.token_ids, 5], SamplingParams(max_tokens=2))
    assert engine.prefix_cache.stats.hits == 0


async def test_asleep_the_weights_leave_the_device_and_wake_to_the_same_answers(
    base_model: Qwen2ForCausalLM, other_weights: dict[str, torch.Tensor]
) -> None:
    """``offload_asleep`` (SF_ENGINE_HF_OFFLOAD_ASLEEP): sleep frees the kept KV and moves
    every weight to host memory, accounted; wake brings them back bitwise; a weight load
    that finds the engine asleep wakes it first."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    weight_bytes = sum(
        t.untyped_storage().nbytes() for t in [*base_model.parameters(), *base_model.buffers()]
    )
    async with TransformersEngine(copy.deepcopy(base_model), offload_asleep=True) as engine:
        before = await engine.generate("a", [5, 6, 7], params)
        async with asyncio.timeout(10):  # its KV is kept for a continuation, once it ended
            while len(engine.prefix_cache) == 0:  # noqa: ASYNC110 (the engine's own batch)
                await asyncio.sleep(0.01)
        await engine.pause("abort")
        await engine.sleep()
        asleep = engine.transitions[-1]
        assert asleep.name == "offload" and len(engine.prefix_cache) == 0
        assert asleep.before.on_device == weight_bytes and asleep.after.on_device == 0
        assert asleep.after.host_copies == weight_bytes
        await engine.sleep()  # idempotent: nothing more moves
        assert len(engine.transitions) == 1
        await engine.wake()
        await engine.resume()
        awake = engine.transitions[-1]
        assert awake.name == "reload" and awake.after.on_device == weight_bytes
        assert awake.after.host_copies == 0
        again = await engine.generate("b", [5, 6, 7], params)
        assert again.token_ids == before.token_ids and again.logprobs == before.logprobs

        await engine.pause("abort")
        await engine.sleep()
        await engine.load_weights(other_weights, version=1)  # wakes to copy into them
        assert [t.name for t in engine.transitions] == ["offload", "reload"] * 2
        await engine.resume()
        loaded = await engine.generate("c", [5, 6, 7], params)
    async with TransformersEngine(copy.deepcopy(base_model)) as reference:
        await reference.load_weights(other_weights, version=1)
        expected = await reference.generate("c", [5, 6, 7], params)
        await reference.pause("abort")
        await reference.sleep()  # without offload_asleep: only the kept KV goes
        assert len(reference.prefix_cache) == 0 and not reference.transitions
    assert loaded.token_ids == expected.token_ids


async def test_weights_read_from_their_file_can_sleep(tmp_path, base_model) -> None:  # type: ignore[no-untyped-def]
    """A CPU model loaded in its file's dtype lies in the file's mapping: the engine
    gives it memory of its own so that it can sleep."""
    base_model.save_pretrained(tmp_path)
    async with TransformersEngine(tmp_path, offload_asleep=True) as engine:
        await engine.pause("abort")
        await engine.sleep()
        assert engine.transitions[-1].after.on_device == 0
        await engine.wake()
        await engine.resume()
        result = await engine.generate("a", [5, 6, 7], SamplingParams(max_tokens=4))
        assert len(result.token_ids) == 4
