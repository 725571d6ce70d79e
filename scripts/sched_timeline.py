#!/usr/bin/env python3
"""Where a 1p1d prompt's compute waits for a core, from the kernel's scheduler trace.

Usage: python scripts/sched_timeline.py [--transport tcp] [--requests N] [--topology 1p1d]

Needs ``perf`` with the ``sched`` tracepoints (as root). Starts one cluster, sends it
``--requests`` 512-token prompts one at a time (two tokens each), and records every context
switch and wake-up on every core meanwhile. Each prompt's compute shows in the trace as a
burst: the compute process running, with gaps under 3 ms. Per burst it prints, as p50s:

- **start wait**: from the wake-up that hands the compute its prompt until it runs;
- **preempted**: the burst's wall time less the compute's running time in it;
- **idle**: the time in the burst that no process ran on a core;
- which process held the compute's core while the compute waited within the burst
  (mean ms per burst): who preempts it;
- each process's CPU time in windows around the burst's start (ms from it), so what holds
  the cores while the compute waits to start can be read off.

The scheduler, not a span, is the witness here: spans time a process's own steps and not
the time it was runnable but had no core.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdgrpc.bench.procstat import children, module_of, process_tree  # noqa: E402
from pdgrpc.cluster.client import generate  # noqa: E402
from pdgrpc.cluster.launcher import Cluster  # noqa: E402
from pdgrpc.cluster.topology import load_topology  # noqa: E402
from pdgrpc.rpc.server import run  # noqa: E402
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub  # noqa: E402

_EVENT = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")
_BURST_GAP_S = 0.003  # compute runs closer than this belong to one prompt
_WINDOWS_MS = ((-3, -1), (-1, 0), (0, 2), (2, 5), (5, 40))


def _name(argv_role: str) -> str:
    return {"pdgrpc.prefill.compute_process": "compute", "pdgrpc.prefill.worker_main": "worker",
            "pdgrpc.prefill": "controller"}.get(argv_role, argv_role.removeprefix("pdgrpc."))


async def _record(ns: argparse.Namespace, trace: Path) -> dict[int, str]:
    cluster = Cluster(load_topology(ns.topology), transport=ns.transport)
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(32, 127) for _ in range(511)] for _ in range(ns.requests + 5)]
    async with cluster, cluster.client_channel() as channel:
        stub = GenerateServiceStub(channel)
        kids = children()
        roles = {q: _name(module_of(q)) for p in cluster.procs.values() if p.pid for q in process_tree(p.pid, kids)}
        for ids in prompts[:5]:
            await generate(stub, input_ids=ids, max_new_tokens=2)
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-e", "sched:sched_switch,sched:sched_wakeup", "-a", "-o", str(trace)],
            stdout=subprocess.DEVNULL,
        )
        await asyncio.sleep(1.0)  # perf is recording
        for ids in prompts[5:]:
            await generate(stub, input_ids=ids, max_new_tokens=2)
        perf.send_signal(signal.SIGINT)
        perf.wait()
    return roles


def _analyse(trace: Path, roles: dict[int, str]) -> None:
    text = subprocess.run(
        ["perf", "script", "-i", str(trace), "-F", "pid,tid,cpu,time,event,trace"],
        capture_output=True, text=True, check=True,
    ).stdout
    tid_pid: dict[int, int] = {}
    events = []
    for line in text.splitlines():
        m = _EVENT.match(line)
        if m:
            pid, tid, cpu, t, name, rest = m.groups()
            tid_pid[int(tid)] = int(pid)
            events.append((float(t), int(cpu), name, dict(_FIELD.findall(rest))))

    def role(tid: int) -> str:
        return "idle" if tid == 0 else roles.get(tid_pid.get(tid, -1), "other")

    running: dict[int, tuple[int, float]] = {}  # cpu -> (tid, since)
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)  # tid -> runs
    on_cpu: dict[int, list[tuple[float, float, int]]] = collections.defaultdict(list)  # cpu -> (start, end, tid)
    woken: dict[int, float] = {}
    compute_woken: list[float] = []
    for t, cpu, name, f in events:
        if name == "sched_switch":
            prev, nxt = int(f["prev_pid"]), int(f["next_pid"])
            tid, since = running.get(cpu, (prev, t))
            if tid != prev:
                # A switch the trace lacks (the way out of idle goes unrecorded on some
                # virtual CPUs): ``prev`` ran from its wake-up, ``tid`` until then.
                start = max(since, woken.get(prev, since))
                spans[tid].append((since, start))
                on_cpu[cpu].append((since, start, tid))
                since = start
            spans[prev].append((since, t))
            on_cpu[cpu].append((since, t, prev))
            running[cpu] = (nxt, t)
        else:
            woken[int(f["pid"])] = t
            if role(int(f["pid"])) == "compute":
                compute_woken.append(t)
    compute_runs = sorted(r for tid, runs in spans.items() if role(tid) == "compute" for r in runs)
    bursts: list[list[float]] = []  # [start, end, running]
    for s, e in compute_runs:
        if bursts and s - bursts[-1][1] < _BURST_GAP_S:
            bursts[-1][1], bursts[-1][2] = e, bursts[-1][2] + e - s
        else:
            bursts.append([s, e, e - s])
    bursts = [b for b in bursts if b[1] - b[0] > 0.01]
    if not bursts:
        raise SystemExit("no compute bursts in the trace: is perf allowed to read the sched tracepoints?")
    starts = []
    for b in bursts:
        i = bisect.bisect_right(compute_woken, b[0]) - 1
        if i >= 0 and b[0] - compute_woken[i] < 0.01:
            starts.append(b[0] - compute_woken[i])

    def overlap(role_name: str, lo_ms: float, hi_ms: float | None) -> float:
        """Mean ms per burst that ``role_name`` ran from ``lo_ms`` after a burst's start
        until ``hi_ms`` after it (None: the burst's end)."""
        total = 0.0
        for tid, runs in spans.items():
            if role(tid) != role_name:
                continue
            for s, e in runs:
                for b in bursts:
                    hi = b[1] if hi_ms is None else b[0] + hi_ms / 1e3
                    total += max(0.0, min(e, hi) - max(s, b[0] + lo_ms / 1e3))
        return total / len(bursts) * 1e3

    def p50_ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    print(f"{len(bursts)} compute bursts; p50 ms: wall {p50_ms([b[1] - b[0] for b in bursts]):.2f}, "
          f"start wait {p50_ms(starts):.3f}, preempted {p50_ms([b[1] - b[0] - b[2] for b in bursts]):.3f}, "
          f"idle {overlap('idle', 0, None):.2f} (mean)")
    # What held the compute's core while the compute waited within a burst: the core it
    # ran on last, from the moment it stopped until it ran again.
    compute_cpu = {(s, e): cpu for cpu, runs in on_cpu.items() for s, e, tid in runs if role(tid) == "compute"}
    held: collections.Counter[str] = collections.Counter()
    for b in bursts:
        inside = [(s, e) for s, e in compute_runs if b[0] <= s and e <= b[1]]
        for (s0, e0), (s1, _e1) in zip(inside, inside[1:]):
            cpu = compute_cpu.get((s0, e0))
            for s, e, tid in on_cpu.get(cpu, ()) if cpu is not None else ():
                if s < s1 and e > e0 and role(tid) != "compute":
                    held[role(tid)] += min(e, s1) - max(s, e0)
    print("mean ms per burst that each process held the compute's core while the compute waited: "
          + ", ".join(f"{name} {ms / len(bursts) * 1e3:.3f}" for name, ms in held.most_common()))
    print("mean CPU ms of each process in windows around the burst's start (ms from it):")
    print(f"  {'':12}" + "".join(f"{f'[{lo}, {hi})':>10}" for lo, hi in _WINDOWS_MS))
    for name in sorted({*roles.values(), "other"} - {"compute"}):
        print(f"  {name:12}" + "".join(f"{overlap(name, lo, hi):10.2f}" for lo, hi in _WINDOWS_MS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="tcp", help="the cluster's transport (default: %(default)s)")
    p.add_argument("--topology", default="1p1d", help="topology name or path (default: %(default)s)")
    p.add_argument("--requests", type=int, default=60, help="prompts traced (default: %(default)s)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdgrpc-sched-") as d:
        trace = Path(d) / "sched.perf"
        roles = run(_record(ns, trace))
        _analyse(trace, roles)


if __name__ == "__main__":
    main()
