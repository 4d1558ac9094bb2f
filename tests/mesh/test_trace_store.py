"""A run's spans in a real trace store: the scheduler's lend/reclaim spans and the
phases the timeline draws (its bubbles) can be found there.

The store is Arize Phoenix, installed by ``just trace-store`` into a venv of its own
(``.venv-traces``) and started by ``just trace-store-up`` as a server on free ports of
the loopback with its data under the test's tmp_path: the commands
docs/observability.md gives. An embedded colocated run (every service its own process;
colocated lends the training slots at every step) exports to it over OTLP/HTTP with
only the standard variables set. Phoenix keeps spans per project, named by the resource
attribute ``openinference.project.name``, and keeps no other resource attribute, so
the run files itself under its run id through ``OTEL_RESOURCE_ATTRIBUTES``, and the
service that produced a span is matched through the run's own record (``spans.jsonl``
has each span's ``service``, the store has its span id).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT, free_port, small_embedded_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = REPO_ROOT
PHOENIX = ROOT / ".venv-traces" / "bin" / "phoenix"
# deadlines against a hang, not speed targets: the install is ~1 min on a fresh machine
# (`just test` does it before the suite), the start ~10 s (a new database)
INSTALL_TIMEOUT_S = 600.0
START_TIMEOUT_S = 90.0
INGEST_TIMEOUT_S = 30.0


def just() -> str:
    """The project's ``just`` (installed into the venv with the dev extra)."""
    path = Path(sys.executable).parent / "just"
    assert path.exists(), f"no {path}: install the dev extra (README, Set-up)"
    return str(path)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture
def trace_store(tmp_path: Path) -> Iterator[str]:
    """The store's base URL (OTLP/HTTP at /v1/traces, REST API at /v1)."""
    if not PHOENIX.exists():  # `just test` installs it first; a bare pytest run here
        subprocess.run([just(), "trace-store"], cwd=ROOT, check=True, timeout=INSTALL_TIMEOUT_S)
    port, grpc_port = free_port(), free_port()
    data = tmp_path / "trace-store"
    log_path = tmp_path / "trace-store.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [just(), "trace-store-up", str(port), str(data), str(grpc_port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: just and the server stop together
        )
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"the trace store exited with {server.returncode} while starting:\n"
                    + log_path.read_text(errors="replace")[-3000:]
                )
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(
                    f"the trace store did not answer {url}/healthz within {START_TIMEOUT_S:.0f}"
                    " s:\n" + log_path.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.25)
        print(f"trace store up in {time.monotonic() - started:.1f} s")
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def stored_spans(url: str, project: str, names: list[str]) -> list[dict[str, Any]]:
    """Every span of ``project`` with one of ``names``, through the REST API's pages."""
    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = [("limit", "1000"), *(("name", n) for n in names)]
        if cursor:
            query.append(("cursor", cursor))
        try:
            page = get_json(f"{url}/v1/projects/{project}/spans?{urllib.parse.urlencode(query)}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # the project appears with its first span
                return []
            raise
        spans.extend(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def attribute(span: dict[str, Any], key: str) -> Any:
    """An attribute as the store returns it: flat (``resource.id``) or nested."""
    attributes = span["attributes"]
    if key in attributes:
        return attributes[key]
    for part in key.split("."):
        attributes = attributes[part]
    return attributes


async def test_a_runs_lends_and_bubbles_are_found_in_the_trace_store(
    trace_store: str,
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_") or n == "SF_OTLP_ENDPOINT"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", trace_store)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={run_id}")
    steps = 2
    summary = await small_embedded_run(
        run_id, tmp_path, base_model_dir, steps, nats_url=nats_url, mode="colocated"
    ).run()
    assert summary.status == "finished" and summary.final_version == steps

    # what the run recorded itself, by service
    recorded = [
        json.loads(line) for line in (tmp_path / run_id / "spans.jsonl").read_text().splitlines()
    ]
    lends = [s for s in recorded if s["name"] == "sched.lend"]
    assert lends and {s["service"] for s in lends} == {"tag-scheduler"}
    wanted_names = ["sched.lend", "sched.reclaim", "phase.idle", "phase.rollout", "phase.train"]
    wanted = {s["span_id"]: s for s in recorded if s["name"] in wanted_names}
    assert {s["name"] for s in wanted.values()} == set(wanted_names), "a span kind is missing"

    # the store ingests in the background: wait, bounded, for every one of them
    deadline = time.monotonic() + INGEST_TIMEOUT_S
    while True:
        stored = {
            s["context"]["span_id"]: s for s in stored_spans(trace_store, run_id, wanted_names)
        }
        missing = wanted.keys() - stored.keys()
        if not missing or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert not missing, (
        f"{len(missing)} of the run's {len(wanted)} spans are not in the store, e.g. "
        f"{[wanted[m]['name'] for m in sorted(missing)[:5]]}"
    )

    # the lends by the tag-scheduler, with the engines lent and the reason
    for lend in lends:
        in_store = stored[lend["span_id"]]
        assert in_store["name"] == "sched.lend"
        assert attribute(in_store, "lent") == lend["attributes"]["lent"] != []
        assert attribute(in_store, "reason") == lend["attributes"]["reason"]
    # the bubbles: idle phases with their resource and slots, at the recorded times
    idle = [s for s in wanted.values() if s["name"] == "phase.idle"]
    for span in idle:
        in_store = stored[span["span_id"]]
        assert attribute(in_store, "resource.id") == span["attributes"]["resource.id"]
        assert attribute(in_store, "resource.slots") == span["attributes"]["resource.slots"]
        assert in_store["parent_id"] is None  # phases are roots: lanes, not trees
    longest = max(idle, key=lambda s: s["end"] - s["start"])
    store_longest = max(
        (stored[s["span_id"]] for s in idle),
        key=lambda s: _seconds(s["end_time"]) - _seconds(s["start_time"]),
    )
    assert store_longest["context"]["span_id"] == longest["span_id"]  # the biggest bubble
    assert _seconds(store_longest["end_time"]) - _seconds(
        store_longest["start_time"]
    ) == pytest.approx(longest["end"] - longest["start"], abs=1e-3)
    # the store's filter on an attribute: the trainer's phases, as the docs show
    trainer_phases = get_json(
        f"{trace_store}/v1/projects/{run_id}/spans?"
        + urllib.parse.urlencode(
            [("name", "phase.train"), ("attribute", "resource.kind:trainer"), ("limit", "100")]
        )
    )["data"]
    assert len(trainer_phases) == steps


def _seconds(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp).timestamp()
