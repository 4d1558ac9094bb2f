"""The name mapping the vLLM engine applies to a tied matrix before its checks
(``sf_engine.backends.vllm_engine``), without vLLM: the input name, the output name or
both are taken, and two different matrices under the two names are refused. The engines
serving each family's versions are tests/service/test_model_families.py."""

from __future__ import annotations

import pytest
import torch


def test_vllm_engine_takes_a_tied_matrix_under_either_name_or_both() -> None:
    """The name mapping the vLLM engine applies before its checks (no vLLM needed)."""
    from sf_engine.backends.vllm_engine import _tied_names, _untie

    shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,)}
    tied = _tied_names({"tie_word_embeddings": True}, shapes)
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert _tied_names({"tie_word_embeddings": False}, shapes) == {}
    # A checkpoint that lists both names (e.g. saved from a gathered state) maps the same.
    assert _tied_names({"tie_word_embeddings": True}, {**shapes, "lm_head.weight": (8, 4)}) == tied
    matrix, norm = torch.randn(8, 4), torch.ones(4)
    both = {"model.embed_tokens.weight": matrix, "lm_head.weight": matrix.clone(), "n": norm}
    assert _untie(both, tied).keys() == {"model.embed_tokens.weight", "n"}
    head_only = _untie({"lm_head.weight": matrix, "n": norm}, tied)
    assert head_only.keys() == {"model.embed_tokens.weight", "n"}
    assert head_only["model.embed_tokens.weight"] is matrix
    plain = {"model.embed_tokens.weight": matrix, "n": norm}
    assert _untie(plain, tied) is plain
    with pytest.raises(ValueError, match="tied weights"):
        _untie({**both, "lm_head.weight": matrix + 1}, tied)
    with pytest.raises(ValueError, match="tied weights"):
        _untie({**both, "lm_head.weight": matrix[:4]}, tied)
