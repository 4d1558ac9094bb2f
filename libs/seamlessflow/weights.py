"""Weight versions in the NATS Object Store: the CPU/any-host transport.

The trainer serialises a full state dict with safetensors and puts it under
``weights-v<version>``; the object is complete before the WeightsPublished message
exists, and readers verify the sha256 before loading (invariant 5: no engine ever
loads a partial or corrupted set).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import nats.js.errors
from nats.js.object_store import ObjectStore

from seamlessflow.bus import Bus

if TYPE_CHECKING:
    import torch


class WeightsCorrupted(Exception):
    """The stored bytes do not match the checksum announced with the version."""


def object_name(version: int) -> str:
    return f"weights-v{version:08d}"


async def weights_store(bus: Bus) -> ObjectStore:
    bucket = bus.subjects.object_store_weights()
    try:
        return await bus.js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await bus.js.create_object_store(bucket)


def serialize(state_dict: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})
    return data, hashlib.sha256(data).hexdigest()


def deserialize(data: bytes, sha256: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise WeightsCorrupted(f"sha256 {digest} != announced {sha256}")
    return load(data)


async def put_weights(
    bus: Bus, version: int, state_dict: dict[str, torch.Tensor]
) -> tuple[str, str, int]:
    """Store one version; returns (object name, sha256, bytes)."""
    import asyncio

    data, digest = await asyncio.to_thread(serialize, state_dict)
    store = await weights_store(bus)
    name = object_name(version)
    await store.put(name, data)
    return name, digest, len(data)


async def get_weights(bus: Bus, name: str, sha256: str) -> dict[str, torch.Tensor]:
    import asyncio

    store = await weights_store(bus)
    result = await store.get(name)
    assert result.data is not None
    return await asyncio.to_thread(deserialize, result.data, sha256)


async def delete_weights(bus: Bus, name: str) -> None:
    store = await weights_store(bus)
    try:
        await store.delete(name)
    except nats.js.errors.ObjectNotFoundError:
        pass
