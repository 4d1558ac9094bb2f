"""Pull stores for weight payloads: where a version waits until each engine fetches it.

Both stores keep a payload as buckets of ``manifest.bucket_bytes``, write it completely
before ``put`` returns (so before any message names it), and let readers fetch at their
own pace: a late joiner or a lagging engine never stalls the trainer.

- ``ObjectStorePayloads`` (``object``): one NATS Object Store object per bucket; works
  across hosts; the default.
- ``SharedMemoryPayloads`` (``shm``): one file per payload in a shared-memory directory
  (``/dev/shm``), written under a temporary name and renamed, so a reader never maps a
  partial file. Readers map it and verify and apply straight from the mapping (no
  intermediate copy). Trainer and engines must share the host.

The publisher owns its payloads and deletes them (``delete``); a fetch of a deleted
payload raises ``PayloadMissing`` and the engine catches up from a newer chain. A fetch
checks the manifest's sizes against the stored payload before it allocates or reads
anything, and refuses a mismatch (``WeightsCorrupted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import mmap
import os
import sys
from pathlib import Path
from typing import Protocol

from seamlessflow.bus import BROKER_ERRORS, Bus, NotFound, ObjectBucket
from seamlessflow.protocol import DEFAULT_POLICY, WeightManifest
from seamlessflow.weights.codec import EncodedWeights, WeightsCorrupted
from seamlessflow.weights.layout import bucket_ranges

# NATS caps a message at 1 MiB by default; a chunk leaves room for the headers.
OBJECT_CHUNK_BYTES = 1024 * 1024 - 4096
OBJECT_FETCH_PARALLEL = 2
"""Buckets an engine fetches at once. With 4, a 1 GB fetch on two busy cores had the
server close the engine's connection as a slow consumer (its 64 MiB ``max_pending``
exceeded: each get's flow-control window is pushed while nats-py reads behind) and the
fetch failed or was retried after a reconnect; 2 never did in the runs here, and fetched
1 GB in 11.8-12.1 s against 10-15 s with 4 (docs/benchmarks.md, "Weight sync")."""


class PayloadMissing(Exception):
    """The payload a manifest names is gone (pruned, or another host's shared memory)."""


class PayloadWriter(Protocol):
    """A payload being stored bucket by bucket; readers see it only once ``close``d."""

    async def write(self, index: int, bucket: memoryview) -> None:
        """Bucket ``index`` (written in order); done with ``bucket`` on return."""
        ...

    async def close(self, manifest: WeightManifest) -> WeightManifest:
        """Every bucket written: the payload is complete; ``manifest`` with its place."""
        ...

    async def abort(self) -> None:
        """Give the partial payload up (removed as far as the store can be reached)."""
        ...


class PayloadStore(Protocol):
    name: str
    ephemeral: bool
    """Payloads live in RAM: the publisher deletes them all when it stops."""

    async def writer(self, version: int, kind: str) -> PayloadWriter:
        """Start storing the payload of ``version`` (a ``full`` or ``delta``)."""
        ...

    async def put(self, encoded: EncodedWeights) -> WeightManifest:
        """Store the payload completely; returns the manifest with its location."""
        ...

    async def fetch(self, manifest: WeightManifest) -> memoryview:
        """The payload's bytes (not yet verified: ``WeightMirror.apply`` checks them)."""
        ...

    async def delete(self, manifest: WeightManifest) -> None: ...

    async def delete_before(self, version: int) -> None:
        """Delete every stored payload of a version below ``version`` (those of an
        earlier trainer process too, which no publisher remembers)."""
        ...


def payload_name(version: int, kind: str) -> str:
    return f"weights-v{version:08d}-{kind}"


async def put_whole(store: PayloadStore, encoded: EncodedWeights) -> WeightManifest:
    """``put`` through the store's writer: the payload's buckets in turn."""
    manifest = encoded.manifest
    writer = await store.writer(manifest.version, manifest.kind)
    try:
        for index, (start, end) in enumerate(
            bucket_ranges(len(encoded.payload), manifest.bucket_bytes)
        ):
            await writer.write(index, encoded.payload[start:end])
    except BaseException:
        await writer.abort()
        raise
    return await writer.close(manifest)


def _payload_version(name: str) -> int:
    """The version in a name ``payload_name`` made (with any suffix); a name it did not
    make counts as the newest, so nothing else is ever deleted as old."""
    digits = name.removeprefix("weights-v")[:8]
    if name.startswith("weights-v") and len(digits) == 8 and digits.isdigit():
        return int(digits)
    return sys.maxsize


class ObjectStorePayloads:
    name = "object"
    ephemeral = False

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._store: ObjectBucket | None = None
        self._bucket = bus.subjects.object_store_weights()

    async def _objects(self) -> ObjectBucket:
        if self._store is None:
            self._store = await self.bus.object_bucket(self._bucket)
        return self._store

    async def writer(self, version: int, kind: str) -> PayloadWriter:
        return _ObjectWriter(await self._objects(), payload_name(version, kind))

    async def put(self, encoded: EncodedWeights) -> WeightManifest:
        return await put_whole(self, encoded)

    async def fetch(self, manifest: WeightManifest) -> memoryview:
        store = await self._objects()
        check_buckets(manifest)
        ranges = list(bucket_ranges(manifest.payload_bytes, manifest.bucket_bytes))
        # A manifest is input: its sizes must be those of the stored objects before its
        # payload is allocated, or one message could make an engine allocate anything.
        for index, (start, end) in enumerate(ranges):
            size = await self._stored_size(store, manifest, index)
            if size != end - start:
                raise WeightsCorrupted(
                    f"version {manifest.version}: the manifest makes bucket {index} "
                    f"{end - start} bytes; the store holds {size}"
                )
        payload = memoryview(bytearray(manifest.payload_bytes))
        # several buckets at once: each get waits on nats-py's flow-control replies,
        # which it sends only every 250 ms, so overlapping gets overlaps those waits
        parallel = asyncio.Semaphore(OBJECT_FETCH_PARALLEL)

        async def fetch_bucket(index: int, start: int, end: int) -> None:
            # chunks are written straight into place: nats-py would otherwise build each
            # object by ``bytes +=``, quadratic in the chunks per bucket
            into = _SliceWriter(payload[start:end])
            async with parallel:
                try:
                    await store.read_into(_bucket_object(manifest.location, index), into)
                except NotFound as exc:
                    raise PayloadMissing(f"{manifest.location} bucket {index}") from exc
            if into.written != end - start:
                raise PayloadMissing(f"{manifest.location} bucket {index}: {into.written} bytes")

        try:
            async with asyncio.TaskGroup() as group:
                for index, (start, end) in enumerate(ranges):
                    group.create_task(fetch_bucket(index, start, end))
        except* PayloadMissing as missing:
            raise missing.exceptions[0] from None
        return payload

    async def _stored_size(self, store: ObjectBucket, manifest: WeightManifest, index: int) -> int:
        try:
            return await store.size(_bucket_object(manifest.location, index))
        except NotFound as exc:
            raise PayloadMissing(f"{manifest.location} bucket {index}") from exc

    async def delete(self, manifest: WeightManifest) -> None:
        """Remove every message of the payload from the bucket's stream, the object
        store's "deleted" markers too (``ObjectBucket.remove``: otherwise disk grew by a
        payload per version)."""
        store = await self._objects()
        for index in range(len(manifest.bucket_digests)):
            await store.remove(_bucket_object(manifest.location, index))

    async def delete_before(self, version: int) -> None:
        store = await self._objects()
        for name in await store.names():
            if _payload_version(name) < version:
                await store.remove(name)


class SharedMemoryPayloads:
    """Payloads as files in shared memory (``/dev/shm``: RAM), read in place (mmap) by
    the engines of one host: ``seamlessflow-<run>-<policy>-weights-v<version>-<kind>``."""

    name = "shm"
    ephemeral = True

    def __init__(
        self, run_id: str, directory: Path = Path("/dev/shm"), policy: str = DEFAULT_POLICY
    ) -> None:
        self.directory = directory
        # one name space per run and policy: two policies of a run publish the same
        # version numbers, often at the same moment, and each prunes its own old ones
        self.prefix = f"seamlessflow-{run_id}-{policy}-"

    async def writer(self, version: int, kind: str) -> PayloadWriter:
        final = self.directory / (self.prefix + payload_name(version, kind))
        out = await asyncio.to_thread(final.with_name(final.name + ".partial").open, "wb")
        return _FileWriter(out, final)

    async def put(self, encoded: EncodedWeights) -> WeightManifest:
        return await put_whole(self, encoded)

    async def fetch(self, manifest: WeightManifest) -> memoryview:
        if not manifest.location.startswith(self.prefix):
            raise PayloadMissing(f"{manifest.location} is not a payload of this run")
        check_buckets(manifest)
        try:
            with (self.directory / manifest.location).open("rb") as source:
                stored = os.fstat(source.fileno()).st_size
                if stored != manifest.payload_bytes:
                    raise WeightsCorrupted(
                        f"version {manifest.version}: the manifest says "
                        f"{manifest.payload_bytes} bytes; the store holds {stored}"
                    )
                if manifest.payload_bytes == 0:
                    return memoryview(b"")
                mapping = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:
            raise PayloadMissing(f"{manifest.location} (another host, or pruned)") from exc
        # the mapping stays valid after an unlink, until the view is released
        return memoryview(mapping)

    async def delete(self, manifest: WeightManifest) -> None:
        (self.directory / manifest.location).unlink(missing_ok=True)

    async def delete_before(self, version: int) -> None:
        for path in self.directory.glob(self.prefix + "weights-v*"):
            if _payload_version(path.name.removeprefix(self.prefix)) < version:
                path.unlink(missing_ok=True)


class _ObjectWriter:
    """A payload as one object per bucket: ``.b00000``, ``.b00001``, ..."""

    def __init__(self, store: ObjectBucket, location: str) -> None:
        self.store, self.location = store, location
        self.written = 0

    async def write(self, index: int, bucket: memoryview) -> None:
        await self.store.put(
            _bucket_object(self.location, index), bytes(bucket), chunk_bytes=OBJECT_CHUNK_BYTES
        )
        self.written = index + 1

    async def close(self, manifest: WeightManifest) -> WeightManifest:
        if self.written != len(manifest.bucket_digests):
            raise ValueError(f"{self.written} of {len(manifest.bucket_digests)} buckets stored")
        return _located(manifest, ObjectStorePayloads.name, self.location)

    async def abort(self) -> None:
        with contextlib.suppress(*BROKER_ERRORS):
            for index in range(self.written):
                await self.store.remove(_bucket_object(self.location, index))


class _FileWriter:
    """A payload written to ``<final>.partial`` and renamed: readers see all or nothing."""

    def __init__(self, out: io.BufferedWriter, final: Path) -> None:
        self.out, self.final = out, final
        self.written = 0

    async def write(self, index: int, bucket: memoryview) -> None:
        if index != self.written:
            raise ValueError(f"bucket {index} written after {self.written} buckets")
        await asyncio.to_thread(self.out.write, bucket)
        self.written += 1

    async def close(self, manifest: WeightManifest) -> WeightManifest:
        if self.written != len(manifest.bucket_digests):
            raise ValueError(f"{self.written} of {len(manifest.bucket_digests)} buckets written")
        await asyncio.to_thread(self.out.close)
        os.replace(self.out.name, self.final)  # atomic: readers see all of it or nothing
        return _located(manifest, SharedMemoryPayloads.name, self.final.name)

    async def abort(self) -> None:
        await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        self.out.close()
        Path(self.out.name).unlink(missing_ok=True)


class _SliceWriter(io.BufferedIOBase):
    """A file-like ``write`` into a fixed slice; what does not fit is counted, not kept."""

    def __init__(self, target: memoryview) -> None:
        super().__init__()
        self.target = target
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        end = self.written + len(data)
        if end <= len(self.target):
            self.target[self.written : end] = data
        self.written = end
        return len(data)


def check_buckets(manifest: WeightManifest, count: int | None = None) -> None:
    """The manifest's sizes agree with each other: one digest per bucket (or ``count``
    buckets: a version whose digests are pending has device handles only). Arithmetic
    only, so a wild size never yields a long list of buckets."""
    size, bucket = manifest.payload_bytes, manifest.bucket_bytes
    if count is None:
        have, what = len(manifest.bucket_digests), "bucket digests"
    else:
        have, what = count, "device buckets"
    if size < 0 or bucket <= 0 or -(-size // bucket) != have:
        raise WeightsCorrupted(
            f"version {manifest.version}: {size} bytes in buckets of {bucket} bytes "
            f"do not make its {have} {what}"
        )


def _bucket_object(location: str, index: int) -> str:
    return f"{location}.b{index:05d}"


def _located(manifest: WeightManifest, transport: str, location: str) -> WeightManifest:
    import msgspec

    return msgspec.structs.replace(manifest, transport=transport, location=location)
