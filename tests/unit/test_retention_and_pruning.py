"""Bounded storage without a broker: the retention settings refuse to drop batches before
the events of their sessions, and a publisher whose deletion of old payloads fails (the
broker away) fails no version and deletes them at the next publish. The streams' limits
and the weights store on a real nats-server are tests/service/test_bounded_storage.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamlessflow.protocol import WeightManifest
from seamlessflow.settings import RetentionSettings
from seamlessflow.weights import (
    PayloadMissing,
    SharedMemoryPayloads,
    WeightEncoder,
    WeightPublisher,
)
from tests.support.weight_states import one_tensor_state


def test_batches_may_not_be_dropped_before_the_events_of_their_sessions() -> None:
    with pytest.raises(ValueError, match="BATCHES_MAX_AGE_H"):
        RetentionSettings(trajectory_max_age_h=48, batches_max_age_h=24)
    with pytest.raises(ValueError, match="BATCHES_MAX_AGE_H"):
        RetentionSettings(trajectory_max_age_h=0, batches_max_age_h=24)
    with pytest.raises(ValueError, match="0 \\(none\\) or positive"):
        RetentionSettings(metrics_max_gb=-1)


async def test_a_broker_away_while_old_payloads_are_deleted_fails_no_version(
    tmp_path: Path,
) -> None:
    """Deleting old payloads is housekeeping: a broker error then (a NATS restart) is
    logged and the deletion is retried at the next publish; the new version stands."""

    class BrokerAwayOnce(SharedMemoryPayloads):
        failures = 1

        async def delete(self, manifest: WeightManifest) -> None:
            if self.failures:
                self.failures -= 1
                raise TimeoutError("the broker restarts")
            await super().delete(manifest)

    store = BrokerAwayOnce("away", tmp_path)
    publisher = WeightPublisher(store, WeightEncoder(bucket_bytes=1 << 20), keep_chains=1)
    first, second = [await publisher.publish(v, one_tensor_state(v)) for v in (1, 2)]
    assert len(await store.fetch(first)) == first.payload_bytes  # its delete failed
    assert len(await store.fetch(second)) == second.payload_bytes
    third = await publisher.publish(3, one_tensor_state(3))
    for pruned in (first, second):
        with pytest.raises(PayloadMissing):
            await store.fetch(pruned)
    assert len(await store.fetch(third)) == third.payload_bytes
