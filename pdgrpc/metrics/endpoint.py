"""Serving one registry as Prometheus text over HTTP, and the ``--metrics-port`` flag.

:func:`start_metrics_server` runs a small threaded WSGI server (prometheus-client's
exposition app: ``/metrics``, gzip when asked, ``?name[]=`` filters; ``*_created`` series
left out) on its own thread and returns the bound port and a ``stop`` callable.

``stop`` shuts the listener down and joins its thread and every request thread, so a
stopped server leaves no thread behind. It is idempotent and normally returns within
0.1 s; a client that connected and sends nothing is cut off by the per-connection
timeout (``request_timeout_s``, 5 s by default), the longest ``stop`` can block. From
async code that cannot afford that worst case: ``await asyncio.to_thread(stop)``.

Wiring a server's CLI takes three lines::

    add_metrics_arguments(parser)                                 # build_parser()
    stop_metrics = start_metrics_from_args(ns, metrics.registry, "decode")   # main()
    ...                                                           # serve
    stop_metrics()                                                # on shutdown
"""

from __future__ import annotations

import argparse
import logging
import socket
import socketserver
import threading
from typing import Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdgrpc import argtypes
from pdgrpc.errors import ConfigError

__all__ = [
    "METRICS_PORT_HELP",
    "WithoutCreated",
    "add_metrics_arguments",
    "derived_metrics_port",
    "start_metrics_from_args",
    "start_metrics_server",
]

log = logging.getLogger("pdgrpc.metrics")

# A scrape is one short request; a client that holds a connection longer is dropped, which
# bounds how long stop() can wait for a request thread.
_REQUEST_TIMEOUT_S = 5.0


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class name
        pass  # one access-log line per scrape would drown the request events


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    # Non-daemon request threads that server_close() joins: stopping the server really
    # stops everything it started.
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True


class WithoutCreated(Collector):
    """The registry minus prometheus-client's ``*_created`` timestamp series, which the
    text format exposes as one extra gauge family per counter and histogram: they double
    the page and say nothing an operator of these servers uses."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self._registry.collect():
            kept = [s for s in m.samples if not s.name.endswith("_created")]
            if len(kept) != len(m.samples):
                m = _copy(m, kept)
            yield m

    def restricted_registry(self, names: Iterable[str]) -> "WithoutCreated":
        # make_wsgi_app calls this for ?name[]=... scrapes.
        return WithoutCreated(self._registry.restricted_registry(names))


def _copy(m: Metric, samples: list[Any]) -> Metric:
    out = Metric(m.name, m.documentation, m.type, m.unit)
    out.samples = samples
    return out


def _family_for(host: str) -> socket.AddressFamily:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return socket.AF_INET  # let bind() report the bad host
    return infos[0][0]


def start_metrics_server(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, request_timeout_s: float = _REQUEST_TIMEOUT_S,
) -> tuple[int, Callable[[], None]]:
    """Serve ``registry`` on ``http://host:port/metrics`` (``port`` 0: a free one); a
    connection idle for ``request_timeout_s`` is dropped.

    Returns ``(bound_port, stop)``. Raises ``OSError`` when the address is taken."""

    class Server(_Server):
        address_family = _family_for(host)

    class Handler(_Handler):
        timeout = request_timeout_s

    httpd = make_server(host, port, make_wsgi_app(WithoutCreated(registry)), Server, handler_class=Handler)
    bound = int(httpd.server_address[1])
    # Daemon: a server that exits without calling stop() must not hang on this thread.
    # poll_interval bounds how long shutdown() waits for the loop to notice.
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name=f"pdgrpc-metrics:{bound}", daemon=True)
    thread.start()
    stopped = threading.Lock()
    done = [False]

    def stop() -> None:
        with stopped:
            if done[0]:
                return
            done[0] = True
            httpd.shutdown()  # returns once serve_forever has left its loop
            httpd.server_close()  # closes the socket, joins request threads
            thread.join()

    return bound, stop


METRICS_PORT_HELP = (
    "serve Prometheus metrics (text format) on http://METRICS_HOST:PORT/metrics; 0 picks a free port, "
    "printed in the log line 'pdgrpc <server> metrics on http://HOST:PORT/metrics'. Absent: no metrics endpoint"
)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` (absent = disabled, 0 = free port) and ``--metrics-host``."""
    g = parser.add_argument_group("metrics")
    g.add_argument("--metrics-port", type=argtypes.port, default=None, metavar="PORT", help=METRICS_PORT_HELP)
    g.add_argument(
        "--metrics-host", default="127.0.0.1", metavar="HOST",
        help="address the metrics endpoint listens on; 0.0.0.0 = every IPv4 interface. It is plain HTTP without "
        "authentication: an address other than loopback needs --insecure (default: %(default)s)",
    )


def _noop() -> None:
    pass


def start_metrics_from_args(ns: argparse.Namespace, registry: CollectorRegistry, what: str) -> Callable[[], None]:
    """Start the endpoint that ``--metrics-port``/``--metrics-host`` ask for and log
    ``pdgrpc <what> metrics on http://HOST:PORT/metrics`` with the bound port. Returns
    ``stop`` (a no-op when ``--metrics-port`` was not given). Raises OSError naming both
    flags and the reason when the address cannot be listened on: like a taken ``--port``,
    the process then ends with status 1 (:func:`pdgrpc.serving.launch.launch`)."""
    port = getattr(ns, "metrics_port", None)
    if port is None:
        return _noop
    host = getattr(ns, "metrics_host", "127.0.0.1")
    shown = f"[{host}]" if ":" in host else host
    try:
        bound, stop = start_metrics_server(registry, host, port)
    except OSError as exc:  # a port in use, a host not of this machine: name the flags, not just the errno
        why = exc.strerror or str(exc)
        raise OSError(f"--metrics-port {port} --metrics-host {host}: cannot listen on http://{shown}:{port}: {why}") from None
    log.info("pdgrpc %s metrics on http://%s:%d/metrics", what, shown, bound)
    return stop


def derived_metrics_port(base: int | None, offset: int) -> int | None:
    """The metrics port of a child process of a server whose own ``--metrics-port`` is
    ``base``: ``base + offset`` (``offset`` >= 1), so a scrape config can list them all.
    Prefill dp worker ``r``: offset ``1 + r``; decode TP rank ``r`` >= 1: offset ``r``.
    0 stays 0 (each child picks a free port and logs it); None (metrics off) stays None.
    A port past 65535 is a ConfigError (a ValueError) naming the flag; a server asks for
    its last child's port before it starts any child, so the error is one line at start."""
    if offset < 1:
        raise ValueError(f"offset must be >= 1 (the parent serves on the base port), got {offset}")
    if base is None or base == 0:
        return base
    port = base + offset
    if port > 65535:
        raise ConfigError(f"--metrics-port {base} leaves no port at offset {offset} (would be {port})")
    return port
