"""The protocol's messages and subjects on their own: every message type round-trips
with its type tag (one example of each), a wrong type, missing fields, garbage and a
newer schema are ``ProtocolError``s, subjects are namespaced by run and policy, message
ids name one fact each, and every name imported from ``seamlessflow.protocol`` anywhere
in the tree resolves there."""

from __future__ import annotations

import ast
from importlib.util import find_spec

import msgspec
import pytest

from seamlessflow import protocol as p
from tests.support import REPO_ROOT

MANIFEST = p.WeightManifest(
    version=2,
    kind="delta",
    base_version=1,
    transport="object",
    location="weights-v00000002-delta",
    payload_bytes=12,
    bucket_bytes=1024,
    digest="xxh3-128",
    bucket_digests=["ab"],
    state_bytes=64,
    state_digest="cd",
    layout=[p.TensorSpec(name="w", dtype="bfloat16", shape=[4, 8], offset=0)],
    delta=p.DeltaEncoding(word_bytes=2, changed_words=2, positions="indices"),
)


def examples() -> list[p.Message]:
    sample = p.TrainSample(
        session_id="s1",
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -0.5, -0.25],
        versions=[-1, 3, 3],
        reward=1.0,
    )
    return [
        p.ErrorReply(code="bad_request", message="nope"),
        # three the hand-kept union lacked, so decode() without a type refused them
        p.ShedRequests(to_engine="engine-lend-0", count=2),
        p.ShedReport(engine_id="engine-0", handed_over=2),
        p.GroupClosed(group_id="g1", task_id="t1", group_size=4, closed_at=1.5),
        p.GenerateRequest(
            request_id="r",
            session_id="s",
            prompt_ids=[1, 2],
            max_tokens=4,
            stop_token_ids=[7],
            seed=3,
        ),
        p.GenerateReply(
            request_id="r",
            engine_id="e",
            token_ids=[5],
            logprobs=[-0.1],
            versions=[2],
            finish_reason="stop",
        ),
        p.GenerateChunk(
            request_id="r",
            index=0,
            token_ids=[5],
            logprobs=[-0.1],
            versions=[2],
            top_logprobs=[[p.TopLogprob(token_id=5, logprob=-0.1)]],
        ),
        p.AbortGeneration(request_id="r", reason="weights"),
        p.LoadWeights(manifest=MANIFEST),
        p.WeightsLoaded(engine_id="e", version=2),
        p.SessionOpened(session_id="s", task_id="t", group_id="g", sample_index=0, group_size=2),
        p.TurnRecorded(
            session_id="s",
            turn_index=0,
            request_id="r",
            engine_id="e",
            prompt_ids=[1],
            completion_ids=[2],
            logprobs=[-1.0],
            versions=[0],
            finish_reason="stop",
            completion_text="x",
        ),
        p.RewardReported(session_id="s", reward=0.5),
        p.SessionFinished(session_id="s"),
        p.TaskClaim(runner_id="a"),
        p.TaskAssignment(
            task_id="t",
            group_id="g",
            sample_index=1,
            group_size=2,
            messages=[p.ChatMessage(role="user", content="hi")],
            reference="2",
            reward_fn="integer_match",
        ),
        p.NoTask(reason="exhausted"),
        p.TrainBatch(
            batch_index=0, groups=[p.SampleGroup(group_id="g", task_id="t", samples=[sample])]
        ),
        p.BatchReady(
            batch_index=0,
            groups=[
                p.GroupSummary(
                    group_id="g",
                    task_id="t",
                    samples=[p.SampleSummary(session_id="s1", reward=1.0, tokens=3)],
                )
            ],
            payload=p.BatchPayload(
                encoding="packed-msgpack-1", chunk_seqs=[4, 5], payload_bytes=9, sha256="ab" * 32
            ),
        ),
        p.BatchProgress(batch_index=2, groups_ready=3, groups_per_batch=4, policy="solver"),
        p.BatchFilterReport(
            batch_index=3,
            stage="arithmetic",
            groups_kept=8,
            samples_kept=60,
            groups_dropped={"zero_variance": 2},
            samples_dropped={"zero_variance": 16, "stale": 4},
            groups_waived={"zero_variance": 1},
        ),
        p.EpochFilterReport(
            stage="arithmetic",
            stage_index=0,
            epoch=1,
            first_group=320,
            prompts=300,
            kept={"mixed": 200, "all_wrong": 100},
            dropped={"all_correct": 20},
            dropped_task_ids=["add-1-2"],
        ),
        p.SessionExportQuery(session_id="s"),
        p.SessionExport(
            session_id="s",
            task_id="t",
            finished=True,
            samples=[
                p.ExportedSample(
                    token_ids=[1, 2],
                    loss_mask=[0, 1],
                    behaviour_logprobs=[0, -1],
                    versions=[-1, 0],
                    turn_indexes=[0],
                    final=True,
                    reward=1.0,
                )
            ],
        ),
        p.WeightsPublished(manifest=MANIFEST, step=1),
        p.CurrentVersionQuery(engine_id="e"),
        p.CurrentVersion(version=1, chain=[MANIFEST]),
        p.WeightsGroupQuery(rank=1),
        p.WeightsGroupOffer(unique_id=[1, 2, 3], size=2),
        p.TrainStepMetrics(
            step=1,
            version=1,
            batch_index=0,
            mean_reward=0.5,
            loss=0.1,
            clip_fraction=0.0,
            samples=8,
            tokens_generated=10,
            tokens_trained=10,
            max_staleness=0,
            step_seconds=0.1,
            wait_seconds=0.2,
            publish_seconds=0.01,
            lr=1e-4,
        ),
        p.TrainEvalMetrics(
            step=2,
            version=2,
            task="arithmetic",
            split="eval",
            samples=64,
            mean_reward=0.25,
            max_tokens=16,
            eval_seconds=0.5,
        ),
        p.TrainingPlanned(steps=100, seed=7, policy="solver"),
        p.TrainingFinished(steps=1, final_version=1, checkpoint_dir="/x"),
        p.ResourceRegister(resource_id="e", kind="engine", tags=["rollout"]),
        p.ResourceRegister(
            resource_id="e", kind="engine", tags=["train", "rollout"], slots=["gpu0"]
        ),
        p.RoleAssignment(resource_id="e", role="rollout", reason="tag"),
        p.RoleAck(resource_id="e", role="idle", seconds=0.2, handed_back=3),
        p.SlotsClaim(trainer_id="t", batch_index=4),
        p.SlotsGranted(reclaimed=["e"], seconds=0.2, missed=[]),
        p.CoresLent(trainer_id="t", threads=1, engines=["e"]),
        p.SlotsReleased(trainer_id="t", version=5),
        p.SlotsReleased(trainer_id="t", version=5, frees_memory=True),
        p.SlotsFreed(trainer_id="t", offloaded_bytes=2**30, seconds=0.4),
        p.LendReport(lent=["e"], reason="r", expected_wait_s=None, gain_s=None, cost_s=1.0),
        p.LendReport(lent=[], reason="r", expected_wait_s=2.5, gain_s=2.0, cost_s=1.0),
        p.Heartbeat(resource_id="e", phase="rollout", in_flight=2, version=1),
        p.PhaseChanged(resource_id="e", phase="dead"),
    ]


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips_with_its_type_tag(message: p.Message) -> None:
    data = p.encode(message)
    assert msgspec.json.decode(data)["type"] == type(message).__struct_config__.tag
    assert p.decode(data, type(message)) == message
    assert p.decode(data) == message  # the union of all messages finds the type by tag


def test_every_message_type_is_covered_by_the_examples() -> None:
    covered = {type(m) for m in examples()}
    declared = set(p.AnyMessage.__args__)  # type: ignore[attr-defined]
    assert covered == declared


def test_wrong_type_missing_fields_and_garbage_are_protocol_errors() -> None:
    with pytest.raises(p.ProtocolError, match="invalid message"):
        p.decode(p.encode(p.TaskClaim(runner_id="a")), p.GenerateRequest)
    with pytest.raises(p.ProtocolError):
        p.decode(b'{"type": "engine.generate", "request_id": "r"}', p.GenerateRequest)
    with pytest.raises(p.ProtocolError):
        p.decode(b"\xff not json")
    with pytest.raises(p.ProtocolError):
        p.decode(b'{"type": "engine.generate", "prompt_ids": "not a list"}')


def test_a_newer_schema_is_refused() -> None:
    data = p.encode(p.TaskClaim(runner_id="a", schema=p.SCHEMA_VERSION + 1))
    with pytest.raises(p.ProtocolError, match="newer"):
        p.decode(data, p.TaskClaim)


def test_subjects_are_namespaced_by_run_and_validated() -> None:
    s = p.Subjects("run-1")
    assert s.policy == p.DEFAULT_POLICY
    assert s.engine_generate() == "sf.run-1.engine.policy.generate"
    assert s.engine_abort() == "sf.run-1.engine.abort"
    assert s.trajectory_event("sabc") == "sf.run-1.traj.event.sabc"
    assert s.sched_heartbeat("engine-0") == "sf.run-1.sched.heartbeat.engine-0"
    assert s.stream_trajectory() == "SF_RUN_1_TRAJ"
    assert s.stream_batches() == "SF_RUN_1_BATCH-policy"
    assert s.stream_batch_payloads() == "SF_RUN_1_BATCHDATA-policy"
    assert s.batch_payload(12) == "sf.run-1.batch.policy.payload.12"
    with pytest.raises(p.ProtocolError):
        s.batch_payload(-1)
    assert s.object_store_weights() == "sf_run_1_weights-policy"
    with pytest.raises(p.ProtocolError):
        s.trajectory_event("a.b")  # a dot would open another subject level
    with pytest.raises(p.ProtocolError):
        p.Subjects("Run.1")
    # every durable subject is captured by exactly one stream
    for name, subjects in s.streams().items():
        assert name.startswith("SF_RUN_1_") and subjects


def test_policies_share_the_run_subjects_and_own_their_version_line() -> None:
    solver, verifier = p.Subjects("run-1", "solver"), p.Subjects("run-1").for_policy("verifier")
    shared = (
        "task_claim",
        "trajectory_events_all",
        "engine_abort",
        "sched_claim",
        "data_epoch_report",
        "stream_trajectory",
        "stream_metrics",
        "kv_resources",
    )
    for name in shared:
        assert getattr(solver, name)() == getattr(verifier, name)(), name
    owned = (
        "engine_generate",
        "engine_load",
        "weights_published",
        "weights_current",
        "batch_ready",
        "batch_progress",
        "batch_payloads_all",
        "train_metrics",
        "train_eval",
        "data_batch_report",
        "stream_batches",
        "stream_batch_payloads",
        "stream_weights",
        "object_store_weights",
    )
    for name in owned:
        assert getattr(solver, name)() != getattr(verifier, name)(), name
        assert "solver" in getattr(solver, name)(), name
    assert solver.for_policy("solver") is solver
    with pytest.raises(p.ProtocolError):
        p.Subjects("run-1", "Solver")  # a model name must be a lowercase token
    with pytest.raises(p.ProtocolError):
        p.Subjects("run-1", "a.b")


def test_policy_tags_name_one_policy() -> None:
    assert p.policy_of_tags(["rollout"]) == p.DEFAULT_POLICY
    assert p.policy_of_tags(["rollout", p.policy_tag("solver")]) == "solver"
    with pytest.raises(p.ProtocolError, match="one policy"):
        p.policy_of_tags(["policy:a", "policy:b"])
    with pytest.raises(p.ProtocolError):
        p.policy_of_tags(["policy:Not.A.Token"])


def test_message_ids_name_one_fact_each() -> None:
    """Exactly-once rests on these: the same fact always gets the same id, different
    facts (another policy, index, version or kind) never share one."""
    ids = p.MessageIds
    facts = [
        ids.batch("a", 1),
        ids.batch("b", 1),
        ids.batch("a", 2),
        ids.batch_chunk(ids.batch("a", 1), "ab" * 32, 0),
        ids.batch_chunk(ids.batch("a", 1), "cd" * 32, 0),
        ids.batch_chunk(ids.batch("a", 1), "ab" * 32, 1),
        ids.data_batch_report("a", 1),
        ids.data_epoch_report(0, 1),
        ids.data_epoch_report(1, 0),
        ids.group_closed("g1"),
        ids.weights("a", 1),
        ids.weights("b", 1),
        ids.train_metrics("a", 1),
        ids.train_eval("a", 1),
        ids.train_finished("a", 1),
        ids.train_finished("a", 2),
        ids.train_plan("a", "trainer-a-host-1"),
        ids.train_plan("a", "trainer-a-host-2"),
    ]
    assert len(set(facts)) == len(facts)
    assert ids.weights("a", 3) == ids.weights("a", 3)


def test_every_name_imported_from_the_protocol_package_resolves() -> None:
    """``seamlessflow.protocol`` is a package of one module per domain; everything is
    still imported from the package itself (``from seamlessflow.protocol import X`` or
    ``protocol.X``), so each such name anywhere in the tree must resolve there."""
    root = REPO_ROOT
    wanted: dict[str, str] = {}
    for top in ("app", "libs", "services", "tests", "loadtests", "examples"):
        for path in sorted((root / top).rglob("*.py")):
            if "protocol" in path.relative_to(root).parts[:3]:
                continue  # the package itself
            tree = ast.parse(path.read_text(), str(path))
            aliases = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "seamlessflow.protocol":
                    wanted.update((alias.name, str(path)) for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module == "seamlessflow":
                    aliases |= {a.asname or a.name for a in node.names if a.name == "protocol"}
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                ):
                    wanted.setdefault(node.attr, str(path))
    assert len(wanted) > 50
    # a module of the package (``from seamlessflow.protocol import table``) is not a name
    modules = {name for name in wanted if find_spec(f"seamlessflow.protocol.{name}")}
    missing = {n: path for n, path in wanted.items() if n not in modules and not hasattr(p, n)}
    assert not missing, missing
    assert set(p.__all__) <= set(dir(p))
