"""OpenTelemetry spans for each hop of a request; off unless a server is asked for them.

``--trace`` on every server (default: ``$PDGRPC_TRACE``, else ``$OTEL_TRACES_EXPORTER``,
else off) picks where spans go:

* ``otlp`` -- an OTLP collector (the ``otlp`` extra); the standard ``OTEL_EXPORTER_OTLP_*``
  variables set its endpoint and protocol (``grpc`` unless ``http/protobuf``);
* ``console`` -- one JSON object per span on stdout;
* ``file:DIR`` -- one JSON line per span in ``DIR/<service>-<pid>.jsonl`` (what
  ``bench e2e`` reads back: :func:`read_spans`);
* ``off``.

The SDK's other ``OTEL_*`` variables apply as usual: ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*`` (spans leave in batches, off the request path), ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED``.

One request is one trace. A server reads the W3C ``traceparent`` of the call it serves
(:func:`server`; smg sends one with ``--enable-trace``), opens its span under it, and
sends its own span's ``traceparent`` on the calls it makes for the request
(:meth:`Hops.metadata`): router -> prefill controller and decode, decode -> prefill worker
handshake. Between a prefill controller and its worker the span context travels in the
link frame (:func:`pack`, :func:`unpack`). Within a process, :class:`Hops` cuts the time
since the request arrived into consecutive hops (``worker.queue``, ``compute``,
``transfer``; ``decode.commit``, ``first_token``), each a child span.

Off, nothing of this runs: callers test the module flag :data:`enabled` first, so a
request allocates no span and reads no metadata, and OpenTelemetry is never imported.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "CONTEXT_BYTES",
    "Hops",
    "add_tracing_arguments",
    "enabled",
    "hop",
    "pack",
    "read_spans",
    "server",
    "setup_tracing",
    "unpack",
]

# The fast path: False until setup_tracing() installs an exporter. Read it before any other
# call of this module; every call below assumes tracing is on.
enabled = False

CONTEXT_BYTES = 25  # a packed span context: trace id (16), span id (8), trace flags (1)
ENV = "PDGRPC_TRACE"
_TRACEPARENT = "traceparent"
_MODES = ("off", "otlp", "console", "file:DIR")

_tracer: "Tracer | None" = None
_shutdown: Any = None
_api: Any = None  # opentelemetry.trace, once tracing is on
_propagator: Any = None  # the W3C trace context propagator, once tracing is on
# The hops of the request the current task serves (set by the task that serves it).
_current: "contextvars.ContextVar[Hops | None]" = contextvars.ContextVar("pdgrpc_trace_hops", default=None)


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--trace``."""
    parser.add_argument(
        "--trace", type=_trace_arg, default="", metavar="otlp|console|file:DIR|off",
        help="OpenTelemetry spans for each hop of a request: to an OTLP collector (OTEL_EXPORTER_OTLP_* "
        "variables; needs the otlp extra), to stdout, or as JSON lines in DIR; the W3C traceparent of an "
        f"incoming call is their parent. Default: ${ENV}, else $OTEL_TRACES_EXPORTER, else off",
    )


def _trace_arg(value: str) -> str:
    try:
        return choice(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def choice(value: str | None) -> str:
    """The tracing mode ``--trace`` ``value`` selects (empty: the environment's), checked."""
    if not value:
        value = os.environ.get(ENV) or os.environ.get("OTEL_TRACES_EXPORTER", "off")
    value = value.strip() or "off"
    if value == "none":  # OTEL_TRACES_EXPORTER's word for off
        value = "off"
    if value in ("off", "otlp", "console") or (value.startswith("file:") and len(value) > 5):
        return value
    raise ValueError(f"--trace: {value!r} is not one of {', '.join(_MODES)}")


def setup_tracing(value: str | None, service: str) -> None:
    """Install the exporter ``value`` (``--trace``) names for this process, whose spans
    carry ``service`` (e.g. ``prefill.dp0``) unless ``OTEL_SERVICE_NAME`` is set. Call
    once, at start-up; with tracing off it does nothing and imports nothing. Exits with a
    line naming the extra to install when OpenTelemetry is missing."""
    global enabled, _tracer, _shutdown, _api, _propagator
    mode = choice(value)
    if mode == "off" or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise SystemExit(f"--trace {mode}: OpenTelemetry is not installed (pip install opentelemetry-sdk): {exc}") from None
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"pdgrpc.{service}"}
    provider = TracerProvider(resource=Resource.create({**attrs, "pdgrpc.process": service}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(mode, service)))
    import opentelemetry.trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _api, _propagator = opentelemetry.trace, TraceContextTextMapPropagator()
    _tracer = provider.get_tracer("pdgrpc")
    _shutdown = provider.shutdown
    enabled = True


def shutdown() -> None:
    """Export the spans still queued and stop tracing (also done at exit)."""
    global enabled
    if _shutdown is not None:
        enabled = False
        _shutdown()


def _exporter(mode: str, service: str) -> "SpanExporter":
    if mode == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if mode == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        try:
            if protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        except ImportError as exc:
            raise SystemExit(f"--trace otlp: the OTLP exporter is not installed (pip install 'pdgrpc[otlp]'): {exc}") from None
        return OTLPSpanExporter()
    directory = Path(mode[len("file:"):])
    directory.mkdir(parents=True, exist_ok=True)
    return _file_exporter(directory / f"{service}-{os.getpid()}.jsonl")


def _file_exporter(path: Path) -> "SpanExporter":
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLines(SpanExporter):
        """Appends each span as one JSON line (flushed per batch) to a file of its own."""

        def __init__(self) -> None:
            self._file = open(path, "a", encoding="utf-8")

        def export(self, spans: "Sequence[ReadableSpan]") -> "SpanExportResult":
            for s in spans:
                c, p = s.context, s.parent
                assert c is not None
                self._file.write(json.dumps({
                    "name": s.name, "trace_id": f"{c.trace_id:032x}", "span_id": f"{c.span_id:016x}",
                    "parent_id": None if p is None else f"{p.span_id:016x}", "start_ns": s.start_time,
                    "end_ns": s.end_time, "service": s.resource.attributes.get("pdgrpc.process", ""),
                    "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
                }) + "\n")
            self._file.flush()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self._file.close()

    return JsonLines()


def read_spans(directory: str | Path) -> Iterator[dict[str, Any]]:
    """Every span the ``file:DIR`` exporters of all processes wrote to ``directory``."""
    for path in sorted(Path(directory).glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):  # a line still being written is skipped
                    yield json.loads(line)


# ---- the request path (only with `enabled`) -------------------------------------------


def ns_of(monotonic_s: float) -> int:
    """``time.monotonic()`` reading ``monotonic_s`` as span time (ns since the epoch)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Hops:
    """A request's span in this process, and the end of its last hop: :meth:`hop` records
    the time since then as a child span."""

    __slots__ = ("span", "mark")

    def __init__(self, span: "Span", mark: int) -> None:
        self.span = span
        self.mark = mark  # ns since the epoch

    def hop(self, name: str, start: int | None = None) -> None:
        """A child span ``name`` from ``start`` (default: the last hop's end) to now."""
        now = time.time_ns()
        begin = self.mark if start is None else start
        assert _tracer is not None
        _tracer.start_span(name, _api.set_span_in_context(self.span), start_time=begin).end(end_time=now)
        self.mark = now

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata making this span the parent of the call it goes with."""
        c = self.span.get_span_context()
        return ((_TRACEPARENT, f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"),)

    def pack(self) -> bytes:
        """This span's context in :data:`CONTEXT_BYTES` bytes (:func:`unpack`)."""
        c = self.span.get_span_context()
        return c.trace_id.to_bytes(16, "big") + c.span_id.to_bytes(8, "big") + bytes((int(c.trace_flags) & 0xFF,))

    def end(self, error: str | None = None) -> None:
        if error is not None:
            self.span.set_status(_api.Status(_api.StatusCode.ERROR, error))
        self.span.end()


def _start(name: str, parent: "Context | None", start: int | None = None) -> Hops:
    assert _tracer is not None
    begin = time.time_ns() if start is None else start
    return Hops(_tracer.start_span(name, parent, kind=_api.SpanKind.SERVER, start_time=begin), begin)


def server(name: str, metadata: Sequence[tuple[str, Any]] | None, start: int | None = None) -> Hops:
    """The span ``name`` of a call this process serves, under the ``traceparent`` in the
    call's ``metadata`` (``context.invocation_metadata()``) when it carries one."""
    carrier = {k: v for k, v in metadata or () if k in (_TRACEPARENT, "tracestate")}
    parent = _propagator.extract(carrier) if carrier else None
    return _start(name, parent, start)


def unpack(data: bytes) -> "Context":
    """A span context :meth:`Hops.pack` packed, as the parent of spans of this process."""
    ctx = _api.SpanContext(int.from_bytes(data[:16], "big"), int.from_bytes(data[16:24], "big"), True, _api.TraceFlags(data[24]))
    return _api.set_span_in_context(_api.NonRecordingSpan(ctx))


def serve(name: str, parent: "Context", start: int) -> Hops:
    """Open span ``name`` (from ``start``) under ``parent`` for the request the current
    task serves, so :func:`hop` reaches it from anywhere in the task."""
    hops = _start(name, parent, start)
    _current.set(hops)
    return hops


def hop(name: str) -> None:
    """:meth:`Hops.hop` on the request the current task serves (:func:`serve`), if any."""
    hops = _current.get()
    if hops is not None:
        hops.hop(name)
