"""Sparse deltas between two flat weight states.

After one optimizer step most low-precision (bf16) weights are often bit-identical: only
the changed words need to travel. A delta is the positions of the changed words followed
by their new values. Positions are either word indices (uint32, or uint64 for states of
4 G words or more) or a bitmap with one bit per word, whichever is smaller; when neither
beats sending the state itself, ``encode`` returns None and the caller sends it in full.

Work is done in chunks so that encoding a multi-GB state never allocates a comparison
mask of the state's size.
"""

from __future__ import annotations

import numpy as np

from seamlessflow.protocol import DeltaEncoding

CHUNK_WORDS = 1 << 24


class DeltaCorrupted(ValueError):
    """A delta payload that cannot be applied to the state it names."""


_WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _words(buffer: np.ndarray, word: int) -> np.ndarray:
    if word not in _WORD_DTYPES or buffer.nbytes % word:
        raise ValueError(f"cannot compare a {buffer.nbytes}-byte state in {word}-byte words")
    return buffer.view(_WORD_DTYPES[word])


def encode(
    old: np.ndarray, new: np.ndarray, word: int, max_ratio: float = 1.0
) -> tuple[DeltaEncoding, bytes] | None:
    """The delta turning ``old`` into ``new`` (uint8 arrays of one size), or None when it
    would be at least ``max_ratio`` times the size of ``new``."""
    if old.shape != new.shape:
        raise ValueError("a delta needs two states of the same size")
    old_words, new_words = _words(old, word), _words(new, word)
    total = len(new_words)
    index_dtype = np.uint32 if total < 2**32 else np.uint64
    changed_chunks: list[np.ndarray] = [
        np.add(
            np.flatnonzero(
                old_words[start : start + CHUNK_WORDS] != new_words[start : start + CHUNK_WORDS]
            ).astype(index_dtype),
            start,
            dtype=index_dtype,
        )
        for start in range(0, total, CHUNK_WORDS)
    ]
    changed = int(sum(len(chunk) for chunk in changed_chunks))
    index_bytes = np.dtype(index_dtype).itemsize
    as_indices = changed * index_bytes
    as_bitmap = -(-total // 8)
    if changed * word + min(as_indices, as_bitmap) >= max_ratio * new.nbytes:
        return None
    values = b"".join(new_words[chunk].tobytes() for chunk in changed_chunks)
    use_indices = as_indices <= as_bitmap
    if use_indices:
        positions = b"".join(chunk.tobytes() for chunk in changed_chunks)
    else:
        positions = _bitmap(old_words, new_words)
    encoding = DeltaEncoding(
        word_bytes=word,
        changed_words=changed,
        positions="indices" if use_indices else "bitmap",
        index_bytes=index_bytes,
    )
    return encoding, positions + values


def apply(state: np.ndarray, encoding: DeltaEncoding, payload: memoryview | bytes) -> None:
    """Patch ``state`` (uint8, writable) in place. Checks sizes and bounds first, so a
    payload that does not fit the state raises DeltaCorrupted before anything changes."""
    words = _words(state, encoding.word_bytes)
    data = np.frombuffer(payload, dtype=np.uint8)
    changed = encoding.changed_words
    values_bytes = changed * encoding.word_bytes
    if encoding.positions == "indices":
        index_dtype = np.uint32 if encoding.index_bytes == 4 else np.uint64
        position_bytes = changed * encoding.index_bytes
        if data.nbytes != position_bytes + values_bytes:
            raise DeltaCorrupted(f"{data.nbytes} bytes for {changed} indexed words")
        indices = data[:position_bytes].view(index_dtype)
        if changed and int(indices.max()) >= len(words):
            raise DeltaCorrupted("a word index lies outside the state")
        values = data[position_bytes:].view(words.dtype)
        words[indices] = values
        return
    position_bytes = -(-len(words) // 8)
    if data.nbytes != position_bytes + values_bytes:
        raise DeltaCorrupted(f"{data.nbytes} bytes for a bitmap of {len(words)} words")
    bitmap = data[:position_bytes]
    if int(np.bitwise_count(bitmap).sum(dtype=np.int64)) != changed:
        raise DeltaCorrupted("the bitmap does not mark the announced number of words")
    values = data[position_bytes:].view(words.dtype)
    written = 0
    for start in range(0, len(words), CHUNK_WORDS):
        end = min(start + CHUNK_WORDS, len(words))
        mask = np.unpackbits(bitmap[start // 8 : -(-end // 8)], count=end - start).view(bool)
        count = int(mask.sum())
        words[start:end][mask] = values[written : written + count]
        written += count


def _bitmap(old_words: np.ndarray, new_words: np.ndarray) -> bytes:
    # CHUNK_WORDS is a multiple of 8, so each chunk's bits start on a byte boundary
    return b"".join(
        np.packbits(
            old_words[start : start + CHUNK_WORDS] != new_words[start : start + CHUNK_WORDS]
        ).tobytes()
        for start in range(0, len(new_words), CHUNK_WORDS)
    )
