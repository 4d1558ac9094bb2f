"""The offload state machine (``seamlessflow.residency``) on real torch modules: memory
accounted at each transition, contents bitwise kept, training unchanged by an offload,
refusals and roll-backs."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from seamlessflow.residency import Residency, ResidencyError, resizable_parameters

CPU = torch.device("cpu")


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # one matrix, two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(seed))
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def held_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in held_tensors(model, optimizer)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def trained_pair() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, seed=1)  # AdamW's state exists
    return model, optimizer


def test_an_offload_frees_every_byte_on_the_device_and_a_reload_brings_them_back_bitwise() -> None:
    model, optimizer = trained_pair()
    before = snapshot(model, optimizer)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    residency = Residency(held_tensors(model, optimizer), CPU)
    # the tied matrix is held once: parameters once, plus AdamW's two moments and steps
    steps = sum(state["step"].nbytes for state in optimizer.state.values())
    assert residency.nbytes == 3 * parameter_bytes + steps

    offload = residency.offload()
    assert residency.state == "offloaded"
    assert offload.before.on_device == residency.nbytes and offload.before.host_copies == 0
    assert offload.after.on_device == 0 and offload.after.host_copies == residency.nbytes
    assert offload.device_bytes_moved == residency.nbytes
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())

    reload = residency.reload()
    assert residency.state == "resident"
    assert reload.before == offload.after
    assert reload.after.on_device == residency.nbytes and reload.after.host_copies == 0
    assert [t.name for t in residency.ledger] == ["offload", "reload"]
    for kept, now in zip(before, held_tensors(model, optimizer), strict=True):
        assert same_bytes(kept, now)
    assert model.head.weight is model.embed.weight


def test_training_after_an_offload_and_reload_is_the_training_without_one() -> None:
    model, optimizer = trained_pair()
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    residency = Residency(held_tensors(model, optimizer), CPU)
    for seed in (2, 3):
        residency.offload()
        residency.reload()
        assert train_step(model, optimizer, seed) == train_step(twin, twin_optimizer, seed)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_transitions_only_from_their_state() -> None:
    model, optimizer = trained_pair()
    residency = Residency(held_tensors(model, optimizer), CPU)
    with pytest.raises(ResidencyError, match="cannot reload while resident"):
        residency.reload()
    residency.offload()
    with pytest.raises(ResidencyError, match="cannot offload while offloaded"):
        residency.offload()
    assert len(residency.ledger) == 1


def test_kept_host_copies_are_reused_by_the_next_offload() -> None:
    model, optimizer = trained_pair()
    residency = Residency(held_tensors(model, optimizer), CPU, keep_host_copies=True)
    residency.offload()
    buffers = [held.host.data_ptr() for held in residency._held if held.host is not None]
    reload = residency.reload()
    assert reload.after.host_copies == residency.nbytes  # held while resident: the price
    train_step(model, optimizer, seed=2)
    offload = residency.offload()
    assert offload.before.host_copies == offload.after.host_copies == residency.nbytes
    assert [held.host.data_ptr() for held in residency._held if held.host is not None] == buffers


class FailsToFinish(Residency):
    """A transition whose copies fail at the end (the device out of memory, a copy
    error): the seam is the wait for the copies."""

    def _synchronize(self) -> None:
        raise RuntimeError("CUDA out of memory (stand-in)")


def test_a_failed_offload_frees_nothing_and_a_failed_reload_can_be_retried() -> None:
    model, optimizer = trained_pair()
    before = snapshot(model, optimizer)
    failing = FailsToFinish(held_tensors(model, optimizer), CPU)
    with pytest.raises(RuntimeError, match="out of memory"):
        failing.offload()
    assert failing.state == "resident" and failing.figures().on_device == failing.nbytes
    assert not failing.ledger

    residency = Residency(held_tensors(model, optimizer), CPU)
    residency.offload()
    failing._held, failing._state = residency._held, "offloaded"  # the same storages
    with pytest.raises(RuntimeError, match="out of memory"):
        failing.reload()
    assert failing.state == "offloaded" and failing.figures().on_device == 0
    residency.reload()  # the retry
    for kept, now in zip(before, held_tensors(model, optimizer), strict=True):
        assert same_bytes(kept, now)


def test_memory_mapped_weights_are_refused_until_given_storages_of_their_own(tmp_path) -> None:
    model = TiedModel()
    save_file({"body.weight": model.body.weight.detach().clone()}, tmp_path / "w.safetensors")
    mapped = load_file(tmp_path / "w.safetensors")["body.weight"]
    model.body.weight = nn.Parameter(mapped)
    with pytest.raises(ResidencyError, match="1 tensors on cpu cannot be freed in place"):
        Residency(model.parameters(), CPU)
    assert resizable_parameters(model) == 1
    assert torch.equal(model.body.weight, mapped)
    assert model.head.weight is model.embed.weight
    assert Residency(model.parameters(), CPU).offload().after.on_device == 0


def test_tensors_on_another_device_stay_where_they_are() -> None:
    on_device = torch.ones(10)
    elsewhere = torch.ones(10, device="meta")
    residency = Residency([on_device, elsewhere], CPU)
    assert residency.nbytes == on_device.nbytes
    residency.offload()
    assert on_device.untyped_storage().nbytes() == 0


def test_a_residency_holds_the_same_storages_until_the_tensors_change() -> None:
    """The trainer keeps one residency from lend to lend: the same storages, whatever
    their resizes did to the data pointers; the optimizer's first step adds its own."""
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    residency = Residency(held_tensors(model, optimizer), CPU)
    assert residency.holds(held_tensors(model, optimizer))
    residency.offload()
    residency.reload()  # new data pointers, the same storages
    assert residency.holds(held_tensors(model, optimizer))
    train_step(model, optimizer, seed=1)  # AdamW's state appears
    assert not residency.holds(held_tensors(model, optimizer))
