"""How weights travel (env prefix ``SF_WEIGHTS_``): read by the trainer, which publishes,
and by the engines, which fetch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic_settings import SettingsConfigDict

from seamlessflow.bus import Bus
from seamlessflow.runfile import RunFileSettings
from seamlessflow.weights.codec import WeightEncoder
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

    transport: Literal["object", "shm"] = "object"
    """Where the trainer puts each version for engines to pull: ``object`` (NATS Object
    Store, any host) or ``shm`` (files in ``shm_dir``; trainer and engines on one host).
    GPU engines in a collective group also get a push broadcast (``collective``)."""

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
    return {
        ObjectStorePayloads.name: ObjectStorePayloads(bus),
        SharedMemoryPayloads.name: SharedMemoryPayloads(
            bus.subjects.run_id, settings.shm_dir, bus.subjects.policy
        ),
    }


def publisher(bus: Bus, settings: WeightTransferSettings, version_bytes: int) -> WeightPublisher:
    """The trainer's publisher for versions of ``version_bytes`` (their travel size)."""
    encoder = WeightEncoder(
        bucket_bytes=settings.bucket_bytes,
        deltas=settings.deltas and version_bytes <= settings.delta_max_mb * 1024 * 1024,
        full_every=settings.full_every,
        max_delta_ratio=settings.max_delta_ratio,
    )
    store = payload_stores(bus, settings)[settings.transport]
    return WeightPublisher(
        store, encoder, keep_chains=settings.keep_chains, dtype=settings.travel_dtype
    )
