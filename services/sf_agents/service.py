"""The agent runner service: claims task samples, runs an agent per sample in its own
session (``python -m sf_agents``, ``seamlessflow serve agents``).

Consumes:
- ``sf.<run>.task.claim`` replies (TaskAssignment | NoTask) from the trajectory service
Produces:
- ``sf.<run>.task.claim`` requests (TaskClaim)
- HTTP to the gateway: ``POST /sessions``, the agent's OpenAI calls, ``/reward``,
  ``/finish``, each carrying the W3C trace context of the sample's ``agent.sample``
  span (the gateway's spans are its children)

Every claimed sample ends with ``/finish`` (also when the agent raised), so the
trajectory service can always close the group. A sample that did not complete names
why in the finish (``failure``: the environment's reason from ``EpisodeFailed``,
``agent_error``, ``gateway_lost``), and its drop is counted under that reason.

A gateway that restarts rebuilds its open sessions from the trajectory stream, so a
call that could not reach it is tried again once it answers: the runner's own calls
after waiting for its health check, the agents' through their OpenAI client's retries
(``AGENT_CALL_RETRIES``). The sample goes on in the same session.

HTTP costs CPU on the machine the agents share with the engines and the trainer, so
both clients run on aiohttp: the runner's own calls use an ``aiohttp.ClientSession``
(~0.2 ms of CPU per call here, against ~2.7 ms for an ``httpx.AsyncClient`` with 64
connections in its pool), and the agents' OpenAI clients share one
``DefaultAioHttpClient`` (the SDK's aiohttp transport: ~2 ms per completion call,
against ~3 ms on its default httpx transport). See docs/benchmarks.md "Against TRL".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from collections.abc import Mapping

import aiohttp
from openai import APIConnectionError, AsyncOpenAI, DefaultAioHttpClient
from opentelemetry import trace

from seamlessflow import telemetry
from seamlessflow.agents import (
    AgentReward,
    AgentTask,
    EpisodeFailed,
    EpisodeReturn,
    get_agent,
)
from seamlessflow.bus import NoResponder, Unrecoverable
from seamlessflow.protocol import NoTask, TaskAssignment, TaskClaim
from seamlessflow.retry import RetryPolicy, retry
from seamlessflow.service import ServiceContext, supervise
from sf_agents.settings import AgentRunnerSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

AGENT_CALL_RETRIES = 8
"""Retries of an agent's OpenAI call that found no gateway (or a 5xx): the client's
back-off (0.5 s doubling to 8 s) spans about 40 s, longer than a gateway's restart. The
gateway marks the errors a retry cannot fix (4xx) as not to be retried."""


class GatewayBusy(Exception):
    """The gateway answered 503: it could not record the call now (its broker)."""


GATEWAY_CALL_RETRY = RetryPolicy(
    retry_on=(aiohttp.ClientConnectionError, GatewayBusy),
    first_delay_s=0.25,
    backoff=2.0,
    max_delay_s=8.0,
    deadline_s=120.0,
)
"""One of the runner's own calls (open, reward, finish) that could not connect, or that
the gateway answered 503 (it stored nothing: its broker is electing a stream leader or
restarting), is made again for up to two minutes: before each new attempt it waits for
the gateway's health check, then 0.25 s doubling to 8 s. The time limit, not a count of
attempts, is what matters: a NATS cluster that lost a stream's leader answers no publish
for a few seconds, and a sample whose session could not be opened in that time was lost
until its group timed out (``SF_GROUP_TIMEOUT_S``, 10 minutes by default)."""

TASK_CLAIM_RETRY = RetryPolicy(retry_on=(NoResponder,), first_delay_s=0.5)
"""A task claim nobody answered (the trajectory service restarting or busy) is repeated,
with the same claim id, every 0.5 s until an answer comes back."""


class GatewayRefused(Exception):
    """The gateway answered one of the runner's calls with an error status."""


AGENT_ERRORS_IN_A_ROW = 32
"""An agent that raised on this many samples in a row (at least twice the runner's
concurrency), none completing in between, stops the run with one line: a bug that
fails every sample would otherwise loop for as long as the run lasts, claiming and
losing samples (an agent that could not parse its answers failed 81,195 samples in ten
minutes of a run that never trained a step). Failures of the environment or of the
gateway are not the agent's bug and do not count."""


ENV_FAILURES_IN_A_ROW = 256
"""Episodes the environment failed in a row (at least eight times the runner's
concurrency), none completing in between, stop the run with one line. One failure is
the environment's and drops only its sample, but a run where every episode fails makes
no progress: an environment that refuses the agent's protocol (an ``env_error`` on
every episode: 41,602 of them in 14 minutes of a test run that trained nothing), or one
that is gone for good (each episode first retries ``env_unreachable`` for a minute, so
a restarting environment does not get near this)."""


class AgentRunner:
    name = "agents"

    def __init__(self, settings: AgentRunnerSettings | None = None) -> None:
        self.settings = settings or AgentRunnerSettings()
        self.runner_id = f"agents-{socket.gethostname()}-{os.getpid()}"
        self.agent = get_agent(self.settings.agent)
        self.completed = 0
        self.failed = 0
        self.errors_in_a_row = 0
        """The agent's own errors since the last sample it completed."""
        self.env_failures_in_a_row = 0
        """Episodes the environment failed since the last sample completed."""

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.gateway_url = self.settings.gateway_url.rstrip("/")
        # One connection pool for every agent's OpenAI client: building a client with its
        # own pool costs ~40 ms of CPU, more than the tiny model's whole answer.
        self.openai_http = DefaultAioHttpClient(timeout=600.0)
        operator_key = self.settings.gateway_key.get_secret_value()
        headers = {"authorization": f"Bearer {operator_key}"} if operator_key else {}
        timeout = aiohttp.ClientTimeout(total=600.0)
        async with (
            self.openai_http,
            aiohttp.ClientSession(timeout=timeout, headers=headers) as http,
        ):
            self.http = http
            await self._wait_for_gateway(self.settings.gateway_wait_s)
            workers = [self._worker() for _ in range(self.settings.concurrency)]
            await supervise(ctx.stopping, *workers)
        log.info("agent runner done: %d completed, %d failed", self.completed, self.failed)

    async def _wait_for_gateway(self, limit_s: float | None = None) -> None:
        """The gateway may start after us (embedded mode, compose): poll its health, for
        at most ``limit_s`` (None: without limit)."""
        loop = asyncio.get_running_loop()
        deadline = None if limit_s is None else loop.time() + limit_s
        last = "no answer"
        while not self.ctx.stopping.is_set():
            try:
                async with self.http.get(f"{self.gateway_url}/healthz") as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except aiohttp.ClientConnectionError as exc:
                last = str(exc) or type(exc).__name__
            if deadline is not None and loop.time() >= deadline:
                raise Unrecoverable(
                    f"cannot reach the gateway at {self.gateway_url} within {limit_s:.0f}s "
                    f"({last}): check SF_AGENTS_GATEWAY_URL"
                )
            await asyncio.sleep(0.2)

    async def _claim(self) -> TaskAssignment | NoTask:
        """The trajectory service's answer to a new claim. A claim unanswered in time
        may still have been handed a sample (it waited behind other claims, or its reply
        was lost): it is repeated with the same id, which gets that same sample, until
        an answer comes back (``TASK_CLAIM_RETRY``)."""
        claim = TaskClaim(runner_id=self.runner_id, claim_id=uuid.uuid4().hex)

        async def ask() -> TaskAssignment | NoTask:
            reply: TaskAssignment | NoTask = await self.ctx.bus.request(
                self.ctx.subjects.task_claim(), claim, TaskAssignment | NoTask, timeout=5.0
            )
            return reply

        return await retry(ask, TASK_CLAIM_RETRY)

    async def _worker(self) -> None:
        while True:
            reply = await self._claim()
            if isinstance(reply, NoTask):
                if reply.reason == "exhausted":
                    return
                await asyncio.sleep(reply.retry_after_s)
                continue
            try:
                await self.run_sample(reply)
            except (aiohttp.ClientError, TimeoutError, GatewayRefused, GatewayBusy) as exc:
                # The sample is lost to this runner; the trajectory service closes its
                # group once it makes no progress (SF_GROUP_TIMEOUT_S). No
                # new claim before the gateway answers again: it would be lost too.
                self.failed += 1
                log.error("sample %s/%d failed at the gateway: %s", reply.group_id,
                          reply.sample_index, exc)  # fmt: skip
                await self._wait_for_gateway()

    async def run_sample(self, assignment: TaskAssignment) -> None:
        """One sample, as the span ``agent.sample``: the parent of the gateway's spans
        for its session (every call carries its W3C trace context)."""
        attributes: dict[str, str | int] = {
            "task.id": assignment.task_id,
            "group.id": assignment.group_id,
            "sample.index": assignment.sample_index,
            "policy": assignment.policy,
        }
        with tracer.start_as_current_span("agent.sample", attributes=attributes) as span:
            outcome = await self._run_sample(assignment, span)
            span.set_attribute("outcome", outcome)

    async def _run_sample(self, assignment: TaskAssignment, span: trace.Span) -> str:
        body = {
            "task_id": assignment.task_id,
            "group_id": assignment.group_id,
            "sample_index": assignment.sample_index,
            "group_size": assignment.group_size,
            "reference": assignment.reference,
            "reward_fn": assignment.reward_fn,
            "policy": assignment.policy,
            "min_version": assignment.min_version,
        }
        status, answer = await self._post("/sessions", body, telemetry.inject_headers())
        if status in (401, 403):
            # every claim would fail the same way: stop the run instead of losing them
            given = "its key" if self.settings.gateway_key.get_secret_value() else "no key"
            raise Unrecoverable(
                f"the gateway at {self.gateway_url} refused {given} to open a session "
                f"(HTTP {status}): set SF_AGENTS_GATEWAY_KEY to one of the "
                "gateway's SF_GATEWAY_API_KEYS"
            )
        if status != 201:
            raise GatewayRefused(f"opening a session: HTTP {status} {answer[:200]!r}")
        session = json.loads(answer)
        session_id = session["session_id"]
        span.set_attribute("session.id", session_id)
        # the session's own key: this agent can reach its session and no other
        session_auth = {"authorization": f"Bearer {session['api_key']}"}
        client = AsyncOpenAI(
            base_url=session["base_url"],
            api_key=session["api_key"],
            max_retries=AGENT_CALL_RETRIES,
            http_client=self.openai_http,
            default_headers=telemetry.inject_headers(),
        )
        policies = tuple(self.ctx.mesh.policy_names())
        task = AgentTask(
            task_id=assignment.task_id,
            messages=[{"role": m.role, "content": m.content} for m in assignment.messages],
            model=self.settings.model or policies[0],
            reference=assignment.reference,
            max_tokens=self.settings.max_tokens,
            temperature=self.settings.temperature,
            reward_fn=assignment.reward_fn,
            policies=policies,
            env_url=self.settings.env_url,
            env_step_timeout_s=self.settings.env_step_timeout_s,
            env_max_steps=self.settings.env_max_steps,
            env_hidden_tools=tuple(self.settings.env_hidden_tools),
        )
        finish_body: dict[str, object] | None = None
        try:
            reward = await self.agent(client, task)
            for reward_body in _reward_bodies(reward):
                path = f"/sessions/{session_id}/reward"
                status, answer = await self._post(path, reward_body, session_auth)
                if status != 200:
                    raise GatewayRefused(f"reward: HTTP {status} {answer[:200]!r}")
            self.completed += 1
            self.errors_in_a_row = self.env_failures_in_a_row = 0
            outcome = "completed"
        except asyncio.CancelledError:
            raise
        except EpisodeFailed as exc:
            # the environment failed the episode (timed out, errored, went away): not
            # the agent's bug, one line; the sample is dropped with the reason
            self.failed += 1
            outcome = exc.reason
            finish_body = {"failure": exc.reason}
            log.warning("episode of %s failed (session %s): %s", assignment.task_id,
                        session_id, exc)  # fmt: skip
            self._count_env_failure(exc)
        except APIConnectionError as exc:
            # the gateway went away mid-conversation and the client's retries are spent:
            # not the agent's fault, so one line each, no traceback (the session is
            # finished below once the gateway answers again)
            self.failed += 1
            outcome = "gateway_lost"
            finish_body = {"failure": outcome}
            log.error("agent on %s (session %s): the gateway did not answer its call (%s)",
                      assignment.task_id, session_id, exc)  # fmt: skip
        except Exception as exc:
            self.failed += 1
            outcome = "agent_error"
            finish_body = {"failure": outcome}
            log.exception("agent failed on %s (session %s)", assignment.task_id, session_id)
            self._count_agent_error(exc)
        finally:
            path = f"/sessions/{session_id}/finish"
            status, answer = await self._post(path, finish_body, session_auth)
            if status not in (200, 409):
                log.warning("finishing %s: HTTP %d %s", session_id, status, answer[:200])
        return outcome

    def _count_agent_error(self, exc: Exception) -> None:
        """Stop the run once the agent failed ``AGENT_ERRORS_IN_A_ROW`` samples in a row
        (raised after this sample's session is finished)."""
        self.errors_in_a_row += 1
        limit = max(AGENT_ERRORS_IN_A_ROW, 2 * self.settings.concurrency)
        if self.errors_in_a_row >= limit:
            first_line = (str(exc).splitlines() or [""])[0][:300]
            raise Unrecoverable(
                f"the agent {self.settings.agent!r} raised on {self.errors_in_a_row} samples "
                f"in a row, none completed ({type(exc).__name__}: {first_line}): fix the "
                "agent (the agents' log has each traceback)"
            ) from exc

    def _count_env_failure(self, exc: EpisodeFailed) -> None:
        """Stop the run once ``ENV_FAILURES_IN_A_ROW`` episodes failed in a row in the
        environment (raised after this sample's session is finished)."""
        self.env_failures_in_a_row += 1
        limit = max(ENV_FAILURES_IN_A_ROW, 8 * self.settings.concurrency)
        if self.env_failures_in_a_row >= limit:
            first_line = (str(exc).splitlines() or [""])[0][:300]
            raise Unrecoverable(
                f"the environment {self.settings.env_url or '(none set)'} failed "
                f"{self.env_failures_in_a_row} episodes in a row, none completed "
                f"({first_line}): check that it runs and speaks what the agent "
                f"{self.settings.agent!r} sends (the agents' log has each failure)"
            ) from exc

    async def _post(
        self, path: str, body: dict[str, object] | None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, str]:
        """POST to the gateway: (status, body text). A call that cannot connect (the
        gateway restarting) is made again once the gateway answers its health check;
        the restarted gateway knows the session (``GATEWAY_CALL_RETRY``)."""

        async def post() -> tuple[int, str]:
            async with self.http.post(
                f"{self.gateway_url}{path}", json=body, headers=headers
            ) as response:
                if response.status == 503:
                    raise GatewayBusy(await response.text())
                return response.status, await response.text()

        async def wait_for_gateway(exc: BaseException) -> None:
            log.warning("POST %s: %s; trying again once the gateway answers", path, exc)
            await self._wait_for_gateway()

        return await retry(post, GATEWAY_CALL_RETRY, on_retry=wait_for_gateway)


def _reward_bodies(reward: AgentReward) -> list[dict[str, object]]:
    """The ``/reward`` bodies for what an agent returned: one for the whole session, one
    per policy, or none (the task's verifier scores)."""
    if reward is None:
        return []
    if isinstance(reward, EpisodeReturn):
        return [{"reward": float(reward.reward), "step_rewards": list(reward.step_rewards)}]
    if isinstance(reward, Mapping):
        return [{"reward": float(value), "policy": policy} for policy, value in reward.items()]
    return [{"reward": float(reward)}]
