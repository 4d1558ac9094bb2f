"""Sender and receiver state of weight versions, independent of any transport.

``WeightEncoder`` (trainer side) turns each new state dict into a payload: the flat
state (``full``) or a sparse delta against the previous version. It sends a full state
for the first version, after a layout change, every ``full_every`` versions, after a
version gap, and whenever the delta would not be smaller than ``max_delta_ratio`` of
the state.

``WeightMirror`` (engine side) holds the flat state of the version an engine serves. It
checks every payload bucket against its digest before touching anything, applies a
delta only on top of exactly its base version, and after a delta checks the digest of
the whole resulting state, so an engine is never handed a partial or wrong set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
import torch

from seamlessflow.protocol import TensorSpec, WeightManifest
from seamlessflow.weights import delta
from seamlessflow.weights.layout import (
    DIGEST,
    LayoutMismatch,
    as_bytes,
    bucket_digests,
    bucket_ranges,
    digest_of,
    fill_buckets,
    flatten_into,
    layout_bytes,
    plan_layout,
    state_digest,
    stream_buckets,
    stream_into,
    tensor_views,
    word_bytes,
)


class WeightsCorrupted(Exception):
    """A payload that does not match its manifest (size, bucket digests, state digest)."""


class VersionGap(Exception):
    """The payloads at hand cannot build the target from the version this mirror holds."""


@dataclass
class EncodedWeights:
    """A payload and its manifest; the store fills ``transport`` and ``location``."""

    manifest: WeightManifest
    payload: memoryview


BUCKET_BUFFERS = 2
"""Buckets ``encode_buckets`` fills in turn: one is being written while the sink still
holds the one before."""


class BucketSink(Protocol):
    """Where ``WeightEncoder.encode_buckets`` hands a version, from a worker thread."""

    def begin(self, payload_bytes: int, bucket_bytes: int) -> list[torch.Tensor] | None:
        """A version of ``payload_bytes`` in buckets of ``bucket_bytes`` starts. Returns
        ``BUCKET_BUFFERS`` buffers of ``bucket_bytes`` to fill the buckets in (memory the
        sink sends without copying it: a same-host push ring's slots), or None: the
        encoder fills its own."""
        ...

    def put(self, index: int, bucket: memoryview) -> None:
        """Bucket ``index``. Its view is reused for a later bucket once the next ``put``
        returns: the sink is done with it by then (copied, stored or sent)."""
        ...

    def end(self) -> None:
        """Every bucket was put: return once the sink is done with all of them."""
        ...


class WeightEncoder:
    def __init__(
        self,
        bucket_bytes: int,
        deltas: bool = False,
        full_every: int = 10,
        max_delta_ratio: float = 0.5,
    ) -> None:
        if bucket_bytes <= 0 or full_every <= 0:
            raise ValueError("bucket_bytes and full_every must be positive")
        self.bucket_bytes = bucket_bytes
        self.deltas = deltas
        self.full_every = full_every
        self.max_delta_ratio = max_delta_ratio
        self._previous: torch.Tensor | None = None
        self._previous_version = -1
        self._previous_layout: list[TensorSpec] | None = None
        self._deltas_since_full = 0
        self._spare: torch.Tensor | None = None
        """The buffer of two versions ago, reused: allocating (and zeroing) a new one per
        version costs about half a second per GB."""
        self._spare_layout: list[TensorSpec] | None = None
        self._bucket_buffers: list[torch.Tensor] = []
        """``encode_buckets``'s two buckets, kept from version to version."""

    def encode(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> EncodedWeights:
        """Flatten ``state_dict`` and encode it; blocking (call it in a worker thread).

        The payload may be a view of the encoder's own buffer: store or send it before
        the next call (which may recycle that buffer)."""
        layout = plan_layout(state_dict)
        flat = self._buffer(layout)
        flatten_into(flat, state_dict, layout)
        return self._encode_flat(version, flat, layout)

    def encode_stream(
        self,
        version: int,
        layout: list[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> EncodedWeights:
        """``encode`` of tensors that come one at a time, in ``layout``'s order
        (``layout.layout_of``): each goes straight into the payload, so no whole state
        dict exists beside it. Same payload and manifest as ``encode`` of the same
        tensors."""
        flat = self._buffer(layout)
        stream_into(flat, tensors, layout)
        return self._encode_flat(version, flat, layout)

    @property
    def streams(self) -> bool:
        """Versions can leave bucket by bucket (``encode_buckets``): a delta needs the
        whole previous state, so an encoder with deltas keeps whole payloads."""
        return not self.deltas

    def encode_buckets(
        self,
        version: int,
        layout: list[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        sink: BucketSink,
    ) -> WeightManifest:
        """A full version handed to ``sink`` one bucket at a time as ``tensors`` come (in
        ``layout``'s order), each hashed as it fills; its manifest, once every bucket was
        handed over. Only two buckets exist here, reused version after version: a payload
        never does. The buckets and manifest are those of ``encode`` of the same tensors.
        Blocking (a worker thread)."""
        if not self.streams:
            raise ValueError("an encoder that sends deltas needs whole versions: encode_stream")
        payload_bytes = layout_bytes(layout)
        buffers = sink.begin(payload_bytes, self.bucket_bytes)
        if buffers is None:
            if len(self._bucket_buffers) != BUCKET_BUFFERS:
                self._bucket_buffers = [
                    torch.empty(self.bucket_bytes, dtype=torch.uint8) for _ in range(BUCKET_BUFFERS)
                ]
            buffers = self._bucket_buffers
        digests: list[str] = []
        for index, bucket in enumerate(stream_buckets(tensors, layout, buffers)):
            digests.append(digest_of(bucket))
            sink.put(index, bucket)
        sink.end()
        # no whole state is kept, so the next version is full too
        self._previous = self._spare = None
        self._previous_version, self._previous_layout = version, layout
        return self._full_manifest(version, payload_bytes, layout, digests)

    def pack_buckets(
        self,
        version: int,
        layout: list[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
    ) -> tuple[WeightManifest, list[torch.Tensor]]:
        """A full version packed where the trainer computes: one uint8 tensor per bucket
        on ``device``, each its own allocation (another process maps a bucket whole:
        ``cuda_ipc``), filled as ``tensors`` come (in ``layout``'s order, where they
        live): no host copy. The bytes are those ``encode_buckets`` hands over; the
        manifest has no digests yet: they are hashed where the buckets reach the host
        (``DevicePayloads.store_fallback``). Blocking (a worker thread)."""
        if not self.streams:
            raise ValueError("an encoder that sends deltas needs whole versions: encode_stream")
        payload_bytes = layout_bytes(layout)
        buckets = [
            torch.empty(end - start, dtype=torch.uint8, device=device)
            for start, end in bucket_ranges(payload_bytes, self.bucket_bytes)
        ]
        fill_buckets(tensors, layout, buckets)
        self._previous = self._spare = None  # as encode_buckets: the next version is full
        self._previous_version, self._previous_layout = version, layout
        manifest = self._full_manifest(version, payload_bytes, layout, [])
        return msgspec.structs.replace(manifest, state_digest=""), buckets

    def _full_manifest(
        self, version: int, payload_bytes: int, layout: list[TensorSpec], digests: list[str]
    ) -> WeightManifest:
        return WeightManifest(
            version=version,
            kind="full",
            transport="",
            location="",
            payload_bytes=payload_bytes,
            bucket_bytes=self.bucket_bytes,
            digest=DIGEST,
            bucket_digests=digests,
            state_bytes=payload_bytes,
            state_digest=state_digest(digests),
            layout=layout,
        )

    def _encode_flat(
        self, version: int, flat: torch.Tensor, layout: list[TensorSpec]
    ) -> EncodedWeights:
        payload = as_bytes(flat)
        digests = bucket_digests(payload, self.bucket_bytes)
        manifest = self._full_manifest(version, flat.numel(), layout, digests)
        encoded = self._delta(manifest, flat) if self._delta_allowed(version, layout) else None
        if encoded is not None:
            manifest, payload = encoded
            self._deltas_since_full += 1
        else:
            self._deltas_since_full = 0
        self._spare, self._spare_layout = self._previous, self._previous_layout
        self._previous, self._previous_version, self._previous_layout = flat, version, layout
        return EncodedWeights(manifest=manifest, payload=payload)

    def _buffer(self, layout: list[TensorSpec]) -> torch.Tensor:
        """A buffer for ``layout``. The spare one (its payload was stored and pushed
        before this call, so nobody reads it) only if it was laid out the same: then it
        has the right size and the alignment gaps, which no tensor overwrites, are still
        zero. (The spare is two versions old: the previous version's layout says nothing
        about it after a layout change.)"""
        spare, self._spare = self._spare, None
        if spare is not None and layout == self._spare_layout:
            return spare
        return torch.zeros(layout_bytes(layout), dtype=torch.uint8)

    def _delta_allowed(self, version: int, layout: list[TensorSpec]) -> bool:
        return (
            self.deltas
            and self._previous is not None
            and self._previous_version == version - 1
            and self._previous_layout == layout
            and self._deltas_since_full + 1 < self.full_every
        )

    def _delta(
        self, full: WeightManifest, flat: torch.Tensor
    ) -> tuple[WeightManifest, memoryview] | None:
        assert self._previous is not None
        found = delta.encode(
            self._previous.numpy(), flat.numpy(), word_bytes(full.layout), self.max_delta_ratio
        )
        if found is None:
            return None
        encoding, data = found
        manifest = WeightManifest(
            version=full.version,
            kind="delta",
            base_version=self._previous_version,
            transport="",
            location="",
            payload_bytes=len(data),
            bucket_bytes=self.bucket_bytes,
            digest=DIGEST,
            bucket_digests=bucket_digests(data, self.bucket_bytes),
            state_bytes=full.state_bytes,
            state_digest=full.state_digest,
            layout=full.layout,
            delta=encoding,
        )
        return manifest, memoryview(data)


class WeightMirror:
    """The flat state of one version on the receiving side (version 0: nothing held)."""

    def __init__(self) -> None:
        self.version = 0
        self.flat: torch.Tensor | None = None
        self.manifest: WeightManifest | None = None

    def plan(self, chain: list[WeightManifest]) -> list[WeightManifest]:
        """Which payloads of ``chain`` (a full, then consecutive deltas; or a single
        payload) to apply, in order, to reach its last version from this one."""
        if not chain or chain[-1].version <= self.version:
            return []
        held = [i for i, m in enumerate(chain) if m.version == self.version]
        if self.flat is not None and held:
            return chain[held[0] + 1 :]
        if (
            chain[0].kind == "delta"
            and chain[0].base_version == self.version
            and self.flat is not None
        ):
            return chain
        if chain[0].kind == "full":
            return chain
        raise VersionGap(
            f"holding version {self.version}; the payloads start with a delta on "
            f"{chain[0].base_version}"
        )

    def apply(
        self,
        manifest: WeightManifest,
        payload: memoryview | bytes,
        payload_digests: list[str] | None = None,
    ) -> None:
        """Check then apply one payload; blocking (call it in a worker thread).

        ``payload_digests``: the digest of each of ``payload``'s buckets, computed by
        the caller from these very bytes (the push group's receiver hashes each bucket
        as it lands); None: hashed here."""
        view = memoryview(payload).cast("B")
        if len(view) != manifest.payload_bytes:
            raise WeightsCorrupted(
                f"version {manifest.version}: {len(view)} bytes, announced {manifest.payload_bytes}"
            )
        if payload_digests is None:
            payload_digests = bucket_digests(view, manifest.bucket_bytes)
        if payload_digests != manifest.bucket_digests:
            raise WeightsCorrupted(f"version {manifest.version}: a bucket's digest does not match")
        try:
            state_bytes = layout_bytes(manifest.layout)
        except LayoutMismatch as exc:
            raise WeightsCorrupted(f"version {manifest.version}: {exc}") from exc
        if manifest.state_bytes != state_bytes:
            raise WeightsCorrupted(
                f"version {manifest.version}: the layout needs {state_bytes} bytes"
            )
        if manifest.kind == "full":
            if (
                manifest.payload_bytes != manifest.state_bytes
                or state_digest(manifest.bucket_digests) != manifest.state_digest
            ):
                raise WeightsCorrupted(f"version {manifest.version}: inconsistent manifest")
            if self.flat is None or self.flat.numel() != manifest.state_bytes:
                self.flat = torch.empty(manifest.state_bytes, dtype=torch.uint8)
            self.flat.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        else:
            self._apply_delta(manifest, view)
        self.version, self.manifest = manifest.version, manifest

    def _apply_delta(self, manifest: WeightManifest, view: memoryview) -> None:
        if self.flat is None or manifest.base_version != self.version or manifest.delta is None:
            raise VersionGap(f"a delta on {manifest.base_version}; holding {self.version}")
        assert self.manifest is not None
        if self.manifest.layout != manifest.layout:
            raise VersionGap(f"version {manifest.version} changes the layout")
        try:
            delta.apply(self.flat.numpy(), manifest.delta, view)
        except delta.DeltaCorrupted as exc:
            raise WeightsCorrupted(f"version {manifest.version}: {exc}") from exc
        digests = bucket_digests(as_bytes(self.flat), manifest.bucket_bytes)
        if state_digest(digests) != manifest.state_digest:
            # patched in place: what is held is no known version any more
            self.version, self.flat, self.manifest = 0, None, None
            raise WeightsCorrupted(f"version {manifest.version}: wrong state after the delta")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held version as views (no copy): valid until the next ``apply``."""
        if self.flat is None or self.manifest is None:
            return {}
        return tensor_views(self.flat, self.manifest.layout)
