"""``seamlessflow build-model`` on a directory that already holds a model, as compose's
one-shot ``build-model`` finds its ``models`` volume after ``SF_MODEL`` changed: the
built-in model replaces a converted pretrained one whole, keeping none of its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sf_app.cli import app

# it builds a model (tokenizer, weights, a warm-up of 0 steps: ~11 s of one core)
pytestmark = pytest.mark.integration


def test_the_built_in_model_replaces_a_converted_one_whole(tmp_path: Path) -> None:
    out = tmp_path / "base"
    out.mkdir()
    # what a conversion leaves (seamlessflow.assets.pretrained.convert_pretrained)
    (out / "build_info.json").write_text(json.dumps({"source_sha256": "0" * 64}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 49152}))
    (out / "special_tokens_map.json").write_text("{}")
    result = CliRunner().invoke(
        app, ["build-model", "--from", "built-in", "--out", str(out), "--sft-steps", "0"]
    )
    assert result.exit_code == 0, result.output
    info = json.loads((out / "build_info.json").read_text())
    assert "build_hash" in info and "source_sha256" not in info
    assert not (out / "special_tokens_map.json").exists()  # the other model's file is gone
    generation = json.loads((out / "generation_config.json").read_text())
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert generation["eos_token_id"] < vocab  # the built-in model's own eos
