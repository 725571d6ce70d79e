"""``python -m pdgrpc.decode``: run a decode server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

from pdgrpc.rpc.tuning import apply_grpc_defaults

apply_grpc_defaults()  # before grpc is imported (below): see pdgrpc.rpc.tuning

from pdgrpc.decode.job import SchedulerConfig  # noqa: E402
from pdgrpc.decode.scheduler import DecodeScheduler  # noqa: E402
from pdgrpc.decode.service import start_decode_server  # noqa: E402
from pdgrpc.engine.reference import ReferenceEngine  # noqa: E402
from pdgrpc.errors import ConfigError, PdgrpcError  # noqa: E402
from pdgrpc.metrics import DecodeMetrics, add_metrics_arguments, start_metrics_from_args  # noqa: E402
from pdgrpc.rpc.server import run, serve_until_signal  # noqa: E402
from pdgrpc.serving import (  # noqa: E402
    add_engine_arguments,
    add_logging_arguments,
    add_transport_arguments,
    create_transport,
    engine_config_from_args,
    setup_logging,
)
from pdgrpc.state import DecodeDeadlines  # noqa: E402
from pdgrpc.transport.base import Transport  # noqa: E402

DESCRIPTION = """\
A pdgrpc decode server (gRPC, pdgrpc.v1.DecodeService).

For each Decode call (sent by the router together with the prefill request) it finds the
prefill dp rank that holds the request (routed rank, room % dp_size, or a batched
QueryDpRanks to the prefill's bootstrap), allocates KV pages and a metadata slot,
handshakes with that prefill worker, waits for the KV and the metadata row to land over
the transport, checks the row's bootstrap_room, then continues generation and streams
the tokens. Every phase has a deadline. GetStats reports what the server holds.
Also serves grpc.health.v1 and server reflection. Logs "pdgrpc decode listening on
HOST:PORT" once it accepts calls, and one line per request event (grep room=<room>).

Tensor parallelism: --tp-size N starts N-1 more processes (python -m pdgrpc.decode.follower),
one per TP rank, joined in a gloo group. Each rank holds its share of the KV heads, its own
transport endpoint and metadata rows; this process (rank 0) serves gRPC and drives the
others, which replay its scheduling so that all ranks commit the same requests in the same
order. Rank r's metrics are on --metrics-port + r. If a rank dies, the instance exits 1."""

_D = DecodeDeadlines()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.decode", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="TCP port of the gRPC server; 0 picks a free one, printed in the log line (default: %(default)s)")
    add_engine_arguments(p)
    add_transport_arguments(p)
    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--tp-size", type=int, default=1, metavar="N",
        help="tensor-parallel ranks (processes); must divide the model's heads and MLP width (default: %(default)s)",
    )
    g.add_argument(
        "--dist-timeout", type=float, default=120.0, metavar="SECONDS",
        help="TP > 1: how long a rank waits in a collective for the others before giving up (default: %(default)s)",
    )
    g.add_argument("--dist-init", default="", help=argparse.SUPPRESS)  # set by rank 0 for the other ranks
    g.add_argument(
        "--num-slots", type=int, default=256, metavar="N",
        help="metadata slots: at most this many transfers in flight; more requests wait for a slot (default: %(default)s)",
    )
    g.add_argument(
        "--dp-rank-query-interval", type=float, default=0.05, metavar="SECONDS",
        help="at most one batched QueryDpRanks per prefill instance per interval (default: %(default)s)",
    )
    g.add_argument(
        "--rpc-timeout", type=float, default=5.0, metavar="SECONDS",
        help="deadline of each bootstrap call and AbortRoom (default: %(default)s)",
    )
    d = p.add_argument_group("deadlines (seconds a request may spend in each phase; DEADLINE_EXCEEDED names the phase)")
    d.add_argument("--resolve-timeout", type=float, default=_D.resolve_dp_rank_s, metavar="S", help="until the prefill dp rank is known (default: %(default)s)")
    d.add_argument("--allocate-timeout", type=float, default=_D.allocate_s, metavar="S", help="waiting for free KV pages and a metadata slot (default: %(default)s)")
    d.add_argument("--bootstrap-timeout", type=float, default=_D.bootstrap_s, metavar="S", help="until every prefill worker accepted the handshake (default: %(default)s)")
    d.add_argument(
        "--waiting-timeout", type=float, default=_D.waiting_for_input_s, metavar="S",
        help="handshake accepted, no KV byte arrived yet (prefill queueing and computing) (default: %(default)s)",
    )
    d.add_argument("--transfer-timeout", type=float, default=_D.transferring_s, metavar="S", help="KV arriving until the metadata row landed (default: %(default)s)")
    d.add_argument(
        "--abort-lease", type=float, default=_D.abort_lease_s, metavar="S",
        help="an aborted request's pages and slot are reused once the prefill acknowledged AbortRoom, or after this long (default: %(default)s)",
    )
    add_metrics_arguments(p)
    add_logging_arguments(p)
    return p


def scheduler_config_from_args(ns: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        deadlines=DecodeDeadlines(
            resolve_dp_rank_s=ns.resolve_timeout,
            allocate_s=ns.allocate_timeout,
            bootstrap_s=ns.bootstrap_timeout,
            waiting_for_input_s=ns.waiting_timeout,
            transferring_s=ns.transfer_timeout,
            abort_lease_s=ns.abort_lease,
        ),
        query_interval_s=ns.dp_rank_query_interval,
        rpc_timeout_s=ns.rpc_timeout,
    )


def wrap_test_faults(transport: Transport, tp_rank: int) -> Transport:
    """Test hook: PDGRPC_TEST_FAULTS (JSON, see pdgrpc.transport.faults) wraps the
    transport, on every rank or only on rank PDGRPC_TEST_FAULTS_TP_RANK."""
    if not os.environ.get("PDGRPC_TEST_FAULTS"):
        return transport
    only = os.environ.get("PDGRPC_TEST_FAULTS_TP_RANK", "")
    if only and int(only) != tp_rank:
        return transport
    from pdgrpc.transport.faults import wrap_from_env

    return wrap_from_env(transport)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def _start_ranks(ns: argparse.Namespace) -> tuple[list[asyncio.subprocess.Process], str]:
    """Start TP ranks 1..N-1 with this process's flags; returns them and the gloo address."""
    from pdgrpc.metrics import derived_metrics_port

    init = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
    procs = []
    for rank in range(1, ns.tp_size):
        argv = [sys.executable, "-m", "pdgrpc.decode.follower", *getattr(ns, "argv", []), "--tp-rank", str(rank), "--dist-init", init]
        port = derived_metrics_port(ns.metrics_port, rank)
        if port is not None:
            argv += ["--metrics-port", str(port)]
        procs.append(await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL))
    return procs, init


async def _watch_ranks(procs: list[asyncio.subprocess.Process], scheduler: DecodeScheduler) -> None:
    done, _ = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], return_when=asyncio.FIRST_COMPLETED)
    if scheduler.fatal is not None and not scheduler.fatal.done() and not scheduler._closing:
        dead = next(p for p in procs if p.returncode is not None)
        scheduler._tp_lost(RuntimeError(f"decode TP rank {procs.index(dead) + 1} (pid {dead.pid}) exited with code {dead.returncode}"))


async def main(ns: argparse.Namespace) -> int:
    if ns.tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {ns.tp_size}")
    config = scheduler_config_from_args(ns)
    tp = None
    procs: list[asyncio.subprocess.Process] = []
    if ns.tp_size > 1:
        engine_config_from_args(ns, tp_rank=0, tp_size=ns.tp_size)  # bad sizes fail here, before any process starts
        from pdgrpc.decode.tp import TpGroup

        procs, init = await _start_ranks(ns)
        try:
            tp = await asyncio.to_thread(TpGroup, 0, ns.tp_size, init, ns.dist_timeout)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        from pdgrpc.engine.tp import torch_distributed_all_reduce

        engine = ReferenceEngine(engine_config_from_args(ns, tp_rank=0, tp_size=ns.tp_size), all_reduce=torch_distributed_all_reduce())
    else:
        engine = ReferenceEngine(engine_config_from_args(ns))
    transport = wrap_test_faults(create_transport(ns), 0)
    metrics = DecodeMetrics(transport=transport.name)
    metrics.set_info(tp_rank=0, tp_size=ns.tp_size)
    scheduler = DecodeScheduler(engine, transport, ns.num_slots, config, metrics=metrics, tp=tp)
    try:
        return await _serve(ns, engine, transport, scheduler, metrics, procs)
    finally:
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 10.0)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        if tp is not None:
            tp.close()


async def _serve(
    ns: argparse.Namespace, engine: ReferenceEngine, transport: Transport, scheduler: DecodeScheduler,
    metrics: DecodeMetrics, procs: list[asyncio.subprocess.Process],
) -> int:
    server = await start_decode_server(scheduler, ns.host, ns.port)
    watcher = asyncio.ensure_future(_watch_ranks(procs, scheduler)) if procs else None
    fatal_stop = asyncio.ensure_future(_stop_on_fatal(scheduler, server.rpc))
    # Live gauges read the scheduler's own allocators at scrape time (one source of truth).
    metrics.bind(scheduler.stats)
    try:
        stop_metrics = start_metrics_from_args(ns, metrics.registry, "decode")
    except BaseException:
        metrics.unbind()
        await server.stop(0)
        raise
    logging.getLogger("pdgrpc.decode").info(
        "decode ready: transport=%s slots=%d pages=%d page_size=%d tp_size=%d compat_hash=%s",
        transport.name, ns.num_slots, engine.num_pages, engine.kv_layout.page_size, ns.tp_size, scheduler.compat_hash.hex()[:16],
    )
    try:
        await serve_until_signal(server.rpc)
    finally:
        # After the gRPC server (and the scheduler) stopped: the last scrape still saw them.
        metrics.unbind()
        stop_metrics()
        for t in (watcher, fatal_stop):
            if t is not None:
                t.cancel()
    if scheduler.fatal is not None and scheduler.fatal.done() and not scheduler.fatal.cancelled():
        logging.getLogger("pdgrpc.decode").error("decode stopped: %s", scheduler.fatal.result())
        return 1
    logging.getLogger("pdgrpc.decode").info("decode stopped")
    return 0


async def _stop_on_fatal(scheduler: DecodeScheduler, rpc: "object") -> None:
    while scheduler.fatal is None:
        await asyncio.sleep(0.1)
    await asyncio.shield(scheduler.fatal)
    await rpc.stop(1.0)  # type: ignore[attr-defined]


def cli(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # the other TP ranks get the same flags
    setup_logging(ns.log_level, "decode")
    try:
        return run(main(ns))
    except PdgrpcError as exc:  # bad flag values, transport unavailable: one clear line
        logging.getLogger("pdgrpc.decode").error("%s", exc)
        return 2
    except OSError as exc:
        logging.getLogger("pdgrpc.decode").error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
