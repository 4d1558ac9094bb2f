"""Reading a rank's rows straight from safetensors files (``sf_trainer.sharded_loading``),
against safetensors' own loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sf_trainer.sharded_loading import (
    ShardedLoadError,
    read_header,
    read_rows,
    tensor_files,
)


def test_rows_read_are_the_files_rows_in_every_dtype(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embed": torch.randn(7, 5, generator=generator).bfloat16(),
        "proj": torch.randn(3, 4, 2, generator=generator),
        "norm": torch.randn(9, generator=generator).half(),
        "ids": torch.arange(6, dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reference = load_file(str(path))
    header = read_header(path)
    assert set(header) == set(tensors)
    for name, tensor in reference.items():
        rows = tensor.shape[0]
        for start, end in [(0, rows), (0, 1), (rows // 2, rows), (1, rows - 1), (rows, rows)]:
            got = read_rows(path, header[name], start, end)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor[start:end]), name


def test_a_model_is_one_file_or_an_index_of_several(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert tensor_files(tmp_path) == {"a": tmp_path / "model.safetensors"}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(2)}, str(sharded / "one.safetensors"))
    save_file({"b": torch.ones(3)}, str(sharded / "two.safetensors"))
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert tensor_files(sharded) == {
        "a": sharded / "one.safetensors",
        "b": sharded / "two.safetensors",
    }
    with pytest.raises(ShardedLoadError, match=r"neither model\.safetensors"):
        tensor_files(tmp_path / "sharded" / "nothing")


def test_a_file_cut_short_is_refused_not_read_as_zeros(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    header = read_header(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardedLoadError, match="ends inside a tensor"):
        read_rows(path, header["w"], 0, 64)
