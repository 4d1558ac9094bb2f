"""The CUDA layer of the ``cuda_ipc`` transport: a version's buckets in one process's
CUDA memory, applied by another process that maps them by their handles (plain data,
decoded from JSON as a manifest from NATS would be). Skipped without CUDA (the ``gpu``
mark); the protocol above this layer runs on CPU in ``test_cuda_ipc_weights.py``."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import msgspec
import pytest
import torch

from seamlessflow.protocol import WeightManifest
from seamlessflow.weights import SharedMemoryPayloads, WeightEncoder, WeightMirror
from seamlessflow.weights.device import CudaBuffers
from seamlessflow.weights.ipc import DevicePayloads, HeldVersions
from seamlessflow.weights.layout import layout_of

pytestmark = pytest.mark.gpu


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1024, 1024, generator=generator).bfloat16(), "b": torch.ones(7)}


def engine(manifest_json: bytes, directory: str, out: str) -> None:
    """Another process: apply the version from the handles alone (its shm copy is gone)."""
    import asyncio

    manifest = msgspec.json.decode(manifest_json, type=WeightManifest)
    stores = {"shm": SharedMemoryPayloads("gpu", Path(directory))}
    payloads = DevicePayloads(stores, "shm", None, HeldVersions(1, 1.0), {"cuda": CudaBuffers()})
    mirror = WeightMirror()
    mirror.apply(manifest, asyncio.run(payloads.fetch(manifest)))
    got, want = mirror.tensors(), state()
    # and device to device: the buckets copied on this process's GPU, checked by sums
    on_device = asyncio.run(payloads.fetch_tensors(manifest, torch.device("cuda")))
    same = all(torch.equal(got[k], want[k]) for k in want)
    same_on_device = all(
        on_device[k].is_cuda and torch.equal(on_device[k].cpu(), want[k]) for k in want
    )
    Path(out).write_text(f"{same} {same_on_device}")


@pytest.mark.parametrize("packed", [False, True], ids=["uploaded", "packed-on-device"])
async def test_another_process_applies_a_version_from_cuda_ipc_handles(
    tmp_path: Path, packed: bool
) -> None:
    """Encoded on the host and each bucket uploaded (``put``), or packed where the
    trainer's weights live (``pack_buckets`` + ``put_packed``: the buckets adopted as
    they are, the fallback hashed from pinned host copies): the same bytes either way."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    stores = {"shm": SharedMemoryPayloads("gpu", tmp_path)}
    trainer = DevicePayloads(stores, "shm", CudaBuffers("cuda"), HeldVersions(2, 60.0))
    encoder = WeightEncoder(bucket_bytes=1 << 19)
    if packed:
        on_device = {name: tensor.cuda() for name, tensor in state().items()}
        layout = layout_of((name, t.dtype, list(t.shape)) for name, t in on_device.items())
        manifest = await trainer.put_packed(
            *encoder.pack_buckets(1, layout, iter(on_device.items()), torch.device("cuda"))
        )
        assert manifest.bucket_digests == encoder.encode(1, state()).manifest.bucket_digests
    else:
        manifest = await trainer.put(encoder.encode(1, state()))
    assert manifest.device is not None and {h.kind for h in manifest.device.buckets} == {"cuda"}
    (tmp_path / manifest.location).unlink()
    out = tmp_path / "engine"
    process = multiprocessing.get_context("spawn").Process(
        target=engine, args=(msgspec.json.encode(manifest), str(tmp_path), str(out))
    )
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert out.read_text() == "True True"
    before = torch.cuda.memory_allocated()
    await trainer.release(trainer.held.ack("engine-1", 1))
    assert torch.cuda.memory_allocated() < before  # the acknowledgement freed them
