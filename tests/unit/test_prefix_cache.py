"""PrefixCache: which kept KV a prompt reuses, and what the cache keeps (real tensors)."""

from __future__ import annotations

import pytest
import torch

from sf_engine.backends.prefix_cache import PrefixCache

HEADS, DIM, LAYERS = 2, 4, 3


def _kv(n: int, fill: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.full((HEADS, n, DIM), fill), torch.full((HEADS, n, DIM), -fill))
        for _ in range(LAYERS)
    ]


BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # float32 keys and values


def test_the_longest_proper_prefix_is_reused() -> None:
    cache = PrefixCache(10**6)
    cache.insert([1, 2], _kv(2, 1.0))
    cache.insert([7, 8, 9], _kv(3, 2.0))
    hit = cache.lookup([7, 8, 9, 10, 11])
    assert hit is not None and hit.tokens == (7, 8, 9)
    assert hit.layers[0][0][0, 0, 0].item() == 2.0
    # equal to a kept entry: nothing left to prefill, so no reuse
    assert cache.lookup([7, 8, 9]) is None
    assert cache.lookup([7, 9, 9, 10]) is None
    assert cache.lookup([1, 2, 3]) is not None
    assert (cache.stats.lookups, cache.stats.hits, cache.stats.reused_tokens) == (4, 2, 5)
    assert cache.stats.prompt_tokens == 5 + 3 + 4 + 3


def test_a_conversations_next_turn_replaces_its_last() -> None:
    cache = PrefixCache(10**6)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 4], _kv(3))  # another sample of the same prompt: kept beside it
    cache.insert([1, 2, 3, 5, 6], _kv(5))
    assert len(cache) == 2
    assert cache.nbytes == 8 * BYTES_PER_TOKEN
    hit = cache.lookup([1, 2, 3, 5, 6, 7])
    assert hit is not None and len(hit.tokens) == 5


def test_the_least_recently_used_goes_first_when_full() -> None:
    cache = PrefixCache(10 * BYTES_PER_TOKEN)
    cache.insert([1, 1, 1, 1], _kv(4))
    cache.insert([2, 2, 2, 2], _kv(4))
    assert cache.lookup([1, 1, 1, 1, 9]) is not None  # [1...] is now the most recent
    cache.insert([3, 3, 3, 3], _kv(4))
    assert len(cache) == 2
    assert cache.lookup([2, 2, 2, 2, 9]) is None
    assert cache.lookup([1, 1, 1, 1, 9]) is not None
    assert cache.nbytes <= 10 * BYTES_PER_TOKEN
    cache.insert(list(range(20)), _kv(20))  # larger than the whole cache: not kept
    assert len(cache) == 2


def test_kv_must_cover_exactly_the_tokens_and_zero_bytes_keeps_nothing() -> None:
    cache = PrefixCache(10**6)
    with pytest.raises(ValueError, match="3 tokens offered for 4"):
        cache.insert([1, 2, 3, 4], _kv(3))
    assert len(cache) == 0
    off = PrefixCache(0)
    off.insert([1, 2, 3], _kv(3))
    assert not off.enabled and len(off) == 0 and off.lookup([1, 2, 3, 4]) is None
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
    cache.insert([1, 2], _kv(2))
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
