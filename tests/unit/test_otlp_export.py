"""Spans reach an OTLP/HTTP receiver (what Jaeger runs in compose), with trace context
carried across processes. The receiver is a real HTTP server decoding real OTLP."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

CHILD = """
import sys
from seamlessflow import telemetry
telemetry.setup("otlp-probe", jsonl_path=None, otlp_endpoint=sys.argv[1], run_id="probe-run")
tracer = telemetry.tracer("probe")
with tracer.start_as_current_span("parent"):
    headers = telemetry.inject_headers()
with telemetry.extracted_context(headers), tracer.start_as_current_span("child"):
    pass
telemetry.shutdown()
"""


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    received: list[ExportTraceServiceRequest] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.append(request)
                self.send_response(200)
            else:
                self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_spans_are_exported_over_otlp_http_with_context_propagated(receiver) -> None:  # type: ignore[no-untyped-def]
    url, received = receiver
    subprocess.run([sys.executable, "-c", CHILD, url], check=True, timeout=60)
    spans = {}
    for request in received:
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            assert service["service.name"] == "otlp-probe"
            assert service["sf.run_id"] == "probe-run"  # what finds a run in Jaeger
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans[span.name] = span
    assert set(spans) == {"parent", "child"}
    # the child was started from the injected W3C headers: same trace, parent link
    assert spans["child"].trace_id == spans["parent"].trace_id
    assert spans["child"].parent_span_id == spans["parent"].span_id


HTTP_CHILD = """
import asyncio, sys
from pathlib import Path
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from seamlessflow import telemetry
telemetry.setup("http-probe", jsonl_path=Path(sys.argv[1]), run_id="probe-run")
tracer = telemetry.tracer("probe")

async def handler(request):
    with tracer.start_as_current_span("gateway.turn"):
        return JSONResponse({})

app = Starlette(routes=[Route("/x", handler, methods=["POST"])],
                middleware=[Middleware(telemetry.TraceContextMiddleware)])

async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        with tracer.start_as_current_span("agent.sample"):
            await http.post("/x", headers=telemetry.inject_headers())
        await http.post("/x")  # no trace context: a trace of its own

asyncio.run(main())
telemetry.shutdown()
"""


def test_an_http_call_carrying_trace_context_makes_the_gateway_span_its_child(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """The agents' calls carry the W3C context of their ``agent.sample`` span; the
    gateway's middleware makes its spans children of it (agents' spans were missing
    from compose's traces, and nothing linked them to the gateway's)."""
    import json

    out = tmp_path / "spans.jsonl"
    subprocess.run([sys.executable, "-c", HTTP_CHILD, str(out)], check=True, timeout=60)
    spans = [json.loads(line) for line in out.read_text().splitlines()]
    [agent] = [s for s in spans if s["name"] == "agent.sample"]
    linked, alone = [s for s in spans if s["name"] == "gateway.turn"]
    assert linked["trace_id"] == agent["trace_id"]
    assert linked["parent_id"] == agent["span_id"]
    assert alone["trace_id"] != agent["trace_id"] and alone["parent_id"] is None
