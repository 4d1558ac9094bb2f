"""Small weight states for the tests of weight stores and publishers: ``small_state``
(two tensors, 512 x 33 and 5 values), ``one_tensor_state`` (one tensor of 1000
values), both drawn from a seed, and ``round_trip``, a state put into a store and read
back through a ``WeightMirror``."""

from __future__ import annotations

import torch

from seamlessflow.weights import EncodedWeights, WeightMirror


def small_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(512, 33, generator=generator),
        "b": torch.randn(5, generator=generator),
    }


async def round_trip(store, encoded: EncodedWeights) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    manifest = await store.put(encoded)
    mirror = WeightMirror()
    mirror.apply(manifest, await store.fetch(manifest))
    return mirror.tensors()


def one_tensor_state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(1000, generator=torch.Generator().manual_seed(seed))}
