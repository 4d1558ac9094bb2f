"""OpenTelemetry set-up shared by every process, and trace context in NATS headers.

Spans go to two places: a JSONL file in the run directory (always, so every run can be
rendered into a timeline offline: ``seamlessflow timeline``, the run report) and an
OTLP/HTTP endpoint when one is configured (Jaeger in compose; the trace store of
``just trace-store`` on a workstation).

The standard OpenTelemetry environment variables apply as the OTel SDK defines them,
with the project's own settings fitted in (docs/observability.md has the table):

- service name: ``OTEL_SERVICE_NAME``, else ``service.name`` in
  ``OTEL_RESOURCE_ATTRIBUTES``, else the service's own name (``tag-scheduler``, ...).
  Compose sets ``OTEL_SERVICE_NAME=sf-<service>``, so two engine deployments (CPU and
  GPU) are two services in Jaeger.
- resource: ``OTEL_RESOURCE_ATTRIBUTES`` is merged in; ``sf.run_id`` is always the run's
  id (``SF_RUN_ID``): a stale value there would file spans under another run.
- endpoint: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL, used as it is), else
  the settings' base URL (``SF_OTLP_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``)
  with ``/v1/traces`` appended; none of them = no export.
- headers, timeout, compression, TLS files: ``OTEL_EXPORTER_OTLP_TRACES_*``, else
  ``OTEL_EXPORTER_OTLP_*``; the SDK's exporter reads them itself.
- protocol: OTLP/HTTP with protobuf only; ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
  naming another one stops the process rather than sending to a port that does not
  speak it.
- ``OTEL_SDK_DISABLED=true``: nothing is exported. The JSONL file is still written: it
  is the run's own record, which the report and the timeline read, not an export.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None

TRACES_PATH = "/v1/traces"
PROTOCOL = "http/protobuf"


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


def sdk_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``OTEL_SDK_DISABLED``, read as the SDK reads it (only ``true`` disables)."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def traces_endpoint(base_url: str, environ: Mapping[str, str] = os.environ) -> str:
    """The URL spans are sent to, or ``""`` for none (see the module docstring).

    ``base_url`` is the settings' ``otlp_endpoint`` (``SF_OTLP_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
    if sdk_disabled(environ):
        return ""
    if signal_url := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return signal_url
    base = base_url.strip().rstrip("/")
    if not base:
        return ""
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


class TelemetryConfigError(ValueError):
    """The OpenTelemetry variables ask for something this process cannot do."""


def check_protocol(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse an OTLP protocol other than the one spans are sent with."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise TelemetryConfigError(
                    f"{name}={protocol}: spans are sent as OTLP {PROTOCOL} only; set it to "
                    f"{PROTOCOL} (or unset it) and point the endpoint at the receiver's "
                    "OTLP/HTTP port (4318 on Jaeger and the OpenTelemetry Collector)"
                )
            return  # the signal-specific variable wins over the generic one


def service_resource(service_name: str, run_id: str = "") -> Resource:
    """The process's resource: ``service_name`` as the default ``service.name``, under
    what ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` say; ``sf.run_id`` last."""
    # Resource.create() also merges these variables, but *under* the attributes it is
    # given, so a service.name passed to it would beat OTEL_SERVICE_NAME
    attributes: dict[str, Any] = {SERVICE_NAME: service_name}
    attributes.update(OTELResourceDetector().detect().attributes)
    if run_id:
        attributes["sf.run_id"] = run_id
    return Resource.create(attributes)


def setup(
    service_name: str, *, jsonl_path: Path | None, otlp_endpoint: str = "", run_id: str = ""
) -> None:
    """Install the global tracer provider for this process (once). Every span carries
    the resource attribute ``sf.run_id``: in Jaeger, the tag that finds a run.

    ``service_name`` is the default ``service.name`` (``OTEL_SERVICE_NAME`` wins);
    ``otlp_endpoint`` is the settings' OTLP base URL (see :func:`traces_endpoint`)."""
    global _provider
    if _provider is not None:
        return
    endpoint = traces_endpoint(otlp_endpoint)
    if endpoint:
        check_protocol()
    resource = service_resource(service_name, run_id)
    provider = TracerProvider(resource=resource)
    # The SDK turns every tracer into a no-op under OTEL_SDK_DISABLED=true; the JSONL
    # record is the run's own (report, timeline), so only the export is left out (above).
    provider._disabled = False
    if jsonl_path is not None:
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(jsonl_path)))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        log.info("spans: OTLP to %s as %s", endpoint, resource.attributes[SERVICE_NAME])
    elif sdk_disabled() and (otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        log.info("spans: no OTLP export (OTEL_SDK_DISABLED=true); JSONL only")
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


class TraceContextMiddleware:
    """ASGI middleware: each HTTP request runs as a child of the W3C trace context in
    its headers (``traceparent``), so an agent's span is the parent of the gateway's
    and, through NATS, of the engine's. Without the header nothing changes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"traceparent", b"tracestate")
        }
        with extracted_context(headers):
            await self.app(scope, receive, send)


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
