"""`PrefixCache`: the KV cache of finished requests, kept for the next turn of their
conversation.

An agent's turn k+1 is sent as turn k's prompt, turn k's answer and the new
observation; without this cache the engine prefills that whole context again on every
turn, so a 12-turn episode pays for its first prompt 12 times. The cache keeps, per
finished request, the keys and values of every token the request fed the model (its
prompt and all of its sampled tokens but the last), and a new request whose prompt
starts with those tokens prefills only the rest.

Invariants:
- an entry holds keys and values computed under one weight set, the one of `epoch`;
  the engine clears the cache when it copies new weights (`clear`), and offers a
  finished request only if no copy happened since its prefill, so a hit never mixes
  weight sets (which would change the recorded logprobs' meaning);
- a hit leaves at least one prompt token to prefill: the engine needs that token's
  logits to sample the first answer token;
- an entry whose tokens start another entry's replaces it (a conversation keeps one
  entry: its latest turn); the least recently used entries go first once the cache
  holds more than `max_bytes`.

Pure data structure over tensors; the engine owns the locking (it runs on the engine's
compute thread only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's (keys, values), each [heads, tokens, head_dim]."""


@dataclass(frozen=True, eq=False)
class PrefixEntry:
    tokens: tuple[int, ...]
    layers: tuple[LayerKV, ...]
    nbytes: int


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    """Prompt tokens not prefilled again, summed over hits."""
    prompt_tokens: int = 0
    """Prompt tokens of every lookup."""


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._bytes = 0
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The longest entry whose tokens are a proper prefix of `prompt`, or None."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        best: PrefixEntry | None = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)):
                if tuple(prompt[:n]) == entry.tokens:
                    best = entry
        if best is not None:
            self._entries.move_to_end(best.tokens)
            self.stats.hits += 1
            self.stats.reused_tokens += len(best.tokens)
        return best

    def insert(self, tokens: list[int], layers: list[LayerKV]) -> None:
        """Keep `layers` (each [heads, len(tokens), head_dim]) as the KV of `tokens`."""
        if not self.enabled or not tokens:
            return
        for keys, values in layers:
            if keys.shape[-2] != len(tokens) or values.shape[-2] != len(tokens):
                raise ValueError(
                    f"KV of {keys.shape[-2]} tokens offered for {len(tokens)} token ids"
                )
        key = tuple(tokens)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self._max_bytes:
            return
        # This conversation's earlier turns (prefixes of `key`) are superseded by it.
        for old in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)
        self._entries[key] = PrefixEntry(key, tuple(layers), nbytes)
        self._bytes += nbytes
        while self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Drop every entry and start the stats again."""
        self._entries.clear()
        self._bytes = 0
        self.stats = PrefixCacheStats()

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
