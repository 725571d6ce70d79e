"""Helpers for the metrics tests: serve a registry on 127.0.0.1, scrape it over HTTP and
parse the text with prometheus-client's own parser (what a Prometheus server reads)."""

from __future__ import annotations

import urllib.request
from typing import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.metrics_core import Metric

from pdgrpc.metrics import start_metrics_server


def scrape_text(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


class Scrape:
    """One parsed scrape: families by name, and sample lookup by name + labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        """The value of the one sample called ``sample`` whose labels include ``labels``."""
        hits = [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(hits) == 1, f"{sample}{labels}: {len(hits)} matching samples"
        return hits[0]

    def has(self, sample: str, **labels: str) -> bool:
        return any(
            s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
            for f in self.families.values()
            for s in f.samples
        )


@pytest.fixture
def serve() -> Iterator[Callable[[CollectorRegistry], Callable[[], Scrape]]]:
    """``scrape = serve(registry)`` starts an endpoint; ``scrape()`` reads it over HTTP."""
    stops: list[Callable[[], None]] = []

    def _serve(registry: CollectorRegistry) -> Callable[[], Scrape]:
        port, stop = start_metrics_server(registry, "127.0.0.1", 0)
        stops.append(stop)
        return lambda: Scrape(scrape_text(port))

    yield _serve
    for stop in stops:
        stop()
