#!/usr/bin/env python3
"""How long a cluster takes from launch to serving, against another checkout's.

Usage: python scripts/cluster_startup.py --baseline-tree PATH [--topology servers/1p1d.toml]
       [--transport tcp] [--rounds 4]

Starts the topology with this checkout's pdgrpc and with the one at ``--baseline-tree``
(a git worktree of another commit), alternately, ``--rounds`` times each, each in a fresh
interpreter, and prints each start's seconds (``Cluster`` entered: every process ready)
and the medians. Alternating keeps a busy host's drift out of the comparison.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in each tree: start the cluster, print the seconds until it serves, stop it.
_ONE_START = """
import asyncio, sys, tempfile, time
from pdgrpc.cluster import Cluster, load_topology

async def main() -> None:
    topology = load_topology(sys.argv[1])
    with tempfile.TemporaryDirectory() as logs:
        t = time.perf_counter()
        async with Cluster(topology, transport=sys.argv[2], log_dir=logs):
            print(time.perf_counter() - t, flush=True)

asyncio.run(main())
"""


def _start(tree: Path, topology: str, transport: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", _ONE_START, topology, transport], cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the cluster did not start:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the commit to compare with")
    p.add_argument("--topology", default="servers/1p1d.toml", help="topology file, relative to each tree")
    p.add_argument("--transport", default="tcp", choices=["tcp", "rdma", "fake"])
    p.add_argument("--rounds", type=int, default=4, help="starts of each tree, alternating")
    ns = p.parse_args()
    if not (ns.baseline_tree / "pdgrpc" / "__init__.py").is_file():
        p.error(f"--baseline-tree {ns.baseline_tree}: no pdgrpc package there")
    times: dict[str, list[float]] = {"this": [], "baseline": []}
    for r in range(ns.rounds):
        for name, tree in (("baseline", ns.baseline_tree), ("this", ROOT)):
            s = _start(tree, ns.topology, ns.transport)
            times[name].append(s)
            print(f"round {r + 1} {name:8s} {s:.2f} s", flush=True)
    for name, ts in times.items():
        print(f"{name:8s} median {statistics.median(ts):.2f} s ({', '.join(f'{t:.2f}' for t in ts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
