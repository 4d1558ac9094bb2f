"""The real pretrained models: SmolLM2-135M-Instruct (installed by ``just test``) and Gemma
3 270M (a second family, where ``just pretrained gemma3-270m`` installed it; skipped
otherwise), each converted from the GGUF file its packages ship
(``seamlessflow.assets.pretrained``), through the trainer and both engines.

The conversion runs once into the model cache (``SF_CACHE_DIR``, default
``~/.cache/seamlessflow``), as ``seamlessflow up --model NAME`` does, and later runs of the
suite reuse it. Checked here, for each:

- the converted directory gives the GGUF-loaded model's logits, on a prompt the
  conversion did not check itself, and its tokenizer renders chats to the same ids;
- ``check_model`` accepts it for every consumer and backend;
- each engine (transformers, vLLM) serves the trainer's weights: its logprobs of the
  tokens it generated are within ``tol_same`` (tests/test_model_families.py: two fp32
  implementations at the same weights) of the trainer's recomputation, before and after
  one real trainer step on the engine's own answers, the new weights sent as the trainer
  publishes them (fp32, tied matrix once).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from seamlessflow.assets.loading import load_causal_lm
from seamlessflow.assets.model_check import ModelNeeds, check_model
from seamlessflow.assets.pretrained import (
    BUILD_INFO,
    CHECK_PROMPTS,
    CONVERSION_TOLERANCE,
    PretrainedUnavailable,
    _load_gguf,
    ensure_pretrained,
    gguf_file,
    gguf_files,
    packaged_model,
)
from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample
from sf_engine.backends import ENGINE_BACKENDS, GenerationResult, SamplingParams
from sf_trainer.distributed import TrainGroup
from sf_trainer.learner import Learner
from sf_trainer.settings import TrainerSettings
from tests.support.engines import started_engine, tol_same, trainer_logprobs_and_logits

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
MAX_TOKENS = 8
CHATS = (
    [{"role": "user", "content": "What is 23 + 19? Answer with the number."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a planet."},
    ],
)
"""Not among the conversion's own CHECK_PROMPTS (a system turn, another question)."""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module", params=MODELS)
def pretrained_dir(request: pytest.FixtureRequest) -> Path:
    name = request.param
    try:
        gguf_files(packaged_model(name))
    except PretrainedUnavailable as exc:  # `just test` installs the first (`just pretrained`)
        pytest.skip(str(exc))
    return ensure_pretrained(name, Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")))


def _chat_ids(tokenizer: object, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def test_converted_model_gives_the_gguf_models_logits_and_ids(pretrained_dir: Path) -> None:
    import json

    info = json.loads((pretrained_dir / BUILD_INFO).read_text())
    assert info["max_logit_gap"] <= CONVERSION_TOLERANCE
    assert info["check_prompts"] == list(CHECK_PROMPTS)
    packaged = packaged_model(info["name"])
    assert info["source_sha256"] == packaged.sha256
    with gguf_file(packaged, pretrained_dir.parent) as source:
        reference, gguf_tokenizer = _load_gguf(source, packaged)
    converted = load_causal_lm(pretrained_dir, torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(pretrained_dir), local_files_only=True)
    assert converted.config.tie_word_embeddings
    if packaged.end_of_turn:  # the chat's end of turn is the eos the gateway stops on
        assert tokenizer.eos_token == packaged.end_of_turn
    for messages in CHATS:
        ids = _chat_ids(tokenizer, list(messages))
        assert ids == _chat_ids(gguf_tokenizer, list(messages))
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([ids])).logits
            got = converted(input_ids=torch.tensor([ids])).logits
        gap = float((expected - got).abs().max())
        assert gap <= tol_same(expected), f"{messages}: logits {gap:.3g} apart"


@pytest.mark.parametrize("backend", ENGINE_BACKENDS.names())
def test_check_model_accepts_the_converted_model(pretrained_dir: Path, backend: str) -> None:
    declared = ENGINE_BACKENDS.get(backend)
    unavailable = declared.unavailable()
    if unavailable is not None:
        pytest.skip(unavailable)
    # the context a reasoning task's prompt and a long answer need
    check_model(pretrained_dir, ModelNeeds(architecture=declared.architecture, context_tokens=4096))


def _sample(
    prompt: list[int], params: SamplingParams, result: GenerationResult, reward: float
) -> TrainSample:
    completion = len(result.token_ids)
    return TrainSample(
        session_id=f"s{len(prompt)}-{reward}",
        token_ids=prompt + result.token_ids,
        loss_mask=[0] * len(prompt) + [1] * completion,
        behaviour_logprobs=[0.0] * len(prompt) + result.logprobs,
        versions=[-1] * len(prompt) + result.versions,
        reward=reward,
        temperatures=[1.0] * len(prompt) + [params.temperature] * completion,
    )


async def _served_within_bound(
    engine: object, learner: Learner, prompts: list[list[int]], version: int
) -> list[tuple[list[int], SamplingParams, GenerationResult]]:
    """Generate (one sampled, one greedy answer per prompt) and check each token's
    logprob against the trainer's model at the same weights."""
    sampling = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=version),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
    ]
    requests = [(p, s) for p in prompts for s in sampling]
    results: list[GenerationResult] = await asyncio.gather(
        *(
            engine.generate(f"v{version}-{i}", p, s)  # type: ignore[attr-defined]
            for i, (p, s) in enumerate(requests)
        )
    )
    learner.model.eval()
    try:
        for (prompt, params), result in zip(requests, results, strict=True):
            assert result.versions == [version] * len(result.token_ids)
            temperature = params.temperature or 1.0  # greedy rows: logprobs at T = 1
            with torch.no_grad():
                trainer_logp, logits = trainer_logprobs_and_logits(
                    learner.model,
                    prompt,
                    result.token_ids,
                    temperature,
                )
            gaps = [abs(a - b) for a, b in zip(result.logprobs, trainer_logp.tolist(), strict=True)]
            bound = tol_same(logits / temperature)
            assert max(gaps) <= bound, f"v{version}: engine vs trainer {gaps}, bound {bound:.2g}"
    finally:
        learner.model.train()
    return [(p, s, r) for (p, s), r in zip(requests, results, strict=True)]


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
async def test_engines_serve_the_trainers_weights_before_and_after_a_step(
    pretrained_dir: Path, kind: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(pretrained_dir), local_files_only=True)
    prompts = [_chat_ids(tokenizer, list(messages)) for messages in CHATS]
    learner = Learner(
        TrainerSettings(lr=1e-4),
        TrainGroup(device=torch.device("cpu")),
        pretrained_dir,
    )
    before = {name: tensor.clone() for name, tensor in learner.full_weights().items()}
    async with started_engine(kind, pretrained_dir) as engine:
        answers = await _served_within_bound(engine, learner, prompts, version=0)
        # one real step on the engine's own answers: per prompt, its two answers rewarded
        # 1 and 0, so each group has a learning signal
        groups = [
            SampleGroup(
                group_id=f"g{g}",
                task_id=f"t{g}",
                samples=[_sample(*answer, reward=float(i == 0)) for i, answer in enumerate(pair)],
            )
            for g, pair in enumerate([answers[0:2], answers[2:4]])
        ]
        result = learner.step(TrainBatch(batch_index=0, groups=groups), version=0)
        assert result.samples == 4
        after = learner.full_weights()
        assert after.keys() == before.keys()
        moved = [name for name in after if not torch.equal(after[name], before[name])]
        assert moved, "the step changed no weight"
        await engine.load_weights(after, version=1)
        await _served_within_bound(engine, learner, prompts, version=1)
