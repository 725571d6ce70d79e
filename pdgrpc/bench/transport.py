"""``python -m pdgrpc.bench transport --backend tcp|rdma``: KV transfer throughput of a
transport backend between two processes, against a raw baseline of the same bytes
measured in the same run.

Data: a KV pool shaped like a small model's -- 24 layers x (K, V), 16-token pages of
2 KV heads x 64 dims in fp16 (4 KiB per page per region, HND: heads first) -- for 1k,
8k and 32k tokens (12, 96 and 384 MiB), with contiguous pages (one run: one write per
region) and scattered pages (random source and destination pages: one write per page
per region). The receiver is a separate process
(:class:`~pdgrpc.transport.testing.peer.PeerProcess`); this process is the sender.

Head-sliced (TP 1 -> TP 2): the same page lists as the contiguous case, but the
receiver (a second peer process) is TP rank 1 of 2: its pool holds KV heads
``[H/2, H)``, so pages are half as large, and the sender writes heads ``[H/2, H)`` of
each of its pages into the receiver's whole pages
(:func:`~pdgrpc.transport.pages.head_slice_ops`: one strided write per page per
region, half a page each). GB/s counts the bytes actually moved (half the contiguous
case's); the row ``head-sliced vs whole-page`` compares it with the contiguous case.

Memory: both sides' regions are in transparent huge pages
(:func:`~pdgrpc.host_memory.host_zeros`, what an engine started with
``--kv-huge-pages`` registers); ``--no-huge-pages`` puts them in ordinary pages. Over
rdma this matters: UCX's one-copy shared-memory path pins both buffers page by page.

One iteration (``--write prepared``, the default) = build the ops from the page lists and
``prepare_write`` pages + metadata row, untimed, as a prefill does for its final write
while the prompt computes (over rdma the WRITE is announced then and the receiver posts
its receives, as the raw baseline's receiver posts its receive before its timer); then,
timed, the prepared send and the wait until the sender's room is SUCCESS (the receiver
acknowledged the row, which lands after every page). ``--write direct`` times the ops,
``write`` and the wait, as for an earlier chunk's write (rows say "direct write").
Latency is the median iteration; GB/s = bytes / latency / 1e9.

Spread: each row also carries min and max (table columns, JSON ``min``/``max``/
``samples``). With ``--repeat 1`` (the default) the samples are the iterations; with
``--repeat N`` every case, and its raw baseline, runs N times in the one run (warm-up
iterations included) and the samples are the N repeats' medians, the row's value their
median. A row ``..., slowest repeat`` then gives each repeat's ratio against the raw
baseline of the same repeat, its value the lowest: a case that is fast only some of the
time shows in one run. ``--control`` times a second raw pair right after the
first in every iteration and reports it like a backend (rows ``control: 2nd raw pair
...``): the spread that a backend exactly as fast as raw would show in the same run.
On a small shared host a single run's slowest repeat cannot resolve a gap of 10%; the
median of a run's 15 iterations (the default) is what mostly can, so compare medians.
``--verbose`` prints every iteration, the raw baseline's included.

Baselines, same byte count, two processes, median of as many iterations:

* ``tcp`` (and other socket backends): one plain blocking TCP socket per direction,
  ``sendall`` of one contiguous buffer, the receiver ``recv_into`` a preallocated buffer
  then replies one byte (same socket buffer sizes and TCP_NODELAY as the backend).
* ``rdma``: plain ``ucxx`` tag send/recv between worker-address endpoints
  (:class:`pdgrpc.bench.ucx_baseline.RawUcx`; ucxx is imported only in its two
  processes).

Both raw pairs stay alive for the whole run, and each raw iteration runs right before
the backend's, so a spell of load on a shared machine hits both alike.

After timing, the last transfer of each case is checked bit-exact (digests of the
destination pages against the source pages) so a backend that moves nothing cannot
report a number. Targets: >= 0.9x raw from 4 MiB up; scattered >= 0.8x
contiguous; head-sliced >= 0.7x whole-page (contiguous) GB/s. Numbers from a shared
or loaded machine are noisy; compare ratios.

What bounds the ratios on a small host:

* scattered vs contiguous: every random page breaks the hardware prefetcher, so even a
  single-threaded C ``memcpy`` of the same page lists inside one process moves scattered
  pages well below its contiguous speed. No transport can do better than the memory
  system.
* 1k tokens against raw ucxx: 12 MiB fit in L3, so the raw single-message baseline runs
  cache-hot, while a pdgrpc write of the same bytes is 48 messages of 256 KiB (one
  rendezvous each), a WRITE/META/ACK exchange and an authorization check around the data.
* UCX 1.21 moves every scatter/gather (iov) message between two processes on one host
  as "fragmented copy-in copy-out" through its sysv segments (``UCX_PROTO_INFO=y``
  shows it); only contiguous messages get the one-copy cma path. The contiguous case's
  per-region runs (256 KiB and up) therefore travel as contiguous messages (the rdma
  option ``contiguous_min``): copy-in copy-out needs both processes on a core at once
  and collapses whenever the host is busy.

``--device cuda[:N]`` puts both sides' KV regions in GPU memory (metadata rows stay on
the host) and compares with a CUDA IPC ``copy_`` of the same bytes between two processes
(:mod:`pdgrpc.bench._cuda_baseline`); targets there: >= 0.8x raw from 8k
tokens up, scattered >= 0.5x contiguous.

``--cases`` picks which cases run (head-sliced always brings the contiguous case it is
compared with).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import sys
import time
from typing import Any

import torch

from pdgrpc.bench._cuda_baseline import BASELINE_NAME as CUDA_BASELINE
from pdgrpc.bench._cuda_baseline import add_device_argument, ipc_copy_baseline, placed, resolve_bench_device
from pdgrpc.bench._tcp_baseline import RawTcp
from pdgrpc.bench.ucx_baseline import RawUcx  # imports nothing of UCX in this process
from pdgrpc.bench.report import Result
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import WriteOps
from pdgrpc.transport.pages import METADATA_REGION_ID, head_slice_ops, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest

DESCRIPTION = "KV transfer GB/s and latency of a transport (tcp|rdma) between two processes vs a raw baseline"
PLOT = "GB/s by size: contiguous, scattered and head-sliced beside the raw baseline"
TOKENS_PER_PAGE = 16
KV_HEADS = 2  # per page of the sender's pool (TP 1); the head-sliced receiver holds half
HEAD_DIM = 64
CASES = ("contiguous", "scattered", "head-sliced")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="tcp", help="transport name (tcp, rdma, or any registered backend)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768], help="tokens per transfer")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--iterations", type=int, default=15,
                        help="timed iterations per case, the median reported (default: %(default)s; the median of 5 "
                        "is too coarse for a 10%% margin: two raw pairs read 0.89-1.16x of each other with it)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per case")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every case and its raw baseline N times in this run; min/median/max over the repeats")
    parser.add_argument("--connections", type=int, default=None, help="tcp: sockets per peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option for both sides (repeatable; value parsed as int, float, else str)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="cases to run (head-sliced also runs contiguous, its baseline)")
    parser.add_argument("--verbose", action="store_true", help="print every iteration's latency (to stderr)")
    parser.add_argument(
        "--write", choices=("prepared", "direct"), default="prepared",
        help="prepared (default): build the ops and call prepare_write before the timer, as a prefill does for its "
        "final write while the prompt computes (rdma announces the write then and the receiver posts its receives, "
        "as the raw baseline's receiver does before its timer); timed: the send to the ACK. direct: build the ops "
        "and call write() inside the timer, as for an earlier chunk")
    parser.add_argument(
        "--control", action="store_true",
        help="also time a second raw baseline pair, alternating with the first, and report its ratio against the "
        "first like the backend's: the spread a backend exactly as fast as raw would show in this run (CPU only)")
    parser.add_argument(
        "--no-huge-pages", dest="huge_pages", action="store_false",
        help="put both sides' regions in ordinary 4 KiB pages (torch.zeros) instead of transparent huge pages "
        "(what an engine started with --kv-huge-pages registers); the raw baseline is unaffected")
    add_device_argument(parser)


def run(args: argparse.Namespace) -> list[Result]:
    if getattr(args, "control", False) and str(getattr(args, "device", "cpu")) != "cpu":
        raise SystemExit(f"bench transport: --control repeats the raw pair of a CPU run; with --device {args.device} "
                         "the baseline is a CUDA IPC copy measured once, with no pair to repeat")
    resolve_bench_device(args)  # --device cuda without CUDA: one line naming the flag, exit 2
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(_run(args))


# ----------------------------------------------------------------------------- backend


def _parse_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _size(tokens: int) -> str:
    return f"{tokens // 1024}k tok" if tokens % 1024 == 0 else f"{tokens} tok"


async def _until_posted(target: PeerProcess, room: int) -> bool:
    """A prepared write: wait (up to ~0.1 s) until the receiver posted the room's receives,
    as it does while a prompt computes. False when it did not (a backend that does not
    say, or a sender that does not announce ahead: not waited for again)."""
    for _ in range(100):
        posted = await target.call("receives_posted", room)
        if posted is None:
            return False
        if posted > 0:
            return True
        await asyncio.sleep(0.001)
    return False


async def _run(args: argparse.Namespace) -> list[Result]:
    backend = args.backend
    repeats = getattr(args, "repeat", 1)
    if repeats < 1 or args.iterations < 1:
        raise SystemExit(f"bench transport: --repeat and --iterations must be >= 1, got {repeats} and {args.iterations}")
    kinds = set(getattr(args, "cases", CASES))
    if "head-sliced" in kinds:
        kinds.add("contiguous")
    max_pages = max(args.tokens) // TOKENS_PER_PAGE
    # HND pages: [heads, tokens, head dim]; a head slice of a page is one contiguous block
    huge = getattr(args, "huge_pages", True)
    layout = Layout(layers=args.layers, pages=2 * max_pages, page_shape=(KV_HEADS, TOKENS_PER_PAGE, HEAD_DIM), slots=4,
                    huge_pages=huge)
    half = KV_HEADS // 2
    head_bytes = layout.page_bytes // KV_HEADS
    # the head-sliced receiver: TP rank 1 of 2, holding heads [H/2, H)
    tp2_layout = Layout(layers=args.layers, pages=2 * max_pages, huge_pages=huge,
                        page_shape=(KV_HEADS - half, TOKENS_PER_PAGE, HEAD_DIM), slots=4)
    device = resolve_bench_device(args)
    layout, tp2_layout = placed(layout, device), placed(tp2_layout, device)
    options: dict[str, Any] = {}
    if args.connections is not None:
        options["connections"] = args.connections
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = _parse_value(value)
    base_kind = "contiguous" if "contiguous" in kinds else "scattered"  # raw iterations alternate with it
    rng = random.Random(args.seed)
    # Each case: the kinds timed together, one iteration of each in turn (head-sliced
    # alternates with its whole-page baseline, so both see the same machine load).
    cases: list[tuple[int, list[str], list[int], list[int]]] = []
    for tokens in args.tokens:
        n = tokens // TOKENS_PER_PAGE
        scattered = (rng.sample(range(layout.pages), n), rng.sample(range(layout.pages), n))
        if "contiguous" in kinds:
            together = ["contiguous"] + (["head-sliced"] if "head-sliced" in kinds else [])
            cases.append((tokens, together, list(range(n)), list(range(n))))
        if "scattered" in kinds:
            cases.append((tokens, ["scattered"], *scattered))
    nbytes = {t: 2 * layout.layers * (t // TOKENS_PER_PAGE) * layout.page_bytes for t in args.tokens}
    moved = {(t, k): nbytes[t] // KV_HEADS * (KV_HEADS - half) if k == "head-sliced" else nbytes[t]
             for t, together, _, _ in cases for k in together}

    # The raw baseline's two processes stay alive (rdma: a ucxx sender and receiver, which
    # own their UCX workers; socket backends: a plain socket pair) and each raw iteration
    # runs right before the backend's, so both see the same machine load.
    # base_lat[nbytes][repeat]: the raw latencies of that repeat.
    base_lat: dict[int, list[list[float]]] = {nb: [[] for _ in range(repeats)] for nb in nbytes.values()}
    raw: RawTcp | RawUcx | None = None
    control: RawTcp | RawUcx | None = None  # --control: a second raw pair, timed like a backend
    control_lat: dict[int, list[list[float]]] = {nb: [[] for _ in range(repeats)] for nb in nbytes.values()}
    if device != "cpu":  # GPU memory: the baseline is a device-to-device copy between the processes
        base_name = CUDA_BASELINE
        for nb, lats in ipc_copy_baseline(sorted(set(nbytes.values())), args.iterations, args.warmup, device).items():
            for rep in base_lat[nb]:
                rep.extend(lats)  # measured once; every repeat compares against it
    elif backend == "rdma":
        base_name = "raw ucxx tag send/recv"
        raw = RawUcx(max(nbytes.values()))
    else:
        base_name = "raw tcp socket recv_into"
        raw = RawTcp(max(nbytes.values()))
    if getattr(args, "control", False) and raw is not None:
        try:
            control = type(raw)(max(nbytes.values()))
        except BaseException:
            raw.close()
            raise

    prepared = getattr(args, "write", "prepared") == "prepared"
    posts_ahead = True  # until a prepared write finds the receiver posted nothing ahead

    def ops_of(kind: str, pairs: Any, src: list[int], dst: list[int]) -> WriteOps:
        if kind == "head-sliced":
            return head_slice_ops(pairs, src, dst, src_heads=(0, KV_HEADS), dst_heads=(half, KV_HEADS),
                                  heads=(half, KV_HEADS), head_bytes=head_bytes)
        return page_ops(pairs, src, dst)

    regions, flats = layout.build(args.seed)  # sender memory, filled
    sender = registry.create(backend, **options)
    timings: dict[tuple[int, str], list[list[float]]] = {}  # (tokens, kind) -> latencies of each repeat
    try:
        await sender.register(regions)
        async with contextlib.AsyncExitStack() as stack:
            recv = await stack.enter_async_context(PeerProcess(backend, layout=layout, seed=None, options=options))
            peer = await sender.connect(recv.descriptor)
            targets = {"": (recv, peer, region_pairs(regions, peer.descriptor.regions),
                            peer.descriptor.require_region(METADATA_REGION_ID))}
            if "head-sliced" in kinds:
                recv_tp2 = await stack.enter_async_context(
                    PeerProcess(backend, layout=tp2_layout, seed=None, options=options))
                peer_tp2 = await sender.connect(recv_tp2.descriptor)
                targets["head-sliced"] = (recv_tp2, peer_tp2, region_pairs(regions, peer_tp2.descriptor.regions),
                                          peer_tp2.descriptor.require_region(METADATA_REGION_ID))
            room = 1
            # Warm-up pass (untimed): one write of every page of each receiver's pool.
            # The receivers' pools are fresh zero pages (first touch faults them in,
            # like an engine's pool touched at start-up) and UCX sets up its
            # shared-memory paths on first use; without this pass the first case's
            # iterations would time that set-up, not the transfer.
            everything = list(range(layout.pages))
            for kind, (target, target_peer, pairs, dst_meta) in targets.items():
                room += 1
                await target.call("advertise", room, everything, 0)
                if kind == "head-sliced":
                    ops = head_slice_ops(pairs, everything, everything, src_heads=(0, KV_HEADS),
                                         dst_heads=(half, KV_HEADS), heads=(half, KV_HEADS), head_bytes=head_bytes)
                else:
                    ops = page_ops(pairs, everything, everything)
                await sender.write(target_peer, room, ops, metadata=metadata_op(regions[-1], 0, dst_meta, 0))
                st = await sender.wait(room, 300)
                if st.state is not KVPoll.SUCCESS:
                    raise RuntimeError(f"{backend}: warm-up transfer ({kind or 'whole pages'}) ended {st}")
                sender.release(room)
                await target.call("release", room)
            for rep_i, (case_i, (tokens, together, src, dst)) in itertools.product(range(repeats), enumerate(cases)):
                lat: dict[str, list[float]] = {kind: [] for kind in together}
                for i in range(args.warmup + args.iterations):
                    if raw is not None and together[0] == base_kind:
                        b = raw.once(nbytes[tokens])
                        if i >= args.warmup:
                            base_lat[nbytes[tokens]][rep_i].append(b)
                        if control is not None:
                            c = control.once(nbytes[tokens])
                            if i >= args.warmup:
                                control_lat[nbytes[tokens]][rep_i].append(c)
                    for kind in together:
                        target, target_peer, pairs, dst_meta = targets.get(kind, targets[""])
                        room += 1
                        await target.call("advertise", room, dst, 0)
                        meta = metadata_op(regions[-1], 0, dst_meta, 0)
                        if prepared:  # a prefill's final write: prepared while the prompt computes
                            send = sender.prepare_write(target_peer, room, ops_of(kind, pairs, src, dst), metadata=meta)
                            if posts_ahead:  # the first prepared write finds out (warm-up)
                                posts_ahead = await _until_posted(target, room)
                            t0 = time.perf_counter()
                            await send()
                        else:
                            t0 = time.perf_counter()
                            await sender.write(target_peer, room, ops_of(kind, pairs, src, dst), metadata=meta)
                        st = await sender.wait(room, 300)
                        t1 = time.perf_counter()
                        if st.state is not KVPoll.SUCCESS:
                            raise RuntimeError(f"{backend}: transfer of {tokens} tokens ({kind}) ended {st}")
                        if i >= args.warmup:
                            lat[kind].append(t1 - t0)
                        sender.release(room)
                        await target.call("release", room)  # the bytes stay: checked below
                if isinstance(raw, RawUcx) and together[0] == base_kind:
                    # the raw baseline's last bytes, outside the timing too; in a thread, so
                    # the loop keeps answering the peers' liveness heartbeats meanwhile
                    await asyncio.to_thread(raw.check, nbytes[tokens])
                    if isinstance(control, RawUcx):
                        await asyncio.to_thread(control.check, nbytes[tokens])
                for kind in together:
                    # bit-exact check of the last iteration (outside the timing)
                    target = targets.get(kind, targets[""])[0]
                    first = half * head_bytes if kind == "head-sliced" else 0  # bytes of each page that moved
                    # in a thread, like the receiver's: 384 MiB of sha256 can outlast the
                    # liveness lease on a busy host if it holds the loop
                    want = await asyncio.to_thread(lambda: digest(torch.cat(
                        [flats[r].view(-1, layout.page_bytes)[src, first:].reshape(-1) for r in layout.kv_region_ids()])))
                    got = await target.call("digest_pages", layout.kv_region_ids(), dst, timeout=300)
                    if got != want:
                        raise RuntimeError(f"{backend}: {tokens} tokens ({kind}): destination pages differ from the source")
                    timings.setdefault((tokens, kind), []).append(lat[kind])
                    if args.verbose:
                        print(f"{tokens} tokens {kind}" + (f" (repeat {rep_i + 1})" if repeats > 1 else "") + ": "
                              + " ".join(f"{x * 1e3:.1f}" for x in lat[kind]) + " ms", file=sys.stderr)
                if args.verbose and raw is not None and together[0] == base_kind:
                    print(f"{tokens} tokens {base_name}" + (f" (repeat {rep_i + 1})" if repeats > 1 else "") + ": "
                          + " ".join(f"{x * 1e3:.1f}" for x in base_lat[nbytes[tokens]][rep_i]) + " ms", file=sys.stderr)
    finally:
        await sender.close()
        with contextlib.ExitStack() as closing:  # every pair is closed even if one's bytes check fails
            for pair in (raw, control):
                if pair is not None:
                    closing.callback(pair.close)
    def medians(runs: list[list[float]]) -> list[float]:
        """The samples of a case: its iterations (one repeat) or each repeat's median."""
        return list(runs[0]) if repeats == 1 else [statistics.median(r) for r in runs]

    def median_latency(runs: list[list[float]]) -> float:
        return statistics.median(runs[0]) if repeats == 1 else statistics.median(medians(runs))

    base = {nb: median_latency(runs) for nb, runs in base_lat.items()}

    results: list[Result] = []
    for tokens in args.tokens:
        nb = nbytes[tokens]
        gbps_by_kind = {}
        for kind in CASES:
            if (tokens, kind) not in timings:
                continue
            runs = timings[(tokens, kind)]
            med = median_latency(runs)  # seconds
            gbps = moved[(tokens, kind)] / med / 1e9
            gbps_by_kind[kind] = gbps
            if kind == "head-sliced":
                continue  # moves other byte counts than the baseline; compared below
            b_lat = base[nb]
            b_gbps = nb / b_lat / 1e9
            lats = medians(runs)
            case = f"{backend} {_size(tokens)} {kind} ({nb / 2**20:.0f} MiB{'' if prepared else ', direct write'})"
            results.append(Result(case, f"throughput vs {base_name}", gbps, "GB/s", b_gbps, gbps / b_gbps,
                                  tuple(nb / x / 1e9 for x in lats)))
            results.append(Result(case, f"latency vs {base_name}", med * 1e3, "ms", b_lat * 1e3, med / b_lat,
                                  tuple(x * 1e3 for x in lats)))
            if repeats > 1:
                # each repeat against the raw baseline of the same repeat; the value is the slowest
                per = tuple(statistics.median(b) / statistics.median(r) for r, b in zip(runs, base_lat[nb]))
                results.append(Result(case, f"throughput vs {base_name}, slowest repeat", min(per), "x",
                                      samples=per))
        if control is not None and control_lat[nb][0]:
            # the second raw pair, read exactly like a backend's case
            c_runs = control_lat[nb]
            c_lat, b_lat = median_latency(c_runs), base[nb]
            case = f"control: 2nd raw pair {_size(tokens)} ({nb / 2**20:.0f} MiB)"
            results.append(Result(case, f"throughput vs {base_name}", nb / c_lat / 1e9, "GB/s", nb / b_lat / 1e9,
                                  b_lat / c_lat, tuple(nb / x / 1e9 for x in medians(c_runs))))
            if repeats > 1:
                per = tuple(statistics.median(b) / statistics.median(r) for r, b in zip(c_runs, base_lat[nb]))
                results.append(Result(case, f"throughput vs {base_name}, slowest repeat", min(per), "x",
                                      samples=per))
        for kind, vs in (("scattered", "contiguous"), ("head-sliced", "whole-page")):
            if kind in gbps_by_kind and "contiguous" in gbps_by_kind:
                results.append(
                    Result(
                        f"{backend} {_size(tokens)} {kind} vs {vs}",
                        "throughput",
                        gbps_by_kind[kind],
                        "GB/s",
                        gbps_by_kind["contiguous"],
                        gbps_by_kind[kind] / gbps_by_kind["contiguous"],
                    )
                )
    if getattr(args, "plot", None) is not None:
        from pdgrpc.bench.plot import transport_figure

        def rate(tokens: int, kind: str) -> float | None:
            t = timings.get((tokens, kind))
            return moved[(tokens, kind)] / median_latency(t) / 1e9 if t else None

        sizes = [nbytes[t] for t in args.tokens]
        transport_figure(
            args.plot, backend, base_name, sizes,
            {kind: [rate(t, kind) for t in args.tokens] for kind in CASES},
            [nb / base[nb] / 1e9 for nb in sizes],
        )
    return results
