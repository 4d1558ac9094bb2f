"""Logprobs from the final hidden states chunk by chunk (``SF_TRAINER_LOGPROB_CHUNK_TOKENS``),
the head alone and on tiny models: the same numbers and gradients as the whole logits
within summation order, no graph kept without grad, a fraction of the whole logits'
bytes kept for the backward, only the needed positions through the head, and a
soft-capped head refused (whole logits instead). The trainer's own step and two FSDP2
ranks chunking are tests/service/test_chunked_logprobs.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from sf_trainer.grpo import chunked_token_logprobs, token_logprobs
from sf_trainer.logprobs import chunked_head_refusal, target_logprobs
from tests.support.tiny_models import FLOAT64_REORDERING, gamma, tiny_model

BF16_UNIT_ROUNDOFF = 2.0**-8


# the head alone: bounds derived from the two paths' float operations -------------------


@pytest.mark.parametrize("compute", ["float32", "bf16-autocast"])
def test_chunked_logprobs_and_gradients_equal_the_whole_logits_within_summation_order(
    compute: str,
) -> None:
    """The two paths take the same row operations on the same inputs; what may differ:
    (a) each logit is a dot product over H, which a GEMM with another row count may sum
    in another order: two orders differ by at most 2 gamma_H (|h| |W|^T); under bf16
    autocast each side also rounds its logit to bf16 (u |z| each);
    (b) a logprob (z_t - logsumexp z, z = logits / T) moves by at most twice the row's
    largest logit change (it is 1-Lipschitz in each of the two terms), plus the
    log-softmax's own few roundings of the row's magnitudes;
    (c) the gradients: with g = dL/dz = c / T (onehot - p), grad_h = g W sums over V and
    grad_W = g^T h over the N tokens (chunk by chunk in the chunked path): two orders
    differ by 2 gamma_K (|g| |.|) (K = V or N), and g itself moves by |c| / T (2 p delta +
    a few roundings of (onehot + p)) when the row's scaled logits move by delta;
    bf16 autocast rounds g and each GEMM's output to bf16 as well."""
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab, chunk = 53, 32, 97, 7  # chunk divides nothing
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    temperatures = torch.tensor([0.0, 0.7, 1.0, 1.3]).repeat(tokens // 4 + 1)[:tokens]
    upstream = torch.randn(tokens, generator=generator)
    autocast = compute == "bf16-autocast"
    out_unit = BF16_UNIT_ROUNDOFF if autocast else 0.0

    def run(chunked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            if chunked:
                logprobs = chunked_token_logprobs(h, w, targets, temperatures, chunk)
            else:
                logprobs = token_logprobs(h @ w.T, targets, temperatures)
        (logprobs * upstream).sum().backward()
        assert h.grad is not None and w.grad is not None
        return logprobs.detach(), h.grad, w.grad

    whole, chunked = run(False), run(True)
    assert whole[0].dtype == chunked[0].dtype == torch.float32

    h64, w64 = hidden.double(), weight.double()
    scale = torch.where(temperatures > 0, temperatures, 1.0).double().unsqueeze(-1)
    z = h64 @ w64.T
    magnitudes = h64.abs() @ w64.abs().T * (1 + out_unit) ** 2  # bf16 inputs: |x| (1 + u)
    logit_gap = 2 * gamma(hidden_size) * magnitudes + 2 * out_unit * z.abs() * 1.01
    delta = (logit_gap / scale).amax(-1, keepdim=True)  # the row's largest scaled change
    eps = torch.finfo(torch.float32).eps
    row_size = (z / scale).abs().amax(-1) + torch.log(torch.tensor(float(vocab)))
    value_bound = 2 * delta.squeeze(-1) + 8 * eps * row_size
    assert ((whole[0] - chunked[0]).abs() <= value_bound).all()

    p = torch.softmax(z / scale, dim=-1)
    onehot = torch.nn.functional.one_hot(targets, vocab).double()
    c = upstream.double().unsqueeze(-1) / scale
    g = c * (onehot - p)
    g_gap = c.abs() * (2 * p * delta + 8 * eps * (onehot + p)) + 2 * out_unit * g.abs()
    g_abs = g.abs() + g_gap
    hidden_bound = 2 * gamma(vocab) * g_abs @ w64.abs() + g_gap @ w64.abs()
    hidden_bound += 2 * out_unit * g_abs @ w64.abs()
    weight_bound = 2 * gamma(tokens) * g_abs.T @ h64.abs() + g_gap.T @ h64.abs()
    weight_bound += 2 * out_unit * g_abs.T @ h64.abs()
    assert ((whole[1] - chunked[1]).abs().double() <= hidden_bound).all()
    assert ((whole[2] - chunked[2]).abs().double() <= weight_bound).all()
    # and the gradients are not trivially small next to their bounds
    assert whole[2].abs().max() > 10 * weight_bound.max()


def test_without_grad_the_chunks_keep_no_graph_and_an_empty_batch_is_empty() -> None:
    generator = torch.Generator().manual_seed(5)
    hidden, weight = (
        torch.randn(2, 5, 8, generator=generator),
        torch.randn(11, 8, generator=generator),
    )
    weight.requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    with torch.no_grad():
        logprobs = chunked_token_logprobs(hidden, weight, targets, 1.0, 3)
        whole = token_logprobs(hidden @ weight.T, targets, 1.0)
        # as in the test above: two dot-product orders, then the log-softmax's roundings
        magnitudes = hidden.abs() @ weight.abs().T
        eps = torch.finfo(torch.float32).eps
        bound = 4 * gamma(8) * magnitudes.amax(-1) + 8 * eps * (magnitudes.amax(-1) + 3)
    assert logprobs.shape == (2, 5) and not logprobs.requires_grad
    assert ((logprobs - whole).abs() <= bound).all()
    empty = chunked_token_logprobs(hidden[:, :0], weight, targets[:, :0], 1.0, 3)
    assert empty.shape == (2, 0)
    with pytest.raises(ValueError):
        chunked_token_logprobs(hidden, weight, targets, 1.0, 0)


# tiny models: the bytes kept for the backward, the positions projected, a soft cap ------


def test_the_chunked_path_keeps_a_fraction_of_the_whole_logits_bytes_for_backward() -> None:
    """Bytes the autograd graph holds for the backward after the forward, counted once per
    storage (views of one tensor, and the weight every chunk saves, are one allocation):
    at a 32k vocabulary the whole path keeps several [tokens, vocab] tensors, the
    chunked one the hidden states and one chunk's outputs at most."""
    model = tiny_model(tied=True, vocab=32_000)
    ids = torch.randint(0, 32_000, (4, 128), generator=torch.Generator().manual_seed(0))
    temperatures = torch.full((4, 127), 0.8)

    def saved_bytes(chunk: int) -> int:
        storages: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            logprobs = target_logprobs(
                model, ids, torch.ones_like(ids), ids[:, 1:], temperatures, chunk,
                contextlib.nullcontext,
            )  # fmt: skip
        assert logprobs.requires_grad
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(size for ptr, size in storages.items() if ptr not in parameters)

    whole, chunked = saved_bytes(0), saved_bytes(64)
    logits_bytes = 4 * 127 * 32_000 * 4
    assert whole > logits_bytes  # the log-softmax of the whole logits, at least
    assert chunked < whole / 4


@pytest.mark.parametrize("chunk", [0, 3, 1024], ids=["whole", "chunks", "one-chunk"])
def test_only_the_needed_positions_go_through_the_head(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``needed``, the head projects the needed rows only; their logprobs and the
    gradients are the all-positions ones (float64: only summation order differs), the
    other positions are 0. No needed position at all computes every position, so the
    loss still reaches every parameter (a padding pass)."""
    import sf_trainer.grpo

    model = tiny_model(tied=False).double()
    ids = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(2))
    needed = torch.zeros(3, 9, dtype=torch.bool)
    needed[0, 6:] = needed[1, 4:7] = needed[2, 8] = True
    temperatures = torch.full((3, 9), 0.7, dtype=torch.float64)
    projected: list[int] = []
    chunk_logprobs = sf_trainer.grpo._chunk_logprobs

    def counting(hidden: torch.Tensor, *rest: object) -> torch.Tensor:
        projected.append(hidden.shape[0])
        return chunk_logprobs(hidden, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(sf_trainer.grpo, "_chunk_logprobs", counting)

    def run(mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """(logprobs, gradients, rows the forward projected through the head)"""
        model.zero_grad(set_to_none=True)
        projected.clear()
        logprobs = target_logprobs(
            model, ids, torch.ones_like(ids), ids[:, 1:], temperatures, chunk,
            contextlib.nullcontext, needed=mask,
        )  # fmt: skip
        rows = sum(projected)  # before the backward's recomputation of checkpointed chunks
        (logprobs * needed).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), grads, rows

    every, every_grads, _ = run(None)
    picked, picked_grads, rows = run(needed)
    if chunk:
        assert rows == int(needed.sum())  # the head saw the needed rows only
    assert torch.equal(picked[~needed], torch.zeros(int((~needed).sum()), dtype=torch.float64))
    gap = (picked[needed] - every[needed]).abs().max()
    assert gap <= FLOAT64_REORDERING * every[needed].abs().max()
    assert picked_grads.keys() == every_grads.keys()
    for name, expected in every_grads.items():
        gap = (picked_grads[name] - expected).abs().max()
        assert gap <= FLOAT64_REORDERING * expected.abs().max(), name
    padding, padding_grads, rows = run(torch.zeros_like(needed))
    if chunk:
        assert rows == needed.numel()
    assert torch.equal(padding, every)
    assert len(padding_grads) == len(list(model.parameters()))


def test_a_head_with_a_softcap_is_refused_and_falls_back_to_whole_logits() -> None:
    assert chunked_head_refusal(tiny_model(tied=False)) is None
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(config)
    reason = chunked_head_refusal(gemma)
    assert reason is not None and "gemma2" in reason
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fallback = target_logprobs(
            gemma, ids, torch.ones_like(ids), ids[:, 1:], 1.0, 4, contextlib.nullcontext
        )
        soft_capped = gemma(input_ids=ids).logits[:, :-1]
    # the model's own (soft-capped) logits: exactly the whole-logits path
    assert torch.equal(fallback, token_logprobs(soft_capped, ids[:, 1:], 1.0))
