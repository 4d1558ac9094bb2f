"""A weight set as one flat byte buffer: layout, buckets and digests.

Every transport moves the same thing, a flat ``uint8`` buffer in which each tensor sits
at an aligned offset, cut into buckets of a fixed size. A tensor larger than a bucket
simply spans several; a model larger than any transfer budget moves bucket by bucket.
Offsets are aligned to ``ALIGNMENT`` so every tensor can be viewed in place in its own
dtype and every element size divides every offset (the delta codec relies on it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch
import xxhash

from seamlessflow.protocol import TensorSpec

ALIGNMENT = 64


class LayoutMismatch(ValueError):
    """A state dict that does not have the names, dtypes or shapes of the layout."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutMismatch(f"unknown dtype {name!r}")
    return dtype


def spec_bytes(spec: TensorSpec) -> int:
    numel = 1
    for size in spec.shape:
        numel *= size
    return numel * torch_dtype(spec.dtype).itemsize


def plan_layout(state_dict: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Tensors in the state dict's order, each at an ALIGNMENT-aligned offset."""
    return layout_of((name, t.dtype, list(t.shape)) for name, t in state_dict.items())


def layout_of(tensors: Iterable[tuple[str, torch.dtype, list[int]]]) -> list[TensorSpec]:
    """``plan_layout`` from each tensor's name, dtype and shape alone (a sharded model's
    whole shapes are known before any of it is gathered)."""
    layout: list[TensorSpec] = []
    offset = 0
    for name, dtype, shape in tensors:
        spec = TensorSpec(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset)
        layout.append(spec)
        offset = _aligned(offset + spec_bytes(spec))
    return layout


def layout_bytes(layout: list[TensorSpec]) -> int:
    """Size of the flat buffer (a multiple of ALIGNMENT)."""
    if not layout:
        return 0
    last = layout[-1]
    return _aligned(last.offset + spec_bytes(last))


def word_bytes(layout: list[TensorSpec]) -> int:
    """The smallest element size: the unit in which two versions are compared."""
    return min((torch_dtype(spec.dtype).itemsize for spec in layout), default=1)


def flatten_into(
    flat: torch.Tensor, state_dict: Mapping[str, torch.Tensor], layout: list[TensorSpec]
) -> None:
    """Copy every tensor of ``state_dict`` to its place in ``flat`` (gaps stay zero)."""
    if len(state_dict) != len(layout):
        raise LayoutMismatch(f"{len(state_dict)} tensors for a layout of {len(layout)}")
    for spec in layout:
        tensor = state_dict.get(spec.name)
        if tensor is None:
            raise LayoutMismatch(f"missing tensor {spec.name!r}")
        place(flat, spec, tensor)


def stream_into(
    flat: torch.Tensor, tensors: Iterable[tuple[str, torch.Tensor]], layout: list[TensorSpec]
) -> None:
    """Copy each ``(name, tensor)`` as it comes to its place in ``flat``: exactly the
    layout's tensors, in its order, each whole or as consecutive blocks of its rows
    (``in_layout``). Only one of them needs to exist at a time (a trainer gathers its
    shards block by block into the payload)."""
    for spec, raw, at in in_layout(tensors, layout):
        start = spec.offset + at
        flat[start : start + raw.numel()].copy_(raw)


def in_layout(
    tensors: Iterable[tuple[str, torch.Tensor]], layout: list[TensorSpec]
) -> Iterator[tuple[TensorSpec, torch.Tensor, int]]:
    """Each ``(name, tensor)`` as it comes: its spec, its bytes (flat uint8) and where
    they start in the whole tensor's. Exactly the layout's tensors, in its order; a
    tensor may come as consecutive blocks of its rows under its name (the same dtype and
    trailing shape, the rows adding up). ``LayoutMismatch`` otherwise, at the first one
    out of place."""
    index, done = -1, 0  # the tensor being filled, and how many of its bytes came
    for name, tensor in tensors:
        if index < 0 or done == spec_bytes(layout[index]):
            index, done = index + 1, 0
            if index >= len(layout):
                raise LayoutMismatch(f"{name!r} beyond a layout of {len(layout)} tensors")
        spec = layout[index]
        if name != spec.name:
            if done:
                raise LayoutMismatch(
                    f"{name!r} where {spec.name!r} still lacks {spec_bytes(spec) - done} bytes"
                )
            raise LayoutMismatch(f"{name!r} where the layout has {spec.name!r}")
        whole = done == 0 and list(tensor.shape) == spec.shape
        raw = _raw_bytes(spec, tensor, rows=not whole)
        if done + raw.numel() > spec_bytes(spec):
            raise LayoutMismatch(f"{spec.name}: rows beyond its {spec.shape[0]}")
        yield spec, raw, done
        done += raw.numel()
    complete = index + 1 if index < 0 or done == spec_bytes(layout[index]) else index
    if complete != len(layout):
        raise LayoutMismatch(f"{complete} tensors for a layout of {len(layout)}")


def stream_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    layout: list[TensorSpec],
    buffers: Sequence[torch.Tensor],
) -> Iterator[memoryview]:
    """The flat state of ``layout`` bucket by bucket, as ``tensors`` come (exactly the
    layout's, in its order: ``in_layout``): bucket ``i`` is written into
    ``buffers[i % len(buffers)]`` (each a CPU uint8 tensor of one bucket) and yielded once
    complete, the last one short. A yielded view is valid until the generator writes its
    buffer again, ``len(buffers)`` buckets later, so only a tensor and the buffers exist
    at a time; the buckets are those of the same tensors flattened whole (alignment gaps
    are zero)."""
    if not buffers or any(b.numel() != buffers[0].numel() for b in buffers):
        raise ValueError("stream_buckets needs buffers of one bucket size")
    filled = _filled_buckets(
        tensors, layout, buffers[0].numel(), lambda index: buffers[index % len(buffers)]
    )
    for bucket in filled:
        yield as_bytes(bucket)


def fill_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    layout: list[TensorSpec],
    buckets: Sequence[torch.Tensor],
) -> None:
    """The flat state of ``layout`` written across ``buckets`` as ``tensors`` come: one
    uint8 tensor per bucket of ``bucket_ranges(layout_bytes(layout), bucket_bytes)``, of
    that bucket's size, wherever they lie (the trainer's device: ``cuda_ipc``). The same
    bytes as ``stream_buckets``."""
    total = layout_bytes(layout)
    if not buckets:
        if total:
            raise ValueError(f"no buckets for {total} bytes")
        return
    bucket_bytes = buckets[0].numel()
    sizes = [end - start for start, end in bucket_ranges(total, bucket_bytes)]
    if [b.numel() for b in buckets] != sizes:
        raise ValueError(f"buckets of {[b.numel() for b in buckets]} bytes for {sizes}")
    for _ in _filled_buckets(tensors, layout, bucket_bytes, buckets.__getitem__):
        pass


def _filled_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    layout: list[TensorSpec],
    bucket_bytes: int,
    buffer_of: Callable[[int], torch.Tensor],
) -> Iterator[torch.Tensor]:
    """Bucket ``i`` of the flat state written into ``buffer_of(i)`` (at least the
    bucket's size) and yielded once complete: the last one, short, as a view of its
    first bytes."""
    index = filled = position = 0

    def write(source: torch.Tensor | None, length: int) -> Iterator[torch.Tensor]:
        """``length`` bytes of ``source`` (zeros if None) at ``position``."""
        nonlocal index, filled, position
        done = 0
        while done < length:
            bucket = buffer_of(index)
            count = min(bucket_bytes - filled, length - done)
            target = bucket[filled : filled + count]
            if source is None:
                target.zero_()
            else:
                target.copy_(source[done : done + count])
            filled, done, position = filled + count, done + count, position + count
            if filled == bucket_bytes:
                yield bucket
                index, filled = index + 1, 0

    for spec, raw, at in in_layout(tensors, layout):
        yield from write(None, spec.offset + at - position)
        yield from write(raw, raw.numel())
    yield from write(None, layout_bytes(layout) - position)
    if filled:
        yield buffer_of(index)[:filled]


def place(flat: torch.Tensor, spec: TensorSpec, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` to ``spec``'s place in ``flat``; its dtype and shape must be the
    spec's."""
    raw = _raw_bytes(spec, tensor)
    flat[spec.offset : spec.offset + raw.numel()].copy_(raw)


def _raw_bytes(spec: TensorSpec, tensor: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """``tensor``'s bytes, flat; its dtype and shape must be the spec's (``rows``: its
    trailing shape, for a block of the spec's rows)."""
    shape, expected = list(tensor.shape), spec.shape
    fits = (len(shape) > 0 and shape[1:] == expected[1:]) if rows else shape == expected
    if dtype_name(tensor.dtype) != spec.dtype or not fits:
        what = f"[rows, {', '.join(map(str, expected[1:]))}]" if rows else str(expected)
        raise LayoutMismatch(
            f"{spec.name}: {dtype_name(tensor.dtype)}{shape} != {spec.dtype}{what}"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


def flatten(state_dict: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSpec]]:
    layout = plan_layout(state_dict)
    flat = torch.zeros(layout_bytes(layout), dtype=torch.uint8)
    flatten_into(flat, state_dict, layout)
    return flat, layout


def tensor_views(flat: torch.Tensor, layout: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Each tensor as a view into ``flat``: no copy; valid while ``flat`` is unchanged."""
    views: dict[str, torch.Tensor] = {}
    for spec in layout:
        size = spec_bytes(spec)
        raw = flat[spec.offset : spec.offset + size]
        views[spec.name] = raw.view(torch_dtype(spec.dtype)).view(spec.shape)
    return views


def bucket_ranges(total: int, bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each bucket; the last one may be short."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    for start in range(0, total, bucket_bytes):
        yield start, min(start + bucket_bytes, total)


DIGEST: Final = "xxh3-128"
"""The checksum of every bucket and state: XXH3's 128-bit hash, a check against corruption
(a torn write, a wrong fetch, a bit flipped on the wire), not an authentication: the
manifest that carries the digests travels on the same bus as the payload. On this
project's two-core AVX2 machine it hashes 10 GB/s against sha256's 1.3-1.6 GB/s, and a
sync hashes every payload twice (docs/benchmarks.md, "Weight sync")."""


def digest_of(data: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def bucket_digests(data: memoryview | bytes, bucket_bytes: int) -> list[str]:
    """The digest of each bucket of ``data``, in order."""
    view = memoryview(data)
    return [digest_of(view[start:end]) for start, end in bucket_ranges(len(view), bucket_bytes)]


def state_digest(digests: list[str]) -> str:
    """Digest of a whole flat state from its bucket digests (cheap for a full payload,
    whose bucket digests are exactly these)."""
    return digest_of("".join(digests).encode())


def as_bytes(flat: torch.Tensor) -> memoryview:
    """The buffer of a contiguous CPU uint8 tensor, without a copy."""
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT
