"""A weight set staged for vLLM's worker (``sf_engine.backends.staged_weights``): written
once into one buffer, read back as views of the mapping, bit for bit; removed on close;
refused (None: the caller sends bytes) where it does not fit."""

from __future__ import annotations

import os
import stat
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from sf_engine.backends import staged_weights
from sf_engine.backends.staged_weights import ALIGN, StagedTensor, layout, opened, stage


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    square = torch.randn(6, 6, generator=generator)
    return {
        "embed": torch.randn(11, 3, generator=generator),  # 132 bytes: not aligned
        "norm": torch.randn(5, generator=generator).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "transposed": square.t(),  # not contiguous
        "steps": torch.arange(3),
    }


def test_every_tensor_starts_aligned_and_none_overlaps() -> None:
    places, total = layout(weights())
    assert [p.name for p in places] == list(weights())
    assert all(p.offset % ALIGN == 0 for p in places)
    ends = [p.offset + p.nbytes for p in places]
    assert all(end <= nxt.offset for end, nxt in zip(ends, places[1:], strict=False))
    assert total >= ends[-1] and total % ALIGN == 0


def test_a_staged_set_reads_back_bit_for_bit_and_is_removed_on_close(tmp_path: Path) -> None:
    state = weights()
    staged = stage(state, tmp_path)
    assert staged is not None and staged.kind == "file"
    path = Path(staged.where)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the engine's own
    # the worker gets the places as the RPC delivers them: lists, not dataclasses
    as_sent = [list(t.__dict__.values()) for t in staged.tensors]
    with opened(staged.kind, staged.where, as_sent) as views:
        got = dict(views)
        assert list(got) == list(state)
        for name, tensor in state.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert torch.equal(got[name], tensor), name
        got["embed"].add_(1)  # a private mapping: writing never reaches the file
        del got, views
    with opened(staged.kind, staged.where, staged.tensors) as again:
        assert torch.equal(dict(again)["embed"], state["embed"])
        del again
    staged.close()
    assert not path.exists()


def test_places_are_accepted_as_mappings_too(tmp_path: Path) -> None:
    state = {"w": torch.arange(4, dtype=torch.float32)}
    staged = stage(state, tmp_path)
    assert staged is not None
    fields = [t.__dict__ for t in staged.tensors]
    with opened("file", staged.where, fields) as views:
        assert torch.equal(views[0][1], state["w"])
        del views
    staged.close()


def test_a_set_that_does_not_fit_is_not_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(staged_weights.shutil, "disk_usage", lambda _: Usage(1, 1, 1024))
    assert stage(weights(), tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_bad_places_and_kinds_are_refused(tmp_path: Path) -> None:
    staged = stage({"w": torch.ones(2)}, tmp_path)
    assert staged is not None
    bad = [StagedTensor("w", "not_a_dtype", (2,), 0, 8)]
    with pytest.raises(ValueError, match="not a dtype"), opened("file", staged.where, bad):
        pass
    with pytest.raises(ValueError, match="unknown staged weights kind"):
        with opened("pigeon", staged.where, staged.tensors):
            pass
    staged.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_on_the_device() -> None:
    state = {k: v.cuda() for k, v in weights().items()}
    staged = stage(state)
    assert staged is not None and staged.kind == "cuda"
    # opened here, in the same process, it is the same allocation: CUDA IPC refuses to
    # map a process's own memory, so the cross-process read is gpu_run's to check
    staged.close()


def test_files_of_engines_that_no_longer_run_are_swept(tmp_path: Path) -> None:
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = tmp_path / f"{staged_weights.PREFIX}{gone.stdout.strip()}-abc"
    left.write_bytes(b"weights of a killed engine")
    mine = tmp_path / f"{staged_weights.PREFIX}{os.getpid()}-def"
    mine.write_bytes(b"a load in flight")
    other = tmp_path / "not-ours"
    other.write_bytes(b"")
    staged = stage({"w": torch.ones(3)}, tmp_path)
    assert staged is not None
    assert not left.exists() and mine.exists() and other.exists()
    staged.close()
