"""OpenTelemetry set-up shared by every process, and trace context in NATS headers.

Spans go to two places: a JSONL file in the run directory (always, so every run can be
rendered into a timeline offline) and an OTLP/HTTP endpoint when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (Jaeger in compose).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_provider: TracerProvider | None = None


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans as one JSON object per line (the run's local trace record)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._lock = threading.Lock()  # the batch processor exports from its worker thread

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [orjson.dumps(span_to_dict(span)) + b"\n" for span in spans]
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.writelines(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "service": span.resource.attributes.get("service.name"),
        "start": (span.start_time or 0) / 1e9,
        "end": (span.end_time or 0) / 1e9,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def setup(
    service_name: str, *, jsonl_path: Path | None, otlp_endpoint: str = "", run_id: str = ""
) -> None:
    """Install the global tracer provider for this process (once). Every span carries
    the resource attribute ``sf.run_id``: in Jaeger, the tag that finds a run."""
    global _provider
    if _provider is not None:
        return
    attributes = {"service.name": service_name}
    if run_id:
        attributes["sf.run_id"] = run_id
    provider = TracerProvider(resource=Resource.create(attributes))
    if jsonl_path is not None:
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(jsonl_path)))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown() -> None:
    """Flush and close exporters; safe to call twice."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers() -> dict[str, str]:
    """W3C trace context of the current span, as NATS headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def extracted_context(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block as a child of the trace context carried in ``headers``."""
    if not headers:
        yield
        return
    token = context.attach(propagate.extract(dict(headers)))
    try:
        yield
    finally:
        context.detach(token)
