"""The push group in a whole mesh (every service its own process): the trainer
broadcasts each version over gloo to the engine, payloads also sit in shared memory for
pulls, and they travel as bf16 (full, then deltas)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sf_app.run.config import RunConfig
from sf_app.run.embedded import EmbeddedRun
from tests.support import free_port

pytestmark = pytest.mark.slow

STEPS = 3


async def test_engines_get_each_version_by_push_and_shared_memory_is_cleaned_up(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    for name, value in {
        "SF_WEIGHTS_GROUP_BACKEND": "gloo",
        "SF_WEIGHTS_GROUP_ADDRESS": f"127.0.0.1:{free_port()}",
        "SF_WEIGHTS_TRANSPORT": "shm",
        "SF_WEIGHTS_SHM_DIR": str(shm_dir),
        "SF_WEIGHTS_DTYPE": "bfloat16",
        "SF_LR": "1e-6",
    }.items():
        monkeypatch.setenv(name, value)
    config = RunConfig(
        run_id=run_id,
        runs_dir=tmp_path,
        model_dir=base_model_dir,
        nats_url=nats_url,
        steps=STEPS,
        group_size=4,
        groups_per_batch=2,
        engines=1,
        agent_concurrency=8,
        engine_batch_size=8,
        lr=1e-6,
        live=False,
    )
    summary = await EmbeddedRun(config).run()
    assert summary.status == "finished", summary.status

    run_dir = tmp_path / run_id
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    for version in range(1, STEPS + 1):
        assert f"loaded version {version} (" in engine_log
    pushed = [line for line in engine_log.splitlines() if "pushed)" in line]
    assert pushed, "no version arrived by push"
    # one host, one directory: the buckets went through the shared-memory ring, which
    # the trainer unlinked once mapped (the directory is empty below)
    assert "joined the gloo push group as rank 1 (buckets through shared memory)" in engine_log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["weights_kind"] == "full"
    assert metrics[0]["weights_payload_bytes"] == metrics[0]["weights_state_bytes"] > 0
    # at lr 1e-6 few bf16 words change (often none: the fp32 master weights move, the
    # bf16 words they round to do not yet), so every later version is a small delta
    for step in metrics[1:]:
        assert step["weights_kind"] == "delta"
        assert step["weights_payload_bytes"] < step["weights_state_bytes"] / 10
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["weights_bytes_sent"] == sum(m["weights_payload_bytes"] for m in metrics)
    assert written["weights_bytes_sent"] < written["weights_bytes_full"]
    assert os.listdir(shm_dir) == []  # shared memory is RAM: the trainer removed its payloads
