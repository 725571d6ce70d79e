"""``--plot PATH.png``: the benchmarks' tables as pictures (matplotlib, ``pdgrpc[plot]``).

One function per benchmark that draws (``transport``, ``e2e``, ``bootstrap``); each takes
the numbers its benchmark measured and writes a PNG. matplotlib is imported only here and
only when a picture is asked for (:func:`require`), with the non-interactive ``Agg``
backend, so the benchmarks run without it.

Each PNG names its series in a ``Series`` text chunk (one per line, in legend order), so a
program can tell what a picture shows without looking at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from pdgrpc.errors import PdgrpcError

__all__ = ["PlotUnavailable", "bootstrap_figure", "e2e_figure", "multiturn_figure", "prefix_figure", "require", "transport_figure"]

INSTALL_HINT = "--plot needs matplotlib: pip install 'pdgrpc[plot]'"


class PlotUnavailable(PdgrpcError):
    """``--plot`` was asked for, and matplotlib cannot be imported."""


def require() -> Any:
    """matplotlib's ``pyplot`` on the ``Agg`` backend; :class:`PlotUnavailable` (saying
    how to install it) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(f"{INSTALL_HINT} ({exc})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, ax: Any, path: Path, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    series = "\n".join(str(h.get_label()) for h in ax.get_legend_handles_labels()[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Title": title, "Series": series, "Software": "pdgrpc.bench"})
    require().close(fig)


def transport_figure(
    path: Path, backend: str, baseline: str, sizes: Sequence[int],
    gbps: Mapping[str, Sequence[float | None]], baseline_gbps: Sequence[float],
) -> None:
    """GB/s by transfer size: one line per case (``contiguous``, ``scattered``,
    ``head-sliced``; None where a case did not run at that size) beside the raw baseline.
    ``sizes`` are bytes per transfer (the whole-page cases' bytes)."""
    plt = require()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    mib = [s / 2**20 for s in sizes]
    for kind, values in gbps.items():
        pts = [(x, v) for x, v in zip(mib, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{backend} {kind}")
    ax.plot(mib, list(baseline_gbps), marker="s", linestyle="--", color="black", label=f"raw baseline ({baseline})")
    ax.set_xscale("log")
    ax.set_xticks(mib, [f"{m:.3g}" for m in mib], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_xlabel("KV bytes per transfer (MiB)")
    ax.set_ylabel("GB/s (higher is better)")
    _save(fig, ax, path, f"bench transport --backend {backend}: throughput by size")


def e2e_figure(path: Path, ttft_ms: Mapping[str, Sequence[float]], prompt_tokens: int) -> None:
    """Cumulative distribution of TTFT per system (``colocated`` and each transport)."""
    plt = require()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, xs in ttft_ms.items():
        ys = sorted(xs)
        n = len(ys)
        if n:
            p50 = ys[round(0.5 * (n - 1))]  # the table's rule (bench e2e's _pct)
            ax.step(ys, [(i + 1) / n for i in range(n)], where="post", label=f"{name} (p50 {p50:.1f} ms)")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    _save(fig, ax, path, f"bench e2e: TTFT CDF, {prompt_tokens}-token prompts")


def bootstrap_figure(path: Path, batches: Mapping[int, tuple[float, float]], floor: tuple[float, float]) -> None:
    """QueryDpRanks latency (p50, p99 in ms) by batch size (rooms per call), beside the
    health-check floor (a Check call's p50, p99 on the same channel)."""
    plt = require()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = sorted(batches)
    ax.plot(xs, [batches[x][0] for x in xs], marker="o", label="QueryDpRanks p50")
    ax.plot(xs, [batches[x][1] for x in xs], marker="o", linestyle=":", label="QueryDpRanks p99")
    ax.axhline(floor[0], color="black", linestyle="--", label="health Check p50 (floor)")
    ax.axhline(floor[1], color="gray", linestyle="--", label="health Check p99")
    ax.set_xscale("log")
    ax.set_xticks(xs, [str(x) for x in xs], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_xlabel("rooms per call")
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(bottom=0)
    _save(fig, ax, path, "bench bootstrap: latency by batch size")


def prefix_figure(path: Path, ttft_ms: Mapping[str, Mapping[str, float]]) -> None:
    """Grouped bars per arm: TTFT p50 and p90 (ms) of each group's first request and of
    the later ones (``ttft_ms[arm]["ttft_p50/first"]`` and so on)."""
    plt = require()
    fig, ax = plt.subplots(figsize=(7.2, 4))
    arms = list(ttft_ms)
    metrics = ("ttft_p50/first", "ttft_p90/first", "ttft_p50/later", "ttft_p90/later")
    width = 0.8 / len(metrics)
    for i, m in enumerate(metrics):
        xs = [a + (i - 1.5) * width for a in range(len(arms))]
        ax.bar(xs, [ttft_ms[arm].get(m, 0.0) for arm in arms], width, label=m.replace("ttft_", "").replace("/", " "))
    ax.set_xticks(range(len(arms)), [a.split(":")[0] for a in arms])
    ax.set_ylabel("time to first token (ms)")
    _save(fig, ax, path, "bench prefix: TTFT by arm, first request of a group vs later ones")


def multiturn_figure(path: Path, per_turn: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    """Per arm, by turn index: KV bytes moved per request (solid, left axis, KiB) and TTFT
    p50 (dashed, right axis, ms); ``per_turn[arm]["bytes/request"]`` and ``["ttft_p50"]``
    hold turn 1's value first."""
    plt = require()
    fig, ax = plt.subplots(figsize=(7.2, 4))
    right = ax.twinx()
    for arm, m in per_turn.items():
        name = arm.split(":")[0]
        moved = m.get("bytes/request", ())
        (line,) = ax.plot(range(1, len(moved) + 1), [v / 1024 for v in moved], marker="o", label=f"{name} bytes/request")
        ttft = m.get("ttft_p50", ())
        right.plot(range(1, len(ttft) + 1), ttft, linestyle="--", marker="x", color=line.get_color())
        # The legend is the left axis's: the right axis's series join it by name.
        ax.plot([], [], linestyle="--", marker="x", color=line.get_color(), label=f"{name} TTFT p50")
    ax.set_xlabel("turn")
    ax.set_ylabel("KV moved per request (KiB)")
    right.set_ylabel("TTFT p50 (ms)")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    _save(fig, ax, path, "bench multiturn: KV moved and TTFT by turn")
