"""The embeddings split by vocabulary rows (``sf_trainer.vocab_parallel``) on two gloo
ranks, against the whole matrices in this process, in float64.

Each rank brings different rows (different counts, as the trainer's ranks train
different sequences), per-row temperatures with a greedy one, targets on both ranks'
vocabulary rows, a padding row (no gradient from its lookups) and a vocabulary of odd
size (the ranks hold 19 and 18 rows). One loss
per rank, summed: the split weight's gradient on each rank must be the whole matrix's
gradient of the summed loss, rows [start, end).

The trainer's own use, on the tiny model through FSDP2, is compared with one process
in tests/mesh/test_trainer_distributed.py (the split is on by default).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from sf_trainer.grpo import token_logprobs
from tests.support import SUPPORT_DIR, free_port
from tests.support.ranks import rank_environment
from tests.support.vocab_parallel_rank import PADDING

VOCAB, HIDDEN = 37, 6


def make_problem() -> dict[str, object]:
    generator = torch.Generator().manual_seed(3)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    ranks = []
    for count, id_shape in ((5, torch.Size((2, 3))), (3, torch.Size((1, 4)))):
        ranks.append(
            {
                # ids of both halves of the vocabulary, the padding row among them
                "ids": torch.cat(
                    [
                        torch.tensor([PADDING]),
                        torch.randint(0, VOCAB, (id_shape.numel() - 1,), generator=generator),
                    ]
                ).reshape(id_shape),
                "embedding_weights": normal(*id_shape, HIDDEN),
                "rows": normal(count, HIDDEN),
                "targets": torch.tensor([0, VOCAB - 1, 18, 19, 7][:count]),
                "temperatures": torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0][:count]),
                "logprob_weights": normal(count),
            }
        )
    return {
        "weight": normal(VOCAB, HIDDEN),
        "ranks": ranks,
        "chunk_tokens": 3,  # 8 rows: three chunks, the last short
        "shared_hidden": normal(2, 1, HIDDEN),
    }


def run_two_ranks(problem_path: Path, out: Path) -> list[dict[str, torch.Tensor]]:
    port = free_port()
    processes = []
    for rank in range(2):
        env = rank_environment(rank, 2, port)
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(SUPPORT_DIR / "vocab_parallel_rank.py"),
                    str(problem_path),
                    str(out / f"rank{rank}.pt"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [process.communicate(timeout=180)[0].decode() for process in processes]
    codes = [process.returncode for process in processes]
    assert codes == [0, 0], f"ranks ended with {codes}:\n" + "\n".join(outputs)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_split_embeddings_give_the_whole_matrices_values_and_gradients(tmp_path: Path) -> None:
    problem = make_problem()
    torch.save(problem, tmp_path / "problem.pt")
    results = run_two_ranks(tmp_path / "problem.pt", tmp_path)

    # the reference: the whole matrix, both ranks' losses summed
    weight = problem["weight"].clone().requires_grad_(True)  # type: ignore[attr-defined]
    loss = torch.zeros((), dtype=torch.float64)
    expected = []
    for mine in problem["ranks"]:  # type: ignore[attr-defined]
        embedded = torch.nn.functional.embedding(mine["ids"], weight, padding_idx=PADDING)
        rows = mine["rows"].clone().requires_grad_(True)
        entropy: list[torch.Tensor] = []
        logprobs = token_logprobs(rows @ weight.T, mine["targets"], mine["temperatures"], entropy)
        loss = loss + (embedded * mine["embedding_weights"]).sum()
        loss = loss + (logprobs * mine["logprob_weights"]).sum()
        expected.append((embedded, rows, logprobs, entropy[0]))
    loss.backward()
    assert weight.grad is not None

    covered = []
    for result, (embedded, rows, logprobs, entropy) in zip(results, expected, strict=True):
        assert result["weight_is_sharded"] == "DTensor"
        torch.testing.assert_close(result["embedded"], embedded.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(result["logprobs"], logprobs.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(result["entropy"], entropy, rtol=0, atol=1e-12)
        torch.testing.assert_close(result["rows_grad"], rows.grad, rtol=0, atol=1e-12)
        start, end = result["weight_rows"]
        covered.append((start, end))
        torch.testing.assert_close(
            result["weight_grad_rows"], weight.grad[start:end], rtol=0, atol=1e-12
        )
        with torch.no_grad():
            whole_logits = problem["shared_hidden"] @ weight.T  # type: ignore[operator]
        torch.testing.assert_close(result["logits"], whole_logits, rtol=0, atol=1e-12)
    assert covered == [(0, 19), (19, VOCAB)]
    # the comparison can fail: every rank's rows reach both halves' gradients
    assert weight.grad[:19].abs().sum() > 0 and weight.grad[19:].abs().sum() > 0
    assert weight.grad[PADDING].abs().sum() > 0  # from the head; the lookups add nothing
