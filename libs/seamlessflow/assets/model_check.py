"""What a run needs from a model directory, checked before anything loads it.

A model brought with ``--model-dir`` / ``SF_MODEL_DIR`` can miss things that would
otherwise surface one at a time, late and far from their cause: a tokenizer without a
chat template fails the first agent request, a checkpoint in ``.bin`` fails the engine
after NATS and every other service came up, a context shorter than the run's prompts
fails mid-run. :func:`check_model` looks at everything at once and raises
:class:`ModelUnfit` (an :class:`~seamlessflow.bus.Unrecoverable`: one line, exit 78)
naming every problem, so one attempt shows all there is to fix.

Who checks what (:class:`ModelNeeds`):

- the embedded run (``seamlessflow up``), before it starts a process: everything, with
  the context its task needs (longest prompt + ``max_tokens``);
- the gateway: tokenizer, chat template, eos (it templates, tokenizes and stops);
- each engine worker: config, an architecture its backend runs (the backend declares
  its :class:`ArchitectureNeed`), weights, the context it is set to serve;
- the trainer (every rank): config, a transformers causal-LM architecture, weights,
  a tokenizer that loads (saved with each checkpoint).

Everything is read from local files (no hub access); a runner's own architecture check
(``ArchitectureNeed.extra_problems``, which may import its package) runs only when that
runner is the one checked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seamlessflow.assets.tokenizer import load_tokenizer
from seamlessflow.bus import Unrecoverable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A tokenizer's vocabulary lives in one of these (fast, sentencepiece, BPE)."""

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
"""Where a config.json states its context length, in the order they are read."""


class ModelUnfit(Unrecoverable):
    """A model directory lacks what the run needs; the message lists every problem."""

    def __init__(self, model_dir: Path, problems: list[str]) -> None:
        self.model_dir = model_dir
        self.problems = problems
        listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, start=1))
        super().__init__(f"model {model_dir} is not usable: {listed}")


@dataclass(frozen=True)
class ArchitectureNeed:
    """What the code that runs a model's weights needs of its architecture (config.json),
    declared by that code: the trainer and most engines need a transformers causal LM
    (``TRANSFORMERS_CAUSAL_LM``); an engine backend may add its own check, or need
    none (``SHAPES_ONLY``: it reads tensor shapes, not an architecture)."""

    transformers_causal_lm: bool = True
    """A ``model_type`` this transformers version knows as a causal LM, whose config
    loads."""
    extra_problems: Callable[[dict[str, Any]], list[str]] | None = None
    """The runner's own check of the parsed config.json: each problem a short sentence
    (e.g. an architecture vLLM's registry does not run)."""


TRANSFORMERS_CAUSAL_LM = ArchitectureNeed()
"""The trainer's need, and the default: a transformers causal LM."""

SHAPES_ONLY = ArchitectureNeed(transformers_causal_lm=False)
"""A runner that reads only the weights' names and shapes: any architecture."""


@dataclass(frozen=True)
class ModelNeeds:
    """What one consumer of the model directory needs from it."""

    tokenizer: bool = True
    """Tokenizer files that load (the trainer saves them with every checkpoint)."""
    chat: bool = True
    """Also a chat template that renders, an eos and a pad (or eos) token: the gateway
    templates, tokenizes and stops on them."""
    weights: bool = True
    """``*.safetensors`` weights (every shard of an index) and a config whose
    architecture the code that loads them runs (``architecture``)."""
    architecture: ArchitectureNeed = TRANSFORMERS_CAUSAL_LM
    """What the code that loads the weights needs of the architecture (an engine
    worker: its backend's declaration, ``EngineBackend.architecture``)."""
    context_tokens: int = 0
    """Prompt + completion tokens the consumer will ask of the model (0 = no need
    stated): the config's context length must be at least this."""
    context_reason: str = ""
    """Where ``context_tokens`` comes from, for the message (``SF_ENGINE_MAX_CONTEXT``)."""


def context_need(settings: Any, env_name: str) -> dict[str, Any]:
    """The context fields of :class:`ModelNeeds` for a service's ``max_context``
    setting: a need only when the user set it (``env_name``, or in code); the default
    is a cap that the engines lower to the model's own context."""
    if "max_context" not in settings.model_fields_set:
        return {}
    return {"context_tokens": settings.max_context, "context_reason": env_name}


def check_model(model_dir: Path, needs: ModelNeeds) -> None:
    """Raise :class:`ModelUnfit` listing every problem of ``model_dir`` for ``needs``."""
    problems = model_problems(Path(model_dir), needs)
    if problems:
        raise ModelUnfit(Path(model_dir), problems)


def model_problems(model_dir: Path, needs: ModelNeeds) -> list[str]:
    """Every problem of ``model_dir`` for ``needs``, each as a short sentence (empty:
    usable)."""
    if not model_dir.is_dir():
        return ["no such directory"]
    problems: list[str] = []
    config = _config_problems(model_dir, needs, problems)
    if needs.weights:
        problems.extend(_weight_problems(model_dir))
    if needs.tokenizer or needs.chat:
        problems.extend(_tokenizer_problems(model_dir, config, chat=needs.chat))
    if needs.context_tokens > 0 and config is not None:
        context = context_length(config)
        if context is None:
            problems.append(
                f"config.json states no context length (one of {', '.join(CONTEXT_KEYS)})"
            )
        elif context < needs.context_tokens:
            reason = f" ({needs.context_reason})" if needs.context_reason else ""
            problems.append(
                f"context of {context} tokens (config.json) is shorter than the "
                f"{needs.context_tokens} the run needs{reason}"
            )
    return problems


def task_context_tokens(model_dir: Path, task: str, seed: int, max_tokens: int) -> int | None:
    """What a run of ``task`` asks of the model's context at least: its longest prompt
    (every split, rendered with the model's chat template and the task's tools) plus the
    completion budget ``max_tokens``. A multi-turn agent's later turns need more.
    Without a chat template, the prompts' contents alone (a lower bound). None when the
    tokenizer or the template fails (reported by :func:`check_model`)."""
    from seamlessflow.tasks import get_task_source

    try:
        tokenizer: Any = load_tokenizer(model_dir, local_files_only=True)
        source = get_task_source(task, seed=seed)
        tools = getattr(source, "tools", None)
        items = [item for split in ("train", "eval") for item in source.items(split)]
        if tokenizer.chat_template:
            prompts = [
                tokenizer.apply_chat_template(
                    list(item.messages), tools=tools, add_generation_prompt=True, tokenize=False
                )
                for item in items
            ]
        else:  # no template (check_model says so): the contents alone are a lower bound
            prompts = [
                "".join(str(m.get("content") or "") for m in item.messages) for item in items
            ]
        # as the gateway tokenizes a rendered prompt: no special tokens added
        encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
        longest = max((len(ids) for ids in encoded), default=0)
    except Exception:  # the tokenizer's or the template's problem, which check_model names
        return None
    return longest + max_tokens


def model_context(model_dir: Path, setting: str) -> int:
    """The model's context length from ``model_dir``'s config.json: what a service whose
    ``max_context`` is 0 (the default) allows. A config that states none is an error
    naming ``setting``, which the user then sets."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelUnfit(Path(model_dir), [f"config.json unreadable ({exc})"]) from None
    context = context_length(config)
    if context is None:
        raise ModelUnfit(
            Path(model_dir),
            [
                f"config.json states no context length (one of {', '.join(CONTEXT_KEYS)}): "
                f"set {setting}"
            ],
        )
    return context


def context_length(config: dict[str, Any]) -> int | None:
    """The model's context length from its config.json (a multimodal config's text part)."""
    text = config.get("text_config") or config
    for key in CONTEXT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _config_problems(
    model_dir: Path, needs: ModelNeeds, problems: list[str]
) -> dict[str, Any] | None:
    """The parsed config.json (None if it is missing or not JSON); problems appended."""
    path = model_dir / "config.json"
    if not path.is_file():
        problems.append("no config.json")
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"config.json is not JSON ({exc})")
        return None
    if not isinstance(config, dict):
        problems.append("config.json is not a JSON object")
        return None
    if not needs.weights:
        return config
    if needs.architecture.transformers_causal_lm:
        problems.extend(_transformers_problems(model_dir, config))
    if needs.architecture.extra_problems is not None:
        problems.extend(needs.architecture.extra_problems(config))
    return config


def _transformers_problems(model_dir: Path, config: dict[str, Any]) -> list[str]:
    model_type = config.get("model_type")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [
            f"model_type {model_type!r} (config.json) is no causal LM this transformers "
            "version knows"
        ]
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # any failure here is the config's: report, go on
        return [f"config.json does not load in transformers ({one_line(exc)})"]
    return []


def _weight_problems(model_dir: Path) -> list[str]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"model.safetensors.index.json has no readable weight_map ({exc})"]
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            return [f"weight shards named by model.safetensors.index.json are missing: {missing}"]
        return []
    if any(model_dir.glob("*.safetensors")):
        return []
    other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt")
    )
    hint = (
        f" (found {', '.join(other)}: save it again with save_pretrained, which writes safetensors)"
        if other
        else ""
    )
    return [f"no *.safetensors weights{hint}"]


def _tokenizer_problems(model_dir: Path, config: dict[str, Any] | None, *, chat: bool) -> list[str]:
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        # Without a vocabulary nothing else of the tokenizer can be checked by loading
        # it; say what the files alone show.
        problems = [f"no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"]
        if chat and not _template_in_files(model_dir):
            problems.append(
                "no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
            )
        return problems
    try:
        tokenizer: Any = load_tokenizer(model_dir, local_files_only=True)
    except Exception as exc:  # a broken tokenizer is the model's problem: report it
        return [f"the tokenizer does not load ({one_line(exc)})"]
    if not chat:
        return []
    problems = []
    if not tokenizer.chat_template:
        problems.append(
            "no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
        )
    else:
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "1 + 1 = ?"}],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # the template's own error (raise_exception, syntax)
            problems.append(f"the chat template does not render a user turn ({one_line(exc)})")
    eos_ids = _ids(tokenizer.eos_token_id) | config_ids(model_dir, config, "eos_token_id")
    if tokenizer.eos_token_id is None:
        where = f" (config.json / generation_config.json have {sorted(eos_ids)})" if eos_ids else ""
        problems.append(
            "no eos token in the tokenizer (tokenizer_config.json eos_token): the gateway "
            f"stops generation and closes assistant turns on it{where}"
        )
    pad_ids = _ids(tokenizer.pad_token_id) | config_ids(model_dir, config, "pad_token_id")
    if not pad_ids and not eos_ids:
        problems.append("no pad token id and no eos id to pad with")
    return problems


def _template_in_files(model_dir: Path) -> bool:
    if any((model_dir / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template"))


def config_ids(model_dir: Path, config: dict[str, Any] | None, key: str) -> set[int]:
    """``key`` (an id or a list of ids) from ``config`` (config.json as parsed; None: only
    generation_config.json is read) and generation_config.json."""
    found: set[int] = set()
    sources = [config or {}]
    try:
        sources.append(json.loads((model_dir / "generation_config.json").read_text()))
    except (OSError, ValueError):
        pass
    for source in sources:
        if isinstance(source, dict):
            text = source.get("text_config") or source
            found |= _ids(text.get(key))
    return found


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: first line of its message`` (problems are one line each)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
