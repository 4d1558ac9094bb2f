"""Data algorithms as plug-ins (``sf_trajectory.data_filters``), the epochs and stages of
the dispatcher, in process: real Grouper, Dispatcher and filters, synthetic events."""

from __future__ import annotations

import importlib
import logging
from collections import Counter

import pytest

from seamlessflow.protocol import (
    NoTask,
    RewardReported,
    SessionFinished,
    SessionOpened,
    TaskAssignment,
    TurnRecorded,
)
from seamlessflow.tasks import TaskItem
from seamlessflow.tasks.schedule import schedule_sources
from sf_trajectory.data_filters import DataFilters, DynamicSampling, HistoryResampling, Staleness
from sf_trajectory.dispatch import Dispatcher
from sf_trajectory.grouping import Grouper
from sf_trajectory.schedule import Stage, StageSource, StageSpec, build_stages, parse_stages
from sf_trajectory.settings import TrajectorySettings
from tests.support import write_outside_filter


def no_verifier(name: str):  # type: ignore[no-untyped-def]
    raise AssertionError("rewards are reported in these tests")


def prompts(prefix: str, n: int) -> list[TaskItem]:
    return [
        TaskItem(task_id=f"{prefix}{i}", messages=({"role": "user", "content": "q"},), reference="")
        for i in range(n)
    ]


def play(grouper: Grouper, claim: TaskAssignment, reward: float, version: int = 0) -> None:
    """One finished session of the claimed sample, with one engine turn and a reward."""
    session = f"{claim.group_id}-{claim.sample_index}"
    grouper.apply(
        SessionOpened(
            session_id=session,
            task_id=claim.task_id,
            group_id=claim.group_id,
            sample_index=claim.sample_index,
            group_size=claim.group_size,
        )
    )
    grouper.apply(
        TurnRecorded(
            session_id=session,
            turn_index=0,
            request_id=session,
            engine_id="e",
            prompt_ids=[1],
            completion_ids=[2],
            logprobs=[-0.5],
            versions=[version],
            finish_reason="stop",
            completion_text="x",
        )
    )
    grouper.apply(RewardReported(session_id=session, reward=reward))
    grouper.apply(SessionFinished(session_id=session))


def claim_group(dispatcher: Dispatcher, **progress: int) -> list[TaskAssignment]:
    claims = [dispatcher.claim(**progress) for _ in range(dispatcher.group_size)]
    assert all(isinstance(c, TaskAssignment) for c in claims), claims
    return claims  # type: ignore[return-value]


def history_run() -> tuple[Dispatcher, Grouper]:
    filters = DataFilters([HistoryResampling(correct_reward=1.0)])
    dispatcher = Dispatcher(
        [Stage(name="six", items=prompts("p", 6), reward_fn="exact", first_batch=0)],
        group_size=2,
        groups_per_batch=1,
        total_batches=0,
        max_batches_ahead=100,
        seed=3,
        data_filters=filters,
    )
    return dispatcher, Grouper(no_verifier, filters=filters)


# rewards of the two samples of each prompt in epoch 0
EPOCH_0 = {
    "p0": (1.0, 1.0),  # all correct: dropped
    "p1": (1.0, 1.0),
    "p2": (1.0, 0.0),  # mixed
    "p3": (0.0, 1.0),
    "p4": (0.0, 0.0),  # all wrong: kept, it may become solvable
    "p5": (0.5, 0.0),  # 0.5 < the 1.0 threshold: wrong
}


def test_history_resampling_keeps_mixed_and_all_wrong_prompts_for_the_next_epoch() -> None:
    dispatcher, grouper = history_run()
    for _ in range(6):
        for claim in claim_group(dispatcher, trained_batches=0):
            play(grouper, claim, EPOCH_0[claim.task_id][claim.sample_index])
    epoch_0 = dispatcher.unrecorded_epochs.pop()
    assert (epoch_0.epoch, epoch_0.prompts, epoch_0.first_group) == (0, 6, 0)

    next_epoch = [claim_group(dispatcher, trained_batches=0)[0].task_id for _ in range(4)]

    assert sorted(next_epoch) == ["p2", "p3", "p4", "p5"]
    report = dispatcher.unrecorded_epochs.pop()
    assert (report.epoch, report.first_group, report.prompts) == (1, 6, 4)
    assert report.dropped == {"all_correct": 2}
    assert sorted(report.dropped_task_ids) == ["p0", "p1"]
    assert report.kept == {"mixed": 2, "all_wrong": 2} and not report.kept_all
    # epoch 1's groups are still in flight at the next boundary: their prompts are judged
    # by epoch 0's outcomes and stay
    claim_group(dispatcher, trained_batches=0)
    assert dispatcher.unrecorded_epochs.pop().prompts == 4


def test_a_restarted_dispatcher_rebuilds_each_epoch_from_its_records() -> None:
    dispatcher, grouper = history_run()
    for _ in range(6):
        for claim in claim_group(dispatcher, trained_batches=0):
            play(grouper, claim, EPOCH_0[claim.task_id][claim.sample_index])
    uninterrupted = [claim_group(dispatcher, trained_batches=0)[0].task_id for _ in range(4)]
    records = list(dispatcher.unrecorded_epochs)

    restarted = Dispatcher(
        dispatcher.stages,
        group_size=2,
        groups_per_batch=1,
        total_batches=0,
        max_batches_ahead=100,
        seed=3,
        next_group=8,  # groups 6 and 7 were opened before the restart
        data_filters=DataFilters([HistoryResampling(correct_reward=1.0)]),
        recorded_epochs=records,
    )
    resumed = [claim_group(restarted, trained_batches=0)[0].task_id for _ in range(2)]
    assert resumed == uninterrupted[2:]
    assert not restarted.unrecorded_epochs  # nothing new: epoch 1 was recorded


def test_when_every_prompt_would_be_dropped_the_set_is_kept() -> None:
    dispatcher, grouper = history_run()
    for _ in range(6):
        for claim in claim_group(dispatcher, trained_batches=0):
            play(grouper, claim, 1.0)
    claim_group(dispatcher, trained_batches=0)
    report = dispatcher.unrecorded_epochs[-1]
    assert report.kept_all and report.prompts == 6
    assert report.dropped == {} and report.dropped_task_ids == []


def assignment(task_id: str, group: int, sample: int, size: int) -> TaskAssignment:
    return TaskAssignment(
        task_id=task_id,
        group_id=f"g{group:07d}",
        sample_index=sample,
        group_size=size,
        messages=[],
        reference="",
        reward_fn="",
    )


def test_history_counts_the_latest_group_of_a_prompt_whatever_the_order_seen() -> None:
    history = HistoryResampling(correct_reward=1.0)
    grouper = Grouper(no_verifier, filters=DataFilters([history]))
    play(grouper, assignment("p0", group=7, sample=0, size=2), 1.0)
    play(grouper, assignment("p0", group=7, sample=1, size=2), 0.0)
    play(grouper, assignment("p0", group=1, sample=0, size=1), 1.0)  # older, seen later

    selection = history.select(prompts("p", 1), since_group=0)
    assert [i.task_id for i in selection.kept] == ["p0"]
    assert dict(selection.kept_reasons) == {"mixed": 1}
    # groups dispatched before the stage started do not count
    assert dict(history.select(prompts("p", 1), since_group=8).kept_reasons) == {"unseen": 1}


# --------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_drops_zero_variance_groups_up_to_the_refill_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grouper = Grouper(no_verifier, filters=DataFilters([DynamicSampling(max_refills=2)]))
    rewards = {0: (1.0, 1.0), 1: (0.0, 0.0), 2: (1.0, 1.0), 3: (1.0, 0.0)}
    with caplog.at_level(logging.WARNING):
        for group, pair in rewards.items():
            for sample, reward in enumerate(pair):
                play(grouper, assignment(f"p{group}", group, sample, 2), reward)
        batch = grouper.take_batch(2, batch_index=0)

    assert batch is not None
    assert [g.group_id for g in batch] == ["g0000002", "g0000003"]  # g2 past the cap
    assert grouper.groups_lost == 2  # the dispatcher refills g0 and g1
    tally = grouper.last_tally
    assert tally.groups_dropped == {"zero_variance": 2}
    assert tally.samples_dropped == {"zero_variance": 4}
    assert tally.groups_waived == {"zero_variance": 1}
    assert "batch 0: refill cap reached" in caplog.text
    # the cap is per batch
    for sample in range(2):
        play(grouper, assignment("p4", 4, sample, 2), 0.0)
    assert grouper.take_batch(2, batch_index=1) is None and grouper.groups_lost == 3


def test_a_run_whose_groups_all_agree_still_ends() -> None:
    """Every group zero-variance: the refill cap bounds the groups each batch costs, so
    the run reaches its budget instead of dispatching forever."""
    groups_per_batch, total_batches, cap = 2, 3, 1
    dispatcher = Dispatcher(
        [Stage(name="p", items=prompts("p", 5), reward_fn="exact", first_batch=0)],
        group_size=2,
        groups_per_batch=groups_per_batch,
        total_batches=total_batches,
        max_batches_ahead=0,
        seed=0,
    )
    grouper = Grouper(no_verifier, filters=DataFilters([DynamicSampling(max_refills=cap)]))
    batches = 0
    for _ in range(100):
        answer = dispatcher.claim(batches, grouper.groups_lost, batches)
        if isinstance(answer, NoTask):
            assert answer.reason == "exhausted"
            break
        play(grouper, answer, 1.0)
        while grouper.take_batch(groups_per_batch, batch_index=batches) is not None:
            batches += 1
    assert batches == total_batches
    assert dispatcher.next_group == total_batches * (groups_per_batch + cap)


# --------------------------------------------------------------------------- staleness, order


def test_the_default_filters_are_the_staleness_bound_alone() -> None:
    settings = TrajectorySettings()
    filters = DataFilters.from_settings(settings.data_filter_names(), settings.data_filter)
    assert filters.names == ["staleness"]
    [staleness] = filters.group_filters
    assert isinstance(staleness, Staleness) and staleness.max_staleness == 4


def test_group_filters_run_in_the_configured_order() -> None:
    """One stale wrong sample and two fresh right ones. ``staleness`` first leaves two
    equal rewards, which dynamic sampling drops; the other order keeps the group (it had
    variance when judged) and only trims the stale sample."""

    def judge(order: str) -> tuple[list[str], dict[str, int]]:
        """The sessions batched, and the samples dropped by reason."""
        settings = TrajectorySettings(
            data_filters=order, data_filter={"staleness": {"max_staleness": 2}}
        )
        filters = DataFilters.from_settings(settings.data_filter_names(), settings.data_filter)
        grouper = Grouper(no_verifier, filters=filters)
        for sample, (reward, version) in enumerate([(0.0, 0), (1.0, 5), (1.0, 5)]):
            play(grouper, assignment("p0", 0, sample, 3), reward, version=version)
        batch = grouper.take_batch(1, batch_index=5)
        kept = [s.session_id for s in batch[0].samples] if batch else []
        return kept, grouper.dropped

    assert judge("staleness,dynamic_sampling") == ([], {"stale": 1, "zero_variance": 2})
    assert judge("dynamic_sampling,staleness") == (["g0000000-1", "g0000000-2"], {"stale": 1})


def test_unknown_or_repeated_filter_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown data filter"):
        TrajectorySettings(data_filters="staleness,greso")
    with pytest.raises(ValueError, match="twice"):
        TrajectorySettings(data_filters="staleness,staleness")


# --------------------------------------------------------------------------- plug-ins by path


@pytest.fixture
def outside_filter(tmp_path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    return write_outside_filter(tmp_path, monkeypatch)


def test_a_filter_written_outside_the_repo_is_listed_by_its_path_with_its_keys(
    outside_filter: str, monkeypatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SF_TRAJECTORY_DATA_FILTERS", f"staleness,{outside_filter}")
    monkeypatch.setenv("SF_TRAJECTORY_DATA_FILTER__LOW_REWARD__MIN_MEAN_REWARD", "0.6")
    run_file = tmp_path / "run.toml"
    run_file.write_text("[trajectory.data_filter.staleness]\nmax_staleness = 1\n")
    monkeypatch.setenv("SF_CONFIG", str(run_file))
    settings = TrajectorySettings()
    filters = DataFilters.from_settings(settings.data_filter_names(), settings.data_filter)
    assert filters.names == ["staleness", "low_reward"]
    staleness, low_reward = filters.group_filters
    assert isinstance(staleness, Staleness) and staleness.max_staleness == 1
    assert getattr(low_reward, "min_mean_reward", None) == 0.6

    grouper = Grouper(no_verifier, filters=filters)
    for group, rewards in enumerate(((1.0, 0.0), (1.0, 1.0))):  # means 0.5, then 1.0
        for sample, reward in enumerate(rewards):
            play(grouper, assignment(f"p{group}", group, sample, 2), reward)
    [kept] = grouper.take_batch(1, batch_index=0) or []
    assert kept.task_id == "p1"
    assert grouper.dropped == {"low_reward": 2}


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        (
            {"SF_TRAJECTORY_DATA_FILTER__STALENESS__MAX_STALE": "2"},
            r"data filter 'staleness' has no setting 'max_stale' "
            r"\(SF_TRAJECTORY_DATA_FILTER__STALENESS__MAX_STALE\); its keys: max_staleness",
        ),
        (
            {"SF_TRAJECTORY_DATA_FILTER__STALENESS__MAX_STALENESS": "-1"},
            r"max_staleness = '-1': Input should be greater than or equal to 0",
        ),
        (
            {"SF_TRAJECTORY_DATA_FILTER__HISTORY_RESAMPLING__CORRECT_REWARD": "0.5"},
            r"settings for the data filter 'history_resampling', which "
            r"SF_TRAJECTORY_DATA_FILTERS does not list \(it lists: staleness\)",
        ),
        (
            {"SF_TRAJECTORY_MAX_STALENESS": "2"},
            r"SF_TRAJECTORY_MAX_STALENESS \(\[trajectory\] max_staleness\) is no longer "
            r"read: .* set SF_TRAJECTORY_DATA_FILTER__STALENESS__MAX_STALENESS",
        ),
        (
            {"SF_TRAJECTORY_DATA_FILTERS": "my_filters:NotAFilter"},
            r"'my_filters:NotAFilter' is not a data filter: it has neither judge",
        ),
        (
            {"SF_TRAJECTORY_DATA_FILTERS": "my_filters:Missing"},
            r"'my_filters:Missing': module 'my_filters' has no attribute 'Missing'",
        ),
        (
            {"SF_TRAJECTORY_DATA_FILTERS": "collections:Counter"},
            r"'collections:Counter' is not a data filter: a class with a 'name'",
        ),
        (
            {
                "SF_TRAJECTORY_DATA_FILTERS": "staleness,my_filters:Twin",
            },
            r"two filters are named alike: \['staleness', 'staleness'\]",
        ),
    ],
    ids=[
        "unknown-key",
        "bad-value",
        "unlisted",
        "retired",
        "no-hook",
        "missing",
        "no-name",
        "twins",
    ],
)
def test_a_data_filter_configured_wrongly_stops_the_service_in_one_line(
    outside_filter: str, monkeypatch, environment: dict[str, str], message: str
) -> None:  # type: ignore[no-untyped-def]
    my_filters = importlib.import_module("my_filters")  # the fixture's, outside the repo

    class Twin(Staleness):
        pass

    monkeypatch.setattr(my_filters, "Twin", Twin, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        TrajectorySettings()


def test_a_retired_filter_key_in_the_run_file_names_its_new_place(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_file = tmp_path / "run.toml"
    run_file.write_text("[trajectory]\ndynamic_sampling_max_refills = 3\n")
    monkeypatch.setenv("SF_CONFIG", str(run_file))
    with pytest.raises(
        ValueError, match=r"max_refills under \[trajectory.data_filter.dynamic_sampling\]"
    ):
        TrajectorySettings()


# --------------------------------------------------------------------------- stages


def test_stage_syntax() -> None:
    assert parse_stages("lookup:100, arithmetic") == [
        StageSpec("lookup", 100),
        StageSpec("arithmetic", None),
    ]
    # only a final :<digits> is a count, so a task name may be a data file's
    assert parse_stages("jsonl:data/math.jsonl?reward=math_answer:5,data/code.jsonl") == [
        StageSpec("jsonl:data/math.jsonl?reward=math_answer", 5),
        StageSpec("data/code.jsonl", None),
    ]
    assert TrajectorySettings(task="lookup").stage_specs() == [StageSpec("lookup", None)]
    for bad in ("a,b", "a:3,b:4", "a:0,b"):
        with pytest.raises(ValueError):
            TrajectorySettings(stages=bad)


def test_a_stage_of_several_sources_parses_with_its_weights() -> None:
    [first, second] = parse_stages("arithmetic:3,arithmetic*3+rg:chain_sum?size=10")
    assert first.sources() == [StageSource("arithmetic", 1.0)]
    assert second.sources() == [StageSource("arithmetic", 3.0), StageSource("rg:chain_sum?size=10")]
    for bad in ("a*0+b", "a*x+b", "+b", "a*-1", "a*inf+b"):
        with pytest.raises(ValueError, match="weight above 0"):
            TrajectorySettings(stages=bad)


def test_a_run_s_task_may_be_a_whole_schedule_and_its_evaluation_names_each_source() -> None:
    """``seamlessflow up --task`` sets the trajectory's task and the trainer's eval task
    from one string: the trajectory runs it as stages, the trainer evaluates each source."""
    from sf_trainer.settings import TrainerSettings

    schedule = "arithmetic:3,arithmetic*1+counting*3"
    assert TrajectorySettings(task=schedule).stage_specs() == parse_stages(schedule)
    assert TrajectorySettings(task="a", stages="b:2,c").stage_specs() == parse_stages("b:2,c")
    assert TrainerSettings(eval_task=schedule).eval_tasks() == ["arithmetic", "counting"]
    assert TrainerSettings(eval_task="counting, arithmetic").eval_tasks() == [
        "counting",
        "arithmetic",
    ]
    assert schedule_sources("rg:chain_sum?size=10:5,rg:bf*2+rg:chain_sum?size=10") == [
        "rg:chain_sum?size=10",
        "rg:bf",
    ]
    with pytest.raises(ValueError, match="needs a length in batches"):
        TrajectorySettings(task="arithmetic,counting")
    with pytest.raises(ValueError, match="weight above 0"):
        TrainerSettings(eval_task="arithmetic*0+counting")
    with pytest.raises(ValueError, match="names no task"):
        TrainerSettings(eval_task=" , ")


def test_a_stage_of_several_sources_mixes_them_in_proportion_each_scored_by_its_own() -> None:
    """arithmetic (320 train prompts, ``integer_match``) and counting (4536, ``math_answer``)
    at 1:3: arithmetic, the scarcer for its share, is used whole and counting gives three
    times as many; each dispatched sample names its own source's reward function."""
    [stage] = build_stages(parse_stages("arithmetic*1+counting*3"), seed=0)
    sources = Counter(item.task_id.split("/")[0] for item in stage.items)
    assert sources == {"arithmetic": 320, "counting": 960}
    assert len({item.task_id for item in stage.items}) == len(stage.items)
    assert stage.reward_fns() == {"integer_match", "math_answer"}
    # the same seed gives the same prompt set (a restart rebuilds its epochs from it)
    [again] = build_stages(parse_stages("arithmetic*1+counting*3"), seed=0)
    assert again.items == stage.items
    [other_seed] = build_stages(parse_stages("arithmetic*1+counting*3"), seed=1)
    assert {i.task_id for i in other_seed.items} != {i.task_id for i in stage.items}

    dispatcher = Dispatcher(
        [stage], group_size=1, groups_per_batch=1, total_batches=0, max_batches_ahead=10**6,
        seed=0,
    )  # fmt: skip
    claimed = [dispatcher.claim(0) for _ in range(200)]
    by_source = Counter()
    for claim in claimed:
        assert isinstance(claim, TaskAssignment)
        source = claim.task_id.split("/")[0]
        by_source[source] += 1
        assert claim.reward_fn == {"arithmetic": "integer_match", "counting": "math_answer"}[source]
    assert 0.15 < by_source["arithmetic"] / 200 < 0.35  # a quarter, up to the shuffle


def test_the_stage_switch_waits_for_the_last_batch_of_the_stage_before() -> None:
    stages = [
        Stage(name="a", items=prompts("a", 4), reward_fn="reward_a", first_batch=0),
        Stage(name="b", items=prompts("b", 4), reward_fn="reward_b", first_batch=2),
    ]
    dispatcher = Dispatcher(
        stages,
        group_size=1,
        groups_per_batch=1,
        total_batches=0,
        max_batches_ahead=5,
        seed=0,
    )
    first = [dispatcher.claim(0, 0, 0) for _ in range(2)]
    assert [(c.task_id[0], c.reward_fn) for c in first] == [("a", "reward_a")] * 2  # type: ignore[union-attr]
    # group 2 is for batch 2 (stage b): it waits until batch 1 is published
    assert isinstance(dispatcher.claim(0, 0, batches_published=1), NoTask)
    # a stage-a group was lost: its refill is still stage a
    refill = dispatcher.claim(0, groups_lost=1, batches_published=1)
    assert isinstance(refill, TaskAssignment) and refill.reward_fn == "reward_a"
    switched = dispatcher.claim(0, groups_lost=1, batches_published=2)
    assert isinstance(switched, TaskAssignment)
    assert (switched.task_id[0], switched.reward_fn) == ("b", "reward_b")
    report = dispatcher.unrecorded_epochs[-1]
    assert (report.stage, report.stage_index, report.epoch, report.first_group) == ("b", 1, 0, 3)


def test_staleness_keeps_or_drops_a_session_with_several_samples_whole() -> None:
    """A session whose rewritten turns gave several samples: one stale sample drops the
    session's other samples with it (a group member is a session), named once."""
    from seamlessflow.protocol import SampleGroup, TrainSample

    def of(session: str, version: int) -> TrainSample:
        return TrainSample(session_id=session, token_ids=[1, 2], loss_mask=[0, 1],
                           behaviour_logprobs=[0.0, -0.5], versions=[-1, version],
                           reward=1.0)  # fmt: skip

    group = SampleGroup(group_id="g", task_id="t", samples=[of("a", 5), of("a", 1), of("b", 5)])
    verdict = Staleness(max_staleness=2).judge(group, batch_index=5)
    assert verdict.group is not None and verdict.reason == "stale"
    assert [s.session_id for s in verdict.group.samples] == ["b"]
    assert verdict.dropped_sessions == ("a",)
