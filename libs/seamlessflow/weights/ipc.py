"""The ``cuda_ipc`` transport: each version's buckets in the trainer's device memory,
mapped by the engines of its host, with a pull store beside it as the fallback.

- ``choose_transport``: what ``SF_WEIGHTS_TRANSPORT=auto`` resolves to.
- ``HeldVersions``: which versions' device buffers the trainer still holds, and when
  each may go (pure bookkeeping, no I/O, its clock injected).
- ``DevicePayloads``: a ``PayloadStore``. The trainer's writer stores each bucket in the
  fallback store (``shm`` or ``object``) and in a device buffer; the manifest it returns
  says ``transport="cuda_ipc"``, carries one ``DeviceHandle`` per bucket, and names the
  fallback store, which holds the same payload at the manifest's ``location``. An
  engine's ``fetch`` maps each bucket, copies it out, releases the mapping, and checks
  the bucket digests; any failure (freed, another host, no device, a digest mismatch)
  fetches from the fallback store instead. ``watch`` listens for the engines'
  ``WeightsLoaded`` (the acknowledgement) and the tag-scheduler's ``dead``.

Lifetime (invariants):
- A version's buffers are held until every engine the trainer knows acknowledged it or a
  newer version (at least ``expect_engines`` of them, and at least one), or until
  ``hold_s`` passed, or an engine is declared dead and the rest acknowledged. Engines
  are known from their acknowledgements; a dead one is forgotten.
- At most ``max_versions`` are held: publishing one more frees the oldest at once, so a
  dead or stuck engine never stalls the trainer nor fills its device; an engine that had
  not mapped it yet reads the fallback store (the same bytes).
- Freeing never breaks a reader in the middle: an open mapping stays valid (torch keeps
  a shared CUDA allocation until importers release it; the stand-in's unlinked file
  stays mapped). A handle opened after the free fails, or (CUDA: the allocation reused)
  yields bytes whose digests do not match: both read the fallback.
- Nothing executable travels: handles are plain fields (``protocol.DeviceHandle``).

On the engine, device to device: an engine whose model is on a CUDA device
(``WeightReceiver(device=...)``) copies a full version's buckets from their mappings
into one buffer on its device (``fetch_tensors``), checks each bucket's byte sum
(``DevicePayload.checksums``, computed by the trainer where the bucket lies), and loads
views of it: no host copy, no host digest. With ``cuda_ipc`` the trainer sends every
version in full (``weights.settings.publisher``): a delta needs the host mirror. Any
failure there (not full, no checksums, a handle that will not open, a sum that differs)
falls back to ``fetch`` through the host.

On the trainer, packed on its device: a CUDA trainer casts and copies each tensor, where
it lives, into per-bucket device allocations (``WeightEncoder.pack_buckets``), which
``hold_packed`` makes the held buffers as they are. The manifest it returns is announced
at once, its fallback pending (``DevicePayload.fallback_pending``: no digests, no
location): engines copy the version device to device while ``store_fallback`` writes the
fallback (one pinned copy per bucket, hashed, written to the store), off the version's
path; the trainer then announces the completed manifest, which an engine that could not
map the buckets loads (until then ``fetch`` raises ``PayloadMissing``: catch up later).
``put`` and ``writer`` (a version encoded in host memory, each bucket uploaded) serve a
publisher with a push group or deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    DeviceHandle,
    DevicePayload,
    PhaseChanged,
    WeightManifest,
    WeightsLoaded,
)
from seamlessflow.weights.codec import EncodedWeights, WeightsCorrupted
from seamlessflow.weights.device import BufferGone, DeviceBuffers, byte_sum
from seamlessflow.weights.layout import (
    LayoutMismatch,
    as_bytes,
    bucket_digests,
    bucket_ranges,
    digest_of,
    layout_bytes,
    state_digest,
    tensor_views,
)
from seamlessflow.weights.stores import (
    PayloadMissing,
    PayloadStore,
    PayloadWriter,
    check_buckets,
    put_whole,
)

log = logging.getLogger(__name__)

Transport = Literal["object", "shm", "cuda_ipc"]
EnginePlacement = Literal["other-hosts", "this-host", "this-host-cuda"]


def choose_transport(trainer_device: str, engines: EnginePlacement) -> Transport:
    """``auto``: device memory when the trainer computes on CUDA and every engine is on
    its host with a CUDA device; shared memory when they share the host; else the NATS
    Object Store (the only one that reaches another host)."""
    if engines == "other-hosts":
        return "object"
    if engines == "this-host-cuda" and trainer_device.startswith("cuda"):
        return "cuda_ipc"
    return "shm"


@dataclass
class HeldVersion:
    version: int
    buffers: list[Any]
    since: float


@dataclass
class HeldVersions:
    """The versions whose device buffers the trainer holds (see the module docstring).
    Every method returns the versions it released; the caller frees their buffers."""

    max_versions: int
    hold_s: float
    expect_engines: int = 0
    clock: Callable[[], float] = time.monotonic
    acked: dict[str, int] = field(default_factory=dict)
    """Engine -> the newest version it acknowledged (the engines the trainer knows)."""
    held: dict[int, HeldVersion] = field(default_factory=dict)
    """Oldest first."""

    def __post_init__(self) -> None:
        if self.max_versions < 1:
            raise ValueError("max_versions must be at least 1")

    def hold(self, version: int, buffers: list[Any]) -> list[HeldVersion]:
        released = self.drop(version)  # a republished version replaces its buffers
        self.held[version] = HeldVersion(version, buffers, self.clock())
        while len(self.held) > self.max_versions:
            released.extend(self.drop(next(iter(self.held))))
        return released + self._settled()

    def ack(self, engine_id: str, version: int) -> list[HeldVersion]:
        self.acked[engine_id] = max(self.acked.get(engine_id, 0), version)
        return self._settled()

    def gone(self, engine_id: str) -> list[HeldVersion]:
        self.acked.pop(engine_id, None)
        return self._settled()

    def expire(self) -> list[HeldVersion]:
        cutoff = self.clock() - self.hold_s
        return [self.held.pop(v) for v, held in list(self.held.items()) if held.since <= cutoff]

    def drop(self, version: int) -> list[HeldVersion]:
        held = self.held.pop(version, None)
        return [] if held is None else [held]

    def drop_all(self) -> list[HeldVersion]:
        released, self.held = list(self.held.values()), {}
        return released

    def _settled(self) -> list[HeldVersion]:
        """Versions every known engine acknowledged (enough engines known)."""
        if len(self.acked) < max(1, self.expect_engines):
            return []
        done = min(self.acked.values())
        return [self.held.pop(v) for v in list(self.held) if v <= done]


class DevicePayloads:
    """``cuda_ipc`` (see the module docstring). ``stores`` are the pull stores by name,
    ``fallback`` the one the trainer writes beside the device; ``buffers`` the device
    layer the trainer allocates with; ``readers`` the layers an engine opens handles with
    (by ``DeviceHandle.kind``)."""

    name = "cuda_ipc"

    def __init__(
        self,
        stores: Mapping[str, PayloadStore],
        fallback: str,
        buffers: DeviceBuffers | None,
        held: HeldVersions,
        readers: Mapping[str, DeviceBuffers] | None = None,
    ) -> None:
        if fallback not in stores or fallback == self.name:
            raise ValueError(f"no fallback store {fallback!r}")
        self.stores = dict(stores)
        self.fallback = self.stores[fallback]
        self.buffers = buffers
        self.held = held
        self.readers = dict(readers or {})
        if buffers is not None:
            self.readers.setdefault(buffers.kind, buffers)
        self.ephemeral = self.fallback.ephemeral
        self._expiry: asyncio.Task[None] | None = None
        self._subscriptions: list[Any] = []

    # -- trainer side ----------------------------------------------------------------

    async def writer(self, version: int, kind: str) -> PayloadWriter:
        return _DeviceWriter(self, await self.fallback.writer(version, kind), version)

    async def put(self, encoded: EncodedWeights) -> WeightManifest:
        return await put_whole(self, encoded)

    async def put_packed(self, manifest: WeightManifest, buckets: list[Any]) -> WeightManifest:
        """A full version the trainer packed on its device, stored in both at once:
        ``hold_packed`` then ``store_fallback``. The manifest as ``put`` returns it."""
        held = await self.hold_packed(manifest, buckets)
        return await self.store_fallback(held or manifest, buckets)

    async def hold_packed(
        self, manifest: WeightManifest, buckets: list[Any]
    ) -> WeightManifest | None:
        """A full version the trainer packed on its device (``WeightEncoder.pack_buckets``:
        ``manifest`` without digests, one tensor per bucket): the buckets become the held
        device buffers as they are (no upload), summed there. Returns the manifest an
        engine that copies the buckets on its device loads from, its fallback pending
        (``DevicePayload.fallback_pending``: ``store_fallback`` completes it), or None
        when the device refused the buckets (nothing held: the fallback alone serves)."""
        layer = self.buffers
        if layer is None:
            raise ValueError("only a trainer's DevicePayloads (with buffers) stores versions")
        if manifest.kind != "full" or manifest.payload_bytes != manifest.state_bytes:
            raise ValueError(f"version {manifest.version}: only a full version is packed")
        held: list[Any] = []
        try:
            for bucket in buckets:
                held.append(await asyncio.to_thread(layer.adopt, bucket))
            checksums = [await asyncio.to_thread(layer.checksum, b) for b in held]
            handles = [await asyncio.to_thread(layer.export, b) for b in held]
        except Exception as exc:  # the device refused them: the store will have the version
            log.warning("version %d stays out of device memory: %r", manifest.version, exc)
            await self.release([HeldVersion(manifest.version, held, 0.0)])
            return None
        await self.release(self.held.hold(manifest.version, held))
        device = DevicePayload(
            buckets=handles,
            fallback=self.fallback.name,
            checksums=checksums,
            fallback_pending=True,
        )
        return msgspec.structs.replace(
            manifest,
            transport=self.name,
            location="",
            bucket_digests=[],
            state_digest="",
            device=device,
        )

    async def store_fallback(self, manifest: WeightManifest, buckets: list[Any]) -> WeightManifest:
        """The fallback store's copy of a packed version (``manifest``: ``hold_packed``'s,
        or the encoder's when the device refused it): each bucket through one host copy
        (pinned, two reused in turn), hashed as it arrives, the copy of the next bucket
        overlapping the store's write of this one. Returns the manifest completed: its
        digests and location, its fallback no longer pending."""
        writer = await self.fallback.writer(manifest.version, manifest.kind)
        staging = _HostStaging()
        writing: asyncio.Future[None] | None = None
        digests: list[str] = []
        try:
            for index, bucket in enumerate(buckets):
                view, digest = await asyncio.to_thread(staging.copy_and_hash, index, bucket)
                digests.append(digest)
                if writing is not None:
                    await writing  # its staging buffer is the one the next copy fills
                writing = asyncio.ensure_future(writer.write(index, view))
            if writing is not None:
                await writing
            hashed = msgspec.structs.replace(
                manifest, bucket_digests=digests, state_digest=state_digest(digests)
            )
            stored = await writer.close(hashed)
        except BaseException:
            if writing is not None and not writing.done():
                writing.cancel()
                with contextlib.suppress(BaseException):
                    await writing
            await writer.abort()
            raise
        if manifest.device is None:
            return stored
        device = msgspec.structs.replace(
            manifest.device, fallback=stored.transport, fallback_pending=False
        )
        return msgspec.structs.replace(stored, transport=self.name, device=device)

    async def delete(self, manifest: WeightManifest) -> None:
        await self.release(self.held.drop(manifest.version))
        await self._store_of(manifest).delete(manifest)

    async def delete_before(self, version: int) -> None:
        await self.release([h for v in list(self.held.held) if v < version
                            for h in self.held.drop(v)])  # fmt: skip
        await self.fallback.delete_before(version)

    async def release(self, released: list[HeldVersion]) -> None:
        """Free the buffers of released versions (engines still mapping them keep them)."""
        if not released or self.buffers is None:
            return
        buffers = self.buffers
        for held in released:
            for buffer in held.buffers:
                await asyncio.to_thread(buffers.free, buffer)
            held.buffers.clear()
            log.debug("device buffers of version %d freed", held.version)

    async def watch(self, bus: Bus, tick_s: float = 1.0) -> None:
        """Follow the engines' acknowledgements and deaths, and expire held versions."""
        subjects = bus.subjects

        async def on_loaded(loaded: WeightsLoaded) -> None:
            await self.release(self.held.ack(loaded.engine_id, loaded.version))

        async def on_phase(changed: PhaseChanged) -> None:
            if changed.phase == "dead":
                await self.release(self.held.gone(changed.resource_id))

        async def expire() -> None:
            while True:
                await asyncio.sleep(tick_s)
                await self.release(self.held.expire())

        self._subscriptions = [
            await bus.subscribe(subjects.weights_loaded(), WeightsLoaded, on_loaded),
            await bus.subscribe(subjects.sched_phase(), PhaseChanged, on_phase),
        ]
        self._expiry = asyncio.create_task(expire())

    async def close(self) -> None:
        """Stop watching and free every held buffer."""
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
            self._expiry = None
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
        await self.release(self.held.drop_all())

    # -- engine side -----------------------------------------------------------------

    async def fetch(self, manifest: WeightManifest) -> memoryview:
        """The payload from the trainer's device memory, else from the fallback store."""
        if manifest.fallback_pending:  # the host path needs the completed one's digests
            raise PayloadMissing(
                f"version {manifest.version}: in device memory only until its fallback "
                "is stored (the trainer announces it again then)"
            )
        try:
            return await asyncio.to_thread(self._read_device, manifest)
        except (BufferGone, WeightsCorrupted) as exc:
            log.info("version %d: reading %s instead of device memory (%s)",
                     manifest.version, self._fallback_name(manifest), exc)  # fmt: skip
        return await self._store_of(manifest).fetch(manifest)

    def _read_device(self, manifest: WeightManifest) -> memoryview:
        import torch

        payload = memoryview(bytearray(manifest.payload_bytes))
        if len(payload):
            self._copy_buckets(manifest, torch.frombuffer(payload, dtype=torch.uint8))
        # checked here too, so that a buffer reused after its free reads the fallback
        # instead of failing the version (the mirror checks again what it applies)
        if bucket_digests(payload, manifest.bucket_bytes) != manifest.bucket_digests:
            raise WeightsCorrupted(f"version {manifest.version}: device buckets changed")
        return payload

    def _copy_buckets(
        self, manifest: WeightManifest, into: Any, checksums: list[int] | None = None
    ) -> None:
        """Each bucket copied from its mapping into its range of ``into`` (a uint8
        tensor of the payload's size, on the host or a device), the mapping released
        right after; with ``checksums``, each copied bucket's byte sum checked (after
        the copy: a buffer freed and reused before or during it is caught)."""
        handles = self._checked_handles(manifest)
        ranges = bucket_ranges(manifest.payload_bytes, manifest.bucket_bytes)
        for index, (handle, (start, end)) in enumerate(zip(handles, ranges, strict=True)):
            reader = self.readers.get(handle.kind)
            if reader is None:
                raise BufferGone(f"no {handle.kind!r} device on this engine")
            mapping = reader.open(handle)
            try:
                into[start:end].copy_(reader.tensor(mapping))
            finally:
                reader.close(mapping)
                del mapping
            if checksums is not None and byte_sum(into[start:end]) != checksums[index]:
                raise WeightsCorrupted(f"version {manifest.version}: device buckets changed")

    async def fetch_tensors(self, manifest: WeightManifest, device: Any) -> dict[str, Any]:
        """A full version copied from the trainer's device buffers into one new buffer
        on ``device`` (the engine's; device to device on CUDA), as tensor views: no host
        copy. Checked by each bucket's ``checksums`` and the manifest's sizes; raises
        ``BufferGone`` or ``WeightsCorrupted`` (the caller then fetches through the host).
        """
        return await asyncio.to_thread(self._copy_to_device, manifest, device)

    def _copy_to_device(self, manifest: WeightManifest, device: Any) -> dict[str, Any]:
        import torch

        handles = self._checked_handles(manifest)
        payload = manifest.device
        assert payload is not None  # _checked_handles refused a manifest without one
        if manifest.kind != "full" or manifest.payload_bytes != manifest.state_bytes:
            raise BufferGone(f"version {manifest.version}: only a full version maps on a device")
        if len(payload.checksums) != len(handles):
            raise BufferGone(f"version {manifest.version}: its buckets carry no checksums")
        try:
            if layout_bytes(manifest.layout) != manifest.state_bytes:
                raise WeightsCorrupted(f"version {manifest.version}: the layout disagrees")
        except LayoutMismatch as exc:
            raise WeightsCorrupted(f"version {manifest.version}: {exc}") from exc
        flat = torch.empty(manifest.payload_bytes, dtype=torch.uint8, device=device)
        self._copy_buckets(manifest, flat, payload.checksums)
        return tensor_views(flat, manifest.layout)

    def _checked_handles(self, manifest: WeightManifest) -> list[DeviceHandle]:
        """The manifest's device handles, one per bucket of the sizes it announces (a
        manifest is input: every size is checked before anything is allocated)."""
        device = manifest.device
        if device is None:
            raise BufferGone("the manifest has no device buffers")
        check_buckets(manifest, len(device.buckets) if device.fallback_pending else None)
        ranges = list(bucket_ranges(manifest.payload_bytes, manifest.bucket_bytes))
        if len(device.buckets) != len(ranges) or any(
            handle.nbytes != end - start
            for handle, (start, end) in zip(device.buckets, ranges, strict=False)
        ):
            raise WeightsCorrupted(f"version {manifest.version}: buckets and handles disagree")
        return device.buckets

    def _fallback_name(self, manifest: WeightManifest) -> str:
        return manifest.device.fallback if manifest.device is not None else manifest.transport

    def _store_of(self, manifest: WeightManifest) -> PayloadStore:
        """The store that holds the manifest's payload at its ``location``."""
        name = self._fallback_name(manifest)
        store = self.stores.get(name) if name != self.name else None
        if store is None:
            raise PayloadMissing(f"no {name!r} store on this process")
        return store


class _HostStaging:
    """Host copies of a packed version's buckets, for the fallback store: two buffers
    used in turn (pinned when the buckets are on a CUDA device: the copy runs at the
    link's rate), each read until the bucket after next is copied. On CUDA the copies
    run on a stream of their own, so that the trainer's next step, queued on its stream
    meanwhile, neither waits for them nor holds them back (the buckets were complete
    before they were held: ``CudaBuffers.adopt``, and are never written again)."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.stream: Any = None

    def copy_and_hash(self, index: int, bucket: Any) -> tuple[memoryview, str]:
        import torch

        if bucket.device.type == "cpu":  # the buckets are host memory already
            view = as_bytes(bucket)
            return view, digest_of(view)
        if len(self.buffers) < 2:  # sized by the first bucket: no later one is larger
            pin = bucket.device.type == "cuda"
            self.buffers.append(torch.empty(bucket.numel(), dtype=torch.uint8, pin_memory=pin))
        target = self.buffers[index % 2][: bucket.numel()]
        if bucket.device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=bucket.device)
            with torch.cuda.stream(self.stream):
                target.copy_(bucket, non_blocking=True)
            self.stream.synchronize()
        else:
            target.copy_(bucket)
        view = as_bytes(target)
        return view, digest_of(view)


class _DeviceWriter:
    """Each bucket to the fallback store and to a device buffer. A device that cannot
    take a bucket (out of memory) leaves the version to the fallback store alone."""

    def __init__(self, payloads: DevicePayloads, fallback: PayloadWriter, version: int) -> None:
        self.payloads, self.fallback, self.version = payloads, fallback, version
        self.buffers: list[Any] = []
        self.checksums: list[int] = []
        self.device_ok = payloads.buffers is not None

    async def write(self, index: int, bucket: memoryview) -> None:
        await self.fallback.write(index, bucket)
        layer = self.payloads.buffers
        if not self.device_ok or layer is None:
            return
        try:
            buffer = await asyncio.to_thread(layer.allocate, bucket)
            self.buffers.append(buffer)
            self.checksums.append(await asyncio.to_thread(layer.checksum, buffer))
        except Exception as exc:  # e.g. out of device memory: the store has the bucket
            log.warning("version %d stays out of device memory: %r", self.version, exc)
            self.device_ok = False
            await self._free()

    async def close(self, manifest: WeightManifest) -> WeightManifest:
        stored = await self.fallback.close(manifest)
        layer = self.payloads.buffers
        if not self.device_ok or layer is None or len(self.buffers) != len(stored.bucket_digests):
            await self._free()
            return stored
        handles = [await asyncio.to_thread(layer.export, b) for b in self.buffers]
        await self.payloads.release(self.payloads.held.hold(self.version, self.buffers))
        return msgspec.structs.replace(
            stored,
            transport=DevicePayloads.name,
            device=DevicePayload(
                buckets=handles, fallback=stored.transport, checksums=self.checksums
            ),
        )

    async def abort(self) -> None:
        await self._free()
        await self.fallback.abort()

    async def _free(self) -> None:
        buffers, self.buffers = self.buffers, []
        await self.payloads.release([HeldVersion(self.version, buffers, 0.0)])
