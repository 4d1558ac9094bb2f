"""Weight transfer from the trainer to the engines (docs/architecture.md, weight-sync).

Shared logic, written once:
- ``layout``: a weight set as one flat buffer, its buckets and digests;
- ``delta``: sparse deltas between two versions;
- ``codec``: sender (``WeightEncoder``) and receiver (``WeightMirror``) state;
- ``chain`` and ``sync``: the version handshake (the chain weight-sync keeps; the
  publisher and the receiver).

Thin transports:
- ``stores``: pull stores, NATS Object Store (any host) and shared memory (same host);
- ``ipc`` over ``device``: ``cuda_ipc``, buckets in the trainer's device memory mapped
  by the engines of its host, a pull store beside it as the fallback;
- ``collective``: push broadcast over a process group (torch.distributed gloo on CPU,
  NCCL through CuPy on GPUs).

docs/architecture.md, invariant 5 (an engine never serves a partial set), lives in
``WeightMirror.apply``: every bucket is checked before the state changes, a delta
applies only to its exact base version, and the resulting state's digest is checked
before anyone sees it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seamlessflow.weights.chain import VersionChain
    from seamlessflow.weights.codec import (
        EncodedWeights,
        VersionGap,
        WeightEncoder,
        WeightMirror,
        WeightsCorrupted,
    )
    from seamlessflow.weights.stores import (
        ObjectStorePayloads,
        PayloadMissing,
        PayloadStore,
        SharedMemoryPayloads,
    )
    from seamlessflow.weights.sync import WeightPublisher, WeightReceiver

_MODULE_OF = {
    "EncodedWeights": "codec",
    "VersionGap": "codec",
    "WeightEncoder": "codec",
    "WeightMirror": "codec",
    "WeightsCorrupted": "codec",
    "ObjectStorePayloads": "stores",
    "PayloadMissing": "stores",
    "PayloadStore": "stores",
    "SharedMemoryPayloads": "stores",
    "VersionChain": "chain",
    "WeightPublisher": "sync",
    "WeightReceiver": "sync",
}
"""Each name's module, imported on first use: what needs no tensor (``chain``, the
weight-sync service) does not import torch with this package."""


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "EncodedWeights",
    "ObjectStorePayloads",
    "PayloadMissing",
    "PayloadStore",
    "SharedMemoryPayloads",
    "VersionChain",
    "VersionGap",
    "WeightEncoder",
    "WeightMirror",
    "WeightPublisher",
    "WeightReceiver",
    "WeightsCorrupted",
]
