"""A model sharded from the first byte: built on the meta device, each rank reads its own shard.

With several ranks no rank ever holds the whole model:

1. :func:`model_on_meta` builds the model from its config on the meta device: shapes
   and dtypes only, no memory, no initialisation;
2. the caller prepares it (gradient checkpointing, tied names) and shards it with FSDP2
   (``TrainGroup.shard``), still on meta: every parameter becomes a DTensor whose local
   part is this rank's rows (``Shard(0)``, ``torch.chunk``'s split: ``ceil(n / ranks)``
   rows each, the last ranks fewer or none);
3. :func:`materialize_own_shards` allocates the local parts on the rank's device and
   fills each from the safetensors files, reading only its rows (one positioned read
   per tensor, not a memory mapping, whose touched pages would count as the rank's
   resident memory) and casting them to the parameter's dtype there. Buffers, which
   FSDP2 does not shard, are read whole when the file has them; the others (non-
   persistent: rotary frequencies, embedding scales) are computed by the model's own
   initialisation, which transformers uses the same way for its meta-device loads.

Peak memory per rank is its shard plus one tensor's slice in flight, instead of a full
float32 model before sharding begins. The result equals ``from_pretrained`` then
sharding, tensor for tensor (``tests/mesh/test_trainer_distributed.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard

from seamlessflow.assets.loading import causal_lm_from_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ShardedLoadError(RuntimeError):
    """The model directory does not hold what the model built from its config needs."""


def model_on_meta(model_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``model_dir``'s config with every tensor on the meta device."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return causal_lm_from_config(config, dtype)


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Each tensor name's safetensors file: one ``model.safetensors``, or the files a
    ``model.safetensors.index.json`` maps names to."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ShardedLoadError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return dict.fromkeys(read_header(single), single)


def own_rows(total: int, rank: int, ranks: int) -> tuple[int, int]:
    """[start, end) of the rows rank ``rank`` holds of a dimension of ``total`` rows
    split as ``torch.chunk`` splits it (FSDP2's ``Shard(0)``): chunks of
    ``ceil(total / ranks)``, so the last ranks may hold fewer rows or none."""
    chunk = -(-total // ranks)
    start = min(rank * chunk, total)
    return start, min(start + chunk, total)


def materialize_own_shards(
    model: torch.nn.Module, model_dir: Path, device: torch.device, aliases: dict[str, str]
) -> None:
    """Allocate ``model``'s tensors (sharded by FSDP2 on the meta device) on ``device``
    and fill them: parameters and persistent buffers from ``model_dir``'s safetensors,
    each rank reading only its rows; non-persistent buffers by the model's own
    initialisation. ``aliases``: ``{alias: name}`` of tied tensors, whose file may hold
    either name."""
    model.to_empty(device=device)
    loaded = dict(_stored_tensors(model))
    _compute_unstored_buffers(model, loaded)
    files = tensor_files(model_dir)
    missing = [name for name in loaded if _file_name(name, files, aliases) is None]
    if missing:
        raise ShardedLoadError(
            f"{model_dir} lacks {len(missing)} tensor(s) the model's config builds: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    headers: dict[Path, dict[str, StoredTensor]] = {}
    for name, tensor in loaded.items():
        file_name = _file_name(name, files, aliases)
        assert file_name is not None
        path = files[file_name]
        if path not in headers:
            headers[path] = read_header(path)
        _fill(tensor, path, headers[path][file_name], name)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's entry in a safetensors header: where its bytes lie in the file."""

    dtype: torch.dtype
    shape: list[int]
    offset: int
    """Of its first byte, from the start of the file."""


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, the
    JSON header, then the data, each tensor's bytes contiguous in row-major order."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header: dict[str, Any] = json.loads(file.read(length))
    header.pop("__metadata__", None)
    data_start = 8 + length
    stored = {}
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ShardedLoadError(f"{path}: {name} has dtype {entry['dtype']}, not read here")
        stored[name] = StoredTensor(
            dtype, list(entry["shape"]), data_start + entry["data_offsets"][0]
        )
    return stored


def read_rows(path: Path, stored: StoredTensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a stored tensor, read with one positioned read: no mapping
    of the file, whose touched pages would count in this process's resident memory."""
    row_elements = math.prod(stored.shape[1:])
    row_bytes = row_elements * stored.dtype.itemsize
    rows = torch.empty((end - start) * row_bytes, dtype=torch.uint8)
    if rows.numel():
        with path.open("rb", buffering=0) as file:
            file.seek(stored.offset + start * row_bytes)
            array: Any = rows.numpy()
            view = memoryview(array)
            while view:  # readinto may return less than asked
                count = file.readinto(view)
                if not count:
                    raise ShardedLoadError(f"{path}: ends inside a tensor")
                view = view[count:]
    return rows.view(stored.dtype).view([end - start, *stored.shape[1:]])


def _stored_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (once, under its first name) and persistent buffer: what a
    checkpoint holds."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer


def _compute_unstored_buffers(model: torch.nn.Module, stored: dict[str, torch.Tensor]) -> None:
    """Non-persistent buffers, which no file holds, as the model's initialisation computes
    them. transformers' initialisation skips any tensor marked ``_is_hf_initialized``
    and any module marked so: the stored tensors (read next) are marked, the modules
    unmarked, so it computes exactly the rest (without drawing random weights)."""
    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:
        return
    for tensor in stored.values():
        setattr(tensor, "_is_hf_initialized", True)  # noqa: B010 - not a declared attribute
    for module in model.modules():
        setattr(module, "_is_hf_initialized", False)  # noqa: B010
    initialize()


def _file_name(name: str, files: dict[str, Path], aliases: dict[str, str]) -> str | None:
    if name in files:
        return name
    for alias, target in aliases.items():  # a tied matrix stored under its other name
        if target == name and alias in files:
            return alias
        if alias == name and target in files:
            return target
    return None


def _fill(tensor: torch.Tensor, path: Path, stored: StoredTensor, name: str) -> None:
    """Copy this rank's part of the ``stored`` tensor into ``tensor`` (cast as it goes)."""
    if list(tensor.shape) != stored.shape:
        raise ShardedLoadError(
            f"{name}: the file holds {stored.shape}, the model {list(tensor.shape)}"
        )
    if not stored.shape:  # a scalar
        with torch.no_grad():
            tensor.copy_(read_rows(path, StoredTensor(stored.dtype, [1], stored.offset), 0, 1)[0])
        return
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        placement = tensor.placements[0]
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ShardedLoadError(f"{name}: sharded as {placement}, not by rows")
        mesh = tensor.device_mesh
        start, end = own_rows(stored.shape[0], mesh.get_local_rank(), mesh.size())
        if local.shape[0] != end - start:
            raise ShardedLoadError(
                f"{name}: this rank holds {local.shape[0]} rows, its split {end - start}"
            )
    else:
        local, start, end = tensor, 0, stored.shape[0]
    if end > start:
        with torch.no_grad():
            local.copy_(read_rows(path, stored, start, end))
