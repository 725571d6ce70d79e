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
link frame (:meth:`Hops.pack`, :func:`unpack`). Within a process, :class:`Hops` cuts the
time since the request arrived into consecutive hops (``router.prepare``; ``worker.queue``,
``compute``, ``write``, ``transfer``; ``decode.commit``, ``first_token``), each a child
span. A sampled parent's children are sampled; a request without a parent is sampled as
``OTEL_TRACES_SAMPLER`` says.

On the request's path a span is only its ids and times: the SDK's span objects, which
cost tens of microseconds each, are made on the event loop's next turn after the span
ends (:meth:`Hops.end`), with the ids and times recorded, so tracing a request does not
delay it.

Off, nothing of this runs: callers test the module flag :data:`enabled` first, so a
request allocates no span and reads no metadata, and OpenTelemetry is never imported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Tracer

__all__ = [
    "CONTEXT_BYTES",
    "Hops",
    "add_tracing_arguments",
    "enabled",
    "hop",
    "read_spans",
    "serve",
    "server",
    "setup_tracing",
    "shutdown",
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
_sampler: "Sampler | None" = None
_ids: Any = None  # the provider's id generator (_PresetIds), once tracing is on
_shutdown: Any = None
_api: Any = None  # opentelemetry.trace, once tracing is on
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
        return _checked(*_source(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _source(value: str | None) -> tuple[str, str]:
    """The mode ``--trace`` ``value`` names (empty: the environment's), and what names it
    ("" for the flag, else ``$VARIABLE``): a bad mode is refused naming where it came from."""
    if value:
        return value, ""
    for var in (ENV, "OTEL_TRACES_EXPORTER"):
        if os.environ.get(var):
            return os.environ[var], f"${var} "
    return "off", ""


def _checked(value: str, source: str) -> str:
    value = value.strip() or "off"
    if value == "none":  # OTEL_TRACES_EXPORTER's word for off
        value = "off"
    if value in ("off", "otlp", "console") or (value.startswith("file:") and len(value) > 5):
        return value
    raise ValueError(f"{source}{value!r} is not one of {', '.join(_MODES)}")


def choice(value: str | None) -> str:
    """The tracing mode ``--trace`` ``value`` selects (empty: the environment's), checked:
    ValueError naming the flag or the variable that gave a bad one."""
    mode, source = _source(value)
    return _checked(mode, source or "--trace: ")


def setup_tracing(value: str | None, service: str) -> None:
    """Install the exporter ``value`` (``--trace``) names for this process, whose spans
    carry ``service`` (e.g. ``prefill.dp0``) unless ``OTEL_SERVICE_NAME`` is set. Call
    once, at start-up; with tracing off it does nothing and imports nothing. Exits with a
    line naming the extra to install when OpenTelemetry is missing, or naming the flag
    when ``file:DIR`` cannot be made a directory."""
    global enabled, _tracer, _sampler, _ids, _shutdown, _api
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
    _ids = _preset_ids()
    provider = TracerProvider(resource=Resource.create({**attrs, "pdgrpc.process": service}), id_generator=_ids)
    provider.add_span_processor(BatchSpanProcessor(_exporter(mode, service)))
    import opentelemetry.trace

    _api, _sampler = opentelemetry.trace, provider.sampler
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
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, no permission: the flag is what to fix
        raise SystemExit(f"--trace {mode}: cannot make the directory: {exc.strerror}") from None
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


def _preset_ids() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        """The ids a span was given on the request's path, when the SDK makes it later."""

        trace_id = 0
        span_id = 0

        def generate_span_id(self) -> int:
            span_id, self.span_id = self.span_id, 0
            return span_id or super().generate_span_id()

        def generate_trace_id(self) -> int:
            trace_id, self.trace_id = self.trace_id, 0
            return trace_id or super().generate_trace_id()

    return PresetIds()


# ---- the request path (only with `enabled`) -------------------------------------------


def ns_of(monotonic_s: float) -> int:
    """``time.monotonic()`` reading ``monotonic_s`` as span time (ns since the epoch)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _span_id() -> int:
    return random.getrandbits(64) or 1


class Hops:
    """A request's span in this process, and the end of its last hop: :meth:`hop` records
    the time since then as a child span. Unsampled, it records nothing and passes the
    decision on."""

    __slots__ = ("name", "trace_id", "span_id", "parent_id", "sampled", "recording", "start", "mark", "hops")

    def __init__(self, name: str, trace_id: int, parent_id: int, sampled: bool, start: int) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = _span_id()
        self.parent_id = parent_id  # 0: the root of its trace
        self.sampled = sampled
        self.recording = sampled  # sampled, and not ended yet
        self.start = start  # ns since the epoch
        self.mark = start  # the end of the last hop
        self.hops: list[tuple[str, int, int]] = []

    def hop(self, name: str, start: int | None = None, end: int | None = None) -> None:
        """A child span ``name`` from ``start`` (default: the last hop's end) to ``end``
        (default: now), where the next hop starts."""
        now = time.time_ns() if end is None else end
        if self.recording:
            self.hops.append((name, self.mark if start is None else start, now))
        self.mark = now

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata making this span the parent of the call it goes with."""
        return ((_TRACEPARENT, f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"),)

    def pack(self) -> bytes:
        """This span's context in :data:`CONTEXT_BYTES` bytes (:func:`unpack`)."""
        return self.trace_id.to_bytes(16, "big") + self.span_id.to_bytes(8, "big") + (b"\x01" if self.sampled else b"\x00")

    def end(self, error: str | None = None) -> None:
        """The span ends now (with ``error``: as failed); its SDK spans are made on the
        loop's next turn."""
        if not self.recording:
            return
        self.recording = False
        end = time.time_ns()
        try:
            asyncio.get_running_loop().call_soon(self._emit, end, error)
        except RuntimeError:  # no loop in this thread
            self._emit(end, error)

    def _emit(self, end: int, error: str | None) -> None:
        assert _tracer is not None
        api = _api
        parent = None
        if self.parent_id:
            remote = api.SpanContext(self.trace_id, self.parent_id, True, api.TraceFlags(api.TraceFlags.SAMPLED))
            parent = api.set_span_in_context(api.NonRecordingSpan(remote))
        else:
            _ids.trace_id = self.trace_id
        _ids.span_id = self.span_id
        span = _tracer.start_span(self.name, parent, kind=api.SpanKind.SERVER, start_time=self.start)
        inside = api.set_span_in_context(span)
        for name, begin, finish in self.hops:
            _tracer.start_span(name, inside, start_time=begin).end(end_time=finish)
        if error is not None:
            span.set_status(api.Status(api.StatusCode.ERROR, error))
        span.end(end_time=end)


def _root(name: str, start: int) -> Hops:
    trace_id = random.getrandbits(128) or 1
    assert _sampler is not None
    sampled = _sampler.should_sample(None, trace_id, name).decision.is_sampled()
    return Hops(name, trace_id, 0, sampled, start)


def server(name: str, metadata: Sequence[tuple[str, Any]] | None, start: int | None = None) -> Hops:
    """The span ``name`` of a call this process serves, under the ``traceparent`` in the
    call's ``metadata`` (``context.invocation_metadata()``) when it carries a valid one."""
    begin = time.time_ns() if start is None else start
    value = next((v for k, v in metadata or () if k == _TRACEPARENT), None)
    if isinstance(value, str):
        parts = value.strip().split("-")
        try:
            if len(parts) >= 4 and parts[0] != "ff" and len(parts[1]) == 32 and len(parts[2]) == 16 and len(parts[3]) == 2:
                trace_id, parent_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
                if trace_id and parent_id:
                    return Hops(name, trace_id, parent_id, bool(flags & 1), begin)
        except ValueError:  # not hex: as if none came
            pass
    return _root(name, begin)


def unpack(data: bytes) -> tuple[int, int, bool]:
    """The span context :meth:`Hops.pack` packed: trace id, span id, sampled."""
    return int.from_bytes(data[:16], "big"), int.from_bytes(data[16:24], "big"), bool(data[24] & 1)


def serve(name: str, parent: tuple[int, int, bool], start: int) -> Hops:
    """Open span ``name`` (from ``start``) under ``parent`` (:func:`unpack`) for the
    request the current task serves, so :func:`hop` reaches it from anywhere in the task."""
    hops = Hops(name, parent[0], parent[1], parent[2], start)
    _current.set(hops)
    return hops


def hop(name: str, end: int | None = None) -> None:
    """:meth:`Hops.hop` on the request the current task serves (:func:`serve`), if any."""
    hops = _current.get()
    if hops is not None:
        hops.hop(name, end=end)
