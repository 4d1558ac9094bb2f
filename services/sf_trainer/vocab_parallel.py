"""The input and output embeddings split by vocabulary rows across the trainer's ranks
(``SF_TRAINER_VOCAB_PARALLEL``): no rank ever holds a whole [vocab, hidden] matrix.

Why: FSDP2 gathers a unit's parameters whole for its forward and backward and holds
their whole gradient before reducing it. The embedding is the largest matrix of the
models users train (Qwen2.5-0.5B: 136M of its 494M parameters, a 151,936-row
vocabulary), so on two ranks its gathered weight (545 MB in float32), its whole gradient
and the reduction's buffers were most of a rank's peak above its steady state.

How (data parallel stays as it is: each rank trains its own sequences):

- the embedding's weight (for a tied model also the head's: one parameter) is a DTensor
  sharded by rows (``Shard(0)``, ``torch.chunk``'s split, as FSDP2 would shard it) and
  left out of FSDP2 (``ignored_params``). Checkpoints, published versions and the
  optimizer see it as any other sharded parameter;
- **lookup**: the ranks exchange their token ids; each looks up, for every rank's tokens,
  the rows it holds (zeros for the others'), and the sum over ranks of those lookups gives
  each rank its own tokens' embeddings. The backward exchanges the gradients the same way
  back, so each rank's gradient of its rows is the sum over every rank's tokens: the same
  summed gradient FSDP2 gives the other parameters (``TrainGroup.shard``);
- **logprobs** (:func:`vocab_parallel_logprobs`, the chunked head of
  ``sf_trainer.logprobs``): the ranks exchange their final hidden states; each projects
  every rank's rows onto its vocabulary rows, chunk by chunk, and the log-softmax's max,
  sum of exponentials and target logit are summed over ranks. The backward recomputes
  each chunk's logits and accumulates the gradient of its rows in one buffer, so a chunk
  of logits is rows x (vocab / ranks) floats, and no whole-vocabulary tensor exists;
- **the head as a module** (generation in ``sf_trainer.evaluation``, which runs the same
  prompts on every rank): each rank projects onto its rows and the logits are gathered
  along the vocabulary. It computes no gradient: training takes the chunked path.

Every function here is a collective: all ranks call it in the same order, as they run
the same passes (``sf_trainer.step``'s padding passes included). Tested against one
process on two gloo ranks (``tests/mesh/test_vocab_parallel.py``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sf_trainer.grpo import ENTROPY_ROWS
from sf_trainer.sharded_loading import own_rows

SPLIT_ATTRIBUTE = "_sf_vocab_split"
"""Set on the embedding and head modules whose weight is split: their
:class:`VocabSplit`."""


@dataclass(frozen=True)
class VocabSplit:
    """Which vocabulary rows this rank holds, and the group that holds the rest."""

    group: dist.ProcessGroup
    rank: int
    ranks: int
    vocab: int
    start: int
    end: int
    compute_dtype: torch.dtype | None
    """The dtype lookups and projections run in (FSDP2's ``param_dtype`` for the other
    parameters); None: the weight's own."""

    @classmethod
    def of(cls, mesh: DeviceMesh, vocab: int, compute_dtype: torch.dtype | None) -> VocabSplit:
        rank, ranks = mesh.get_local_rank(), mesh.size()
        start, end = own_rows(vocab, rank, ranks)  # as Shard(0) splits
        return cls(mesh.get_group(), rank, ranks, vocab, start, end, compute_dtype)

    @property
    def rows_per_rank(self) -> int:
        """The first rank's rows: every rank's, padded (the last ranks may hold fewer)."""
        return own_rows(self.vocab, 0, self.ranks)[1]

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``weight`` (differentiable), in the compute dtype."""
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        if self.compute_dtype is not None and local.dtype != self.compute_dtype:
            local = local.to(self.compute_dtype)
        return local


def split_of(module: torch.nn.Module | None) -> VocabSplit | None:
    """The split of ``module``'s weight (an embedding or head), None if it is whole."""
    return getattr(module, SPLIT_ATTRIBUTE, None) if module is not None else None


def split_embeddings(
    model: torch.nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype | None
) -> set[torch.nn.Parameter]:
    """Make ``model``'s input embedding weight, and its output embedding's (the same
    parameter when tied), DTensors sharded by rows over ``mesh``, and their modules
    compute with this rank's rows. On the meta device the shards stay there (to be
    materialized with the rest); a loaded model keeps this rank's rows of its weights.
    Returns the parameters FSDP2 must ignore."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    sharded: dict[int, torch.nn.Parameter] = {}

    def shard(module: torch.nn.Module) -> VocabSplit:
        weight = module.weight
        assert isinstance(weight, torch.nn.Parameter)
        if weight.shape[0] < mesh.size():
            raise ValueError(f"a vocabulary of {weight.shape[0]} rows over {mesh.size()} ranks")
        split = VocabSplit.of(mesh, weight.shape[0], compute_dtype)
        if id(weight) not in sharded:
            sharded[id(weight)] = _sharded_parameter(weight, mesh, split)
        module.weight = sharded[id(weight)]
        setattr(module, SPLIT_ATTRIBUTE, split)
        return split

    # the modules (and so the state dict's names, and Gemma's embedding scale) stay; only
    # their forward changes
    embedding.forward = types.MethodType(_embedding_forward(shard(embedding)), embedding)
    if head is not None:
        head.forward = types.MethodType(_head_forward(shard(head)), head)
    return set(sharded.values())


def _sharded_parameter(
    weight: torch.nn.Parameter, mesh: DeviceMesh, split: VocabSplit
) -> torch.nn.Parameter:
    """``weight``'s rows [split.start, split.end) as a ``Shard(0)`` DTensor parameter."""
    if weight.is_meta:
        local = torch.empty(
            (split.end - split.start, *weight.shape[1:]), dtype=weight.dtype, device="meta"
        )
    else:
        local = weight.detach()[split.start : split.end].clone()
    value = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
    )
    return torch.nn.Parameter(value, requires_grad=weight.requires_grad)


def _embedding_forward(split: VocabSplit) -> Any:
    def forward(self: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        counts = row_counts(flat, split)
        every_id = all_gather_rows(flat, counts, split)
        looked_up = _SplitLookup.apply(
            every_id, self.weight, split, getattr(self, "padding_idx", None)
        )
        own = _OwnRowsOfSum.apply(looked_up, counts, split)
        embedded = own.reshape(*input_ids.shape, own.shape[-1])
        scale = getattr(self, "embed_scale", None)  # Gemma's scaled embedding
        if scale is not None:
            embedded = embedded * scale.to(embedded.dtype)
        return embedded

    return forward


class _SplitLookup(torch.autograd.Function):
    """Forward: this rank's rows for every id, zeros for the ids another rank holds.
    Backward: the rows' gradients are added into the parameter's gradient in place, and
    none is returned: a lookup touches a few hundred rows, and a dense gradient would be
    a second copy of this rank's whole [rows, hidden] gradient, at the end of the
    backward, where the gradient already holds the head's part. The padding row
    (``nn.Embedding``'s ``padding_idx``) takes no gradient, as unsplit."""

    @staticmethod
    def forward(
        ctx: Any,
        every_id: torch.Tensor,
        parameter: torch.Tensor,
        split: VocabSplit,
        padding: int | None,
    ) -> Any:
        weight = split.local_weight(parameter)
        inside = (every_id >= split.start) & (every_id < split.end)
        local_ids = torch.where(inside, every_id - split.start, 0)
        rows = F.embedding(local_ids, weight)
        rows.masked_fill_(~inside.unsqueeze(-1), 0.0)
        trained = inside if padding is None else inside & (every_id != padding)
        ctx.save_for_backward(local_ids[trained], trained)
        ctx.parameter = parameter
        return rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        local_ids, trained = ctx.saved_tensors
        parameter = ctx.parameter
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)  # a DTensor placed as the parameter
        accumulated = parameter.grad
        if isinstance(accumulated, DTensor):
            accumulated = accumulated.to_local()
        accumulated.index_add_(0, local_ids, grad[trained].to(accumulated.dtype))
        return None, None, None, None


def _head_forward(split: VocabSplit) -> Any:
    def forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1].numel() == 0:  # the chunked path projects no position
            return hidden.new_empty((*hidden.shape[:-1], split.vocab))
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise RuntimeError(
                "the vocabulary-parallel head gives whole logits only without grad "
                "(generation); training takes its logprobs chunk by chunk"
            )
        assert isinstance(self.weight, torch.Tensor)
        weight = split.local_weight(self.weight)
        local = hidden.to(weight.dtype) @ weight.T
        padded = local.new_zeros((*local.shape[:-1], split.rows_per_rank))
        padded[..., : local.shape[-1]] = local
        parts = [torch.empty_like(padded) for _ in range(split.ranks)]
        # every rank generates the same rows, so the shapes match
        dist.all_gather(parts, padded.contiguous(), group=split.group)
        return torch.cat(parts, dim=-1)[..., : split.vocab]

    return forward


def row_counts(rows: torch.Tensor, split: VocabSplit) -> list[int]:
    """Every rank's number of ``rows`` (its first dimension; the ranks train different
    sequences)."""
    mine = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.empty_like(mine) for _ in range(split.ranks)]
    dist.all_gather(counts, mine, group=split.group)
    return [int(count) for count in counts]


def all_gather_rows(rows: torch.Tensor, counts: list[int], split: VocabSplit) -> torch.Tensor:
    """Every rank's ``rows`` (first dimension ``counts[rank]``) concatenated in rank
    order; padded to the longest for the collective."""
    most = max(counts)
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(split.ranks)]
    if most:
        dist.all_gather(parts, padded, group=split.group)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def _own_range(counts: list[int], split: VocabSplit) -> tuple[int, int]:
    first = sum(counts[: split.rank])
    return first, first + counts[split.rank]


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows. Backward: this rank's rows of the gradient summed over
    the ranks (each used every rank's rows with its own part of the vocabulary)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], split: VocabSplit) -> Any:
        ctx.counts, ctx.split = counts, split
        return all_gather_rows(rows, counts, split)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        summed = grad.contiguous().clone()
        if summed.numel():
            dist.all_reduce(summed, group=ctx.split.group)
        first, end = _own_range(ctx.counts, ctx.split)
        return summed[first:end], None, None


class _OwnRowsOfSum(torch.autograd.Function):
    """Forward: the sum over ranks of every rank's rows, this rank's of them. Backward:
    every rank's rows of the gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], split: VocabSplit) -> Any:
        ctx.counts, ctx.split = counts, split
        summed = rows.contiguous().clone()
        if summed.numel():
            dist.all_reduce(summed, group=split.group)
        first, end = _own_range(counts, split)
        return summed[first:end].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return all_gather_rows(grad.contiguous(), ctx.counts, ctx.split), None, None


class _OwnRows(torch.autograd.Function):
    """Forward: this rank's rows of a tensor every rank computed alike. Backward: every
    rank's rows of the gradient (each rank's loss reached only its own)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], split: VocabSplit) -> Any:
        ctx.counts, ctx.split = counts, split
        first, end = _own_range(counts, split)
        return rows[first:end].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return all_gather_rows(grad.contiguous(), ctx.counts, ctx.split), None, None


def vocab_parallel_logprobs(
    rows: torch.Tensor,
    weight: torch.Tensor,
    split: VocabSplit,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sf_trainer.grpo.chunked_token_logprobs(rows, whole head, targets, temperature,
    chunk_tokens, entropy)`` with the head split by vocabulary rows over the ranks.
    ``rows`` [n, H]: this rank's final hidden states (one per target), ``targets`` [n],
    ``temperature`` one or [n] (0: greedy, taken at 1); ``weight``: the head's split
    parameter. A collective: every rank calls it, each with its own rows. Each chunk of
    ``chunk_tokens`` rows (of all ranks) projects onto this rank's part of the vocabulary."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    counts = row_counts(rows, split)
    every_row = _GatherRows.apply(rows, counts, split)
    every_target = all_gather_rows(targets, counts, split)
    if isinstance(temperature, torch.Tensor):
        every_temperature = all_gather_rows(temperature.to(torch.float64), counts, split)
        scale = torch.where(every_temperature > 0, every_temperature, 1.0)
    else:
        scale = torch.full((sum(counts),), temperature if temperature > 0 else 1.0)
    scale = scale.to(every_row.device)
    logprobs, entropies = _SplitHeadLogprobs.apply(
        every_row,
        weight.to_local() if isinstance(weight, DTensor) else weight,
        every_target,
        scale,
        chunk_tokens,
        split,
        entropy is not None,
    )
    if entropy is not None:
        entropy.append(_OwnRows.apply(entropies, counts, split).detach())
    return _OwnRows.apply(logprobs, counts, split)


class _SplitHeadLogprobs(torch.autograd.Function):
    """log p(target) of every row under a head split by vocabulary rows; the same on every
    rank. ``weight``: this rank's rows in the master dtype (cast to the compute dtype for
    the forward, and again for the backward). Keeps no logits: the backward recomputes
    them chunk by chunk and accumulates the weight's gradient in one buffer."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        scale: torch.Tensor,
        chunk_tokens: int,
        split: VocabSplit,
        want_entropy: bool,
    ) -> Any:
        stored = weight
        weight = split.local_weight(stored)
        dtype = torch.promote_types(rows.dtype, torch.float32)
        count = rows.shape[0]
        log_sums = torch.empty(count, dtype=dtype, device=rows.device)
        logprobs = torch.empty(count, dtype=dtype, device=rows.device)
        entropies = torch.zeros(count, dtype=dtype, device=rows.device)
        for first in range(0, count, chunk_tokens):
            end = min(first + chunk_tokens, count)
            logits = _scaled_logits(rows[first:end], weight, scale[first:end], dtype)
            peak = logits.max(dim=-1).values
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=split.group)
            logits -= peak.unsqueeze(-1)
            local_targets, inside = _local_targets(targets[first:end], split)
            sums = torch.zeros((3, end - first), dtype=dtype, device=rows.device)
            picked = logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
            sums[0] = torch.where(inside, picked, 0.0)
            # the chunk's logits are the one chunk-sized tensor: exponentials (and, for
            # the entropy, e^z z) are taken ENTROPY_ROWS rows at a time
            for block in range(0, end - first, ENTROPY_ROWS):
                shifted = logits[block : block + ENTROPY_ROWS]
                exponentials = shifted.exp()
                sums[1, block : block + ENTROPY_ROWS] = exponentials.sum(-1)
                if want_entropy:
                    # a column of weight 0 adds 0 (not 0 x -inf)
                    exponentials = torch.where(exponentials > 0, exponentials * shifted, 0.0)
                    sums[2, block : block + ENTROPY_ROWS] = exponentials.sum(-1)
            del logits
            dist.all_reduce(sums, group=split.group)
            log_sum = sums[1].log()
            log_sums[first:end] = peak + log_sum
            logprobs[first:end] = sums[0] - log_sum
            if want_entropy:
                entropies[first:end] = log_sum - sums[2] / sums[1]
        # the rows in the master dtype: a cast copy would live from here to the backward
        ctx.save_for_backward(rows, stored, targets, scale, log_sums)
        ctx.chunk_tokens, ctx.split = chunk_tokens, split
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_entropies: torch.Tensor) -> Any:
        rows, stored, targets, scale, log_sums = ctx.saved_tensors
        split: VocabSplit = ctx.split
        dtype = log_sums.dtype
        grad_rows = torch.zeros_like(rows)
        weight = ctx.split.local_weight(stored)
        grad_weight = torch.zeros_like(weight)
        for first in range(0, rows.shape[0], ctx.chunk_tokens):
            end = min(first + ctx.chunk_tokens, rows.shape[0])
            # d logprob / d logit_v = ([v = target] - p_v) / scale, p = softmax(logits / scale)
            grads = _scaled_logits(rows[first:end], weight, scale[first:end], dtype)
            grads -= log_sums[first:end].unsqueeze(-1)
            grads.exp_().neg_()
            local_targets, inside = _local_targets(targets[first:end], split)
            grads.scatter_add_(-1, local_targets.unsqueeze(-1), inside.to(dtype).unsqueeze(-1))
            grads *= (grad[first:end].to(dtype) / scale[first:end].to(dtype)).unsqueeze(-1)
            grad_rows[first:end] = (grads @ weight.to(dtype)).to(rows.dtype)
            grad_weight.addmm_(grads.T.to(weight.dtype), rows[first:end].to(weight.dtype))
            del grads
        del weight
        return grad_rows, grad_weight.to(stored.dtype), None, None, None, None, None


def _scaled_logits(
    rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """rows @ weight.T / scale, in ``dtype`` (a new tensor the caller may change)."""
    logits = (rows @ weight.T).to(dtype)
    logits /= scale.to(dtype).unsqueeze(-1)
    return logits


def _local_targets(targets: torch.Tensor, split: VocabSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column among this rank's rows (0 where another rank holds it), and
    whether this rank holds it."""
    inside = (targets >= split.start) & (targets < split.end)
    return torch.where(inside, targets - split.start, 0), inside
