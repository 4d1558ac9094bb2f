"""A model directory's tokenizer, loaded as ``AutoTokenizer`` loads it, without torch.

``AutoTokenizer`` picks a tokenizer class from config.json and tokenizer_config.json. To
read config.json it imports transformers' model configurations, and those import torch:
about 8 s of CPU on two cores, paid by every process that only tokenizes (the gateway,
``seamlessflow up``'s model check). The class it picks depends only on those two files,
the path as given and transformers' version. So the first load asks ``AutoTokenizer``
and records its choice in the model cache (``$SF_CACHE_DIR/tokenizer-classes``, one
small file per path and content), and later loads of the same path and content
instantiate the recorded class directly, as ``AutoTokenizer`` itself ends by doing. The
tokenizer is the same object either way (``tests/unit/test_families.py``).

Not recorded: a tokenizer with remote code (``auto_map``), which ``AutoTokenizer`` alone
loads. A record that cannot be read, or names a class that no longer imports, is asked
again and rewritten; a cache that cannot be written costs only the torch import.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

CHOICES_DIR = "tokenizer-classes"
"""Under the model cache: ``<sha256 of what decides the class>.json``."""


def load_tokenizer(model_dir: Path, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir, **kwargs)``; torch is imported only the
    first time a directory's content is seen (per model cache)."""
    record = _record_path(model_dir)
    chosen = _recorded_class(record) if record is not None else None
    if chosen is not None:
        return chosen.from_pretrained(str(model_dir), **kwargs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
    if record is not None:
        _record(record, type(tokenizer))
    return tokenizer


def cache_dir() -> Path:
    """The model cache, as ``seamlessflow up`` resolves it."""
    return Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()


def _record_path(model_dir: Path) -> Path | None:
    """Where AutoTokenizer's choice for this content is kept; None for remote code."""
    # the path as given too: AutoTokenizer matches it against hub ids it treats apart
    # (``MODEL_IDS_TO_TOKENIZERS_BACKEND``, e.g. a relative ``deepseek-ai/deepseek-coder-x``)
    digest = hashlib.sha256(f"transformers {version('transformers')}\0{model_dir}".encode())
    for name in ("tokenizer_config.json", "config.json"):
        try:
            content = (model_dir / name).read_bytes()
        except OSError:
            content = b""  # absent: AutoTokenizer decides without it, and so does the key
        if name == "tokenizer_config.json" and b'"auto_map"' in content:
            try:
                if "auto_map" in json.loads(content):
                    return None
            except ValueError:
                return None  # AutoTokenizer reports the broken file
        digest.update(b"\0" + name.encode() + b"\0" + content)
    return cache_dir() / CHOICES_DIR / f"{digest.hexdigest()}.json"


def _recorded_class(record: Path) -> Any:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        entry = json.loads(record.read_text())
        chosen = getattr(importlib.import_module(entry["module"]), entry["name"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None
    if not (isinstance(chosen, type) and issubclass(chosen, PreTrainedTokenizerBase)):
        return None
    return chosen


def _record(record: Path, chosen: type) -> None:
    entry = {"module": chosen.__module__, "name": chosen.__qualname__}
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entry))
        partial.replace(record)  # atomic: a concurrent reader sees no half-written record
    except OSError:
        pass  # a read-only cache: the next load asks AutoTokenizer again
