"""``python -m pdgrpc.bench e2e``: disaggregated vs colocated serving, end to end.

Starts, all at once on 127.0.0.1, the colocated baseline (``servers/colocated.toml``:
one process, prefill and decode on one engine, the same GenerateService) and one
disaggregated cluster (``servers/1p1d.toml`` by default) per transport. Same engine flags
and prefill chunk size everywhere. Then:

* **TTFT**: ``--ttft-requests`` prompts of ``--prompt-tokens`` tokens, one request at a
  time, each prompt sent to every system in turn, in a new (seeded) order each time (so
  load from other programs, and each system's wind-down after a request, hits all of
  them alike). TTFT is measured by the client: call start to first streamed message.
  p50 and p99 per system; for each transport the overhead vs colocated as a ratio and in
  ms (the difference of the p50s), and the median of the per-prompt differences
  (``ttft_overhead_paired_p50``: each prompt's disaggregated TTFT minus its colocated one,
  measured moments apart, so a host whose speed drifts during the run moves both).
  Targets, over rdma and tcp on loopback, 512-token prompts: p50 overhead at most 1.5 ms,
  p99 overhead at most 3 ms.
* **tokens/s**: ``--throughput-requests`` requests, ``--concurrency`` in flight, each
  generating exactly ``--max-new-tokens`` tokens; generated tokens / wall time. Target:
  1p1d at least 1.0x colocated. The requests are split into ``--throughput-rounds``
  rounds; each round runs every system once, one after another, in a new order, so that
  a drift of the host lands on every system alike rather than on whichever ran then. A
  round holds several waves of ``--concurrency`` requests (4 at the defaults): a round of
  one wave times how fast one burst drains, where a prefill and a decode barely overlap,
  not the steady rate. ``no_kv_moved_share``: the share of a disaggregated system's
  requests that moved no KV, whose prompt its decode computed (the router's busy-prefills
  rule).
* **where the TTFT goes**: every server, the colocated one too, traces (``--trace
  file:DIR``, one file per process) only the requests whose ``traceparent`` says so
  (``OTEL_TRACES_SAMPLER=parentbased_always_off``), and the client sends one with every
  other measured TTFT request. The TTFT rows above come from the others: a traced request
  pays for its spans, which serving at its defaults does not (``ttft_overhead_paired_p50_traced``
  is the paired overhead of the traced ones). ``span_p50_ms/<hop>`` is the p50 of that
  hop's span over the traced requests (:mod:`pdgrpc.rpc.tracing` names the hops), and ``gap_p50_ms/<a>-><b>`` the
  p50 of the time between two processes' spans that no span covers (a gRPC call on its
  way, the link, the KV's first byte, the token's way back), so every run shows the
  breakdown. ``compute_over_colocated_paired_p50`` is the median, over the traced prompts,
  of the disaggregated ``compute`` span minus colocated serving's: the part of the
  overhead that is a slower compute, not the path.

With ``--security plain,tls`` (any of ``plain``, ``tls``, ``token``, ``tls+token``) each
transport's cluster runs once per mode, side by side in the same run: ``tls`` is
``--tls auto`` (mTLS on every gRPC hop, a throwaway CA), ``token`` is ``--auth-token auto``
(the bearer token on every call). A secured system ``NAME+MODE`` is also reported against
its plaintext twin ``NAME`` (``ttft_p50_vs_plain``, ``kv_rate_vs_plain``): the control
plane's cost, and whether the data plane (which TLS does not touch) lost throughput.

With ``--no-prefix-cache-arm`` each transport's cluster also runs with its prefills'
``--no-prefix-cache``, as ``NAME-no-prefix-cache``, side by side in the same run: the
prompts are random, so nothing is reused, and ``ttft_vs_no_prefix_cache`` (p50 against
p50) and ``ttft_no_prefix_cache_paired_p50`` (the median per-prompt difference) show what
the prefix cache costs when it cannot help.

With ``--first-token-decode-arm`` each transport's cluster also runs with its router's
``--first-token decode``, as ``NAME-first-token-decode``, side by side in the same run:
``ttft_p50_vs_first_token_decode`` and ``ttft_first_token_decode_paired_p50`` report what
the prefill's first token sent ahead saves.

With ``--grpc-arm`` each transport's cluster, in each ``--security`` mode, also runs with
its router calling the prefill and decode over gRPC instead of their local sockets
(:mod:`pdgrpc.rpc.local`), as ``NAME-grpc``, side by side in the same run;
``ttft_p50_vs_grpc`` (p50 against p50) and ``ttft_grpc_paired_p50`` (the median
per-prompt difference) report what the local socket saves.

With ``--baseline-tree PATH`` each transport's cluster also runs from another checkout,
as ``NAME@baseline``, side by side: ``ttft_p50_vs_baseline_tree`` (p50 against p50),
``ttft_baseline_tree_paired_p50`` (the median per-prompt difference, this build's minus
the other's, measured moments apart) and ``tokens_per_s_vs_baseline_tree`` report what a
change did, free of the colocated baseline's own noise.

Every disaggregated output is compared with the colocated one for the same prompt; a
difference aborts the benchmark (numbers for wrong output mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from pdgrpc.argtypes import whole_number
from pdgrpc.bench._cuda_baseline import resolve_bench_device
from pdgrpc.bench.report import Result, percentile
from pdgrpc.cluster.client import Completion, generate
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.topology import Topology, load_topology
from pdgrpc.errors import PdgrpcError, TransportUnavailable
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.rpc.tracing import read_spans
from pdgrpc.transport import registry
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

DESCRIPTION = (
    "TTFT p50/p99 and tokens/s through the router vs a colocated server, same prompts, same run, per transport "
    "(targets at 512-token prompts, rdma and tcp: TTFT overhead p50 <= 1.5 ms and p99 <= 3 ms, tokens/s >= 1.0x colocated)"
)

PLOT = "TTFT distributions (CDF), disaggregated per transport vs colocated"
BASELINE = "colocated"
NO_CACHE = "-no-prefix-cache"  # suffix of a cluster run with its prefills' --no-prefix-cache
GRPC = "-grpc"  # suffix of a cluster whose router calls its prefills and decodes over gRPC
FIRST_FROM_DECODE = "-first-token-decode"  # suffix of a cluster whose router has --first-token decode
AT_BASELINE = "@baseline"  # suffix of a cluster started from --baseline-tree
# --security mode -> the launcher's (tls, auth_token)
_SECURITY = {"plain": ("off", "off"), "tls": ("auto", "off"), "token": ("off", "auto"), "tls+token": ("auto", "auto")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="1p1d", help="disaggregated topology (default: %(default)s)")
    p.add_argument("--transports", default="rdma,tcp", help="comma-separated transports; one not loadable here is skipped with a note (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of the TTFT requests (default: %(default)s)")
    p.add_argument("--ttft-requests", type=int, default=120, help="sequential requests per system for TTFT: every other one is traced for the hop rows, the others give the TTFT rows (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="requests per system before measuring (default: %(default)s)")
    p.add_argument(
        "--throughput-requests", type=int, default=256,
        help="requests per system for tokens/s, over all rounds: each round should hold several waves of --concurrency "
        "requests (default: %(default)s, 4 waves a round)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight for tokens/s (default: %(default)s)")
    p.add_argument("--throughput-prompt-tokens", type=int, default=128, help="prompt length of the tokens/s requests (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per tokens/s request (default: %(default)s)")
    p.add_argument(
        "--throughput-rounds", type=whole_number(1, "rounds"), default=4,
        help="rounds the tokens/s requests are split into: each round runs every system once, in a new order, so that "
        "the host's drift falls on all of them alike (default: %(default)s)",
    )
    p.add_argument(
        "--security", default="plain",
        help="comma-separated gRPC security modes to run each cluster in, side by side: plain, tls (--tls auto: "
        "mTLS everywhere), token (--auth-token auto), tls+token (default: %(default)s)",
    )
    p.add_argument(
        "--no-prefix-cache-arm", action="store_true",
        help="also run each transport's cluster with --no-prefix-cache on its prefills (NAME-no-prefix-cache), side "
        "by side, and report each cluster's TTFT against it: what the prefix cache costs when nothing is reused",
    )
    p.add_argument(
        "--first-token-decode-arm", action="store_true",
        help="also run each transport's cluster with its router's --first-token decode (NAME-first-token-decode), "
        "side by side: what the prefill's first token sent ahead saves",
    )
    p.add_argument(
        "--grpc-arm", action="store_true",
        help="also run each transport's cluster, in each --security mode, with its router calling the prefill and "
        "decode over gRPC instead of their local sockets (NAME-grpc), side by side: what the local socket saves",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    p.add_argument("--model", default="", metavar="PATH",
                   help="serve this checkpoint (a GGUF file or a Hugging Face directory) in every system, the colocated "
                   "baseline included, instead of the topologies' engine (default: the reference engine)")
    p.add_argument("--device", default="cpu",
                   help="engine device of every server, the colocated baseline included: cpu or cuda[:N] "
                   "(default: %(default)s)")
    p.add_argument(
        "--baseline-tree", metavar="PATH", default=None,
        help="also start each disaggregated cluster from another checkout of pdgrpc (its servers import pdgrpc from "
        "PATH, e.g. a `git worktree` of an older commit), so two builds are compared side by side in one run; "
        "its systems are named NAME@baseline, and their routers use local sockets where that tree has them",
    )


def _prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    # BOS + printable bytes: distinct prompts, so nothing could be served from a cache.
    return [[256] + [rng.randrange(32, 127) for _ in range(length - 1)] for _ in range(n)]


def _trace_env(directory: Path) -> dict[str, str]:
    """Environment of a traced cluster: spans as JSON lines under ``directory``, only of
    requests whose ``traceparent`` asks for it, leaving the processes in batches."""
    return {"PDGRPC_TRACE": f"file:{directory}", "OTEL_TRACES_SAMPLER": "parentbased_always_off", "OTEL_BSP_SCHEDULE_DELAY": "500"}


async def _ttft(
    stubs: dict[str, GenerateServiceStub], prompts: list[list[int]], warmup: int, rng: random.Random,
    traced: dict[str, list[str]],
) -> dict[str, list[Completion]]:
    """The measured requests of each system; a system in ``traced`` gets its trace ids."""
    out: dict[str, list[Completion]] = {name: [] for name in stubs}
    names = list(stubs)
    for i, ids in enumerate(prompts):
        # A new order for every prompt: a request starts while the system before it still
        # winds down its last one (logs, the prefill's reply, a decode step), and in a
        # fixed order one system would always follow the busiest.
        rng.shuffle(names)
        for name in names:
            metadata = None
            if i >= warmup and (i - warmup) % 2 and name in traced:  # a sampled trace of the bench's own
                trace_id = secrets.token_hex(16)
                traced[name].append(trace_id)
                metadata = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)
            c = await generate(stubs[name], input_ids=ids, max_new_tokens=2, timeout=60, metadata=metadata)
            if i >= warmup:
                out[name].append(c)
    return out


# Time between two spans of different processes on the way to the first token, which no
# span covers: (from span, its edge, to span, its edge).
_GAPS = (
    ("router", "start", "controller.dispatch", "start"),  # the router's Prefill call reaching the controller
    ("router.prepare", "end", "controller.dispatch", "start"),  # that call alone, after the router's own work
    ("controller.dispatch", "end", "worker", "start"),  # the link to the worker
    ("write", "end", "decode.commit", "start"),  # the last write until its first byte lands at the decode
    ("first_token", "end", "router", "end"),  # the decode's stream to the router, and on to the client
    ("compute", "end", "router", "end"),  # the prompt computed until its first token left the router
)


def span_durations(spans: list[dict], trace_ids: list[str]) -> dict[str, dict[str, float]]:
    """Over the traces ``trace_ids``: each span name's duration in ms per trace (the
    longest, where a trace holds several: tp ranks run in parallel)."""
    wanted = set(trace_ids)
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for s in spans:
        if s["trace_id"] in wanted:
            ms = (s["end_ns"] - s["start_ns"]) / 1e6
            per[s["name"]][s["trace_id"]] = max(ms, per[s["name"]].get(s["trace_id"], 0.0))
    return per


def hop_p50s(spans: list[dict], trace_ids: list[str], durations: dict[str, dict[str, float]]) -> dict[str, float]:
    """Over the traces ``trace_ids``, in ms: ``span_p50_ms/<name>``, the p50 of each span's
    :func:`span_durations` (``durations``), and ``gap_p50_ms/<a>-><b>``, the p50 of each
    of :data:`_GAPS`."""
    wanted = set(trace_ids)
    edges: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)  # (trace, name) -> earliest start, latest end
    for s in spans:
        if s["trace_id"] in wanted:
            e = edges[(s["trace_id"], s["name"])]
            e["start"] = min(s["start_ns"], e.get("start", s["start_ns"]))
            e["end"] = max(s["end_ns"], e.get("end", s["end_ns"]))
    out = {f"span_p50_ms/{name}": percentile(list(d.values()), 0.5) for name, d in sorted(durations.items())}
    for a, a_edge, b, b_edge in _GAPS:
        gaps = [(edges[(t, b)][b_edge] - edges[(t, a)][a_edge]) / 1e6 for t in wanted if (t, a) in edges and (t, b) in edges]
        if gaps:
            out[f"gap_p50_ms/{a}->{b}"] = percentile(gaps, 0.5)
    return out


@dataclasses.dataclass(frozen=True)
class Load:
    """What one system did under the tokens/s load; loads add up over rounds."""

    seconds: float
    tokens: int  # generated
    requests: int = 0
    # Requests that moved no KV: a disaggregated system computed their prompt on the
    # decode (local prefill; ``bench e2e``'s random prompts share no prefix).
    no_kv_moved: int = 0

    def __add__(self, other: object) -> "Load":
        if not isinstance(other, Load):
            return NotImplemented
        return Load(self.seconds + other.seconds, self.tokens + other.tokens, self.requests + other.requests,
                    self.no_kv_moved + other.no_kv_moved)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def run_load(stub: GenerateServiceStub, prompts: list[list[int]], max_new: int, concurrency: int) -> Load:
    """Send ``prompts``, ``concurrency`` in flight, each generating ``max_new`` tokens
    (EOS ignored)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> Completion:
        async with sem:
            return await generate(stub, input_ids=ids, max_new_tokens=max_new, ignore_eos=True, timeout=300)

    start = time.perf_counter()
    done = await asyncio.gather(*(one(ids) for ids in prompts))
    seconds = time.perf_counter() - start
    return Load(seconds, sum(len(c.token_ids) for c in done), len(done), sum(c.bytes_transferred == 0 for c in done))


async def throughput_rounds(
    stubs: dict[str, GenerateServiceStub], prompts: list[list[int]], args: argparse.Namespace, rng: random.Random,
) -> dict[str, Load]:
    """Each system's load over ``prompts``, split into ``--throughput-rounds`` rounds;
    within a round the systems run one after another, in a new order each round."""
    rounds = min(args.throughput_rounds, len(prompts)) or 1
    print(f"measuring tokens/s: {len(prompts)} requests per system in {rounds} round(s), {args.concurrency} in flight ...",
          flush=True)
    if len(prompts) < 2 * rounds * args.concurrency:
        print(f"note: a round holds {len(prompts) // rounds} requests, under two waves of --concurrency {args.concurrency}: "
              "tokens/s then times a burst draining more than a steady rate", flush=True)
    out = {name: Load(0.0, 0) for name in stubs}
    for r, name in turns(list(stubs), rounds, rng):
        out[name] += await run_load(stubs[name], prompts[r::rounds], args.max_new_tokens, args.concurrency)
    return out


def turns(names: list[str], rounds: int, rng: random.Random) -> Iterator[tuple[int, str]]:
    """``(round, name)``: every name once a round, in a new order each round."""
    order = list(names)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            yield r, name


def tree_env(tree: str) -> dict[str, str]:
    """Environment whose Python imports ``pdgrpc`` from ``tree`` rather than this checkout."""
    root = os.path.abspath(tree)
    if not os.path.isfile(os.path.join(root, "pdgrpc", "__init__.py")):
        raise PdgrpcError(f"--baseline-tree {tree}: no pdgrpc package there (expected {root}/pdgrpc/__init__.py)")
    # PYTHONSAFEPATH: `python -m` would otherwise import from its working directory first,
    # which is this checkout when the bench runs from one.
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p), "PYTHONSAFEPATH": "1"}


def has_local_sockets(tree: str) -> bool:
    """Whether the servers of ``tree`` take ``--local-socket`` (older trees lack it)."""
    return os.path.isfile(os.path.join(os.path.abspath(tree), "pdgrpc", "rpc", "local.py"))


async def _run(args: argparse.Namespace) -> list[Result]:
    transports = []
    for t in [t.strip() for t in args.transports.split(",") if t.strip()]:
        try:
            registry.load(t)
            transports.append(t)
        except TransportUnavailable as exc:
            print(f"note: skipping transport {t}: {exc}", flush=True)
    if not transports:
        raise PdgrpcError("no transport to benchmark")
    modes = [m.strip() for m in args.security.split(",") if m.strip()]
    bad = [m for m in modes if m not in _SECURITY]
    if bad or not modes:
        raise PdgrpcError(f"--security: unknown mode(s) {bad or modes}; choose from {sorted(_SECURITY)}")
    device = getattr(args, "device", "cpu")
    model = getattr(args, "model", "")
    topology = on_device(load_topology(args.topology), device, model)
    spans_dir = Path(tempfile.mkdtemp(prefix="pdgrpc-bench-spans-"))
    systems: dict[str, Cluster] = {
        BASELINE: Cluster(on_device(load_topology("colocated"), device, model), extra_env=_trace_env(spans_dir / BASELINE)),
    }
    for t in transports:
        for mode in modes:
            tls, token = _SECURITY[mode]
            name = f"{topology.name}-{t}" + ("" if mode == "plain" else f"+{mode}")
            systems[name] = Cluster(topology, transport=t, tls=tls, auth_token=token, extra_env=_trace_env(spans_dir / name))
            if getattr(args, "grpc_arm", False):
                systems[f"{name}{GRPC}"] = Cluster(topology, transport=t, tls=tls, auth_token=token,
                                                   extra_env=_trace_env(spans_dir / f"{name}{GRPC}"), local_sockets=False)
        if getattr(args, "first_token_decode_arm", False):
            name = f"{topology.name}-{t}{FIRST_FROM_DECODE}"
            systems[name] = Cluster(first_token_from_decode(topology), transport=t, extra_env=_trace_env(spans_dir / name))
        if getattr(args, "no_prefix_cache_arm", False):
            name = f"{topology.name}-{t}{NO_CACHE}"
            systems[name] = Cluster(without_prefix_cache(topology), transport=t, extra_env=_trace_env(spans_dir / name))
        if args.baseline_tree:
            name = f"{topology.name}-{t}{AT_BASELINE}"
            env = {**_trace_env(spans_dir / name), **tree_env(args.baseline_tree)}
            systems[name] = Cluster(topology, transport=t, extra_env=env, local_sockets=has_local_sockets(args.baseline_tree))
    traced: dict[str, list[str]] = {name: [] for name in systems}
    rng = random.Random(args.seed)
    ttft_prompts = _prompts(args.warmup + args.ttft_requests, args.prompt_tokens, rng)
    tput_prompts = _prompts(args.throughput_requests, args.throughput_prompt_tokens, rng)

    try:
        async with contextlib.AsyncExitStack() as stack:
            print(f"starting {', '.join(systems)} ...", flush=True)
            await asyncio.gather(*(stack.enter_async_context(c) for c in systems.values()))
            channels = {n: await stack.enter_async_context(c.client_channel()) for n, c in systems.items()}
            stubs = {n: GenerateServiceStub(ch) for n, ch in channels.items()}
            print(f"measuring TTFT: {args.ttft_requests} x {args.prompt_tokens}-token prompts per system ...", flush=True)
            measured = await _ttft(stubs, ttft_prompts, args.warmup, rng, traced)
            base_ids = [c.token_ids for c in measured[BASELINE]]
            for name, done in measured.items():
                if [c.token_ids for c in done] != base_ids:
                    raise PdgrpcError(f"{name}: outputs differ from colocated generation; not reporting its numbers")
            tput = await throughput_rounds(stubs, tput_prompts, args, rng)
            for c in systems.values():
                c.check()
        # Read once the clusters stopped: a server exports what it still holds as it exits.
        spans = {name: list(read_spans(spans_dir / name)) for name in traced}
        durations = {name: span_durations(spans[name], ids) for name, ids in traced.items()}
        hops = {name: hop_p50s(spans[name], ids, durations[name]) for name, ids in traced.items()}
    finally:
        shutil.rmtree(spans_dir, ignore_errors=True)
    return report(args, list(systems), measured, tput, hops, durations, traced)


def report(
    args: argparse.Namespace, systems: list[str], measured: dict[str, list[Completion]], tput: dict[str, Load],
    hops: dict[str, dict[str, float]], durations: dict[str, dict[str, dict[str, float]]], traced: dict[str, list[str]],
) -> list[Result]:
    """The rows of a run: each system's ``measured`` TTFT requests (every other one
    traced, ``traced`` their trace ids, ``durations`` and ``hops`` their spans) and its
    tokens/s run ``tput``, against colocated serving and its twins."""
    # Measured requests alternate: untraced (the TTFT rows), traced (the hop rows).
    ttft = {name: done[0::2] for name, done in measured.items()}
    with_spans = {name: done[1::2] for name, done in measured.items()}
    results: list[Result] = []
    base_p50 = percentile([c.client_ttft_seconds for c in ttft[BASELINE]], 0.5) * 1e3
    base_p99 = percentile([c.client_ttft_seconds for c in ttft[BASELINE]], 0.99) * 1e3
    base_tps = tput[BASELINE].tokens_per_s
    case_ttft = f"ttft/{args.prompt_tokens}tok"
    results += [
        Result(f"{case_ttft}/{BASELINE}", "ttft_p50", base_p50, "ms"),
        Result(f"{case_ttft}/{BASELINE}", "ttft_p99", base_p99, "ms"),
        Result(f"throughput/{BASELINE}", "tokens_per_s", base_tps, "tok/s"),
        # The same measure as a disaggregated system's router_hop_p50: what the colocated
        # server's own gRPC front costs, so that the router's is read against it.
        Result(f"{case_ttft}/{BASELINE}", "router_hop_p50", percentile([c.client_ttft_seconds - c.ttft_seconds for c in ttft[BASELINE]], 0.5) * 1e3, "ms"),
        *(Result(f"{case_ttft}/{BASELINE}", metric, ms, "ms") for metric, ms in hops[BASELINE].items()),
    ]
    for name in systems:
        if name == BASELINE:
            continue
        done = ttft[name]
        p50 = percentile([c.client_ttft_seconds for c in done], 0.5) * 1e3
        p99 = percentile([c.client_ttft_seconds for c in done], 0.99) * 1e3
        tps = tput[name].tokens_per_s
        gbps = statistics.median(c.gbps for c in done)
        kv_bytes = statistics.median(c.bytes_transferred for c in done)
        results += [
            Result(f"{case_ttft}/{name}", "ttft_p50", p50, "ms", base_p50, p50 / base_p50),
            Result(f"{case_ttft}/{name}", "ttft_p99", p99, "ms", base_p99, p99 / base_p99),
            Result(f"{case_ttft}/{name}", "ttft_p50_overhead", p50 - base_p50, "ms"),
            Result(f"{case_ttft}/{name}", "ttft_p99_overhead", p99 - base_p99, "ms"),
            Result(
                f"{case_ttft}/{name}", "ttft_overhead_paired_p50",
                statistics.median(d.client_ttft_seconds - c.client_ttft_seconds for d, c in zip(done, ttft[BASELINE])) * 1e3, "ms",
            ),
            *([Result(
                f"{case_ttft}/{name}", "ttft_overhead_paired_p50_traced",
                statistics.median(
                    d.client_ttft_seconds - c.client_ttft_seconds for d, c in zip(with_spans[name], with_spans[BASELINE])
                ) * 1e3, "ms",
            )] if with_spans[name] else []),
            # Client TTFT minus the router's own (arrival -> first token): what the extra
            # hop through the router costs, as opposed to prefill compute and KV transfer.
            Result(f"{case_ttft}/{name}", "router_hop_p50", percentile([c.client_ttft_seconds - c.ttft_seconds for c in done], 0.5) * 1e3, "ms"),
            Result(f"{case_ttft}/{name}", "kv_bytes_per_request", kv_bytes, "B"),
            Result(f"{case_ttft}/{name}", "kv_rate_data_plane_p50", gbps, "GB/s"),
            Result(f"throughput/{name}", "tokens_per_s", tps, "tok/s", base_tps, tps / base_tps),
        ]
        if tput[name].requests:  # how many of its prompts the decode computed (the busy-prefills rule)
            results.append(Result(f"throughput/{name}", "no_kv_moved_share", tput[name].no_kv_moved / tput[name].requests, ""))
        results += [Result(f"{case_ttft}/{name}", metric, ms, "ms") for metric, ms in hops[name].items()]
        # The same prompt's compute span here and in colocated serving: how much of the
        # overhead is a slower compute rather than the hops around it.
        mine, base = durations[name].get("compute", {}), durations[BASELINE].get("compute", {})
        slower = [mine[t] - base[c] for t, c in zip(traced[name], traced[BASELINE]) if t in mine and c in base]
        if slower:
            results.append(Result(f"{case_ttft}/{name}", "compute_over_colocated_paired_p50", statistics.median(slower), "ms"))
        # Twins of this system in the run: the same cluster with its prefix cache off (the
        # cache's cost when nothing is reused), and with its router's calls over gRPC (what
        # the local socket saves).
        for twin, ratio, paired in ((NO_CACHE, "ttft_vs_no_prefix_cache", "ttft_no_prefix_cache_paired_p50"),
                                    (GRPC, "ttft_p50_vs_grpc", "ttft_grpc_paired_p50"),
                                    (FIRST_FROM_DECODE, "ttft_p50_vs_first_token_decode", "ttft_first_token_decode_paired_p50"),
                                    (AT_BASELINE, "ttft_p50_vs_baseline_tree", "ttft_baseline_tree_paired_p50")):
            if f"{name}{twin}" in ttft:
                results += _against_twin(f"{case_ttft}/{name}", done, ttft[f"{name}{twin}"], ratio, paired)
        if f"{name}{AT_BASELINE}" in tput:  # this build's tokens/s against the other build's, in the same rounds
            older = tput[f"{name}{AT_BASELINE}"].tokens_per_s
            results.append(Result(f"throughput/{name}", "tokens_per_s_vs_baseline_tree", tps, "tok/s", older, tps / older))
        plain = name.split("+", 1)[0]
        if plain != name and plain in ttft:  # a secured system: against its plaintext twin
            plain_p50 = percentile([c.client_ttft_seconds for c in ttft[plain]], 0.5) * 1e3
            plain_gbps = statistics.median(c.gbps for c in ttft[plain])
            results += [
                Result(f"{case_ttft}/{name}", "ttft_p50_vs_plain", p50, "ms", plain_p50, p50 / plain_p50),
                Result(f"{case_ttft}/{name}", "kv_rate_vs_plain", gbps, "GB/s", plain_gbps, gbps / plain_gbps if plain_gbps else 0.0),
            ]
    if getattr(args, "plot", None) is not None:
        from pdgrpc.bench.plot import e2e_figure

        e2e_figure(args.plot, {n: [c.client_ttft_seconds * 1e3 for c in done] for n, done in ttft.items()}, args.prompt_tokens)
    return results


def _against_twin(case: str, done: list[Completion], twin: list[Completion], ratio: str, paired: str) -> list[Result]:
    """A system's client TTFT p50 against a twin's (``ratio``), and the median of their
    per-prompt differences (``paired``)."""
    p50 = percentile([c.client_ttft_seconds for c in done], 0.5) * 1e3
    twin_p50 = percentile([c.client_ttft_seconds for c in twin], 0.5) * 1e3
    return [
        Result(case, ratio, p50, "ms", twin_p50, p50 / twin_p50),
        Result(case, paired, statistics.median(d.client_ttft_seconds - c.client_ttft_seconds for d, c in zip(done, twin)) * 1e3, "ms"),
    ]


def run(args: argparse.Namespace) -> list[Result]:
    resolve_bench_device(args, "e2e")  # --device cuda without CUDA: one line naming the flag, exit 2
    return run_loop(_run(args))


def without_prefix_cache(topology: Topology) -> Topology:
    """``topology`` with ``--no-prefix-cache`` on every prefill."""
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "no-prefix-cache": True}) if p.role == "prefill" else p for p in topology.processes
    )
    return dataclasses.replace(topology, processes=procs)


def first_token_from_decode(topology: Topology) -> Topology:
    """``topology`` with ``--first-token decode`` on its router."""
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "first-token": "decode"}) if p.role == "router" else p for p in topology.processes
    )
    return dataclasses.replace(topology, processes=procs)


def on_device(topology: Topology, device: str, model: str = "") -> Topology:
    """Every engine of ``topology`` (prefill, decode, colocated) on ``device``, serving
    ``model`` when given."""
    engine = {**topology.engine, **({} if device == "cpu" else {"device": device}), **({"model": model} if model else {})}
    return dataclasses.replace(topology, engine=engine)
