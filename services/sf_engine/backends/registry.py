"""Engine backends: each declares itself in its own module, and the registry lists them.

A backend module ends with ``declare(EngineBackend(...))``: its ``SF_ENGINE_BACKEND``
name, the builder of its engine, what it needs of a model, its own settings, the
optional packages it needs, and what it does not do of the ``InferenceEngine`` contract.
Nothing outside that module names the backend: the worker builds it through
``ENGINE_BACKENDS``, the model check reads its ``architecture``, and the contract tests
(``tests/unit/test_engine_contract.py``) run every registered backend, skipping one whose
optional packages do not import with the reason ``unavailable`` gives.

``ENGINE_BACKENDS`` imports the built-in backend modules on its first lookup (importing
this module stays cheap); a new built-in backend adds its module to ``BUILTIN_BACKENDS``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic_settings import BaseSettings

from seamlessflow.assets.model_check import TRANSFORMERS_CAUSAL_LM, ArchitectureNeed
from seamlessflow.plugins import Registry, first_paragraph

from .base import InferenceEngine

if TYPE_CHECKING:
    from sf_engine.settings import EngineSettings

BUILTIN_BACKENDS = (
    "sf_engine.backends.hf_engine",
    "sf_engine.backends.scripted_engine",
    "sf_engine.backends.vllm_engine",
)
"""Modules whose import declares the built-in backends."""


@dataclass(frozen=True)
class EngineBackend:
    """Everything the rest of the code knows of one engine backend."""

    name: str
    """Its ``SF_ENGINE_BACKEND`` value."""
    build: Callable[[EngineSettings, str], InferenceEngine]
    """The engine (not started) from the worker's settings and its model directory."""
    architecture: ArchitectureNeed = TRANSFORMERS_CAUSAL_LM
    """What it needs of a model's config.json; the worker (and ``seamlessflow up``)
    check it before the engine is built."""
    settings: type[BaseSettings] | None = None
    """Its own settings class, beside ``EngineSettings`` (``SF_ENGINE_<NAME>_...``)."""
    optional_packages: tuple[str, ...] = ()
    """Modules it imports that the base install lacks."""
    extra: str = ""
    """The install extra that provides ``optional_packages``."""
    computes: bool = True
    """Its tokens and logprobs come from the model's weights (False: a stand-in for
    load tests, whose outputs the contract tests do not compare with a forward pass)."""
    structured_output: bool = False
    """It constrains completions to a grammar (``SamplingParams.structured_output``);
    the others refuse such requests with a ValueError."""
    starts_slowly: bool = False
    """Its start takes tens of seconds (the contract tests mark it ``slow``)."""

    @property
    def summary(self) -> str:
        """What it is (the configuration reference lists it): the first paragraph of its
        module's docstring, the extra it needs and where its own settings are."""
        summary = first_paragraph(sys.modules[self.build.__module__].__doc__)
        if self.extra:
            summary += f" Needs the ``{self.extra}`` extra."
        if self.settings is not None:
            prefix = self.settings.model_config.get("env_prefix", "")
            summary += f" Its own settings: ``{prefix}*`` (``{self.settings.__name__}``)."
        return summary

    def unavailable(self) -> str | None:
        """Why it cannot run here (an optional package does not import), or None."""
        for module in self.optional_packages:
            try:
                with warnings.catch_warnings():  # an optional package's import-time chatter
                    warnings.simplefilter("ignore")
                    importlib.import_module(module)
            except Exception as exc:  # ImportError, or a broken install (CUDA triton etc.)
                return (
                    f"the {self.name} engine backend needs the {self.extra!r} extra: "
                    f"`import {module}` failed ({exc!r})"
                )
        return None


ENGINE_BACKENDS: Registry[EngineBackend] = Registry(
    "engine backend", "SF_ENGINE_BACKEND", builtins=BUILTIN_BACKENDS
)
"""Every engine backend a worker can wrap, by its ``SF_ENGINE_BACKEND`` name."""


def declare(backend: EngineBackend) -> EngineBackend:
    """Register ``backend`` under its name (called once, by the backend's own module)."""
    ENGINE_BACKENDS.add(backend.name, backend)
    return backend
