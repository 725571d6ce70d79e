"""Helpers for the metrics tests: serve a registry on 127.0.0.1 and scrape it over HTTP
with :func:`tests.scrape.scrape` (prometheus-client's own parser)."""

from __future__ import annotations

import urllib.request
from typing import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from pdgrpc.metrics import start_metrics_server
from tests.scrape import Scrape, scrape


def scrape_text(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


@pytest.fixture
def serve() -> Iterator[Callable[[CollectorRegistry], Callable[[], Scrape]]]:
    """``scrape = serve(registry)`` starts an endpoint; ``scrape()`` reads it over HTTP."""
    stops: list[Callable[[], None]] = []

    def _serve(registry: CollectorRegistry) -> Callable[[], Scrape]:
        port, stop = start_metrics_server(registry, "127.0.0.1", 0)
        stops.append(stop)
        return lambda: scrape(f"127.0.0.1:{port}")

    yield _serve
    for stop in stops:
        stop()
