"""Batch transport: how a TrainBatch of real size gets from the trajectory service to
the trainer, each way measured on a real nats-server.

Batches (``--shapes``, samples x tokens): each sample a third prompt and the rest
completion, token ids of a 150k vocabulary, behaviour logprobs float32 values (what
engines compute), versions small ints. Ways:

- ``json whole``: one JSON message (``protocol.encode``, what was published before
  ``seamlessflow.batches``); NATS refuses it above ``max_payload`` (1 MiB by
  default), so it is timed on a second server whose ``max_payload`` is raised to 64 MiB
  (the server's maximum; not a setting the project uses);
- ``msgpack whole``: msgspec MessagePack of the same struct (floats as float64), one
  message, on the raised server too;
- ``packed whole``: ``batches.encode_batch`` (numbers as narrow exact arrays), one
  message, on the raised server;
- ``packed chunks``: ``batches.publish_batch`` / ``fetch_batch`` on a default server:
  chunks of the payload stream, then a ``BatchReady`` through the durable consumer
  (what the trajectory service and the trainer do).

Per way: bytes per token, encode and decode time (best of ``--repeats``) and the
publish -> consume latency: from the publisher's first byte (encoding included) to the
decoded TrainBatch in a consumer that was already waiting on a pull subscription.

    .venv/bin/python loadtests/batch_transport.py [--shapes 64x4096,64x16384,1x16384]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import numpy as np
from nats.js.api import ConsumerConfig, DeliverPolicy

from seamlessflow import batches
from seamlessflow.bus import Bus, connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import (
    BatchReady,
    SampleGroup,
    Subjects,
    TrainBatch,
    TrainSample,
    decode,
    encode,
)

RAISED_MAX_PAYLOAD = 64 * 1024 * 1024


def make_batch(samples: int, tokens: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    group_size = min(samples, 8)
    groups = []
    for g in range(samples // group_size):
        members = []
        for s in range(group_size):
            prompt = tokens // 3
            completion = tokens - prompt
            members.append(
                TrainSample(
                    session_id=f"g{g}-s{s}",
                    token_ids=rng.integers(0, 151_000, tokens).tolist(),
                    loss_mask=[0] * prompt + [1] * completion,
                    behaviour_logprobs=[0.0] * prompt
                    + (-rng.exponential(1.0, completion)).astype(np.float32).tolist(),
                    versions=[-1] * prompt + [7] * completion,
                    reward=float(s % 2),
                )
            )
        groups.append(SampleGroup(group_id=f"g{g}", task_id="t", samples=members))
    return TrainBatch(batch_index=0, groups=groups)


def best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


_msgpack = msgspec.msgpack.Encoder()


WHOLE = {
    "json whole": (encode, lambda data: decode(data, TrainBatch)),
    "msgpack whole": (_msgpack.encode, lambda data: msgspec.msgpack.decode(data, type=TrainBatch)),
    "packed whole": (batches.encode_batch, batches.decode_batch),
}


async def latency_whole(bus: Bus, batch: TrainBatch, encode_fn, decode_fn, n: int) -> float:  # type: ignore[no-untyped-def]
    """Publish -> decoded in a waiting consumer, one message on a stream of its own."""
    stream, subject = f"BENCH_{n}", f"bench.whole.{n}"
    await bus.js.add_stream(name=stream, subjects=[subject])
    sub = await bus.js.pull_subscribe(subject, durable=f"c{n}", stream=stream)
    started = time.perf_counter()

    async def consume() -> TrainBatch:
        [msg] = await sub.fetch(1, timeout=60)
        got = decode_fn(msg.data)
        await msg.ack()
        return got  # type: ignore[no-any-return]

    consumer = asyncio.create_task(consume())
    await bus.js.publish(subject, encode_fn(batch))
    got = await consumer
    elapsed = time.perf_counter() - started
    assert got == batch
    await sub.unsubscribe()
    await bus.js.delete_stream(stream)
    return elapsed


async def latency_chunks(bus: Bus, batch: TrainBatch, n: int) -> tuple[float, BatchReady]:
    """Publish -> decoded through the project's path (payload chunks + BatchReady)."""
    batch = msgspec.structs.replace(batch, batch_index=n)
    s = bus.subjects
    sub = await bus.js.pull_subscribe(
        s.batch_ready(),
        durable=f"c{n}",
        stream=s.stream_batches(),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
    )
    started = time.perf_counter()

    async def consume() -> TrainBatch:
        [msg] = await sub.fetch(1, timeout=60)
        got = await batches.fetch_batch(bus, decode(msg.data, BatchReady))
        await msg.ack()
        return got

    consumer = asyncio.create_task(consume())
    ready = await batches.publish_batch(bus, batch)
    got = await consumer
    elapsed = time.perf_counter() - started
    assert got == batch
    await sub.unsubscribe()
    await bus.js.delete_consumer(s.stream_batches(), f"c{n}")
    return elapsed, ready


async def bench(shapes: list[tuple[int, int]], repeats: int, workdir: Path) -> list[dict[str, Any]]:
    raised_conf = workdir / "raised.conf"
    raised_conf.write_text(f"max_payload: {RAISED_MAX_PAYLOAD}\n")
    rows: list[dict[str, Any]] = []
    with (
        EmbeddedNats(workdir / "default") as default_server,
        EmbeddedNats(workdir / "raised", extra_args=["-c", str(raised_conf)]) as raised_server,
    ):
        subjects = Subjects("bench")
        default_bus = await connect(default_server.url, subjects, name="bench")
        raised_bus = await connect(raised_server.url, subjects, name="bench")
        await default_bus.ensure_streams()
        counter = 0
        try:
            for samples, tokens in shapes:
                batch = make_batch(samples, tokens)
                n_tokens = samples * tokens
                for way, (encode_fn, decode_fn) in WHOLE.items():
                    enc_s, data = best(lambda: encode_fn(batch), repeats)  # noqa: B023
                    dec_s, _ = best(lambda: decode_fn(data), repeats)  # noqa: B023
                    lat = []
                    if len(data) < RAISED_MAX_PAYLOAD - 64 * 1024:
                        for _ in range(repeats):
                            counter += 1
                            try:
                                elapsed = await latency_whole(
                                    raised_bus, batch, encode_fn, decode_fn, counter
                                )
                            except nats.js.errors.ServerError:
                                # seen once in a full suite on a shared machine ("error
                                # creating store for stream", a fresh server): say what the
                                # server said, then measure on a new stream once more
                                log_tail(workdir / "raised" / "nats-server.log")
                                counter += 1
                                elapsed = await latency_whole(
                                    raised_bus, batch, encode_fn, decode_fn, counter
                                )
                            lat.append(elapsed)
                    rows.append(
                        {
                            "shape": f"{samples}x{tokens}",
                            "way": way,
                            "bytes_per_token": len(data) / n_tokens,
                            "payload_mb": len(data) / 1e6,
                            "fits_default_max_payload": len(data) <= default_bus.nc.max_payload,
                            "encode_s": enc_s,
                            "decode_s": dec_s,
                            "latency_s": min(lat) if lat else None,
                        }
                    )
                lat, ready = [], None
                for _ in range(repeats):
                    counter += 1
                    elapsed, ready = await latency_chunks(default_bus, batch, counter)
                    lat.append(elapsed)
                assert ready is not None
                packed = next(r for r in rows[::-1] if r["way"] == "packed whole")
                rows.append(
                    {
                        "shape": f"{samples}x{tokens}",
                        "way": "packed chunks",
                        "bytes_per_token": ready.payload.payload_bytes / n_tokens,
                        "payload_mb": ready.payload.payload_bytes / 1e6,
                        "chunks": len(ready.payload.chunk_seqs),
                        "ready_bytes": len(encode(ready)),
                        "fits_default_max_payload": True,
                        "encode_s": packed["encode_s"],
                        "decode_s": packed["decode_s"],
                        "latency_s": min(lat),
                    }
                )
        finally:
            await default_bus.drain()
            await raised_bus.drain()
    return rows


def log_tail(path: Path, lines: int = 20) -> None:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        tail = [f"(no server log: {exc})"]
    print(f"nats-server refused a stream; the end of {path}:", *tail, sep="\n", file=sys.stderr)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'shape':>9} {'way':>14} {'B/token':>8} {'MB':>7} {'1 MiB?':>6} "
          f"{'encode s':>9} {'decode s':>9} {'pub->use s':>10}")  # fmt: skip
    for r in rows:
        latency = "refused" if r["latency_s"] is None else f"{r['latency_s']:.3f}"
        print(
            f"{r['shape']:>9} {r['way']:>14} {r['bytes_per_token']:8.2f} {r['payload_mb']:7.2f} "
            f"{'yes' if r['fits_default_max_payload'] else 'no':>6} {r['encode_s']:9.3f} "
            f"{r['decode_s']:9.3f} {latency:>10}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x4096,64x16384,1x16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    with tempfile.TemporaryDirectory(prefix="sf-batch-bench-") as tmp:
        rows = asyncio.run(bench(shapes, args.repeats, Path(tmp)))  # type: ignore[arg-type]
    print_table(rows)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {peak_mb:.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
