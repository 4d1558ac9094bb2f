"""compose/local-images/trace_collector.py, the Jaeger stand-in, run as a real server.

Each test starts the script as its own process on free ports, talks to it over HTTP
(the real OTLP/HTTP span exporter, or hand-made bodies), and stops it with SIGTERM,
which must end it with exit code 0.
"""

from __future__ import annotations

import gzip
import http.client
import json
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from tests.support import REPO_ROOT, free_ports

pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "compose" / "local-images" / "trace_collector.py"
JAEGER_ENVELOPE_KEYS = {"data", "total", "limit", "offset", "errors"}


class Collector:
    """The script as a subprocess on 127.0.0.1."""

    def __init__(self) -> None:
        self.otlp_port, self.query_port = free_ports(2)
        self.traces_url = f"http://127.0.0.1:{self.otlp_port}/v1/traces"
        self.query_url = f"http://127.0.0.1:{self.query_port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "--host",
                "127.0.0.1",
                "--otlp-port",
                str(self.otlp_port),
                "--query-port",
                str(self.query_port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout = self.stderr = ""
        self.http = httpx.Client(timeout=10)
        self._wait_until_answering()

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + 60  # generous: the machine may be busy
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"collector exited with {self.proc.returncode}: {out}{err}")
            try:
                if self.http.get(f"{self.query_url}/api/services").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        self.stop()
        pytest.fail("collector did not answer within 60 s")

    def get(self, path: str) -> httpx.Response:
        return self.http.get(f"{self.query_url}{path}")

    def services(self) -> list[str]:
        response = self.get("/api/services")
        assert response.status_code == 200
        document = response.json()
        assert set(document) == JAEGER_ENVELOPE_KEYS
        assert document["total"] == len(document["data"])
        return document["data"]

    def operations(self, service: str) -> list[str]:
        response = self.get(f"/api/services/{service}/operations")
        assert response.status_code == 200
        document = response.json()
        assert set(document) == JAEGER_ENVELOPE_KEYS
        assert document["total"] == len(document["data"])
        return document["data"]

    def counts(self) -> dict[str, int]:
        response = self.get("/api/spans-count")
        assert response.status_code == 200
        return response.json()["data"]

    def post(self, body: bytes, content_type: str, **headers: str) -> httpx.Response:
        all_headers = {"Content-Type": content_type, **headers}
        return self.http.post(self.traces_url, content=body, headers=all_headers)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``, wait for the exit; the exit code."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.stdout, self.stderr = self.proc.communicate(timeout=30)
        return self.proc.returncode


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    try:
        yield running
    finally:
        if running.proc.returncode is None:
            code = running.stop()
            assert code == 0, f"exit code {code} after SIGTERM: {running.stderr}"


def export_request(resources: dict[str | None, list[str]]) -> ExportTraceServiceRequest:
    """One ResourceSpans per entry: service.name (None: no such attribute) -> span names."""
    request = ExportTraceServiceRequest()
    for number, (service, names) in enumerate(resources.items()):
        attributes = []
        if service is not None:
            attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=service)))
        spans = [
            Span(
                trace_id=bytes([number + 1]) * 16,
                span_id=bytes([number + 1, index + 1]) * 4,
                name=name,
                start_time_unix_nano=1_000,
                end_time_unix_nano=2_000,
            )
            for index, name in enumerate(names)
        ]
        request.resource_spans.append(
            ResourceSpans(
                resource=ResourceProto(attributes=attributes),
                scope_spans=[ScopeSpans(spans=spans)],
            )
        )
    return request


def test_spans_from_the_otlp_exporter_are_listed_per_service(collector: Collector) -> None:
    # Two providers with their own resources, as two processes would export them: one
    # batches and gzips, the other exports each span uncompressed as it ends.
    alpha = TracerProvider(resource=Resource.create({"service.name": "sf-alpha"}))
    alpha.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(
                endpoint=collector.traces_url, compression=Compression.Gzip, timeout=10
            )
        )
    )
    beta = TracerProvider(resource=Resource.create({"service.name": "sf-beta"}))
    beta.add_span_processor(
        SimpleSpanProcessor(
            OTLPSpanExporter(
                endpoint=collector.traces_url, compression=Compression.NoCompression, timeout=10
            )
        )
    )
    alpha_tracer = alpha.get_tracer("test")
    with alpha_tracer.start_as_current_span("train"):
        for _ in range(2):
            with alpha_tracer.start_as_current_span("step"):
                pass
    beta_tracer = beta.get_tracer("test")
    for name in ("serve", "tokenize", "serve"):
        with beta_tracer.start_as_current_span(name):
            pass
    try:
        assert alpha.force_flush(10_000)
        assert beta.force_flush(10_000)
    finally:
        alpha.shutdown()
        beta.shutdown()

    assert collector.services() == ["sf-alpha", "sf-beta"]
    assert collector.operations("sf-alpha") == ["step", "train"]
    assert collector.operations("sf-beta") == ["serve", "tokenize"]
    assert collector.counts() == {"sf-alpha": 3, "sf-beta": 3}
    # Unknown service: an empty list in the same envelope, as Jaeger answers.
    assert collector.operations("sf-gamma") == []


@pytest.mark.parametrize("encoding", ["identity", "gzip", "deflate"])
def test_protobuf_body_gets_an_export_response(collector: Collector, encoding: str) -> None:
    body = export_request({"svc/with space": ["a", "b"], None: ["orphan"]}).SerializeToString()
    compressed = {"identity": body, "gzip": gzip.compress(body), "deflate": zlib.compress(body)}
    response = collector.post(
        compressed[encoding], "application/x-protobuf", **{"Content-Encoding": encoding}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-protobuf"
    assert ExportTraceServiceResponse.FromString(response.content) == ExportTraceServiceResponse()
    assert collector.counts() == {"svc/with space": 2, "unknown_service": 1}
    # A service name with characters that need escaping in a URL path.
    assert collector.operations("svc%2Fwith%20space") == ["a", "b"]


def test_otlp_json_body_is_accepted(collector: Collector) -> None:
    # The shape of the OTLP/JSON example in the OTLP specification: hex ids, int64 as
    # strings, enums as numbers, lowerCamelCase keys.
    document: dict[str, Any] = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "sf-json"}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "manual", "version": "1.0"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "eee19b7ec3c1b173",
                                "name": name,
                                "kind": 2,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [{"key": "n", "value": {"intValue": "3"}}],
                                "status": {},
                            }
                            for name in ("rollout", "reward", "rollout")
                        ],
                    }
                ],
            }
        ]
    }
    response = collector.post(json.dumps(document).encode(), "application/json; charset=utf-8")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {}
    assert collector.services() == ["sf-json"]
    assert collector.operations("sf-json") == ["reward", "rollout"]
    assert collector.counts() == {"sf-json": 3}


def test_unparseable_bodies_are_refused_and_record_nothing(collector: Collector) -> None:
    ok = collector.post(
        export_request({"sf-before": ["x"]}).SerializeToString(), "application/x-protobuf"
    )
    assert ok.status_code == 200
    before = collector.counts()
    assert before == {"sf-before": 1}

    # Two resources; the cut falls inside the second, after the first is complete. A
    # collector that stored while parsing would have recorded sf-cut-a.
    two = export_request({"sf-cut-a": ["first"], "sf-cut-b": ["second"]})
    whole = two.SerializeToString()
    first_length = len(export_request({"sf-cut-a": ["first"]}).SerializeToString())
    cut = whole[: first_length + (len(whole) - first_length) // 2]
    refused: list[tuple[bytes, str, dict[str, str]]] = [
        (b"not a protobuf message", "application/x-protobuf", {}),
        (cut, "application/x-protobuf", {}),
        (gzip.compress(whole)[:-12], "application/x-protobuf", {"Content-Encoding": "gzip"}),
        (whole, "application/x-protobuf", {"Content-Encoding": "gzip"}),
        (b'{"resourceSpans": [', "application/json", {}),
        (b'{"resourceSpans": 3}', "application/json", {}),
        (b"[]", "application/json", {}),
    ]
    for body, content_type, headers in refused:
        response = collector.post(body, content_type, **headers)
        assert response.status_code == 400, (body[:40], response.text)
        assert response.headers["content-type"].startswith("text/plain")
        assert response.text.strip()
    assert collector.counts() == before
    assert collector.services() == ["sf-before"]

    # The uncut body is valid: the cut alone made it fail.
    assert collector.post(whole, "application/x-protobuf").status_code == 200
    assert collector.counts() == {"sf-before": 1, "sf-cut-a": 1, "sf-cut-b": 1}

    # Each refusal is one line on stderr, with its status and reason.
    assert collector.stop() == 0
    refusals = [line for line in collector.stderr.splitlines() if " 400 POST /v1/traces" in line]
    assert len(refusals) == len(refused), collector.stderr
    assert any("invalid protobuf body" in line for line in refusals)
    assert any("truncated gzip body" in line for line in refusals)


def test_wrong_methods_paths_and_media_types(collector: Collector) -> None:
    get_traces = collector.http.get(collector.traces_url)
    assert get_traces.status_code == 405
    assert get_traces.headers["allow"] == "POST"

    other_signal = collector.http.post(
        f"http://127.0.0.1:{collector.otlp_port}/v1/logs",
        content=b"",
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert other_signal.status_code == 404

    text = collector.post(b"hello", "text/plain")
    assert text.status_code == 415
    unknown_encoding = collector.post(b"", "application/x-protobuf", **{"Content-Encoding": "br"})
    assert unknown_encoding.status_code == 415

    for path in ("/api/traces", "/", "/api/services/x"):
        missing = collector.get(path)
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/json"
        (error,) = missing.json()["errors"]
        assert error["code"] == 404
        assert error["msg"]
    post_query = collector.http.post(f"{collector.query_url}/api/services", content=b"")
    assert post_query.status_code == 405
    assert post_query.json()["errors"][0]["code"] == 405

    assert collector.counts() == {}
    assert collector.services() == []


def raw_post(port: int, headers: dict[str, str]) -> int:
    """POST /v1/traces with exactly ``headers`` and no body; the status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/traces")
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_body_length_is_checked_before_reading(collector: Collector) -> None:
    proto = {"Content-Type": "application/x-protobuf"}
    assert raw_post(collector.otlp_port, proto) == 411
    assert raw_post(collector.otlp_port, {**proto, "Content-Length": "-1"}) == 400
    assert raw_post(collector.otlp_port, {**proto, "Content-Length": "ten"}) == 400
    # Answered at once, without waiting for a body that never comes.
    assert raw_post(collector.otlp_port, {**proto, "Content-Length": str(2**40)}) == 413
    # The decompressed size counts too: 65 MiB of zeros gzip to about 64 KiB.
    bomb = gzip.compress(bytes(65 * 1024 * 1024))
    response = collector.post(bomb, "application/x-protobuf", **{"Content-Encoding": "gzip"})
    assert response.status_code == 413
    assert collector.counts() == {}


def test_sigint_also_exits_0() -> None:
    running = Collector()
    assert running.stop(signal.SIGINT) == 0
    assert "127.0.0.1" in running.stdout
    assert str(running.otlp_port) in running.stdout
