"""A model sharded from the first byte: built on the meta device, each rank reads its own shard.

With several ranks no rank ever holds the whole model:

1. :func:`model_on_meta` builds the model from its config on the meta device: shapes
   and dtypes only, no memory, no initialisation;
2. the caller prepares it (gradient checkpointing, tied names) and shards it with FSDP2
   (``TrainGroup.shard``), still on meta: every parameter becomes a DTensor whose local
   part is this rank's rows (``Shard(0)``, ``torch.chunk``'s split: ``ceil(n / ranks)``
   rows each, the last ranks fewer or none);
3. :func:`materialize_own_shards` allocates the local parts on the rank's device and
   fills each from the safetensors files, reading only its rows (a slice of the
   memory-mapped file) and casting them to the parameter's dtype there. Buffers, which
   FSDP2 does not shard, are read whole when the file has them; the others (non-
   persistent: rotary frequencies, embedding scales) are computed by the model's own
   initialisation, which transformers uses the same way for its meta-device loads.

Peak memory per rank is its shard plus one tensor's slice in flight, instead of a full
float32 model before sharding begins. The result equals ``from_pretrained`` then
sharding, tensor for tensor (``tests/mesh/test_trainer_distributed.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
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
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as file:
        return {name: single for name in file.keys()}


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
    with ExitStack() as stack:
        from safetensors import safe_open

        opened: dict[Path, Any] = {}
        for name, tensor in loaded.items():
            file_name = _file_name(name, files, aliases)
            assert file_name is not None
            path = files[file_name]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            _fill(tensor, opened[path].get_slice(file_name), name)


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


def _fill(tensor: torch.Tensor, stored: Any, name: str) -> None:
    """Copy this rank's part of the file's ``stored`` slice into ``tensor``."""
    shape = list(stored.get_shape())
    if list(tensor.shape) != shape:
        raise ShardedLoadError(f"{name}: the file holds {shape}, the model {list(tensor.shape)}")
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        placement = tensor.placements[0]
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ShardedLoadError(f"{name}: sharded as {placement}, not by rows")
        mesh = tensor.device_mesh
        start, end = own_rows(shape[0], mesh.get_local_rank(), mesh.size())
        if local.shape[0] != end - start:
            raise ShardedLoadError(
                f"{name}: this rank holds {local.shape[0]} rows, its split {end - start}"
            )
        if end > start:
            with torch.no_grad():
                local.copy_(stored[start:end])
        return
    with torch.no_grad():
        tensor.copy_(stored[:])
