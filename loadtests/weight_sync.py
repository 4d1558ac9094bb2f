"""Weight sync: time and bandwidth of each transport against its bound, and the bytes
deltas save on real training steps.

Transports. For each size (``--sizes``, MB = 10^6 bytes) a bf16 state dict of
``STATE_TENSORS`` equal matrices is synced as one full version, the way the trainer and
one engine do it, and timed in parts:

- ``encode``: ``WeightEncoder.encode`` (flatten into one buffer + a digest per bucket);
- ``put``: the trainer stores the payload completely (``PayloadStore.put``);
- ``fetch``: the engine gets it (``PayloadStore.fetch``);
- ``apply``: ``WeightMirror.apply`` (the digest of every bucket, then the copy into the
  engine's flat state).

``shm`` is ``SharedMemoryPayloads`` in a temporary directory of /dev/shm; ``object`` is
``ObjectStorePayloads`` on a real nats-server started here (JetStream on a temporary
directory; trainer and engine have their own connection); ``collective`` is
``collective.send`` / ``receive`` over a gloo group of two processes on loopback: rank 0
encodes and broadcasts, rank 1 receives and applies (the broadcast is both put and fetch,
shown as ``put``; the receiver hashes each bucket as it lands); ``streamed`` is the same
pair with the trainer's publish (``WeightPublisher.publish_streamed``: each bucket
broadcast while the next is encoded, so ``put`` holds the encode; a store that keeps
nothing, so the push alone is timed); ``ring`` is ``streamed`` with the pair's buckets
through the same-host shared-memory ring the push group picks when both ends map it
(``weights.ring``: the encoder fills the ring's slots, the engine copies each out and
hashes it; only control messages on the socket). Each figure is the best
of ``--repeats`` trials. Every trial is a steady-state version, as from the third on:
the engine already holds a version of the same size (applied untimed), the encoder
reuses the buffer of two versions ago and the push receiver one of its two buffers, so
no trial pays for allocating (and faulting in) a buffer.

Bounds, measured in the same run on the same number of bytes, best of ``--repeats``:
``memcpy`` (``torch.Tensor.copy_`` of a uint8 tensor, the bound of ``shm``) and
``loopback TCP`` (one socket on 127.0.0.1 with large buffers, a sender thread and a
receiver, the bound of ``object``, ``collective`` and ``streamed``; ``ring``'s is
``memcpy``, one copy); the payload digest
(XXH3-128) and ``sha256`` (``hashlib``, the digest before) are shown too because every
sync hashes the payload twice. ``sync/bound`` is the whole sync's bandwidth over the
bound's, ``move/bound`` that of put + fetch alone.

torch runs on one thread everywhere, as the trainer does by default
(``SF_TRAINER_TORCH_THREADS``) and as one engine per core would.

Deltas. The built-in model takes ``--steps`` real GRPO steps (``sf_trainer.step.
train_step``, AdamW as the trainer builds it) at each learning rate of ``--lrs``, on
completions the model samples itself for prompts of the built-in task, scored by the
task's reward function. The base model is published as version 1, then every step
publishes the next version through ``WeightPublisher`` with
``WeightEncoder(deltas=True, full_every=1000)``, in float32 and in bfloat16 (the
publisher's cast), to ``SharedMemoryPayloads``; a ``WeightReceiver`` applies and verifies
each one. Per step: payload bytes vs state bytes, the fraction of words that changed and
the delta's position encoding (a delta larger than the codec's ``max_delta_ratio`` of the
state goes in full).

Prints readable tables and writes every figure as JSON (``--json``).

    .venv/bin/python loadtests/weight_sync.py [--sizes 10,100,1000] [--steps 10]
    .venv/bin/python loadtests/weight_sync.py --quick        # sizes 10,100; 3 steps
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from seamlessflow.bus import connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import SampleGroup, Subjects, TrainBatch, TrainSample, WeightManifest
from seamlessflow.rewards import get_reward
from seamlessflow.tasks import TaskItem, get_task_source
from seamlessflow.weights import (
    ObjectStorePayloads,
    PayloadStore,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightMirror,
    WeightPublisher,
    WeightReceiver,
    collective,
)
from seamlessflow.weights.codec import BucketSink
from seamlessflow.weights.layout import digest_of, plan_layout
from seamlessflow.weights.ring import RingCollective, same_host_ring
from seamlessflow.weights.settings import WeightTransferSettings
from sf_app.base_model import IM_END, TASK, ensure_base_model
from sf_trainer.grpo import token_logprobs
from sf_trainer.settings import TrainerSettings
from sf_trainer.step import train_step

MB = 1_000_000
STATE_TENSORS = 4
STATE_COLUMNS = 4096
SOCKET_BUFFER_BYTES = 16 * 1024 * 1024
TRANSPORT_BOUNDS = {
    "shm": "memcpy",
    "object": "loopback_tcp",
    "collective": "loopback_tcp",
    "streamed": "loopback_tcp",
    "ring": "memcpy",
}
PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 8
DELTA_FULL_EVERY = 1000
WORD_VIEWS = {2: torch.int16, 4: torch.int32}
SEED = 0
"""The run's seed (``SF_SEED``): torch's and the task order's, as a trainer with the
default takes them."""


# ---------------------------------------------------------------------------- helpers


def synthetic_state(megabytes: int, seed: int) -> dict[str, torch.Tensor]:
    """A bf16 state dict of STATE_TENSORS equal [rows, STATE_COLUMNS] matrices, about
    ``megabytes`` in all (normal values: the bytes of real weights, not of zeros)."""
    rows = max(1, megabytes * MB // (STATE_TENSORS * STATE_COLUMNS * 2))
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layers.{index}.weight": torch.randn(
            rows, STATE_COLUMNS, generator=generator, dtype=torch.bfloat16
        )
        for index in range(STATE_TENSORS)
    }


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Trial:
    """Seconds of each part of one full-version sync (``fetch`` is 0 for a broadcast)."""

    encode: float
    put: float
    fetch: float
    apply: float

    @property
    def total(self) -> float:
        return self.encode + self.put + self.fetch + self.apply


# ----------------------------------------------------------------------------- bounds


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.zeros(nbytes, dtype=torch.uint8)  # written once: no page faults timed

    def copy() -> float:
        started = time.perf_counter()
        target.copy_(source)
        return time.perf_counter() - started

    return best_of(repeats, copy)


def loopback_tcp_seconds(nbytes: int, repeats: int) -> float:
    payload = memoryview(bytearray(nbytes))
    received = memoryview(bytearray(nbytes))

    def transfer() -> float:
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sender = socket.create_connection(server.getsockname())
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            receiver, _ = server.accept()
            go = threading.Event()

            def send() -> None:
                go.wait()
                sender.sendall(payload)

            thread = threading.Thread(target=send)
            thread.start()
            started = time.perf_counter()
            go.set()
            done = 0
            while done < nbytes:
                done += receiver.recv_into(received[done:])
            elapsed = time.perf_counter() - started
            thread.join()
            sender.close()
            receiver.close()
            return elapsed

    return best_of(repeats, transfer)


def hash_seconds(nbytes: int, repeats: int, hash_once: Callable[[memoryview], object]) -> float:
    data = memoryview(bytearray(nbytes))

    def digest() -> float:
        started = time.perf_counter()
        hash_once(data)
        return time.perf_counter() - started

    return best_of(repeats, digest)


def measure_bounds(nbytes: int, repeats: int) -> dict[str, float]:
    """Seconds of each bound for ``nbytes``; each one's buffers are freed before the next."""
    return {
        "memcpy": memcpy_seconds(nbytes, repeats),
        "loopback_tcp": loopback_tcp_seconds(nbytes, repeats),
        "xxh3_128": hash_seconds(nbytes, repeats, digest_of),
        "sha256": hash_seconds(nbytes, repeats, lambda data: hashlib.sha256(data).digest()),
    }


# ------------------------------------------------------------------------- pull stores


def engine_mirror(state: dict[str, torch.Tensor], bucket_bytes: int) -> WeightMirror:
    """An engine already holding a version of ``state``'s size (applied untimed), as in
    steady state: no timed sync pays for allocating the engine's flat state."""
    mirror = WeightMirror()
    held = WeightEncoder(bucket_bytes).encode(0, state)
    mirror.apply(held.manifest, held.payload)
    return mirror


def steady_encoder(state: dict[str, torch.Tensor], bucket_bytes: int) -> WeightEncoder:
    """An encoder that encoded two versions of ``state`` (untimed): each timed version
    then reuses the buffer of two versions ago, as the trainer's encoder does from its
    third version on (the first two allocate, 0.5 s per GB here)."""
    encoder = WeightEncoder(bucket_bytes)
    for version in (-1, 0):
        encoder.encode(version, state)
    return encoder


async def pull_store_trials(
    trainer_store: PayloadStore,
    engine_store: PayloadStore,
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    repeats: int,
) -> list[Trial]:
    mirror = await asyncio.to_thread(engine_mirror, state, bucket_bytes)
    encoder = await asyncio.to_thread(steady_encoder, state, bucket_bytes)
    trials = []
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        encoded = await asyncio.to_thread(encoder.encode, version, state)
        encoded_at = time.perf_counter()
        manifest = await trainer_store.put(encoded)
        put_at = time.perf_counter()
        payload = await engine_store.fetch(manifest)
        fetched_at = time.perf_counter()
        await asyncio.to_thread(mirror.apply, manifest, payload)
        applied_at = time.perf_counter()
        trials.append(
            Trial(
                encode=encoded_at - started,
                put=put_at - encoded_at,
                fetch=fetched_at - put_at,
                apply=applied_at - fetched_at,
            )
        )
        # the engine's copy of the payload goes before the next
        del encoded, payload
        await trainer_store.delete(manifest)
        gc.collect()
    return trials


async def measure_pull_stores(
    state: dict[str, torch.Tensor],
    nats_url: str,
    shm_dir: Path,
    bucket_bytes: int,
    repeats: int,
) -> dict[str, list[Trial]]:
    run_id = "bench" + uuid.uuid4().hex[:8]
    shm = SharedMemoryPayloads(run_id, shm_dir)
    trials = {"shm": await pull_store_trials(shm, shm, state, bucket_bytes, repeats)}
    trainer_bus = await connect(nats_url, Subjects(run_id), name="bench-trainer")
    engine_bus = await connect(nats_url, Subjects(run_id), name="bench-engine")
    try:
        trials["object"] = await pull_store_trials(
            ObjectStorePayloads(trainer_bus),
            ObjectStorePayloads(engine_bus),
            state,
            bucket_bytes,
            repeats,
        )
    finally:
        await trainer_bus.drain()
        await engine_bus.drain()
    return trials


# -------------------------------------------------------------------------- collective


def send_trials(
    group: collective.TorchCollective,
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    repeats: int,
) -> list[dict[str, float]]:
    import torch.distributed as dist

    encoder = steady_encoder(state, bucket_bytes)
    trials = []
    for version in range(1, repeats + 1):
        dist.barrier()  # the previous apply is done: encode has the cores to itself
        started = time.perf_counter()
        encoded = encoder.encode(version, state)
        trials.append({"encode": time.perf_counter() - started})
        dist.barrier()
        collective.send(group, encoded)
        del encoded
    return trials


class KeptNowhere:
    """A ``PayloadStore`` whose payloads go nowhere: ``streamed`` times the push alone."""

    name = "none"
    ephemeral = True

    async def writer(self, version: int, kind: str) -> KeptNowhere:
        return self

    async def write(self, index: int, bucket: memoryview) -> None:
        pass

    async def close(self, manifest: WeightManifest) -> WeightManifest:
        return manifest

    async def abort(self) -> None:
        pass

    async def delete(self, manifest: WeightManifest) -> None:
        pass

    async def delete_before(self, version: int) -> None:
        pass


def streamed_send_trials(
    group: collective.Collective,
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    repeats: int,
) -> list[dict[str, float]]:
    """The trainer's publish (``WeightPublisher.publish_streamed``): the state encoded
    bucket by bucket in a worker thread while the bucket before is broadcast; the clock
    of the receiver covers encode and broadcast together."""
    import torch.distributed as dist

    publisher = WeightPublisher(KeptNowhere(), WeightEncoder(bucket_bytes))
    layout = plan_layout(state)

    def encode(version: int) -> Callable[[BucketSink], Awaitable[WeightManifest]]:
        return lambda sink: asyncio.to_thread(
            publisher.encoder.encode_buckets, version, layout, iter(state.items()), sink
        )

    trials = []
    for version in range(1, repeats + 1):
        dist.barrier()
        dist.barrier()
        publisher.push = group
        asyncio.run(publisher.publish_streamed(version, encode(version)))
        assert publisher.push is group, "the push group broke"
        trials.append({"encode": 0.0})
    return trials


def receive_trials(
    group: collective.Collective, mirror: WeightMirror, repeats: int
) -> list[dict[str, float]]:
    import torch.distributed as dist

    # the push listener's two buffers after its first two payloads: allocated and touched
    nbytes = mirror.manifest.state_bytes if mirror.manifest else 0
    buffers = [collective.new_buffer(nbytes).zero_() for _ in range(2)]
    trials = []
    for trial in range(repeats):
        dist.barrier()
        dist.barrier()  # the sender has encoded: the clock covers the broadcast alone
        started = time.perf_counter()
        buffer = buffers[trial % 2]
        received = collective.receive(group, buffer=lambda n, into=buffer: into[:n])
        received_at = time.perf_counter()
        assert received is not None
        mirror.apply(received.manifest, received.payload, received.bucket_digests)
        trials.append({"put": received_at - started, "apply": time.perf_counter() - received_at})
        del received
    return trials


def collective_rank(
    rank: int, port: int, sizes: list[int], bucket_bytes: int, repeats: int, out_dir: str
) -> None:
    """One rank of the gloo pair: rank 0 encodes and sends, rank 1 receives and applies."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=10))
    group = collective.TorchCollective()
    ring = same_host_ring(group, Path("/dev/shm"), bucket_bytes, timeout_s=600)
    pairs: dict[str, collective.Collective] = {"collective": group, "streamed": group}
    if isinstance(ring, RingCollective):
        pairs["ring"] = ring
    else:  # a /dev/shm too small for the ring's four buckets (a container's 64 MB)
        print("no ring row: /dev/shm has no room for the ring (see the log line above)")
    seconds: dict[str, list[dict[str, float]]] = {}
    try:
        for megabytes in sizes:
            # rank 1 builds the state only to hold a version of its size, then drops it
            state = synthetic_state(megabytes, seed=megabytes)
            if rank == 0:
                seconds[f"collective {megabytes}"] = send_trials(
                    group, state, bucket_bytes, repeats
                )
                for name, pair in pairs.items():
                    if name != "collective":
                        seconds[f"{name} {megabytes}"] = streamed_send_trials(
                            pair, state, bucket_bytes, repeats
                        )
                del state
            else:
                mirror = engine_mirror(state, bucket_bytes)
                del state
                for name, pair in pairs.items():
                    seconds[f"{name} {megabytes}"] = receive_trials(pair, mirror, repeats)
                del mirror
            gc.collect()  # nothing of this size outlives its trials
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def measure_collective(
    sizes: list[int], bucket_bytes: int, repeats: int
) -> dict[int, dict[str, list[Trial]]]:
    """``collective`` (a whole payload encoded, then sent), ``streamed`` (sent as it is
    encoded) and ``ring`` (streamed through shared memory) per size."""
    with tempfile.TemporaryDirectory(prefix="sf-weight-bench-") as out_dir:
        mp.spawn(
            collective_rank,
            args=(free_port(), sizes, bucket_bytes, repeats, out_dir),
            nprocs=2,
            join=True,
        )
        sender, receiver = (
            json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in (0, 1)
        )

    def trials(key: str) -> list[Trial]:
        return [
            Trial(encode=sent["encode"], put=got["put"], fetch=0.0, apply=got["apply"])
            for sent, got in zip(sender[key], receiver[key], strict=True)
        ]

    return {
        megabytes: {
            name: trials(f"{name} {megabytes}")
            for name in ("collective", "streamed", "ring")
            if f"{name} {megabytes}" in receiver
        }
        for megabytes in sizes
    }


# ---------------------------------------------------------------------- deltas (GRPO)


def rollout(
    model: Any,  # a transformers causal LM: mypy cannot see its generate()
    tokenizer: Any,
    items: list[TaskItem],
    reward_fn: str,
    version: int,
    batch_index: int,
) -> TrainBatch:
    """A GRPO batch as the engines and agents would make it: SAMPLES_PER_PROMPT
    completions per prompt sampled at temperature 1 by the policy of ``version``, with
    their behaviour logprobs and the task's reward."""
    reward = get_reward(reward_fn)
    stop = tokenizer.convert_tokens_to_ids(IM_END)
    groups = []
    model.eval()
    with torch.no_grad():
        for item in items:
            prompt = tokenizer.apply_chat_template(
                list(item.messages), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompt_ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=MAX_NEW_TOKENS,
                num_return_sequences=SAMPLES_PER_PROMPT,
                eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
            )
            samples = []
            for row, new_ids in enumerate(generated[:, len(prompt) :].tolist()):
                # the engine stops at the stop token; generate pads the rows after it
                completion = new_ids[: new_ids.index(stop) + 1] if stop in new_ids else new_ids
                ids = prompt + completion
                logits = model(input_ids=torch.tensor([ids])).logits
                logprobs = token_logprobs(logits[:, :-1], torch.tensor([ids[1:]]), 1.0)
                text = tokenizer.decode(completion, skip_special_tokens=True)
                samples.append(
                    TrainSample(
                        session_id=f"b{batch_index}-{item.task_id}-{row}",
                        token_ids=ids,
                        loss_mask=[0] * len(prompt) + [1] * len(completion),
                        behaviour_logprobs=[0.0] * len(prompt)
                        + logprobs[0, len(prompt) - 1 :].tolist(),
                        versions=[-1] * len(prompt) + [version] * len(completion),
                        reward=reward(text, item.reference),
                    )
                )
            group_id = f"b{batch_index}-{item.task_id}"
            groups.append(SampleGroup(group_id=group_id, task_id=item.task_id, samples=samples))
    model.train()
    return TrainBatch(batch_index=batch_index, groups=groups)


def changed_words(before: torch.Tensor, after: torch.Tensor, word_bytes: int) -> int:
    """Words of two flat states (uint8) that differ bit for bit."""
    return int((before.view(WORD_VIEWS[word_bytes]) != after.view(WORD_VIEWS[word_bytes])).sum())


class DeltaChannel:
    """Trainer -> engine in one dtype: a publisher with deltas, a receiver that applies
    and verifies every version, and what each version cost."""

    def __init__(self, store: SharedMemoryPayloads, dtype: torch.dtype, bucket_bytes: int):
        encoder = WeightEncoder(bucket_bytes, deltas=True, full_every=DELTA_FULL_EVERY)
        self.dtype = dtype
        self.publisher = WeightPublisher(store, encoder, keep_chains=1, dtype=dtype)
        self.receiver = WeightReceiver({store.name: store})

    async def publish(self, version: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        held = self.receiver.mirror.flat
        before = held.clone() if held is not None else None
        manifest = await self.publisher.publish(version, state)
        await self.receiver.follow([manifest])
        after = self.receiver.mirror.flat
        assert after is not None and self.receiver.mirror.version == version
        # the model's words: the flat state's alignment gaps never change
        words = sum(torch.Size(spec.shape).numel() for spec in manifest.layout)
        changed = changed_words(before, after, self.dtype.itemsize) if before is not None else words
        return {
            "version": version,
            "kind": manifest.kind,
            "positions": manifest.delta.positions if manifest.delta else "",
            "payload_bytes": manifest.payload_bytes,
            "state_bytes": manifest.state_bytes,
            "changed_words": changed,
            "changed_fraction": changed / words,
        }


async def delta_run(
    model_dir: Path, lr: float, steps: int, bucket_bytes: int, shm_dir: Path
) -> dict[str, Any]:
    transformers_logging.disable_progress_bar()  # keeps the tables readable
    settings = TrainerSettings(lr=lr)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    # built as sf_trainer.learner.Learner builds it
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )
    source = get_task_source(TASK, seed=SEED)
    items = source.items("train")
    store = SharedMemoryPayloads("delta" + uuid.uuid4().hex[:8], shm_dir)
    channels = {
        "float32": DeltaChannel(store, torch.float32, bucket_bytes),
        "bfloat16": DeltaChannel(store, torch.bfloat16, bucket_bytes),
    }
    try:
        for channel in channels.values():
            await channel.publish(1, model.state_dict())  # the base model, in full
        records = []
        for step in range(1, steps + 1):
            version = step  # the policy that samples this step's batch
            prompts = items[(step - 1) * PROMPTS_PER_STEP : step * PROMPTS_PER_STEP]
            batch = rollout(model, tokenizer, prompts, source.reward_fn, version, step)
            result = train_step(model, optimizer, batch, settings, version)
            with_signal = sum(len({s.reward for s in group.samples}) > 1 for group in batch.groups)
            record: dict[str, Any] = {
                "step": step,
                "mean_reward": round(result.mean_reward, 4),
                "groups_with_signal": with_signal,
                "groups": len(batch.groups),
                "grad_norm": round(result.grad_norm, 4),
            }
            for name, channel in channels.items():
                record[name] = await channel.publish(version + 1, model.state_dict())
            records.append(record)
    finally:
        for channel in channels.values():
            await channel.publisher.close()
    saved = {}
    for name in channels:
        sent = sum(r[name]["payload_bytes"] for r in records)
        full = sum(r[name]["state_bytes"] for r in records)
        saved[name] = {
            "payload_bytes": sent,
            "state_bytes": full,
            "saved_bytes": full - sent,
            "saved_fraction": (full - sent) / full,
        }
    return {
        "lr": lr,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": records,
        "saved": saved,
    }


# ------------------------------------------------------------------------------ report


def transport_figures(trials: list[Trial], nbytes: int, bound_seconds: float) -> dict[str, Any]:
    best = min(trials, key=lambda trial: trial.total)
    move = best.put + best.fetch
    return {
        "seconds": round(best.total, 4),
        "MBps": round(nbytes / best.total / MB, 1),
        "parts_seconds": {name: round(value, 4) for name, value in asdict(best).items()},
        "sync_to_bound": round(bound_seconds / best.total, 4),
        "move_to_bound": round(bound_seconds / move, 4),
        "trial_seconds": [round(trial.total, 4) for trial in trials],
    }


def print_transports(sizes: list[dict[str, Any]], bucket_bytes: int, repeats: int) -> None:
    print(
        f"\nOne full version, trainer -> one engine (bf16 state, {bucket_bytes / 2**20:g} MiB "
        f"buckets, best of {repeats}; MB = 10^6 bytes; collective: put = the broadcast)"
    )
    header = (
        f"{'size MB':>8} {'transport':<11}{'sync s':>8}{'MB/s':>8}{'encode':>8}{'put':>8}"
        f"{'fetch':>8}{'apply':>8}  {'bound':<13}{'MB/s':>8}{'sync/bd':>9}{'move/bd':>9}"
    )
    print(header)
    for size in sizes:
        for name, figures in size["transports"].items():
            parts = figures["parts_seconds"]
            bound = TRANSPORT_BOUNDS[name]
            print(
                f"{size['state_bytes'] / MB:>8.0f} {name:<11}{figures['seconds']:>8.3f}"
                f"{figures['MBps']:>8.0f}{parts['encode']:>8.3f}{parts['put']:>8.3f}"
                f"{parts['fetch']:>8.3f}{parts['apply']:>8.3f}  {bound:<13}"
                f"{size['bounds'][bound]['MBps']:>8.0f}{figures['sync_to_bound']:>9.3f}"
                f"{figures['move_to_bound']:>9.3f}"
            )
    print(f"\nBounds (best of {repeats}), MB/s")
    print(f"{'size MB':>8}{'memcpy':>10}{'loopback TCP':>14}{'xxh3-128':>10}{'sha256':>10}")
    for size in sizes:
        bounds = size["bounds"]
        print(
            f"{size['state_bytes'] / MB:>8.0f}{bounds['memcpy']['MBps']:>10.0f}"
            f"{bounds['loopback_tcp']['MBps']:>14.0f}{bounds['xxh3_128']['MBps']:>10.0f}"
            f"{bounds['sha256']['MBps']:>10.0f}"
        )


def print_deltas(deltas: dict[str, Any]) -> None:
    print(
        f"\nDeltas on real GRPO steps of the built-in model ({deltas['parameters']:,} "
        f"parameters; {deltas['prompts_per_step']} prompts x {deltas['samples_per_prompt']} "
        f"samples per step; rewards: {deltas['rewards']}; signal: groups whose rewards "
        "differ)"
    )
    for run in deltas["runs"]:
        print(f"lr {run['lr']:g}")
        print(
            f"{'step':>5}{'reward':>8}{'signal':>8}  "
            f"{'fp32 payload/state':>24}{'changed':>9} {'sent as':<14}"
            f"{'bf16 payload/state':>24}{'changed':>9} {'sent as':<14}"
        )
        for record in run["steps"]:
            cells = []
            for name in ("float32", "bfloat16"):
                version = record[name]
                sent_as = version["kind"] + (
                    f" {version['positions']}" if version["positions"] else ""
                )
                cells.append(
                    f"{version['payload_bytes']:>11,}/{version['state_bytes']:<12,}"
                    f"{version['changed_fraction']:>9.2%} {sent_as:<14}"
                )
            signal = f"{record['groups_with_signal']}/{record['groups']}"
            print(f"{record['step']:>5}{record['mean_reward']:>8.3f}{signal:>8}  " + "".join(cells))
        for name, saved in run["saved"].items():
            print(
                f"  {name}: {saved['payload_bytes']:,} of {saved['state_bytes']:,} bytes sent "
                f"over {len(run['steps'])} steps, {saved['saved_bytes']:,} saved "
                f"({saved['saved_fraction']:.1%})"
            )


# -------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="state sizes in MB (default 10,100,1000)")
    parser.add_argument("--repeats", type=int, default=3, help="trials per figure (the best)")
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per lr (default 10; 0: no delta runs)"
    )
    parser.add_argument("--lrs", default="1e-4,1e-6", help="learning rates of the delta runs")
    parser.add_argument("--quick", action="store_true", help="sizes 10,100 and 3 steps")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=WeightTransferSettings().bucket_mb,
        help="transfer bucket in MiB (default: the weight-transfer setting's)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="default: the built-in model, built once under $SF_CACHE_DIR",
    )
    parser.add_argument("--json", type=Path, default=Path("runs/bench/weight_sync.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ("10,100" if args.quick else "10,100,1000")).split(",")]
    steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    lrs = [float(lr) for lr in args.lrs.split(",")]
    bucket_bytes = WeightTransferSettings(bucket_mb=args.bucket_mb).bucket_bytes
    torch.set_num_threads(1)
    started = time.perf_counter()

    # first, while this process holds no large buffer: two more processes hold a state each
    collective_trials = measure_collective(sizes, bucket_bytes, args.repeats)
    size_reports = []
    with (
        tempfile.TemporaryDirectory(prefix="sf-weight-bench-") as nats_dir,
        tempfile.TemporaryDirectory(prefix="sf-weight-bench-", dir="/dev/shm") as shm_dir,
        EmbeddedNats(Path(nats_dir)) as server,
    ):
        for megabytes in sizes:
            state = synthetic_state(megabytes, seed=megabytes)
            nbytes = state_bytes(state)
            bound_seconds = measure_bounds(nbytes, args.repeats)
            trials = asyncio.run(
                measure_pull_stores(state, server.url, Path(shm_dir), bucket_bytes, args.repeats)
            )
            trials.update(collective_trials[megabytes])
            del state
            gc.collect()
            size_reports.append(
                {
                    "megabytes": megabytes,
                    "state_bytes": nbytes,
                    "bounds": {
                        name: {"seconds": round(spent, 4), "MBps": round(nbytes / spent / MB, 1)}
                        for name, spent in bound_seconds.items()
                    },
                    "transports": {
                        name: transport_figures(
                            trials[name], nbytes, bound_seconds[TRANSPORT_BOUNDS[name]]
                        )
                        for name in TRANSPORT_BOUNDS
                        if name in trials
                    },
                }
            )
        print_transports(size_reports, bucket_bytes, args.repeats)

        cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
        model_dir = args.model_dir or ensure_base_model(cache / "models" / "base-arithmetic")
        runs = [
            asyncio.run(delta_run(model_dir, lr, steps, bucket_bytes, Path(shm_dir)))
            for lr in (lrs if steps > 0 else [])  # --steps 0: the transports alone
        ]
    deltas: dict[str, Any] | None = None
    if runs:
        deltas = {
            "parameters": runs[0]["parameters"],
            "prompts_per_step": PROMPTS_PER_STEP,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "rewards": f"the task's reward function ({get_task_source(TASK).reward_fn}) "
            "on completions sampled by the policy",
            "runs": runs,
        }
        print_deltas(deltas)

    seconds = time.perf_counter() - started
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": {
            "bucket_bytes": bucket_bytes,
            "repeats": args.repeats,
            "state_tensors": STATE_TENSORS,
            "state_dtype": "bfloat16",
            "torch_threads": 1,
        },
        "sizes": size_reports,
        "deltas": deltas,
        "seconds": round(seconds, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{seconds:.0f} s in all; figures in {args.json}")


if __name__ == "__main__":
    main()
