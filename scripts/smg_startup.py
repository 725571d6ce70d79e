#!/usr/bin/env python3
"""Start-up time of a cluster with smg against the same cluster without it.

Usage: python scripts/smg_startup.py [--rounds N] [--topology smg-1p1d] [--transport tcp]

Starts the topology with its smg process and without it (the same prefill, decode and
router), alternately, ``--rounds`` times each, and prints each start's seconds (from
``Cluster.start`` to every process ready), the median difference, and how long smg
took from its own start (once its workers were ready) to ready, as the launcher logs it.
Alternating keeps a busy host's drift out of the difference.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdgrpc.cluster import Cluster, load_topology  # noqa: E402
from pdgrpc.cluster.topology import Topology  # noqa: E402


async def _start(topology: Topology, transport: str) -> float:
    began = time.monotonic()
    async with Cluster(topology, transport=transport, start_timeout=180):
        return time.monotonic() - began


class _SmgReady(logging.Handler):
    """Collects the launcher's "smg ready N s after its start" figures."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"smg ready ([0-9.]+) s after its start", record.getMessage())
        if m:
            self.seconds.append(float(m.group(1)))


async def _main(ns: argparse.Namespace) -> None:
    ready = _SmgReady()
    launcher_log = logging.getLogger("pdgrpc.cluster")
    launcher_log.addHandler(ready)
    launcher_log.setLevel(logging.INFO)
    with_smg = load_topology(ns.topology)
    if not with_smg.by_role("smg"):
        raise SystemExit(f"topology {ns.topology!r} has no smg process")
    without = dataclasses.replace(with_smg, processes=tuple(p for p in with_smg.processes if p.role != "smg"))
    runs: dict[str, list[float]] = {"without smg": [], "with smg": []}
    for _ in range(ns.rounds):
        runs["without smg"].append(await _start(without, ns.transport))
        runs["with smg"].append(await _start(with_smg, ns.transport))
    for name, seconds in runs.items():
        print(f"{name:12} {' '.join(f'{s:.2f}' for s in seconds)} s (median {statistics.median(seconds):.2f} s)")
    extra = [w - o for w, o in zip(runs["with smg"], runs["without smg"])]
    print(f"smg adds    {' '.join(f'{d:+.2f}' for d in extra)} s (median {statistics.median(extra):+.2f} s)")
    print(f"smg itself  {' '.join(f'{s:.2f}' for s in ready.seconds)} s from its start to ready, its workers ready before")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="starts of each kind. Default: %(default)s")
    p.add_argument("--topology", default="smg-1p1d", help="a topology with an smg process. Default: %(default)s")
    p.add_argument("--transport", default="tcp", help="Default: %(default)s")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
