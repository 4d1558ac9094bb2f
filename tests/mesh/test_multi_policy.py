"""Multi-policy: two policies (a solver and a verifier) trained together in one run.

A real mesh on a real nats-server: one tag-scheduler, trajectory service, gateway and
agent runner for the run; per policy its own trainer, weight-sync and engine worker
(``SF_POLICY``). The built-in ``solve_and_verify`` agent asks the solver (model
``solver``) for an answer and the verifier (model ``verifier``) whether it is right, and
reports a reward per policy. The trainers have different step budgets, so each
policy's version line must advance on its own.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import psutil
import pytest

from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus, RemoteError
from seamlessflow.protocol import (
    ResourceRegister,
    RoleAssignment,
    Subjects,
    TrainingFinished,
    TrainingPlanned,
    TrajectoryEvent,
    TurnRecorded,
    WeightsPublished,
    decode,
)
from sf_agents.service import AgentRunner
from sf_agents.settings import AgentRunnerSettings
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trainer.service import TrainerService
from sf_trainer.settings import TrainerSettings
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, session_auth, small_embedded_run

# every answer the gateway gives here is checked against the openai types
pytestmark = pytest.mark.usefixtures("openai_shapes")

STEPS = {"solver": 2, "verifier": 4}


async def stored(bus: Bus, stream: str, subject: str, kind):  # type: ignore[no-untyped-def]
    return [decode(m.data, kind) for m in await bus.read_subject(stream, subject)]


async def test_two_policies_train_together_each_on_its_own_version_line(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus, tmp_path: Path
) -> None:
    mesh = InProcessMesh(nats_url, run_id, base_model_dir, policies="solver,verifier")
    mesh.mesh = mesh.mesh.model_copy(update={"run_dir": tmp_path})
    trainers: dict[str, TrainerService] = {}
    try:
        scheduler = await mesh.start(TagSchedulerService())
        trajectory = await mesh.start(
            TrajectoryService(TrajectorySettings(group_size=2, groups_per_batch=2))
        )
        engines = []
        for policy, steps in STEPS.items():
            await mesh.start(WeightSyncService(), policy=policy)
            trainers[policy] = await mesh.start(
                TrainerService(TrainerSettings(steps=steps, lr=1e-3)), policy=policy
            )
            engine = EngineService(EngineSettings(engine_id=f"{policy}-engine", max_batch_size=8))
            engines.append(await mesh.start(engine, policy=policy))
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(120):
            for engine in engines:
                await engine.ready.wait()
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"

        # the gateway serves exactly the run's policies; another model is a clear 404
        async with httpx.AsyncClient(base_url=url) as http:
            models = (await http.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["solver", "verifier"]
            session = (await http.post("/sessions", json={})).json()
            wrong = await http.post(
                f"/s/{session['session_id']}/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "1 + 1?"}]},
                headers=session_auth(session),
            )
            assert wrong.status_code == 404
            assert wrong.json()["error"]["code"] == "model_not_found"
            unknown_reward = await http.post(
                f"/sessions/{session['session_id']}/reward",
                json={"reward": 1, "policy": "x"},
                headers=session_auth(session),
            )
            assert unknown_reward.status_code == 404
            assert (
                await http.post(
                    f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
                )
            ).status_code == 200

        await mesh.start(
            AgentRunner(
                AgentRunnerSettings(
                    gateway_url=url, agent="solve_and_verify", concurrency=4, max_tokens=4
                )
            )
        )
        async with asyncio.timeout(300):
            finished: dict[str, TrainingFinished] = {}
            while len(finished) < len(STEPS):
                for policy in STEPS:
                    s = bus.subjects.for_policy(policy)
                    done = await stored(
                        bus, s.stream_metrics(), s.train_finished(), TrainingFinished
                    )
                    if done:
                        finished[policy] = done[-1]
                await asyncio.sleep(0.5)
    finally:
        await mesh.stop()

    subjects = {policy: Subjects(run_id, policy) for policy in STEPS}
    # each policy's own version line: its trainer's steps, published on its own stream
    for policy, steps in STEPS.items():
        s = subjects[policy]
        assert finished[policy].policy == policy
        assert finished[policy].steps == steps and finished[policy].final_version == steps
        published = await stored(bus, s.stream_weights(), s.weights_published(), WeightsPublished)
        assert [w.version for w in published] == list(range(1, steps + 1))
        # each trainer announced its own budget, which the trajectory service followed
        [plan] = await stored(bus, s.stream_metrics(), s.train_plan(), TrainingPlanned)
        assert (plan.policy, plan.steps, plan.seed) == (policy, steps, 0)
        assert trajectory.lines[policy].planned_steps == steps
    # tasks are shared: the dispatch budget is the largest trainer's
    assert trajectory.dispatcher.total_groups == max(STEPS.values()) * 2

    # every trained token of a policy came from that policy's engine
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(
            bus.subjects.stream_trajectory(), bus.subjects.trajectory_events_all()
        )
    ]
    turns = [e for e in events if isinstance(e, TurnRecorded)]
    for policy, steps in STEPS.items():
        s = subjects[policy]
        batches = await stored_batches(bus, policy)
        assert len(batches) >= steps and all(b.policy == policy for b in batches)
        own = {
            (tuple(t.prompt_ids), tuple(t.completion_ids))
            for t in turns
            if t.policy == policy and t.engine_id == f"{policy}-engine"
        }
        for sample in (s for b in batches[:steps] for g in b.groups for s in g.samples):
            start = sample.loss_mask.index(1)
            end = start + sum(sample.loss_mask)
            key = (tuple(sample.token_ids[:start]), tuple(sample.token_ids[start:end]))
            assert key in own, f"a {policy} sample holds tokens its engine did not make"
            assert 0.0 <= sample.reward <= 1.0

    # each policy's own checkpoints, at its own step and version
    for policy, steps in STEPS.items():
        final = tmp_path / "checkpoints" / policy / "final"
        state = json.loads((final / "trainer_state.json").read_text())
        assert (state["step"], state["version"]) == (steps, steps), policy
        assert (final / "model.safetensors").is_file()

    # the tag-scheduler knows each resource's policy from its tags
    policies = {rid: state.policy for rid, state in scheduler.resources.items()}
    assert policies["solver-engine"] == "solver" and policies["verifier-engine"] == "verifier"
    assert {trainers[p].trainer_id: p for p in STEPS}.items() <= policies.items()
    assert trajectory.lines.keys() == {"solver", "verifier"}


async def test_a_resource_naming_two_policies_is_refused(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    mesh = InProcessMesh(nats_url, run_id, None)
    try:
        scheduler = await mesh.start(TagSchedulerService())
        async with asyncio.timeout(10):
            await scheduler.ready.wait()
        request = ResourceRegister(
            resource_id="engine-x", kind="engine", tags=["rollout", "policy:a", "policy:b"]
        )
        with pytest.raises(RemoteError, match="one policy") as refused:
            await bus.request(bus.subjects.sched_register(), request, RoleAssignment)
        assert refused.value.code == "bad_request"
        assert "engine-x" not in scheduler.resources  # nothing stored
    finally:
        await mesh.stop()


@pytest.mark.slow
async def test_the_two_policy_example_runs_embedded_and_lends_per_policy(
    nats_url: str, run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    """``seamlessflow up --policies solver,verifier --agent solve_and_verify`` as
    processes, multiplexed: each policy's lendable engine serves only its own policy's
    rollout while that policy's trainer waits; the verifier is evaluated on its own task
    (``eval_tasks``), the solver on the run's."""
    steps = 3
    summary = await small_embedded_run(
        run_id,
        tmp_path,
        base_model_dir,
        steps,
        nats_url=nats_url,
        policies=["solver", "verifier"],
        agent="solve_and_verify",
        mode="multiplexed",
        eval_every=steps,
        eval_tasks=["verifier=verify:arithmetic"],
    ).run()
    assert summary.status == "finished", summary.status
    run_dir = tmp_path / run_id
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["policies"].keys() == {"solver", "verifier"}
    for policy, figures in written["policies"].items():
        assert figures["finished"] and figures["final_version"] == steps, policy
        assert figures["tokens_trained"] > 0
        assert figures["checkpoint"] == str(run_dir / "checkpoints" / policy / "final")
    assert written["steps"] == steps and written["checkpoint"].endswith("solver/final")
    evaluated = {p: (f["eval_first"]["task"], f["eval_first"]["step"], f["eval_last"]["step"])
                 for p, f in written["policies"].items()}  # fmt: skip
    assert evaluated == {
        "solver": ("arithmetic", 0, steps),
        "verifier": ("verify:arithmetic", 0, steps),
    }
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for policy in ("solver", "verifier"):
        assert [
            m["version"] for m in metrics if m["policy"] == policy and m["type"] == "train.metrics"
        ] == [1, 2, 3]

    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    lent = {
        (span["attributes"]["policy"], engine)
        for span in spans
        if span["name"] == "sched.lend"
        for engine in span["attributes"]["lent"]
    }
    # lends happened, and only of a policy's own engine on its own trainer's slot
    assert lent and lent <= {
        ("solver", "solver-engine-lend-0"),
        ("verifier", "verifier-engine-lend-0"),
    }
    logs = {path.name for path in (run_dir / "logs").iterdir()}
    assert {"solver-trainer.log", "verifier-trainer.log", "gateway.log"} <= logs
    # the two trainers share the host's memory: each plans its micro-batches on at most
    # half of it (both read "available" at their start, before either took any)
    total_gb = psutil.virtual_memory().total / 1e9
    for policy in ("solver", "verifier"):
        log = (run_dir / "logs" / f"{policy}-trainer.log").read_text()
        planned = re.search(r"([0-9.]+) GB free to this rank", log)
        assert planned, f"{policy}: no micro-batch plan logged"
        assert float(planned.group(1)) <= total_gb / 2 + 0.05, (policy, planned.group())
