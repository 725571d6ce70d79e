"""Benchmark results: one row per (case, metric), printed as a table or written as JSON.

JSON format (``--json PATH``)::

    {"benchmark": NAME, "results": [{"case", "metric", "value", "unit"
                                      [, "baseline_value", "ratio"]}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class Result:
    case: str
    metric: str
    value: float
    unit: str
    # Same metric measured on the baseline in the same run, and value / baseline_value.
    baseline_value: float | None = None
    ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"case": self.case, "metric": self.metric, "value": self.value, "unit": self.unit}
        if self.baseline_value is not None:
            d["baseline_value"] = self.baseline_value
        if self.ratio is not None:
            d["ratio"] = self.ratio
        return d


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or 0.01 <= abs(v) < 1e6:
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return f"{v:.3e}"


def format_table(results: Sequence[Result]) -> str:
    header = ("case", "metric", "value", "unit", "baseline", "ratio")
    rows = [header] + [
        (r.case, r.metric, _fmt(r.value), r.unit, _fmt(r.baseline_value), _fmt(r.ratio)) for r in results
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
