import msgspec
import pytest

from seamlessflow.protocol import (
    GroupClosed,
    NoTask,
    RewardReported,
    SampleGroup,
    SessionFinished,
    SessionOpened,
    TaskAssignment,
    TurnRecorded,
)
from seamlessflow.tasks import TaskItem
from sf_trajectory.data_filters import DataFilters, Staleness
from sf_trajectory.dispatch import Dispatcher
from sf_trajectory.grouping import Grouper, export_session
from sf_trajectory.schedule import Stage


def exact_match(completion: str, reference: str) -> float:
    return float(completion.strip() == reference)


def lookup(name: str):  # type: ignore[no-untyped-def]
    assert name == "exact"
    return exact_match


def opened(session: str, group: str, index: int, size: int) -> SessionOpened:
    return SessionOpened(
        session_id=session,
        task_id="t-" + group,
        group_id=group,
        sample_index=index,
        group_size=size,
        reference="4",
        reward_fn="exact",
    )


def turn(session: str, index: int, prompt: list[int], completion: list[int], text: str):  # type: ignore[no-untyped-def]
    return TurnRecorded(
        session_id=session,
        turn_index=index,
        request_id=f"{session}-{index}",
        engine_id="e0",
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5] * len(completion),
        versions=[index] * len(completion),
        finish_reason="stop",
        completion_text=text,
    )


def test_a_group_is_ready_when_all_its_sessions_finished() -> None:
    grouper = Grouper(lookup)
    for i in range(3):
        grouper.apply(opened(f"s{i}", "g0", i, 3))
        grouper.apply(turn(f"s{i}", 0, [1, 2], [3 + i, 9], "4" if i == 0 else "5"))
    grouper.apply(SessionFinished(session_id="s0"))
    grouper.apply(SessionFinished(session_id="s1"))
    assert grouper.take_batch(1) is None
    grouper.apply(SessionFinished(session_id="s2"))
    batch = grouper.take_batch(1)
    assert batch is not None and len(batch) == 1
    samples = batch[0].samples
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert samples[0].token_ids == [1, 2, 3, 9]
    assert samples[0].loss_mask == [0, 0, 1, 1]
    assert samples[0].behaviour_logprobs == [0.0, 0.0, -0.5, -0.5]
    assert samples[0].versions == [-1, -1, 0, 0]


def play_session(grouper: Grouper, session: str, group: str, index: int, size: int) -> None:
    grouper.apply(opened(session, group, index, size))
    grouper.apply(turn(session, 0, [1, 2], [3, 9], "4"))
    grouper.apply(SessionFinished(session_id=session))


def test_a_closed_group_drops_what_did_not_finish_and_goes_on_with_the_rest() -> None:
    grouper = Grouper(lookup)
    play_session(grouper, "s0", "g0", 0, 4)
    play_session(grouper, "s1", "g0", 1, 4)
    grouper.apply(opened("s2", "g0", 2, 4))  # its gateway restarted: it never finishes
    # (sample 3 was claimed, but its session never opened)
    grouper.apply(GroupClosed(group_id="g0", task_id="t-g0", group_size=4))
    assert grouper.tally.dropped_samples == {"timed_out": ["s2", "g0/3"]}
    assert grouper.tally.samples_dropped == {"timed_out": 2}
    # what comes after the close changes nothing: sample 3 is already counted
    grouper.apply(SessionFinished(session_id="s2"))
    play_session(grouper, "s3", "g0", 3, 4)
    batch = grouper.take_batch(1)
    assert batch is not None and [s.session_id for s in batch[0].samples] == ["s0", "s1"]
    assert grouper.last_tally.samples_dropped == {"timed_out": 2}
    # a group none of whose samples opened is lost, and refilled by the dispatcher
    grouper.apply(GroupClosed(group_id="g1", task_id="t-g1", group_size=2))
    assert grouper.groups_lost == 1 and grouper.tally.dropped_groups == {"no_samples": ["g1"]}
    assert grouper.tally.dropped_samples == {"timed_out": ["g1/0", "g1/1"]}
    # a close that comes after the group completed is a no-op
    grouper.apply(GroupClosed(group_id="g0", task_id="t-g0", group_size=4))
    assert grouper.groups_lost == 1 and grouper.ready == []


def test_a_sample_handed_out_twice_is_dropped_as_surplus() -> None:
    """A sample index can reach two agents after a restart; the group completes with
    the first ``size`` sessions and the other one is reported, never a crash."""
    grouper = Grouper(lookup)
    grouper.apply(opened("late", "g0", 1, 2))
    play_session(grouper, "a", "g0", 0, 2)
    play_session(grouper, "b", "g0", 1, 2)
    grouper.apply(SessionFinished(session_id="late"))  # its group is complete already
    play_session(grouper, "later", "g0", 1, 2)  # opens after the group completed
    assert grouper.tally.dropped_samples == {"surplus": ["late", "later"]}
    batch = grouper.take_batch(1)
    assert batch is not None and [s.session_id for s in batch[0].samples] == ["a", "b"]


def test_an_extra_session_still_open_when_its_group_completes_is_dropped_then() -> None:
    """Its agent may never finish it (killed, or the run ends): it must not stay neither
    trained nor dropped. Dropped once, as surplus, at the group's completion; its late
    finish changes nothing."""
    grouper = Grouper(lookup)
    grouper.apply(opened("stuck", "g0", 1, 2))
    play_session(grouper, "a", "g0", 0, 2)
    assert grouper.tally.dropped_samples == {}
    play_session(grouper, "b", "g0", 1, 2)  # completes the group
    assert grouper.tally.dropped_samples == {"surplus": ["stuck"]}
    grouper.apply(SessionFinished(session_id="stuck"))
    assert grouper.tally.dropped_samples == {"surplus": ["stuck"]}
    assert grouper.dropped == {"surplus": 1}


def test_drops_a_published_report_named_are_not_reported_again() -> None:
    """The replay after a restart rebuilds every drop; those a published report already
    named count again for the rhythm (groups lost) but are not reported twice."""
    grouper = Grouper(lookup)
    grouper.reported = {"g0", "g0/0", "s1"}
    grouper.apply(opened("s1", "g0", 1, 2))
    grouper.apply(SessionFinished(session_id="s1"))  # no turns: failed
    grouper.apply(GroupClosed(group_id="g0", task_id="t-g0", group_size=2))
    assert grouper.groups_lost == 1
    assert grouper.tally.samples_dropped == {} and grouper.tally.groups_dropped == {}


def test_a_reported_reward_wins_over_the_verifier() -> None:
    grouper = Grouper(lookup)
    grouper.apply(opened("s", "g", 0, 1))
    grouper.apply(turn("s", 0, [1], [2], "wrong"))
    grouper.apply(RewardReported(session_id="s", reward=0.25))
    grouper.apply(SessionFinished(session_id="s"))
    batch = grouper.take_batch(1)
    assert batch is not None and batch[0].samples[0].reward == 0.25


def test_the_verifier_runs_once_before_the_finish_and_a_failing_one_costs_one_sample() -> None:
    """The service runs ``pending_verification`` in a worker thread (a sandboxed verifier
    takes seconds); ``apply`` then uses its score and never calls the verifier itself."""
    calls: list[str] = []

    def counting(completion: str, reference: str) -> float:
        calls.append(completion)
        if completion == "boom":
            raise ValueError("malformed reference")
        return exact_match(completion, reference)

    grouper = Grouper(lambda name: counting)
    for i, text in enumerate(["4", "boom"]):
        grouper.apply(opened(f"s{i}", "g", i, 2))
        grouper.apply(turn(f"s{i}", 0, [1], [2], text))
        finish = SessionFinished(session_id=f"s{i}")
        verify = grouper.pending_verification(finish)
        assert verify is not None
        verify()  # never raises, even when the verifier does
        grouper.apply(finish)
    assert calls == ["4", "boom"]
    batch = grouper.take_batch(1)
    assert batch is not None and [s.reward for s in batch[0].samples] == [1.0]
    assert grouper.dropped == {"no_reward": 1}
    reported = Grouper(lambda name: counting)
    reported.apply(opened("r", "h", 0, 1))
    reported.apply(RewardReported(session_id="r", reward=0.5))
    assert reported.pending_verification(SessionFinished(session_id="r")) is None


def test_multi_turn_masks_every_engine_turn_and_skips_abandoned_branches() -> None:
    grouper = Grouper(lookup)
    grouper.apply(opened("s", "g", 0, 1))
    grouper.apply(turn("s", 0, [1, 2], [3, 4], "a"))  # on the final path
    grouper.apply(turn("s", 1, [1, 7], [8], "b"))  # a branch the agent abandoned
    grouper.apply(turn("s", 2, [1, 2, 3, 4, 5, 6], [7, 9], "4"))  # extends turn 0
    grouper.apply(SessionFinished(session_id="s"))
    batch = grouper.take_batch(1)
    assert batch is not None
    sample = batch[0].samples[0]
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7, 9]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1, 1]
    assert sample.versions == [-1, -1, 0, 0, -1, -1, 2, 2]


def test_a_constrained_turn_is_context_and_not_trained() -> None:
    """A turn sampled under constrained decoding (response_format) has logprobs of the
    constrained distribution, which the trainer cannot recompute: its tokens stay in the
    sequence but out of the loss; the unconstrained turns around it are trained."""
    grouper = Grouper(lookup)
    grouper.apply(opened("s", "g", 0, 1))
    constrained = msgspec.structs.replace(turn("s", 0, [1, 2], [3, 4], "{}"), constrained=True)
    grouper.apply(constrained)
    grouper.apply(turn("s", 1, [1, 2, 3, 4, 5], [6, 7], "4"))
    grouper.apply(SessionFinished(session_id="s"))
    batch = grouper.take_batch(1)
    assert batch is not None
    sample = batch[0].samples[0]
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert sample.versions == [-1, -1, -1, -1, -1, 1, 1]


def test_sessions_already_batched_are_skipped_on_replay() -> None:
    events = [
        opened("s0", "g", 0, 1),
        turn("s0", 0, [1], [2], "4"),
        SessionFinished(session_id="s0"),
    ]
    first = Grouper(lookup)
    for event in events:
        first.apply(event)
    assert first.take_batch(1) is not None
    replayed = Grouper(lookup, already_batched={"s0"})
    for event in events:
        replayed.apply(event)
    assert replayed.take_batch(1) is None and not replayed.sessions


def test_a_session_without_turns_is_dropped_with_a_reason_and_closes_its_group() -> None:
    grouper = Grouper(lookup)
    grouper.apply(opened("a", "g", 0, 2))
    grouper.apply(opened("b", "g", 1, 2))
    grouper.apply(turn("a", 0, [1], [2], "4"))
    grouper.apply(SessionFinished(session_id="a"))
    grouper.apply(SessionFinished(session_id="b"))
    batch = grouper.take_batch(1)
    assert batch is not None and len(batch[0].samples) == 1
    assert grouper.dropped == {"no_turns": 1}


def test_a_failed_episode_is_dropped_with_its_reason_whatever_its_reward() -> None:
    """An episode whose environment went away is no sample, even with turns and a
    reward; the group completes with the others, and the export says why."""
    grouper = Grouper(lookup)
    for name, index in (("ok", 0), ("lost", 1)):
        grouper.apply(opened(name, "g", index, 2))
        grouper.apply(turn(name, 0, [1], [2], "4"))
        grouper.apply(RewardReported(session_id=name, reward=0.7, step_rewards=[0.1, 0.6]))
        assert grouper.pending_verification(SessionFinished(session_id=name)) is None
    grouper.apply(SessionFinished(session_id="ok"))
    grouper.apply(SessionFinished(session_id="lost", failure="env_lost"))
    batch = grouper.take_batch(1)
    assert batch is not None and [s.reward for s in batch[0].samples] == [0.7]
    assert grouper.dropped == {"env_lost": 1}
    events = [
        opened("lost", "g", 1, 2),
        turn("lost", 0, [1], [2], "4"),
        RewardReported(session_id="lost", reward=0.7, step_rewards=[0.1, 0.6]),
        SessionFinished(session_id="lost", failure="env_lost"),
    ]
    exported = export_session(events, lookup)
    assert exported.failure == "env_lost" and exported.step_rewards == [0.1, 0.6]
    assert [s.reward for s in exported.samples] == [None]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_failed_sample_stays_out_of_its_group_s_advantages(estimator: str) -> None:
    """One sample of a group of four loses its environment after turns and a reported
    reward. The group trains the other three, with exactly the advantages a group of
    those three alone gets: the failure is no zero reward, and whatever the failed
    episode reported does not move the baseline. The batch report names it."""
    from sf_trainer.advantages import batch_advantages
    from sf_trainer.settings import TrainerSettings

    def batch(lost_reward: float | None, size: int) -> tuple[list[SampleGroup], Grouper]:
        grouper = Grouper(lookup)
        rewards = [1.0, 0.0, 0.5, lost_reward]
        for i, reward in enumerate(rewards[:size]):
            grouper.apply(opened(f"s{i}", "g", i, size))
            grouper.apply(turn(f"s{i}", 0, [1], [2 + i], "4"))
            if reward is not None:
                grouper.apply(RewardReported(session_id=f"s{i}", reward=reward))
        for i in range(size):
            failure = "env_lost" if i == 3 else ""
            grouper.apply(SessionFinished(session_id=f"s{i}", failure=failure))
        return grouper.take_batch(1) or [], grouper

    settings = TrainerSettings(advantage=estimator)
    survivors, _ = batch(None, 3)
    expected = batch_advantages(survivors, settings)
    assert any(a != 0 for a in expected)
    for lost_reward in (None, 0.0, 1.0):
        groups, grouper = batch(lost_reward, 4)
        [group] = groups
        assert [s.session_id for s in group.samples] == ["s0", "s1", "s2"]
        assert batch_advantages(groups, settings) == pytest.approx(expected)
        assert grouper.last_tally.samples_dropped == {"env_lost": 1}
        assert grouper.last_tally.dropped_samples == {"env_lost": ["s3"]}


def test_malformed_tool_calls_are_counted_in_the_batch_that_trains_them_or_drops_them() -> None:
    grouper = Grouper(lookup)
    for i, errors in enumerate((["invalid_json"], ["unknown_tool", "invalid_json"], [])):
        grouper.apply(opened(f"s{i}", "g", i, 3))
        grouper.apply(msgspec.structs.replace(turn(f"s{i}", 0, [1], [2], "4"),
                                              tool_call_errors=errors))  # fmt: skip
    grouper.apply(SessionFinished(session_id="s0"))
    grouper.apply(SessionFinished(session_id="s1", failure="env_lost"))
    assert grouper.tally.tool_call_errors == {"unknown_tool": 1, "invalid_json": 1}  # dropped
    grouper.apply(SessionFinished(session_id="s2"))
    assert grouper.take_batch(1) is not None
    assert grouper.last_tally.tool_call_errors == {"unknown_tool": 1, "invalid_json": 2}
    assert grouper.group_tool_call_errors == {} and grouper.tally.tool_call_errors == {}
    # a group every sample of which failed is lost, its errors counted then
    grouper.apply(opened("x", "h", 0, 1))
    broken = msgspec.structs.replace(turn("x", 0, [1], [2], "4"), tool_call_errors=["no_name"])
    grouper.apply(broken)
    grouper.apply(SessionFinished(session_id="x", failure="env_timeout"))
    assert grouper.tally.tool_call_errors == {"no_name": 1}


def test_a_failed_episode_skips_the_verifier() -> None:
    grouper = Grouper(lookup)
    grouper.apply(opened("s", "g", 0, 1))
    grouper.apply(turn("s", 0, [1], [2], "4"))
    assert grouper.pending_verification(SessionFinished(session_id="s")) is not None
    assert (
        grouper.pending_verification(SessionFinished(session_id="s", failure="env_timeout")) is None
    )


def test_a_long_episode_is_one_sample_with_every_turn_masked_in_and_its_versions() -> None:
    """Twelve turns, each prompt the previous prompt + answer + the environment's next
    observation (prefix-stable, as the openenv agent sends it), the weights updated
    between turns: one sample, every answer token trained once with the version that
    made it, the observations context only. Staleness is judged on its oldest token:
    an episode that started too long ago is stale as a whole, however fresh its end."""
    grouper = Grouper(lookup)
    grouper.apply(opened("e", "g", 0, 1))
    context = [1, 2, 3]
    expected_mask, expected_versions = [0, 0, 0], [-1, -1, -1]
    for index in range(12):
        answer = [100 + index, 101 + index]
        grouper.apply(
            TurnRecorded(
                session_id="e",
                turn_index=index,
                request_id=f"e-{index}",
                engine_id="e0",
                prompt_ids=list(context),
                completion_ids=answer,
                logprobs=[-0.25, -0.5],
                versions=[index, index],
                finish_reason="stop",
                completion_text="",
            )
        )
        observation = [7] * (index + 2)  # the environment's reply grows
        context += answer + observation
        expected_mask += [1, 1] + [0] * len(observation)
        expected_versions += [index, index] + [-1] * len(observation)
    grouper.apply(RewardReported(session_id="e", reward=1.3, step_rewards=[0.1] * 12))
    grouper.apply(SessionFinished(session_id="e"))
    batch = grouper.take_batch(1)
    assert batch is not None
    (sample,) = batch[0].samples
    last_observation = 13  # the final observation is never sent: the episode is over
    assert sample.token_ids == context[:-last_observation]
    assert sample.loss_mask == expected_mask[:-last_observation]
    assert sample.versions == expected_versions[:-last_observation]
    assert sum(sample.loss_mask) == 24 and sample.reward == 1.3
    # batch 12 is trained by version 12: the episode's first answer is 12 versions old
    assert Staleness(max_staleness=12).judge(batch[0], 12).group is not None
    stale = Staleness(max_staleness=11).judge(batch[0], 12)
    assert stale.group is None and stale.reason == "stale"


def items(n: int) -> list[TaskItem]:
    return [
        TaskItem(task_id=f"t{i}", messages=({"role": "user", "content": str(i)},), reference=str(i))
        for i in range(n)
    ]


def one_stage(n: int) -> list[Stage]:
    return [Stage(name="t", items=items(n), reward_fn="exact", first_batch=0)]


def test_dispatcher_hands_out_groups_and_applies_backpressure_and_the_budget() -> None:
    dispatcher = Dispatcher(
        one_stage(5),
        group_size=2,
        groups_per_batch=2,
        total_batches=3,
        max_batches_ahead=1,
        seed=0,
    )
    claims = [dispatcher.claim(trained_batches=0) for _ in range(8)]
    assert all(isinstance(c, TaskAssignment) for c in claims)
    got = [(c.group_id, c.sample_index) for c in claims if isinstance(c, TaskAssignment)]
    assert got[:4] == [("g0000000", 0), ("g0000000", 1), ("g0000001", 0), ("g0000001", 1)]
    # samples of one group share the task
    assert claims[0].task_id == claims[1].task_id  # type: ignore[union-attr]
    # batches 0 and 1 dispatched; batch 2 must wait until the trainer consumed batch 0
    blocked = dispatcher.claim(trained_batches=0)
    assert isinstance(blocked, NoTask) and blocked.reason == "backpressure"
    assert isinstance(dispatcher.claim(trained_batches=1), TaskAssignment)
    for _ in range(3):
        dispatcher.claim(trained_batches=1)
    # every group is out, but one may still be lost and need a refill: wait, until the
    # last batch is published
    waiting = dispatcher.claim(trained_batches=3, batches_published=2)
    assert isinstance(waiting, NoTask) and waiting.reason == "backpressure"
    done = dispatcher.claim(trained_batches=3, batches_published=3)
    assert isinstance(done, NoTask) and done.reason == "exhausted"


def test_dispatcher_epochs_are_permutations_and_reproducible() -> None:
    def order(seed: int) -> list[str]:
        d = Dispatcher(
            one_stage(6),
            group_size=1,
            groups_per_batch=1,
            total_batches=0,
            max_batches_ahead=100,
            seed=seed,
        )
        return [d.claim(trained_batches=0).task_id for _ in range(12)]  # type: ignore[union-attr]

    first = order(1)
    assert sorted(first[:6]) == sorted(first[6:]) == [f"t{i}" for i in range(6)]
    assert order(1) == first


def test_stale_samples_are_dropped_with_a_reason_and_the_batch_refilled() -> None:
    grouper = Grouper(lookup, filters=DataFilters([Staleness(max_staleness=4)]))
    # group g0: one sample made by version 0, one by version 5; group g1: version 5
    for session, group, version in (("a", "g0", 0), ("b", "g0", 5), ("c", "g1", 5)):
        grouper.apply(opened(session, group, 0 if session != "b" else 1, 2 if group == "g0" else 1))
        grouper.apply(turn(session, version, [1], [2], "4"))
        grouper.apply(SessionFinished(session_id=session))
    batch = grouper.take_batch(2, batch_index=6)
    assert batch is not None
    assert [[s.session_id for s in g.samples] for g in batch] == [["b"], ["c"]]
    assert grouper.dropped == {"stale": 1}


def test_a_group_left_empty_by_staleness_does_not_fill_a_batch() -> None:
    grouper = Grouper(lookup, filters=DataFilters([Staleness(max_staleness=2)]))
    for session, group, version in (("a", "g0", 0), ("c", "g1", 9)):
        grouper.apply(opened(session, group, 0, 1))
        grouper.apply(turn(session, version, [1], [2], "4"))
        grouper.apply(SessionFinished(session_id=session))
    assert grouper.take_batch(2, batch_index=9) is None
    assert [g.group_id for g in grouper.ready] == ["g1"]
    assert grouper.groups_lost == 1  # the dispatcher replaces it


def test_lost_groups_are_replaced_so_the_last_batch_still_fills() -> None:
    """A run with a step budget: a group lost to staleness (or to failed sessions)
    gets a replacement, else the last batch could never fill and the run would hang."""
    grouper = Grouper(lookup)
    grouper.apply(opened("a", "g0", 0, 1))
    grouper.apply(SessionFinished(session_id="a"))  # no turns: the whole group fails
    assert grouper.groups_lost == 1 and grouper.take_batch(1) is None

    def two_batches_of_one_group() -> Dispatcher:
        return Dispatcher(
            one_stage(3),
            group_size=1,
            groups_per_batch=1,
            total_batches=2,
            max_batches_ahead=5,
            seed=0,
        )

    dispatcher = two_batches_of_one_group()
    handed = [dispatcher.claim(0, groups_lost=grouper.groups_lost) for _ in range(4)]
    assert [type(c).__name__ for c in handed] == [
        "TaskAssignment",
        "TaskAssignment",
        "TaskAssignment",  # the replacement of the lost group
        "NoTask",
    ]
    # without the loss the budget is two groups
    plain = two_batches_of_one_group()
    assert isinstance([plain.claim(0) for _ in range(3)][-1], NoTask)


def chained(session: str, index: int, prompt: list[int], completion: list[int], parent: str):  # type: ignore[no-untyped-def]
    """A chat turn at node ``n<index>`` continuing node ``parent`` by messages."""
    import msgspec

    return msgspec.structs.replace(
        turn(session, index, prompt, completion, "4"),
        node_digest=f"n{index}",
        node_depth=2 * index + 2,
        parent_digest=parent,
    )


def test_turns_the_template_rewrote_are_trained_once_each_with_the_session() -> None:
    """Turn 1 forked off turn 0's tokens (its think block was dropped from the next
    prompt), turn 2 continued turn 1's exact ids, turn 3 forked off again; a sibling of
    turn 2 the agent did not continue is not trained. Every kept turn is masked in
    exactly once, across the session's samples, and the group waits for sessions."""
    from sf_trajectory.grouping import trained_branches

    turns = [
        chained("a", 0, [1, 2], [3, 4, 9], ""),
        chained("a", 1, [1, 2, 5, 6], [7, 9], "n0"),  # prompt ids of turn 0, then new
        chained("a", 2, [1, 2, 5, 6, 7, 9, 8], [10, 9], "n1"),  # extends turn 1's ids
        chained("a", 3, [1, 2, 5, 6, 7, 9, 8], [11, 9], "n1"),  # a sibling left behind
        chained("a", 4, [1, 2, 5, 6, 7, 9, 8, 12], [13, 9], "n2"),  # turn 2's prompt
    ]
    branches = trained_branches(turns)
    assert [(end.turn_index, on_path) for end, _, on_path in branches] == [
        (4, [1, 4]),  # turn 1's ids are on turn 4's prompt too (via turn 2's)
        (2, [2]),  # turn 1 is masked in once, in the first branch that holds it
        (0, [0]),
    ]
    masked = sorted(
        t
        for _, sample, _ in branches
        for t, m in zip(sample.token_ids, sample.loss_mask, strict=True)
        if m
    )
    assert masked == sorted([3, 4, 9, 7, 9, 10, 9, 13, 9])  # turns 0, 1, 2, 4; not 3

    grouper = Grouper(lookup)
    grouper.apply(opened("a", "g0", 0, 2))
    grouper.apply(opened("b", "g0", 1, 2))
    for recorded in turns:
        grouper.apply(recorded)
    grouper.apply(SessionFinished(session_id="a"))
    assert grouper.take_batch(1) is None  # three samples, one session of two
    grouper.apply(turn("b", 0, [1, 2], [3, 9], "5"))
    grouper.apply(SessionFinished(session_id="b"))
    [group] = grouper.take_batch(1) or []
    assert [s.session_id for s in group.samples] == ["a", "a", "a", "b"]
    assert [s.reward for s in group.samples] == [1.0, 1.0, 1.0, 0.0]
