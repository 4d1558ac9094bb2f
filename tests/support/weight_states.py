"""Small weight states for the tests of weight stores and publishers: ``small_state``
(two tensors, 512 x 33 and 5 values), ``one_tensor_state`` (one tensor of 1000
values), both drawn from a seed; ``round_trip``, a state put into a store and read
back through a ``WeightMirror``; and ``publish_three``, a full, a delta and a full
published in a row."""

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


async def publish_three(publisher) -> tuple[list, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Versions 1-3 of ``small_state(2)``, each changing only ``b``: with deltas and
    ``full_every=2``, a full, a delta and a full. The manifests and the last state."""
    state = small_state(2)
    manifests = []
    for version in (1, 2, 3):
        state = {k: v + (0.5 if k == "b" else 0.0) for k, v in state.items()}
        manifests.append(await publisher.publish(version, state))
    return manifests, state
