"""The protocol on a real nats-server: every stream of two policies of a run is created
side by side (their subjects are disjoint), and each captures only its own policy's
messages."""

from seamlessflow import protocol as p
from seamlessflow.batches import publish_batch


async def test_two_policies_streams_coexist_and_capture_only_their_own(
    nats_url: str, run_id: str
) -> None:
    """NATS refuses streams with overlapping subjects: creating every stream of two
    policies proves they are disjoint, and a batch lands in its own policy's stream."""
    from seamlessflow.bus import connect

    bus = await connect(nats_url, p.Subjects(run_id, "solver"), name="test")
    try:
        await bus.ensure_streams(["solver", "verifier"])
        verifier = bus.subjects.for_policy("verifier")
        batch = p.TrainBatch(batch_index=0, groups=[], policy="verifier")
        await publish_batch(bus, batch)
        for stream in ("stream_batches", "stream_batch_payloads"):
            assert (await bus.js.stream_info(getattr(verifier, stream)())).state.messages == 1
            assert (await bus.js.stream_info(getattr(bus.subjects, stream)())).state.messages == 0
        metrics = p.TrainStepMetrics(
            policy="verifier", step=1, version=1, batch_index=0, mean_reward=0.0, loss=0.0,
            clip_fraction=0.0, samples=0, tokens_generated=0, tokens_trained=0,
            max_staleness=0, step_seconds=0.0, wait_seconds=0.0, publish_seconds=0.0,
        )  # fmt: skip
        await bus.js_publish(verifier.train_metrics(), metrics)
        info = await bus.js.stream_info(bus.subjects.stream_metrics())
        assert info.state.messages == 1  # the run's one metrics stream holds every policy's
    finally:
        await bus.drain()
