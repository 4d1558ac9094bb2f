"""How weights travel (env prefix ``SF_WEIGHTS_``): read by the trainer, which publishes,
and by the engines, which fetch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic_settings import SettingsConfigDict

from seamlessflow.bus import Bus
from seamlessflow.runfile import RunFileSettings
from seamlessflow.weights.codec import WeightEncoder
from seamlessflow.weights.device import CudaBuffers, DeviceBuffers, SharedMemoryBuffers
from seamlessflow.weights.ipc import DevicePayloads, EnginePlacement, HeldVersions, choose_transport
from seamlessflow.weights.layout import torch_dtype
from seamlessflow.weights.stores import ObjectStorePayloads, PayloadStore, SharedMemoryPayloads
from seamlessflow.weights.sync import WeightPublisher

if TYPE_CHECKING:
    import torch


class WeightTransferSettings(RunFileSettings):
    """Weight transfer from trainer to engines."""

    model_config = SettingsConfigDict(
        env_prefix="SF_WEIGHTS_", extra="ignore", use_attribute_docstrings=True
    )

    transport: Literal["object", "shm", "cuda_ipc", "auto"] = "object"
    """Where the trainer puts each version for engines to pull: ``object`` (NATS Object
    Store, any host), ``shm`` (files in ``shm_dir``; trainer and engines on one host),
    ``cuda_ipc`` (the trainer's CUDA memory, mapped by the engines of its host, with
    ``ipc_fallback`` holding a copy), or ``auto``: ``cuda_ipc`` for a CUDA trainer when
    ``engine_placement`` is ``this-host-cuda``, ``shm`` on one host, else ``object``.
    GPU engines in a collective group also get a push broadcast (``collective``)."""

    engine_placement: EnginePlacement = "other-hosts"
    """Where the engines are, for ``transport=auto`` (what the launcher knows):
    ``other-hosts`` (some engine may be on another host), ``this-host`` (all on the
    trainer's host), ``this-host-cuda`` (all on its host, each with a CUDA device)."""

    ipc_fallback: Literal["shm", "object"] = "shm"
    """``cuda_ipc``: the pull store that also holds every version, read by an engine that
    cannot map the device buffers (freed, no device) and by late joiners."""

    ipc_max_versions: int = 2
    """``cuda_ipc``: versions whose device buffers the trainer holds at most. Publishing
    one more frees the oldest at once (the trainer never waits); an engine that had not
    mapped it reads ``ipc_fallback``."""

    ipc_hold_s: float = 120.0
    """``cuda_ipc``: a version's device buffers are freed this long after it was stored,
    whether or not every engine acknowledged it (a silent engine reads the fallback)."""

    ipc_expect_engines: int = 0
    """``cuda_ipc``: engines that must acknowledge a version (``WeightsLoaded``) before
    its device buffers are freed early; 0 = the engines heard from (at least one)."""

    dtype: str = ""
    """dtype the weights travel in (``bfloat16``, ``float32``); empty = the precision the
    trainer computes in (``bfloat16`` when ``SF_PRECISION`` is or resolves to
    ``bf16-mixed``, else its float32 weights): the same hardware rule as the trainer's.
    Low-precision transfer is where deltas pay: most bf16 words survive a step."""

    deltas: bool = True
    """Send sparse deltas between consecutive versions when they are smaller (for
    versions up to ``delta_max_mb``)."""

    delta_max_mb: float = 1024.0
    """Largest version (MiB, in the travel dtype) sent with deltas. A delta is computed
    against the whole previous version, so the trainer's rank 0 then keeps two whole
    versions; a larger version streams bucket by bucket as it is gathered and goes in
    full, rank 0 holding two buckets of it (docs/design.md, "Published bucket by
    bucket"). 0: every version streams."""

    full_every: int = 10
    """A full payload at least every N versions (chains stay short for late joiners)."""

    max_delta_ratio: float = 0.5
    """Send in full when a delta would exceed this fraction of the full state."""

    bucket_mb: float = 64.0
    """Transfer bucket: payloads move and are checked (a digest each) in pieces of this size."""

    keep_chains: int = 2
    """Payload chains (a full version and its deltas) the trainer keeps for engines
    still catching up; older payloads are deleted."""

    shm_dir: Path = Path("/dev/shm")
    """Directory of shared-memory payloads (``shm`` transport)."""

    group_backend: Literal["", "gloo", "nccl"] = ""
    """Push group: besides the pull store, the trainer broadcasts each payload to a fixed
    group of engines. ``nccl``: NCCL through CuPy on GPUs (the NCCL id travels over NATS);
    ``gloo``: a gloo group of its own on CPU (beside the trainer ranks' own world); empty =
    pull only.
    Engines that join later, or refuse a broadcast, pull from the store."""

    group_size: int = 0
    """Members of the push group: the trainer (rank 0) and every engine in it."""

    group_rank: int = 0
    """This process's rank in the push group (the trainer is 0; engines 1..size-1)."""

    group_address: str = "127.0.0.1:29650"
    """``gloo`` rendezvous (host:port of the trainer's TCP store)."""

    group_timeout_s: float = 600.0
    """How long forming the group and each broadcast may wait for the other members."""

    group_shared_memory: Literal["auto", "off"] = "auto"
    """``auto``: when every member of a ``gloo`` push group maps the same file in
    ``shm_dir`` (one host, the directory shared), buckets go through that shared memory
    and only small control messages over the sockets (``weights.ring``; checked when the
    group forms, else the sockets carry everything). ``off``: always the sockets."""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024))

    @property
    def travel_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch dtype; None: the trainer's weights as they are."""
        return torch_dtype(self.dtype) if self.dtype else None


def payload_stores(bus: Bus, settings: WeightTransferSettings) -> dict[str, PayloadStore]:
    """Every store an engine can fetch from; the manifest names the one to use."""
    stores: dict[str, PayloadStore] = {
        ObjectStorePayloads.name: ObjectStorePayloads(bus),
        SharedMemoryPayloads.name: SharedMemoryPayloads(
            bus.subjects.run_id, settings.shm_dir, bus.subjects.policy
        ),
    }
    stores[DevicePayloads.name] = DevicePayloads(
        stores, settings.ipc_fallback, None, held_versions(settings), device_readers(bus, settings)
    )
    return stores


def held_versions(settings: WeightTransferSettings) -> HeldVersions:
    return HeldVersions(
        max_versions=settings.ipc_max_versions,
        hold_s=settings.ipc_hold_s,
        expect_engines=settings.ipc_expect_engines,
    )


def stand_in_buffers(bus: Bus, settings: WeightTransferSettings) -> SharedMemoryBuffers:
    """The CPU stand-in of device buffers, named per run and policy like shm payloads."""
    return SharedMemoryBuffers(
        settings.shm_dir, f"seamlessflow-{bus.subjects.run_id}-{bus.subjects.policy}-"
    )


def device_readers(bus: Bus, settings: WeightTransferSettings) -> dict[str, DeviceBuffers]:
    """The device layers an engine opens handles with: CUDA where there is a device."""
    readers: dict[str, DeviceBuffers] = {"shm": stand_in_buffers(bus, settings)}
    import torch

    if torch.cuda.is_available():
        readers["cuda"] = CudaBuffers()
    return readers


def resolved_transport(settings: WeightTransferSettings, trainer_device: str) -> str:
    """The transport the trainer publishes with (``auto`` decided)."""
    if settings.transport == "auto":
        return choose_transport(trainer_device, settings.engine_placement)
    return settings.transport


def publisher(
    bus: Bus,
    settings: WeightTransferSettings,
    version_bytes: int,
    trainer_device: str = "cpu",
    device_buffers: DeviceBuffers | None = None,
) -> WeightPublisher:
    """The trainer's publisher for versions of ``version_bytes`` (their travel size).

    ``cuda_ipc`` allocates on ``trainer_device`` (or in ``device_buffers``: the CPU
    stand-in in tests); its store must be started with ``DevicePayloads.watch``."""
    transport = resolved_transport(settings, trainer_device)
    encoder = WeightEncoder(
        bucket_bytes=settings.bucket_bytes,
        # cuda_ipc: every version in full, which an engine copies on its device (a delta
        # needs the host mirror); device bandwidth makes a delta's saving moot there
        deltas=settings.deltas
        and transport != DevicePayloads.name
        and version_bytes <= settings.delta_max_mb * 1024 * 1024,
        full_every=settings.full_every,
        max_delta_ratio=settings.max_delta_ratio,
    )
    stores = payload_stores(bus, settings)
    store = stores[transport]
    if isinstance(store, DevicePayloads):
        if device_buffers is None and not trainer_device.startswith("cuda"):
            raise ValueError(f"cuda_ipc needs a CUDA trainer, not {trainer_device!r}")
        store.buffers = device_buffers or CudaBuffers(trainer_device)
        store.readers.setdefault(store.buffers.kind, store.buffers)
    return WeightPublisher(
        store, encoder, keep_chains=settings.keep_chains, dtype=settings.travel_dtype
    )
