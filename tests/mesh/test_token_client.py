"""A client of vLLM's token API trains without retokenizing: the built-in ``token_ids``
agent tokenizes its task once, then sends and receives only ids (a completion whose
prompt is ids, ``return_token_ids``), and every trained sample is exactly the ids that
client sent and got back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus
from seamlessflow.protocol import SessionFinished
from tests.support import recorded_turns, small_embedded_run, trajectory_events

pytestmark = pytest.mark.slow

STEPS = 2


async def test_a_token_api_client_trains_on_exactly_the_ids_it_exchanged(
    nats_url: str, run_id: str, base_model_dir: Path, tmp_path: Path, bus: Bus
) -> None:
    run = small_embedded_run(
        run_id, tmp_path, base_model_dir, STEPS, nats_url=nats_url, agent="token_ids"
    )
    summary = await asyncio.wait_for(run.run(), 600)
    assert summary.status == "finished", summary.status
    assert summary.steps == STEPS and summary.tokens_trained > 0

    turns = await recorded_turns(bus)
    finished = [e for e in await trajectory_events(bus) if isinstance(e, SessionFinished)]
    assert turns and finished
    # the agent raises if an answer lacks the ids it asked for, failing its session
    assert all(not f.failure for f in finished), [f.failure for f in finished]
    agents_log = "".join(p.read_text() for p in (tmp_path / run_id / "logs").glob("agent*.log"))
    assert "agent failed" not in agents_log and "lacks the ids" not in agents_log
    exchanged = {(tuple(t.prompt_ids), tuple(t.completion_ids)) for t in turns}
    samples = [s for b in await stored_batches(bus) for g in b.groups for s in g.samples]
    assert len(samples) >= STEPS * 2 * 4  # two groups of four a step
    for sample in samples:
        start = sample.loss_mask.index(1)
        end = start + sum(sample.loss_mask)
        key = (tuple(sample.token_ids[:start]), tuple(sample.token_ids[start:end]))
        assert key in exchanged, "a trained sample holds ids the client never exchanged"
