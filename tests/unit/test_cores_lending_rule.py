"""Lending in the other direction, on its own: which idle rollout engines' cores are lent
to the training trainer (``idle_cores.cores_for_training``: only idle, live, dedicated
engines on the trainer's host), and the trainer's side (``ThreadBudget``: the offer takes
effect at the next layer, forward or backward, never beyond the usable cores, on the
thread that applies it). On a real tag-scheduler and engine worker:
tests/service/test_cores_lending.py."""

from __future__ import annotations

import threading

import pytest
import torch

from sf_tag_scheduler.idle_cores import EngineLoad, cores_for_training, lent_threads
from sf_tag_scheduler.policy import ResourceView
from sf_trainer.threads import ThreadBudget

# -------------------------------------------------------------------------- the rule


def engine(
    engine_id: str,
    tags: str = "rollout",
    host: str = "h1",
    phase: str = "idle",
    in_flight: int = 0,
    alive: bool = True,
    slots: tuple[str, ...] = ("slot-0",),
) -> EngineLoad:
    view = ResourceView(engine_id, "engine", frozenset(tags.split(",")), slots)
    return EngineLoad(view, host, phase, in_flight, alive)


def test_only_idle_dedicated_engines_on_the_trainers_host_lend_their_cores() -> None:
    engines = [
        engine("e-idle"),
        engine("e-busy", phase="rollout", in_flight=3),
        engine("e-loading", phase="sync"),
        engine("e-last-request", phase="idle", in_flight=1),
        engine("e-elsewhere", host="h2"),
        engine("e-dead", alive=False),
        engine("e-lendable", tags="train,rollout"),  # on the trainer's slot: reclaimed
        engine("e-two-slots", slots=("slot-2", "slot-3")),
    ]
    lent = cores_for_training("h1", engines)
    assert lent == ("e-idle", "e-two-slots")
    assert lent_threads(engines, lent) == 3
    assert cores_for_training("", engines) == (), "a trainer of unknown host borrows nothing"
    assert lent_threads(engines, ()) == 0


# -------------------------------------------------------------------------- the trainer


@pytest.fixture
def torch_threads():  # type: ignore[no-untyped-def]
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


class Stack(torch.nn.Module):
    """Four layers in a ModuleList; ``during`` runs inside layer 1's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.seen: list[int] = []
        self.during: list = []  # type: ignore[type-arg]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index == 1:
                for action in self.during:
                    action()
        return x.sum()


def test_an_offer_takes_effect_at_the_next_layer_forward_and_backward(torch_threads) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    budget = ThreadBudget(own=1, cpus=2)
    model = Stack()
    handles = budget.install(model)
    for layer in model.layers:  # what each layer computed on (after the budget's hook)
        layer.register_forward_hook(lambda *_: model.seen.append(torch.get_num_threads()))
    # forward: lent while layer 1 computes -> layers 2 and 3 run on 2 threads
    model.during = [lambda: budget.lend(1)]
    loss = model(torch.ones(2, 8))
    assert model.seen == [1, 1, 2, 2]
    # backward: taken back before it starts -> the first layer gradient applies it
    budget.lend(0)
    observed: list[int] = []
    model.layers[0].weight.register_hook(lambda g: observed.append(torch.get_num_threads()))
    loss.backward()
    assert observed == [1]
    assert budget.switches == 2
    assert budget.extra_thread_seconds() > 0
    for handle in handles:
        handle.remove()


def test_never_more_threads_than_usable_cores(torch_threads) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    budget = ThreadBudget(own=1, cpus=1)  # pinned to one core
    budget.lend(3)
    budget.apply()
    assert budget.applied == 1 and torch.get_num_threads() == 1
    assert budget.switches == 0
    assert budget.extra_thread_seconds() == 0.0
    wider = ThreadBudget(own=2, cpus=3)
    wider.lend(5)
    assert wider.wanted == 3
    with pytest.raises(ValueError, match="own threads"):
        ThreadBudget(own=0)


def test_the_thread_count_is_the_applying_threads_own(torch_threads) -> None:  # type: ignore[no-untyped-def]
    """Why the offer is applied on the learner thread: another thread's setting does not
    reach it (torch's intra-op pool size is per calling thread)."""
    torch.set_num_threads(1)
    budget = ThreadBudget(own=1, cpus=2)
    budget.lend(1)
    seen: list[int] = []

    def learner() -> None:
        torch.set_num_threads(1)
        budget.apply()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=learner)
    worker.start()
    worker.join()
    assert seen == [2]
