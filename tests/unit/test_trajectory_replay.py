"""The trajectory service's recovery (``sf_trajectory.replay``) on plain data: what its
streams hold in, its state out, with no broker."""

from seamlessflow.protocol import (
    BatchFilterReport,
    BatchPayload,
    BatchReady,
    GroupClosed,
    GroupSummary,
    SampleSummary,
    SessionFinished,
    SessionOpened,
    Subjects,
    TrainingPlanned,
    TrainStepMetrics,
)
from seamlessflow.rewards import RewardFn
from sf_trajectory.data_filters import DataFilters
from sf_trajectory.group_ids import group_id, group_index
from sf_trajectory.grouping import Grouper
from sf_trajectory.policy_line import PolicyLine
from sf_trajectory.replay import GroupReplay, StoredLine, restore_line


def no_rewards(name: str) -> RewardFn:
    raise KeyError(name)


def fresh_line() -> PolicyLine:
    return PolicyLine(Subjects("run"), Grouper(no_rewards, filters=DataFilters([])))


def announced(batch_index: int, groups: dict[str, list[str]]) -> BatchReady:
    return BatchReady(
        batch_index=batch_index,
        groups=[
            GroupSummary(
                group_id=group,
                task_id="t-" + group,
                samples=[SampleSummary(session_id=s, reward=1.0, tokens=3) for s in sessions],
            )
            for group, sessions in groups.items()
        ],
        payload=BatchPayload(encoding="packed-msgpack-1", chunk_seqs=[], payload_bytes=0,
                             sha256=""),
    )  # fmt: skip


def metrics(batch_index: int, version: int) -> TrainStepMetrics:
    return TrainStepMetrics(
        step=version, version=version, batch_index=batch_index, mean_reward=0.5, loss=0.1,
        clip_fraction=0.0, samples=4, tokens_generated=4, tokens_trained=4,
        max_staleness=0, step_seconds=0.1, wait_seconds=0.0, publish_seconds=0.1,
    )  # fmt: skip


def opened(group: int, sample: int) -> SessionOpened:
    return SessionOpened(
        session_id=f"s{group}-{sample}",
        task_id=f"t{group}",
        group_id=group_id(group),
        sample_index=sample,
        group_size=4,
    )


def closed(group: int) -> GroupClosed:
    return GroupClosed(group_id=group_id(group), task_id=f"t{group}", group_size=4)


def test_group_ids_round_trip_and_ad_hoc_groups_have_no_index() -> None:
    assert group_id(12) == "g0000012"
    assert group_index(group_id(12)) == 12
    assert group_index("my-own-group") == -1
    assert group_index("g12") == -1


def test_a_line_with_nothing_stored_starts_from_zero() -> None:
    line = fresh_line()
    restore_line(line, StoredLine())
    assert (line.next_batch_index, line.trained_batches, line.published_version) == (0, 0, 0)
    assert not line.finished and line.planned_steps is None
    assert not line.grouper.already_batched and not line.grouper.finished_groups


def test_published_batches_are_never_batched_again_and_their_index_is_not_reused() -> None:
    line = fresh_line()
    stored = StoredLine(
        announcements=[
            announced(0, {"g0000000": ["a", "b"]}),
            announced(1, {"g0000001": ["c"], "g0000002": ["d"]}),
        ]
    )
    restore_line(line, stored)
    assert line.grouper.already_batched == {"a", "b", "c", "d"}
    assert line.grouper.finished_groups == {"g0000000", "g0000001", "g0000002"}
    assert line.next_batch_index == 2


def test_reported_drops_are_remembered_so_they_are_not_reported_twice() -> None:
    line = fresh_line()
    report = BatchFilterReport(
        batch_index=0,
        stage="default",
        groups_kept=1,
        samples_kept=2,
        dropped_samples={"stale": ["s1", "g0000003/2"]},
        dropped_groups={"zero_variance": ["g0000004"]},
    )
    restore_line(line, StoredLine(batch_reports=[report]))
    assert line.grouper.reported == {"s1", "g0000003/2", "g0000004"}


def test_the_trainer_progress_budget_and_finish_come_back() -> None:
    line = fresh_line()
    stored = StoredLine(
        train_metrics=[metrics(0, 1), metrics(2, 3), metrics(1, 2)],
        trainer_finished=True,
        plan=TrainingPlanned(steps=7, seed=1),
    )
    restore_line(line, stored)
    assert (line.trained_batches, line.published_version) == (3, 3)
    assert line.finished and line.planned_steps == 7


def test_batch_indexes_continue_after_the_trained_ones_when_retention_dropped_batches() -> None:
    """The trainer skips a batch at or below the last one it trained."""
    line = fresh_line()
    restore_line(line, StoredLine(announcements=[announced(1, {})], train_metrics=[metrics(4, 5)]))
    assert line.next_batch_index == 5


def test_an_empty_stream_resumes_dispatch_at_the_first_group() -> None:
    replay = GroupReplay()
    assert replay.resume_point([], set(), group_size=4) == (0, 0)
    assert replay.unopened_groups() == []
    assert replay.events == 0


def test_every_message_counts_those_that_did_not_decode_too() -> None:
    replay = GroupReplay()
    for event in (opened(0, 0), None, SessionFinished(session_id="s0-0")):
        replay.read(event)
    assert replay.events == 3


def test_a_group_handed_out_in_part_resumes_at_its_next_sample() -> None:
    replay = GroupReplay()
    for event in (opened(0, 0), opened(0, 1), opened(1, 0), opened(1, 1)):
        replay.read(event)
    assert replay.resume_point([], {group_id(0), group_id(1)}, group_size=4) == (1, 2)


def test_a_closed_complete_or_batched_last_group_is_done() -> None:
    events = (opened(0, 0), opened(1, 0), opened(1, 1))
    replay = GroupReplay()
    for event in events:
        replay.read(event)
    # the last group no longer waits for samples (closed or complete)
    assert replay.resume_point([], {group_id(0)}, group_size=4) == (2, 0)
    # a stored batch names a later group than any event still stored
    assert replay.resume_point([group_id(5)], {group_id(1)}, group_size=4) == (6, 0)
    # every sample of the last group opened
    full = GroupReplay()
    for sample in range(4):
        full.read(opened(0, sample))
    assert full.resume_point([], {group_id(0)}, group_size=4) == (1, 0)


def test_groups_handed_out_that_never_opened_a_session_wait_for_their_time_out() -> None:
    replay = GroupReplay()
    for event in (opened(3, 0), closed(4), opened(6, 0), opened(6, 1)):
        replay.read(event)
    # below the first group stored: older than retention, done
    assert replay.unopened_groups() == [group_id(5)]
    assert replay.resume_point([], {group_id(6)}, group_size=4) == (6, 2)


def test_ad_hoc_groups_are_seen_but_do_not_move_dispatch() -> None:
    replay = GroupReplay()
    replay.read(
        SessionOpened(
            session_id="adhoc", task_id="t", group_id="adhoc", sample_index=0, group_size=1
        )
    )
    assert replay.resume_point([], {"adhoc"}, group_size=1) == (0, 0)
    assert replay.unopened_groups() == []
