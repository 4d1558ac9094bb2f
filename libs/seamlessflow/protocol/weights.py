"""Weight versions: manifests of weight payloads, their announcement, and catching up.

The trainer stores each version's payload (full or delta, checksummed in buckets) and
announces it; engines ask weight-sync which version to serve, and join a trainer's push
group to receive payloads directly.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from seamlessflow.protocol.base import Message


class TensorSpec(msgspec.Struct, array_like=True):
    """One tensor of a weight set, at ``offset`` bytes into the flat state buffer."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix: ``bfloat16``, ``float32``..."""
    shape: list[int]
    offset: int


class DeltaEncoding(msgspec.Struct, kw_only=True):
    """How a delta payload is laid out: changed words, then their new values."""

    word_bytes: int
    """Comparison unit: the smallest element size of the weight set (2 for bf16)."""
    changed_words: int
    positions: Literal["indices", "bitmap"]
    """``indices``: uint32/uint64 word indices; ``bitmap``: one bit per word."""
    index_bytes: int = 4


class DeviceHandle(msgspec.Struct, kw_only=True):
    """Where one payload bucket lies in the trainer's device memory, for an engine on the
    same host to map (``seamlessflow.weights.ipc``). Plain data, never a pickle: a peer's
    message is decoded, not executed.

    ``kind`` names the device layer that exported it: ``cuda`` (a CUDA IPC handle of the
    bucket's allocation; ``offset`` bytes into it) or ``shm`` (the CPU stand-in: a file
    ``name`` in shared memory)."""

    kind: Literal["cuda", "shm"]
    name: bytes
    """The handle itself: the CUDA IPC memory handle, or the stand-in's file name."""
    nbytes: int
    offset: int = 0
    device: int = 0
    """The exporter's CUDA device index (the importer maps it on the same device)."""
    ref_counter: bytes = b""
    """CUDA: torch's shared reference counter of the allocation (its file handle), which
    keeps the exporter from reusing the memory while an importer holds it."""
    ref_counter_offset: int = 0
    event: bytes = b""
    """CUDA: an IPC event recorded after the bucket was written (the importer waits on it)."""
    event_sync: bool = False


class DevicePayload(msgspec.Struct, kw_only=True):
    """A payload also held in the trainer's device memory, bucket by bucket."""

    buckets: list[DeviceHandle]
    fallback: str
    """The pull store that holds the same payload at the manifest's ``location``, for an
    engine that cannot map the buckets (another host, no device, freed already)."""
    checksums: list[int] = []
    """Each bucket's bytes summed (as int64) where the bucket lies: what an engine that
    copies the buckets on its device checks them against (bucket digests are computed
    on the host). It detects memory reused after a free, not tampering: the handles
    come from a process of the same host and run."""
    fallback_pending: bool = False
    """The fallback store is still being written: the manifest has no bucket digests,
    state digest or location yet, and only an engine that copies the buckets on its
    device can load it. The trainer announces the same version again once the fallback
    holds it (the completed manifest); an engine that cannot map the buckets waits for
    that one."""


class WeightManifest(msgspec.Struct, kw_only=True):
    """One weight payload: where it is, how to check it, what it turns into.

    ``full`` payloads are the flat state itself; a ``delta`` applies on top of exactly
    ``base_version``. Payloads move in buckets of ``bucket_bytes`` with one digest each
    (``digest`` names the hash); ``state_digest`` is the digest of the resulting flat
    state (the digest of its bucket digests), checked after a delta is applied.
    """

    version: int
    kind: Literal["full", "delta"]
    base_version: int = 0
    transport: str
    """Pull store holding the payload: ``object`` (NATS Object Store), ``shm``, or
    ``cuda_ipc`` (device memory: ``device`` says where, and which store holds a copy)."""
    location: str
    payload_bytes: int
    bucket_bytes: int
    digest: Literal["xxh3-128"]
    bucket_digests: list[str]
    state_bytes: int
    state_digest: str
    layout: list[TensorSpec]
    delta: DeltaEncoding | None = None
    device: DevicePayload | None = None
    """``cuda_ipc``: the payload's buckets in the trainer's device memory."""

    @property
    def fallback_pending(self) -> bool:
        """Loadable from the trainer's device memory only, for now
        (``DevicePayload.fallback_pending``)."""
        return self.device is not None and self.device.fallback_pending


class WeightsPublished(Message, tag="weights.published"):
    """trainer -> weight-sync (JetStream): the payload of ``manifest.version`` is complete
    in its store (written before this message exists). With ``cuda_ipc`` it may be
    complete in the trainer's device memory only (``DevicePayload.fallback_pending``); the
    version is then announced a second time, completed, once its fallback store holds
    it."""

    manifest: WeightManifest
    step: int

    @property
    def version(self) -> int:
        return self.manifest.version


class CurrentVersionQuery(Message, tag="weights.query"):
    """engine worker -> weight-sync: which version should I serve?"""

    engine_id: str


class CurrentVersion(Message, tag="weights.current"):
    """weight-sync -> engine worker: the newest complete version (0 = the base model) and
    the chain that builds it: the latest full payload, then every delta after it."""

    version: int
    chain: list[WeightManifest] = msgspec.field(default_factory=list)


class WeightsGroupQuery(Message, tag="weights.group.query"):
    """engine worker -> trainer: how do I join the push group?"""

    rank: int


class WeightsGroupOffer(Message, tag="weights.group.offer"):
    """trainer -> engine worker: the push group's NCCL unique id and size."""

    unique_id: list[int]
    size: int
