"""The trainer's torch.distributed group: one rank per process, FSDP2 over a 1-D mesh.

A :class:`TrainGroup` is made from the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Without them (world
size 1) there is no process group at all: the model is not sharded and every helper is
the identity, so a single process trains exactly as it did before ranks existed.

With several ranks:
- the backend is gloo when the trainer's device is the CPU and nccl on CUDA; rank r
  computes on ``cuda:<LOCAL_RANK>``;
- the model is sharded with FSDP2 (``fully_shard`` on each decoder layer, then the
  root). Gradients are **summed** across ranks, not averaged (FSDP2's default): the
  loss of every rank is already divided by the whole batch's trained-token count, so
  the sum of the ranks' gradients is the gradient of the full-batch loss, exactly as
  in a single process;
- every rank holds the whole batch (rank 0 broadcasts it) and trains the part that
  :func:`partition_by_tokens` gives it;
- full (unsharded) CPU state dicts are gathered on rank 0; other ranks take part in
  the gather and get an empty dict.

Partitioning is a plain function, tested in-process; the process-group helpers are
tested with two gloo processes (``tests/mesh/test_trainer_distributed.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from sf_trainer.vocab_parallel import split_embeddings

# gathers: the full tensors, copied to the CPU, on rank 0 only
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
ROW_BLOCK_BYTES = 16 * 1024 * 1024
"""The rows of a sharded tensor reach rank 0 in blocks of about this size, so a version
is published with rank 0 holding a block, not a whole tensor, beside its buckets."""
Model = TypeVar("Model", bound=torch.nn.Module)


def partition_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` split into ``parts`` lists with near-equal token totals.

    Greedy longest first: each sequence goes to the part with the fewest tokens so far,
    ties to the lowest part, so every rank computes the same partition from the same
    batch. No part exceeds another by more than the longest sequence. Indices within a
    part are increasing; a part may be empty (fewer sequences than parts).
    """
    loads = [0] * parts
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        loads[part] += lengths[index]
        assigned[part].append(index)
    return [sorted(indices) for indices in assigned]


@dataclass
class TrainGroup:
    """This process's place among the trainer's ranks (world size 1: no group at all)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None

    @classmethod
    def from_env(cls, device: str, timeout_s: float) -> TrainGroup:
        """Join the process group torchrun describes in the environment, if any.

        ``device`` is the trainer's device setting; with several ranks only its type
        counts (``cuda`` -> ``cuda:<LOCAL_RANK>`` and nccl, ``cpu`` -> gloo).
        ``timeout_s`` bounds every collective, including a follower's wait for the next
        command while rank 0 waits for a batch.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls(device=torch.device(device))
        rank = int(os.environ["RANK"])
        device_type = torch.device(device).type
        if device_type == "cuda":
            local_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(local_device)
        else:
            local_device = torch.device(device_type)
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
        )
        mesh = init_device_mesh(device_type, (world_size,))
        return cls(device=local_device, rank=rank, world_size=world_size, mesh=mesh)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_leader(self) -> bool:
        """Rank 0: the only rank that talks to NATS and writes files."""
        return self.rank == 0

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def shard(
        self,
        model: Model,
        bf16_mixed: bool = False,
        cpu_offload: bool = False,
        float32_compute: bool = False,
        vocab_parallel: bool = False,
    ) -> Model:
        """Move ``model`` to this rank's device; with several ranks, shard it with FSDP2.

        Each module class the model names as unsplittable (HF's ``_no_split_modules``:
        the decoder layers) becomes one FSDP unit, then the root holds the rest
        (embeddings, final norm, head; tied input and output embeddings are one
        parameter there, kept one by FSDP2). A model on the meta device stays there:
        each rank then reads only its own shard (``sf_trainer.sharded_loading``); a
        loaded one (every rank loaded the same weights) is sharded without a
        broadcast. ``bf16_mixed``: the units all-gather their parameters in bfloat16
        and compute in it, and reduce gradients in float32 into the master shards
        (``MixedPrecisionPolicy``); one process ignores it (the step uses autocast,
        ``forward_precision``). ``float32_compute`` (bf16 master weights without
        ``bf16_mixed``): the units all-gather their bf16 shards into float32 and
        compute and reduce in it; the gradients land in the bf16 shards. ``cpu_offload``
        (CUDA ranks): the shards, their gradients and the optimizer step live on the
        host (``CPUOffloadPolicy``). ``vocab_parallel``: the input and output embeddings
        are split by vocabulary rows instead, outside FSDP2
        (``sf_trainer.vocab_parallel``), computing in the policy's dtype.
        """
        on_meta = any(parameter.is_meta for parameter in model.parameters())
        if self.mesh is None:
            return model if on_meta else model.to(self.device)
        if not on_meta:
            model.to(self.device)
        if bf16_mixed:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif float32_compute:
            policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if cpu_offload and self.device.type == "cuda" else None
        options: dict[str, Any] = {"mesh": self.mesh, "mp_policy": policy}
        if offload is not None:
            options["offload_policy"] = offload
        ignored: set[torch.nn.Parameter] = set()
        if vocab_parallel:
            ignored = split_embeddings(model, self.mesh, policy.param_dtype)
        for unit in fsdp_units(model):
            fully_shard(unit, **options)
        fully_shard(model, ignored_params=ignored or None, **options)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # sum, don't average: the loss is normalised by the global token count
                module.set_gradient_divide_factor(1.0)
                # a plain SUM collective (gloo has no PREMUL_SUM); dividing by 1.0 is free
                module.set_force_sum_reduction_for_comms(True)
        return model

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_bytes(self, payload: bytes) -> bytes:
        """Rank 0's ``payload`` on every rank (others pass anything, e.g. ``b""``)."""
        if not self.distributed:
            return payload
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if self.is_leader:
            data = _byte_tensor(payload).to(self.device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return payload if self.is_leader else data.cpu().numpy().tobytes()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64, so counts stay exact)."""
        if not self.distributed:
            return list(values)
        summed = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.tolist()

    def full_model_state(
        self, model: torch.nn.Module, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """The unsharded weights as CPU tensors on rank 0 (a copy, never the live
        parameters); ``{}`` on the other ranks. Every rank must call it. ``dtype``: the
        floating-point tensors in it; one process casts them where they live (on a GPU
        that halves fp32 -> bf16's bytes over PCIe and keeps the cast off the host)."""
        if not self.distributed:
            return {
                k: _host_copy(v.detach(), dtype if v.is_floating_point() else None)
                for k, v in model.state_dict().items()
            }
        return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=_GATHER))

    def host_tensors(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype | None = None,
        skip: Collection[str] = (),
        block_bytes: int = ROW_BLOCK_BYTES,
        on_device: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The unsharded weights in the state dict's order (less the names in ``skip``):
        on rank 0 as CPU tensors (the floating-point ones in ``dtype``, cast where they
        live), or with ``on_device`` where rank 0 computes (packed there: ``cuda_ipc``),
        nothing on the others. A tensor sharded by rows (FSDP2's ``Shard(0)``)
        comes as consecutive blocks of its rows under its name, each of about
        ``block_bytes``, sent to rank 0 by the rank that holds them: a large tensor (a
        151,936-row embedding) never exists whole on rank 0. Every rank must run it to the
        end (the blocks travel by collectives). A yielded tensor may be a live weight of
        this process: copy it before the next step."""
        for name, tensor in model.state_dict().items():
            if name in skip:
                continue
            value = tensor.detach()
            if isinstance(value, DTensor) and _sharded_by_rows(value):
                for block in self._row_blocks(value, dtype, block_bytes):
                    if self.is_leader:
                        yield name, block if on_device else block.cpu()
                continue
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)  # a DTensor casts its shard: half the gather's bytes
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if self.is_leader:
                yield name, value if on_device else value.cpu()

    def _row_blocks(
        self, value: DTensor, dtype: torch.dtype | None, block_bytes: int
    ) -> Iterator[torch.Tensor]:
        """``value``'s rows in order, in blocks: each rank's shard (``torch.chunk``'s
        split, as FSDP2 makes it) cut into blocks of about ``block_bytes``, cast on the
        rank that holds it and sent to rank 0, which yields them where it computes."""
        local = value.to_local()
        if dtype is not None and value.is_floating_point():
            travel = dtype
        else:
            travel = value.dtype
        mesh = value.device_mesh
        group, world = mesh.get_group(), mesh.size()
        me = mesh.get_local_rank()
        rows, tail = value.shape[0], tuple(value.shape[1:])
        per_rank = -(-rows // world)
        row_bytes = max(1, math.prod(tail) * travel.itemsize)
        block_rows = max(1, block_bytes // row_bytes)
        leader = dist.get_global_rank(group, 0)
        for holder in range(world):
            start, end = min(holder * per_rank, rows), min((holder + 1) * per_rank, rows)
            if holder == me and local.shape[0] != end - start:
                raise RuntimeError(
                    f"a shard of {local.shape[0]} rows where rows {start}:{end} were expected"
                )
            for first in range(start, end, block_rows):
                last = min(first + block_rows, end)
                if holder == me:
                    block = local[first - start : last - start].to(travel).contiguous()
                    if me != 0:
                        dist.send(block, leader, group)
                        continue
                elif me == 0:
                    block = torch.empty((last - first, *tail), dtype=travel, device=local.device)
                    dist.recv(block, dist.get_global_rank(group, holder), group)
                else:
                    continue  # between its holder and rank 0
                yield block

    def host_layout(
        self, model: torch.nn.Module, dtype: torch.dtype | None = None, skip: Collection[str] = ()
    ) -> list[tuple[str, torch.dtype, list[int]]]:
        """Name, dtype and whole shape of each tensor ``host_tensors`` yields, known on
        every rank without gathering anything."""
        return [
            (
                name,
                dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype,
                list(tensor.shape),  # a DTensor's shape is the whole tensor's
            )
            for name, tensor in model.state_dict().items()
            if name not in skip
        ]

    def full_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (independent of the world size),
        full CPU tensors on rank 0; ``{}`` on the other ranks. Every rank must call it."""
        return get_optimizer_state_dict(model, optimizer, options=_GATHER)

    def load_full_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Load full states that only rank 0 has read (others pass ``{}``): rank 0
        broadcasts them and each rank keeps its shard. The dicts are consumed."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.distributed)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def _sharded_by_rows(value: DTensor) -> bool:
    """Sharded on dim 0 over a one-dimensional mesh (how FSDP2 shards a parameter)."""
    return (
        value.device_mesh.ndim == 1
        and len(value.placements) == 1
        and isinstance(value.placements[0], Shard)
        and value.placements[0].dim == 0
        and value.dim() > 0
    )


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``TrainGroup.shard`` makes FSDP units below the root: each instance of
    a class the model names unsplittable (HF's ``_no_split_modules``: the decoder
    layers). The root unit holds every parameter outside them."""
    unsplittable = set(getattr(model, "_no_split_modules", None) or ())
    return [
        module
        for module in model.modules()
        if module is not model and type(module).__name__ in unsplittable
    ]


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A CPU copy of ``tensor`` in ``dtype`` (cast first, on its device)."""
    if dtype is not None and tensor.dtype != dtype:
        return tensor.to(dtype).to("cpu")  # the cast is a new tensor already
    return tensor.to("cpu", copy=True)


def forward_precision(bf16_mixed: bool, group: TrainGroup) -> AbstractContextManager[object]:
    """The context a forward pass runs in: bf16 autocast for ``bf16_mixed`` in one
    process (several ranks get bf16 from FSDP2's policy, ``TrainGroup.shard``), else
    nothing. Float32 weights stay float32; autocast computes matmuls in bf16."""
    if bf16_mixed and not group.distributed:
        return torch.autocast(device_type=group.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _byte_tensor(payload: bytes) -> torch.Tensor:
    if not payload:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def as_float(value: torch.Tensor) -> float:
    """A scalar tensor as a float; a DTensor (e.g. FSDP2's grad norm) is made whole first."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)
