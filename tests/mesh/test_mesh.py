"""The whole mesh, every service its own OS process, for a few real training steps.

The engine workers run in audit mode (``SF_ENGINE_TRACE_TOKEN_IDS``): each generation's
span carries the ids the engine consumed and produced, so invariant 1
(docs/architecture.md) is checked against the engines' own record, not against the gateway's.

(A broker wiretap on the generate subject would not do: a plain subscriber there
silences NATS's no-responders signal and requests sent before an engine joins would
go to the tap alone.)
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seamlessflow.batches import stored_batches
from seamlessflow.bus import connect
from seamlessflow.protocol import BatchFilterReport, Subjects, decode
from sf_app.run.config import RunConfig
from sf_app.run.embedded import EmbeddedRun

pytestmark = pytest.mark.slow

STEPS = 3


async def test_full_mesh_trains_and_every_trained_token_came_from_an_engine(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SF_ENGINE_TRACE_TOKEN_IDS", "true")
    subjects = Subjects(run_id)
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
        live=False,
    )
    run = EmbeddedRun(config)
    summary = await run.run()

    # what the trainer consumed, read back from the durable batch stream
    tap = await nats.connect(nats_url)
    js = tap.jetstream()
    reader = await connect(nats_url, subjects, name="test")
    try:
        batches = await stored_batches(reader)
    finally:
        await reader.drain()
    drops = await js.subscribe(subjects.data_batch_report(), ordered_consumer=True)
    reports = []
    with contextlib.suppress(nats.errors.TimeoutError):
        while True:
            reports.append(decode((await drops.next_msg(timeout=1)).data, BatchFilterReport))
    await tap.drain()

    assert summary.status == "finished", summary.status
    assert summary.steps == STEPS and summary.final_version == STEPS
    assert len(batches) >= STEPS

    run_dir = tmp_path / run_id
    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    # every process's resident memory was sampled while the run went on (Linux's /proc)
    memory = json.loads((run_dir / "summary.json").read_text())["process_memory"]
    if sys.platform == "linux":
        assert {"trainer", "trajectory", "weight-sync", "engine-0"} <= set(memory), memory
        assert all(f["samples"] >= 1 and f["peak_rss_bytes"] > 0 for f in memory.values())
        assert memory["trainer"]["peak_rss_bytes"] > 100 << 20, memory  # torch and a model
        # the engine and the trainer tuned glibc's heap before building their models
        for name, setting in (("engine-0", "ENGINE"), ("trainer", "TRAINER")):
            line = f"glibc heap: fixed mmap threshold, one arena (SF_{setting}_COMPACT_HEAP)"
            assert line in (run_dir / "logs" / f"{name}.log").read_text(), name
    # Identical (prompt, completion) pairs can come from several engine calls, whose
    # logprobs differ in the last bits with the batch they were computed in, so every
    # call is kept and a trained sample must match one of them exactly.
    engine_io: dict[tuple[tuple[int, ...], tuple[int, ...]], list[dict]] = {}
    for attributes in (s["attributes"] for s in spans if s["name"] == "engine.generate"):
        key = (tuple(attributes["prompt_ids"]), tuple(attributes["completion_ids"]))
        engine_io.setdefault(key, []).append(attributes)
    trained_samples = [s for b in batches[:STEPS] for g in b.groups for s in g.samples]
    # no sample is lost on a healthy run, however slow (else: the reasons)
    dropped = [(r.batch_index, r.samples_dropped, r.groups_dropped) for r in reports]
    assert len(trained_samples) == STEPS * 2 * 4, dropped
    for sample in trained_samples:
        start = sample.loss_mask.index(1)
        end = len(sample.loss_mask) - sample.loss_mask[::-1].index(1)
        assert all(sample.loss_mask[start:end])
        key = (tuple(sample.token_ids[:start]), tuple(sample.token_ids[start:end]))
        calls = engine_io.get(key, [])
        assert calls, "a trained sample does not match any engine call"
        matching = [
            call
            for call in calls
            if sample.behaviour_logprobs[start:end] == pytest.approx(call["logprobs"])
            and sample.versions[start:end] == list(call["versions"])
        ]
        assert matching, "a trained sample's logprobs or versions match no engine call"
        assert max(matching[0]["versions"]) <= STEPS

    # the agents' samples are spans too, each the root of its engine calls' trace
    samples = {s["span_id"]: s for s in spans if s["name"] == "agent.sample"}
    assert len(samples) >= STEPS * 2 * 4
    assert {s["attributes"]["outcome"] for s in samples.values()} == {"completed"}
    by_id = {s["span_id"]: s for s in spans}

    def root(span: dict) -> dict:  # type: ignore[type-arg]
        while span.get("parent_id") in by_id:
            span = by_id[span["parent_id"]]
        return span

    generates = [s for s in spans if s["name"] == "engine.generate"]
    assert generates and all(root(s)["name"] == "agent.sample" for s in generates)

    written = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "run_id",
        "steps",
        "reward_first",
        "reward_last",
        "tokens_generated",
        "tokens_trained",
        "wall_s",
        "final_version",
    ):
        assert key in written
    assert written["tokens_trained"] == sum(sum(s.loss_mask) for s in trained_samples)
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in metrics] == list(range(1, STEPS + 1))
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert 0 <= written["bubble_ratio"] < 1 and (run_dir / "timeline.html").exists()

    # The final checkpoint loads with from_pretrained. GRPO learns only from groups whose
    # rewards differ (zero advantages give exactly zero gradients, and AdamW without
    # weight decay then moves nothing), so the model changed iff some group had a signal.
    checkpoint = run_dir / "checkpoints" / "final"
    trained = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    base = AutoModelForCausalLM.from_pretrained(str(base_model_dir))
    AutoTokenizer.from_pretrained(str(checkpoint))
    changed = any(
        not torch.equal(a, b) for a, b in zip(trained.parameters(), base.parameters(), strict=True)
    )
    had_signal = any(
        len({s.reward for s in g.samples}) > 1 for b in batches[:STEPS] for g in b.groups
    )
    assert changed == had_signal, (changed, had_signal)

    # spans from several processes, and one trace crossing gateway -> engine over NATS
    services = {s["service"] for s in spans}
    assert {"gateway", "engine", "trainer", "trajectory"} <= services
    by_id = {s["span_id"]: s for s in spans}
    crossing = [
        s
        for s in spans
        if s["name"] == "engine.generate"
        and s["parent_id"] in by_id
        and by_id[s["parent_id"]]["service"] == "gateway"
    ]
    assert crossing, "engine spans must be children of the gateway's request spans"
