"""The standard OpenTelemetry environment variables reach a process's telemetry: a child
process sets telemetry up the way ``run_service`` does (its settings from the
environment) and exports to a real HTTP server that decodes the OTLP requests it
receives: the service name, resource attributes, endpoints, headers, protocol and
OTEL_SDK_DISABLED, with the precedence the module docstring of ``seamlessflow.telemetry``
gives. The rules themselves, as functions of an environment, are
tests/unit/test_telemetry_env_rules.py."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

# -- a child process exporting to a real OTLP/HTTP receiver ------------------------------

# What run_service does: the settings from the environment, then telemetry.setup.
CHILD = """
import sys
from pathlib import Path
from seamlessflow import telemetry
from seamlessflow.settings import MeshSettings
mesh = MeshSettings()
telemetry.setup(
    "tag-scheduler", jsonl_path=Path(sys.argv[1]), otlp_endpoint=mesh.otlp_endpoint,
    run_id=mesh.run_id,
)
with telemetry.tracer("probe").start_as_current_span("sched.lend"):
    pass
telemetry.shutdown()
"""


@dataclass
class Export:
    path: str
    headers: dict[str, str]
    request: ExportTraceServiceRequest

    def resources(self) -> list[dict[str, str]]:
        return [
            {a.key: a.value.string_value for a in spans.resource.attributes}
            for spans in self.request.resource_spans
        ]

    def span_names(self) -> list[str]:
        return [
            span.name
            for spans in self.request.resource_spans
            for scope in spans.scope_spans
            for span in scope.spans
        ]


@dataclass
class Receiver:
    url: str
    exports: list[Export] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver that accepts any path and keeps each request."""
    received = Receiver("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            headers = {k.lower(): v for k, v in self.headers.items()}
            received.exports.append(Export(self.path, headers, request))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    received.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield received
    server.shutdown()
    server.server_close()


def run_child(tmp_path: Path, **environ: str) -> list[dict]:  # type: ignore[type-arg]
    """Run CHILD with only these SF_/OTEL_ variables; the spans of its JSONL file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SF_", "OTEL_"))}
    env.update(environ)
    jsonl = tmp_path / "spans.jsonl"
    subprocess.run([sys.executable, "-c", CHILD, str(jsonl)], env=env, check=True, timeout=60)
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


@pytest.mark.integration  # a child process
def test_a_process_exports_under_otel_service_name_with_the_otel_headers_and_attributes(
    receiver: Receiver, tmp_path: Path
) -> None:
    """What compose sets (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME) plus resource
    attributes and headers (a collector's token): all of it arrives."""
    spans = run_child(
        tmp_path,
        SF_RUN_ID="env-run",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="sf-tag-scheduler",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci",
        OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20t0ken,x-tenant=rl",
    )
    [export] = receiver.exports
    assert export.path == "/v1/traces"
    assert export.headers["authorization"] == "Bearer t0ken"
    assert export.headers["x-tenant"] == "rl"
    [resource] = export.resources()
    assert resource["service.name"] == "sf-tag-scheduler"  # not the default tag-scheduler
    assert resource["deployment.environment"] == "ci"
    assert resource["sf.run_id"] == "env-run"
    assert export.span_names() == ["sched.lend"]
    # the run's own record names the service the same way
    assert [(s["name"], s["service"]) for s in spans] == [("sched.lend", "sf-tag-scheduler")]


@pytest.mark.integration  # a child process
def test_the_signal_specific_endpoint_and_headers_win(receiver: Receiver, tmp_path: Path) -> None:
    run_child(
        tmp_path,
        SF_OTLP_ENDPOINT="http://127.0.0.1:9",  # nothing listens there: must not be used
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.url}/otlp/traces",
        OTEL_EXPORTER_OTLP_HEADERS="x-generic=1",
        OTEL_EXPORTER_OTLP_TRACES_HEADERS="x-traces=2",
    )
    [export] = receiver.exports
    assert export.path == "/otlp/traces"  # as given: no /v1/traces appended
    assert export.headers["x-traces"] == "2" and "x-generic" not in export.headers
    assert export.resources()[0]["service.name"] == "tag-scheduler"  # the default


@pytest.mark.integration  # a child process
def test_otel_sdk_disabled_stops_the_export_but_not_the_runs_record(
    receiver: Receiver, tmp_path: Path
) -> None:
    spans = run_child(
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.url}/v1/traces",
        OTEL_SDK_DISABLED="true",
    )
    assert receiver.exports == []
    assert [s["name"] for s in spans] == ["sched.lend"]


@pytest.mark.integration  # a child process
def test_a_grpc_protocol_stops_the_process_with_the_reason(
    receiver: Receiver, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SF_", "OTEL_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "spans.jsonl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode != 0
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc: spans are sent as OTLP http/protobuf" in child.stderr
    assert receiver.exports == []
