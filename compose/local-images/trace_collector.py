"""A small OTLP/HTTP trace collector that stands in for Jaeger.

It serves Jaeger's OTLP/HTTP receiver (``POST /v1/traces``, protobuf or OTLP/JSON,
optionally gzip- or deflate-compressed) and the two endpoints of Jaeger's HTTP query
API that the compose check reads (``GET /api/services`` and
``GET /api/services/<service>/operations``, same response shapes), for machines where
no Jaeger image is available (no image registry reachable). It also serves
``GET /api/spans-count``, which is its own and not Jaeger's.

Spans are kept in memory (per service: span name -> count) and lost on exit; trace and
span ids, timings and attributes are not kept.

    python trace_collector.py [--otlp-port 4318] [--query-port 16686] [--host 0.0.0.0]

Runs until SIGTERM or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import zlib
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"
# Applies to the body as sent and to the body after decompression (a small gzip body
# can expand to gigabytes).
MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_SERVICE = "unknown_service"
# Idle keep-alive connections are dropped after this many seconds.
CONNECTION_TIMEOUT_S = 60


class SpanStore:
    """Per service, how many spans of each name were received. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, dict[str, int]] = {}

    def add(self, spans: Iterable[tuple[str, str]]) -> None:
        """Record (service, span name) pairs; one request's spans are recorded together."""
        with self._lock:
            for service, name in spans:
                names = self._spans.setdefault(service, {})
                names[name] = names.get(name, 0) + 1

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._spans)

    def operations(self, service: str) -> list[str]:
        with self._lock:
            return sorted(self._spans.get(service, {}))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {service: sum(names.values()) for service, names in self._spans.items()}


class RequestError(Exception):
    """A request the collector refuses: answered with ``status`` and ``reason``."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def decode_content(body: bytes, content_encoding: str) -> bytes:
    """The body with its Content-Encoding undone, at most MAX_BODY_BYTES long."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS  # HTTP "deflate" is the zlib format
    else:
        raise RequestError(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"unsupported Content-Encoding {encoding!r}"
        )
    out = bytearray()
    data = body
    try:
        # A loop because a gzip body may consist of several members.
        while True:
            stream = zlib.decompressobj(wbits)
            out += stream.decompress(data, MAX_BODY_BYTES + 1 - len(out))
            if len(out) > MAX_BODY_BYTES:
                raise RequestError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"decompressed body is over {MAX_BODY_BYTES} bytes",
                )
            if not stream.eof:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"truncated {encoding} body")
            data = stream.unused_data
            if not data:
                return bytes(out)
            if encoding == "deflate":
                raise RequestError(HTTPStatus.BAD_REQUEST, "data after the deflate stream")
    except zlib.error as exc:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"invalid {encoding} body: {exc}") from exc


def parse_export_request(body: bytes, content_type: str) -> tuple[ExportTraceServiceRequest, bool]:
    """The parsed request, and whether it was OTLP/JSON (else protobuf)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    request = ExportTraceServiceRequest()
    if media_type == "application/x-protobuf":
        try:
            request.ParseFromString(body)
        except DecodeError as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"invalid protobuf body: {exc}") from exc
        return request, False
    if media_type == "application/json":
        # json.loads first: json_format.Parse accepts some non-objects (e.g. "[]").
        # OTLP/JSON writes trace and span ids in hex where the protobuf JSON mapping
        # expects base64; they decode to other bytes here, which is harmless because
        # ids are not kept.
        try:
            document = json.loads(body)
            if not isinstance(document, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "OTLP/JSON body is not an object")
            # Unknown fields are ignored, as OTLP asks of receivers.
            json_format.ParseDict(document, request, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"invalid OTLP/JSON body: {exc}") from exc
        return request, True
    raise RequestError(
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        f"unsupported Content-Type {content_type!r} "
        "(expected application/x-protobuf or application/json)",
    )


def spans_of(request: ExportTraceServiceRequest) -> list[tuple[str, str]]:
    """(service.name of the span's resource, span name) for every span in ``request``."""
    spans: list[tuple[str, str]] = []
    for resource_spans in request.resource_spans:
        service = DEFAULT_SERVICE
        for attribute in resource_spans.resource.attributes:
            if attribute.key == "service.name" and attribute.value.string_value:
                service = attribute.value.string_value
        for scope_spans in resource_spans.scope_spans:
            spans.extend((service, span.name) for span in scope_spans.spans)
    return spans


class CollectorServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose handlers share one SpanStore."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        store: SpanStore,
    ) -> None:
        self.store = store
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as exporters pool connections
    timeout = CONNECTION_TIMEOUT_S
    server_version = "sf-trace-collector"
    # For the errors http.server answers itself: plain text, like the collector's own.
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s\n"

    @property
    def store(self) -> SpanStore:
        assert isinstance(self.server, CollectorServer)
        return self.server.store

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: successful requests are not logged; refusals are, by _log_refusal."""

    def _log_refusal(self, status: int, reason: str) -> None:
        # http.server refuses some requests before it has parsed a method and path.
        method = getattr(self, "command", None) or "-"
        path = getattr(self, "path", None) or "-"
        print(
            f"trace_collector: {int(status)} {method} {path}: {reason}",
            file=sys.stderr,
            flush=True,
        )

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Errors http.server itself answers (malformed request line, oversized headers).
        self._log_refusal(code, message or self.responses.get(code, ("",))[0])
        super().send_error(code, message, explain)

    def _reply(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        # Every refusal closes the connection: an unread request body would otherwise be
        # read as the next request.
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class OtlpHandler(_Handler):
    """OTLP/HTTP trace receiver: POST /v1/traces."""

    def _refuse(
        self, status: HTTPStatus, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        self._log_refusal(status, reason)
        self._reply(status, f"{reason}\n".encode(), "text/plain; charset=utf-8", headers)

    def _read_body(self) -> bytes:
        if "Transfer-Encoding" in self.headers:
            raise RequestError(
                HTTPStatus.LENGTH_REQUIRED,
                "Transfer-Encoding is not supported; send Content-Length",
            )
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        # Only plain decimal digits: int() would also accept "+5", " 5" or "5_0".
        if not length_header.isascii() or not length_header.isdigit():
            raise RequestError(HTTPStatus.BAD_REQUEST, f"invalid Content-Length {length_header!r}")
        length = int(length_header)
        if length > MAX_BODY_BYTES:
            raise RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body is over {MAX_BODY_BYTES} bytes"
            )
        body = self.rfile.read(length)
        if len(body) != length:
            raise RequestError(HTTPStatus.BAD_REQUEST, "body shorter than Content-Length")
        return body

    def do_POST(self) -> None:
        if urlsplit(self.path).path != TRACES_PATH:
            self._refuse(HTTPStatus.NOT_FOUND, f"not found; traces go to POST {TRACES_PATH}")
            return
        try:
            body = self._read_body()
            content = decode_content(body, self.headers.get("Content-Encoding", ""))
            request, is_json = parse_export_request(content, self.headers.get("Content-Type", ""))
        except RequestError as exc:
            self._refuse(exc.status, exc.reason)
            return
        # Stored only once the whole request parsed: a refused request records nothing.
        self.store.add(spans_of(request))
        if is_json:
            self._reply(HTTPStatus.OK, b"{}", "application/json")
        else:
            response = ExportTraceServiceResponse().SerializeToString()
            self._reply(HTTPStatus.OK, response, "application/x-protobuf")

    def _not_post(self) -> None:
        if urlsplit(self.path).path != TRACES_PATH:
            self._refuse(HTTPStatus.NOT_FOUND, f"not found; traces go to POST {TRACES_PATH}")
        else:
            self._refuse(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"method {self.command} not allowed; use POST",
                {"Allow": "POST"},
            )

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_post


def jaeger_list(items: list[str]) -> dict[str, Any]:
    """The envelope Jaeger's HTTP query API puts around a list."""
    return {"data": items, "total": len(items), "limit": 0, "offset": 0, "errors": None}


class QueryHandler(_Handler):
    """The parts of Jaeger's HTTP query API the compose check reads, plus /api/spans-count."""

    _OPERATIONS_PREFIX = "/api/services/"
    _OPERATIONS_SUFFIX = "/operations"

    def _json(self, status: int, document: Any, headers: dict[str, str] | None = None) -> None:
        self._reply(status, json.dumps(document).encode(), "application/json", headers)

    def _refuse(
        self, status: HTTPStatus, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        self._log_refusal(status, reason)
        self._json(status, {"errors": [{"code": int(status), "msg": reason}]}, headers)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/api/services":
            self._json(HTTPStatus.OK, jaeger_list(self.store.services()))
        elif (
            path.startswith(self._OPERATIONS_PREFIX)
            and path.endswith(self._OPERATIONS_SUFFIX)
            and len(path) >= len(self._OPERATIONS_PREFIX) + len(self._OPERATIONS_SUFFIX)
        ):
            service = unquote(path[len(self._OPERATIONS_PREFIX) : -len(self._OPERATIONS_SUFFIX)])
            self._json(HTTPStatus.OK, jaeger_list(self.store.operations(service)))
        elif path == "/api/spans-count":
            # Not part of Jaeger's API: this collector's own.
            self._json(HTTPStatus.OK, {"data": self.store.counts()})
        else:
            self._refuse(HTTPStatus.NOT_FOUND, f"not found: {path}")

    def _not_get(self) -> None:
        self._refuse(
            HTTPStatus.METHOD_NOT_ALLOWED,
            f"method {self.command} not allowed; use GET",
            {"Allow": "GET"},
        )

    do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_get


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="In-memory OTLP/HTTP trace collector with a Jaeger-shaped query API."
    )
    parser.add_argument("--otlp-port", type=int, default=4318, help="OTLP/HTTP port")
    parser.add_argument("--query-port", type=int, default=16686, help="query API port")
    parser.add_argument("--host", default="0.0.0.0", help="address both servers bind")
    args = parser.parse_args(argv)

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    # Blocked before any thread starts, so every thread inherits the mask and the signals
    # stay pending until the main thread's sigwait takes them. A blocked signal is
    # queued even for PID 1 in a container, which otherwise drops signals it has no
    # handler for (docker stop would then wait for its timeout and kill).
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)

    store = SpanStore()
    try:
        otlp = CollectorServer((args.host, args.otlp_port), OtlpHandler, store)
        query = CollectorServer((args.host, args.query_port), QueryHandler, store)
    except OSError as exc:
        print(f"trace_collector: cannot listen on {args.host}: {exc}", file=sys.stderr)
        return 1
    servers = (otlp, query)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(
        f"trace_collector: OTLP/HTTP on http://{args.host}:{otlp.server_port}{TRACES_PATH}, "
        f"query API on http://{args.host}:{query.server_port}/api/services",
        flush=True,
    )

    signal.sigwait(stop_signals)
    # shutdown() waits for the serve_forever loop to notice (up to its 0.5 s poll), so
    # both servers are stopped at once. Handler threads are daemons: open keep-alive
    # connections do not hold the exit.
    stoppers = [threading.Thread(target=server.shutdown) for server in servers]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()
    for server in servers:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
