"""Weight transfer from the trainer to the engines (docs/architecture.md, weight-sync).

Shared logic, written once:
- ``layout``: a weight set as one flat buffer, its buckets and digests;
- ``delta``: sparse deltas between two versions;
- ``codec``: sender (``WeightEncoder``) and receiver (``WeightMirror``) state;
- ``sync``: the version handshake (publisher, chain, receiver).

Thin transports:
- ``stores``: pull stores, NATS Object Store (any host) and shared memory (same host);
- ``collective``: push broadcast over a process group (torch.distributed gloo on CPU,
  NCCL through CuPy on GPUs).

docs/architecture.md, invariant 5 (an engine never serves a partial set), lives in
``WeightMirror.apply``: every bucket is checked before the state changes, a delta
applies only to its exact base version, and the resulting state's digest is checked
before anyone sees it.
"""

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
from seamlessflow.weights.sync import VersionChain, WeightPublisher, WeightReceiver

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
