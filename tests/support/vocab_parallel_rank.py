"""One rank of tests/mesh/test_vocab_parallel.py: the split embedding and head on this
rank's rows of a shared problem, in float64, with their gradients.

Run with torchrun's environment; argv: the problem file (``torch.save``d by the test)
and the output file. The problem holds every rank's inputs; this rank takes its own.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from sf_trainer.vocab_parallel import split_embeddings, split_of, vocab_parallel_logprobs

PADDING = 20
"""On the second rank's rows (19-36)."""


class TiedModel(torch.nn.Module):
    """The two modules ``split_embeddings`` works on, tied as in Qwen2.5-0.5B."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # a padding row, as HF's embeddings have: it takes no gradient
        self.embed = torch.nn.Embedding(*weight.shape, padding_idx=PADDING, dtype=weight.dtype)
        self.head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(weight)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def main(problem_path: str, out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    problem = torch.load(problem_path)
    model = TiedModel(problem["weight"])
    ignored = split_embeddings(model, mesh, compute_dtype=None)
    split = split_of(model.head)
    assert split is not None and split_of(model.embed) == split
    assert len(ignored) == 1 and model.head.weight is model.embed.weight
    mine = problem["ranks"][rank]

    # the lookup and the logprobs of this rank's rows, through one loss per rank
    embedded = model.embed(mine["ids"])
    rows = mine["rows"].clone().requires_grad_(True)
    entropy: list[torch.Tensor] = []
    logprobs = vocab_parallel_logprobs(
        rows,
        model.head.weight,
        split,
        mine["targets"],
        mine["temperatures"],
        problem["chunk_tokens"],
        entropy,
    )
    loss = (embedded * mine["embedding_weights"]).sum() + (logprobs * mine["logprob_weights"]).sum()
    loss.backward()
    weight = model.embed.weight
    grad = weight.grad
    assert grad is not None
    # whole logits for generation: every rank the same hidden states
    with torch.no_grad():
        logits = model.head(problem["shared_hidden"])
    torch.save(
        {
            "embedded": embedded.detach(),
            "logprobs": logprobs.detach(),
            "entropy": entropy[0],
            "rows_grad": rows.grad,
            "weight_rows": (split.start, split.end),
            "weight_grad_rows": grad.to_local(),
            "weight_is_sharded": type(weight).__name__,
            "logits": logits,
        },
        out_path,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
