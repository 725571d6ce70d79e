"""Benchmark results: one row per (case, metric), printed as a table or written as JSON.

JSON format (``--json PATH``)::

    {"benchmark": NAME, "results": [{"case", "metric", "value", "unit"
                                      [, "baseline_value", "ratio"]
                                      [, "min", "max", "samples"]}, ...]}

``samples``: where a benchmark reports a spread, the measurements ``value`` summarises
(its median), in order, with their ``min`` and ``max``; the table then shows min and max
columns. What one sample is (an iteration, a repeat of a whole case) is the benchmark's
to say.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ``samples``: the sample nearest that rank."""
    ordered = sorted(samples)
    return ordered[round(q * (len(ordered) - 1))]


@dataclasses.dataclass(frozen=True)
class Result:
    case: str
    metric: str
    value: float
    unit: str
    # Same metric measured on the baseline in the same run, and value / baseline_value.
    baseline_value: float | None = None
    ratio: float | None = None
    # The measurements ``value`` summarises, in the same unit (see the module docstring).
    samples: tuple[float, ...] | None = None

    @property
    def min_value(self) -> float | None:
        return min(self.samples) if self.samples else None

    @property
    def max_value(self) -> float | None:
        return max(self.samples) if self.samples else None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"case": self.case, "metric": self.metric, "value": self.value, "unit": self.unit}
        if self.baseline_value is not None:
            d["baseline_value"] = self.baseline_value
        if self.ratio is not None:
            d["ratio"] = self.ratio
        if self.samples:
            d["min"], d["max"], d["samples"] = self.min_value, self.max_value, list(self.samples)
        return d


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or 0.01 <= abs(v) < 1e6:
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return f"{v:.3e}"


def format_table(results: Sequence[Result]) -> str:
    spread = any(r.samples for r in results)  # min/max columns only where some row has them
    header: tuple[str, ...] = ("case", "metric", "value") + (("min", "max") if spread else ()) \
        + ("unit", "baseline", "ratio")
    rows = [header] + [
        (r.case, r.metric, _fmt(r.value)) + ((_fmt(r.min_value), _fmt(r.max_value)) if spread else ())
        + (r.unit, _fmt(r.baseline_value), _fmt(r.ratio)) for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, benchmark: str, results: Sequence[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": benchmark, "results": [r.to_json() for r in results]}, indent=2) + "\n")
