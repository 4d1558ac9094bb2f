"""Bring your own model, per family: every model family's tiny build passes the start-up
check (``model_check``) for both engines, with the lookup task's tools in the prompt.
The check on a broken model, the CLI and each service are tests/mesh/test_model_check.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamlessflow.assets.families import FAMILIES, build_family_model
from seamlessflow.assets.model_check import ModelNeeds, model_problems, task_context_tokens
from sf_engine.backends import ENGINE_BACKENDS

# What the vLLM backend needs of a model's architecture, as it declares it.
VLLM = ENGINE_BACKENDS.get("vllm").architecture


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_passes_for_both_engines(family: str, tmp_path: Path) -> None:
    model_dir = build_family_model(family, tmp_path / family)
    need = task_context_tokens(model_dir, "lookup", 0, max_tokens=32)  # tools in the prompt
    assert need is not None and need > 32
    assert model_problems(model_dir, ModelNeeds(context_tokens=need)) == []
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    assert model_problems(model_dir, ModelNeeds(architecture=VLLM)) == []
