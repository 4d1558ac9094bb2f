"""Read back a W&B run's transaction log (``run-<id>.wandb``), what an offline run
writes and ``wandb sync`` uploads, so tests can check what was logged.

The format is a LevelDB-style log: a 7-byte file header (``:W&B``, magic 0xBEE1,
version 0), then 32 KiB blocks of records, each with a 7-byte header (checksum,
little-endian length, type: 1 whole, 2 first, 3 middle, 4 last fragment); a block's
tail shorter than a header is zero padding. Each record is a protobuf ``Record``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    payloads: list[bytes] = []
    pending = b""
    offset = HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # padding up to the next block
            offset += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        body = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:
            break  # the unwritten end of the last block
        if kind == WHOLE:
            payloads.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            payloads.append(pending + body)
            pending = b""
    parsed = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        parsed.append(record)
    return parsed


def logged(run_dir: Path) -> dict[str, Any]:
    """``history`` (one dict per logged row), ``summary`` and ``config`` (key -> value
    as JSON text) of the one offline run under ``run_dir``."""
    import json

    [log_file] = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for record in records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            for item in record.run.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"history": history, "summary": summary, "config": config}
