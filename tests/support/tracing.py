"""An OTLP/HTTP trace receiver of the tests' own, and the spans it got."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Span:
    """A span as an OTLP receiver got it: ids in lowercase hex, `parent_span_id` empty for a
    root span; `kind` is "server", "client", "internal"...; `service` the resource's
    `service.name`."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    attributes: dict[str, Any]
    service: str | None


class OtlpReceiver:
    """What a receiver started by `otlp_receiver` got: every span of every export, decoded."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.exports = 0
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def take(self, body: bytes) -> None:
        """Decode one `ExportTraceServiceRequest` (the protobuf of POST /v1/traces)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _otlp_attributes(resource_spans.resource.attributes)
            service = resource.get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    kind = SpanMessage.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_")
                    spans.append(
                        Span(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=kind.lower(),
                            attributes=_otlp_attributes(span.attributes),
                            service=None if service is None else str(service),
                        )
                    )
        with self._lock:
            self.exports += 1
            self._spans += spans


def _otlp_attributes(pairs: Any) -> dict[str, Any]:
    """OTLP key-values as a dict of plain values (strings, numbers, booleans)."""
    return {
        pair.key: getattr(pair.value, pair.value.WhichOneof("value") or "", None) for pair in pairs
    }


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/HTTP receiver on a free port of 127.0.0.1, in a thread of this process: it
    answers POST /v1/traces (protobuf, gzip or not) as a collector does and keeps every span.
    Its `url` is what OTEL_EXPORTER_OTLP_ENDPOINT takes. Stopped on the way out."""
    import gzip
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            try:
                receiver.take(body)
            except Exception:  # not an export: a collector answers 400
                self.send_error(400)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no line per export on the test's output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
