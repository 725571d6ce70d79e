"""Reading a metrics endpoint back, to assert on what it serves.

``scrape("127.0.0.1:9200")`` fetches ``/metrics`` over HTTP and parses it with
prometheus-client's own parser (what a Prometheus server reads), so a check exercises the
real endpoint, not the registry behind it::

    s = scrape(f"127.0.0.1:{port}")
    assert s.value("pdgrpc_metadata_slots_in_use", role="decode") == 0
"""

from __future__ import annotations

import urllib.request

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "scrape"]


class Scrape:
    """One parsed exposition: ``families`` by name (counters without ``_total``, as the
    parser names them) and sample lookup by sample name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(text)}

    def _matching(self, sample: str, labels: dict[str, str]) -> list[float]:
        return [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, sample: str, **labels: str) -> float:
        """The value of the one sample named ``sample`` whose labels include ``labels``;
        KeyError when there is none (e.g. a live gauge whose source is not bound),
        ValueError when the labels match several."""
        hits = self._matching(sample, labels)
        if not hits:
            raise KeyError(f"no sample {sample}{labels}")
        if len(hits) > 1:
            raise ValueError(f"{len(hits)} samples match {sample}{labels}; give more labels")
        return hits[0]

    def has(self, sample: str, **labels: str) -> bool:
        return bool(self._matching(sample, labels))


def scrape(address: str, path: str = "/metrics", timeout: float = 5.0) -> Scrape:
    """GET ``http://{address}{path}`` (``address`` is ``HOST:PORT``) and parse it."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as resp:
        if resp.status != 200:
            raise OSError(f"GET http://{address}{path}: HTTP {resp.status}")
        return Scrape(resp.read().decode())
