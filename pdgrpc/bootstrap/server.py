"""The bootstrap service as a process (``python -m pdgrpc.bootstrap``): its flags, start-up
and shutdown."""

from __future__ import annotations

import argparse
import logging

from pdgrpc.argtypes import port, positive_seconds, seconds, whole_number
from pdgrpc.bootstrap.defaults import DEFAULT_MAX_BATCH, DEFAULT_MAX_ROOMS, DEFAULT_TTL_S, MAX_ROOMS_LIMIT
from pdgrpc.bootstrap.registry import WorkerRegistry, check_sizes
from pdgrpc.bootstrap.service import BootstrapConfig, start_bootstrap_server
from pdgrpc.discovery.cli import add_discovery_arguments, check_discovery_args, register_on, registration_from_args
from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics import BootstrapMetrics, add_metrics_arguments, start_metrics_from_args
from pdgrpc.rpc.server import StopSignal, run, serve_until_signal
from pdgrpc.rpc.drain import add_drain_arguments
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.serving.launch import Role

DESCRIPTION = """\
The bootstrap service of one prefill instance (gRPC, pdgrpc.v1.BootstrapService).
Prefill workers register their endpoints and parallel info at start-up (the first
registration fixes the topology); prefill registers room -> dp rank in batches;
decode queries them in batches. Also serves grpc.health.v1 and server reflection.
Logs "pdgrpc bootstrap listening on HOST:PORT" once it accepts calls."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.bootstrap", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 127.0.0.1 = this machine only, 0.0.0.0 = every IPv4 interface (then TLS or a token is required, or --insecure) (default: %(default)s)")
    p.add_argument("--port", type=port, default=8998, help="TCP port to listen on; 0 picks a free one, printed in the log line (default: %(default)s)")
    p.add_argument(
        "--dp-rank-ttl", type=positive_seconds, default=DEFAULT_TTL_S, metavar="SECONDS",
        help="how long a room -> dp rank entry lives after its last registration; re-registering the same rank renews it (default: %(default)s)",
    )
    p.add_argument(
        "--max-rooms", type=whole_number(1, "rooms", maximum=MAX_ROOMS_LIMIT), default=DEFAULT_MAX_ROOMS, metavar="N",
        help="hard cap on rooms held; at the cap a new room evicts the oldest room no decode has queried yet (a queried room is never evicted; when every room is queried, new ones are refused with RESOURCE_EXHAUSTED until rooms expire). Memory is reserved for it: about 62 bytes per room, touched as rooms arrive (default: %(default)s)",
    )
    p.add_argument(
        "--max-rooms-per-registrant", type=whole_number(0, "rooms"), default=0, metavar="N",
        help="most rooms no decode has queried yet that one caller identity (a worker's certificate name, or its host with a token) may hold; "
        "past it its new rooms are refused with RESOURCE_EXHAUSTED, so one worker looping RegisterDpRanks cannot crowd the others out. "
        "0 = --max-rooms divided by the identities that registered workers; without authentication every caller counts as one (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch", type=whole_number(1, "rooms"), default=DEFAULT_MAX_BATCH, metavar="N",
        help="most rooms one RegisterDpRanks or QueryDpRanks call may carry; larger calls fail with INVALID_ARGUMENT. At most --max-rooms (default: %(default)s)",
    )
    p.add_argument("--sweep-interval", type=positive_seconds, default=1.0, metavar="SECONDS", help="how often expired rooms are freed; queries never see an expired room whatever this is (default: %(default)s)")
    p.add_argument(
        "--expire-budget", type=whole_number(1, "records"), default=16384, metavar="N",
        help="records one expiry step may free before yielding to calls; bounds the pause an expiry wave causes (default: %(default)s)",
    )
    p.add_argument(
        "--topology", type=_topology, default=None, metavar="DP,TP,PP",
        help="the prefill instance's dp_size,tp_size,pp_size, each at least 1: workers announcing other sizes are refused from the start. "
        "Unset: the first complete, consistent registration fixes the topology (default: unset)",
    )
    p.add_argument("--grace", type=seconds, default=5.0, metavar="SECONDS", help="on SIGTERM/SIGINT, how long in-flight calls may finish before the server closes (default: %(default)s)")
    add_metrics_arguments(p)
    add_discovery_arguments(p, "bootstrap")
    add_security_arguments(p)
    add_drain_arguments(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity, to stderr (default: %(default)s)")
    return p


async def _main(args: argparse.Namespace) -> None:
    config = BootstrapConfig(
        ttl=args.dp_rank_ttl,
        max_rooms=args.max_rooms,
        max_batch=args.max_batch,
        max_rooms_per_registrant=args.max_rooms_per_registrant,
        sweep_interval=args.sweep_interval,
        expire_budget=args.expire_budget,
    )
    stop = StopSignal()  # from now on SIGTERM/SIGINT stop us gracefully, even mid start-up
    metrics = BootstrapMetrics()
    server = await start_bootstrap_server(args.host, args.port, config, metrics=metrics, registry=WorkerRegistry(args.topology))
    table = server.table
    metrics.bind_table(lambda: table.stats)  # read at scrape time: the table's own totals
    try:
        stop_metrics = start_metrics_from_args(args, metrics.registry, "bootstrap")
    except BaseException:
        metrics.unbind()
        await server.stop(0)
        raise
    register_on(server.rpc, registration_from_args(args, "bootstrap", f"{args.host}:{server.rpc.port}"))
    try:
        server.rpc.on_drain(metrics.on_draining)
        await serve_until_signal(server.rpc, grace=args.grace, stop=stop, drain_timeout=args.drain_timeout)
    finally:
        metrics.unbind()
        stop_metrics()
    stats = server.table.stats
    logging.getLogger("pdgrpc.bootstrap").info(
        "stopped: %d rooms held, %d registered, %d expired, %d evicted; %d expiry steps, longest %.2f ms (%.2f ms CPU)",
        stats.size, stats.registered, stats.expired, stats.evicted,
        server.sweep_steps, server.longest_sweep_step_s * 1e3, server.longest_sweep_step_cpu_s * 1e3,
    )


def _topology(text: str) -> tuple[int, int, int]:
    """``--topology``'s value: three sizes of at least 1, written in ASCII digits (a size of
    0 leaves a topology no worker completes; ``int`` would also read other scripts' digits),
    whose workers fit the registry (:func:`check_sizes`)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(x.isascii() and x.isdigit() and int(x) >= 1 for x in parts):
        raise argparse.ArgumentTypeError(f"expected DP,TP,PP (three whole numbers >= 1), got {text!r}")
    dp, tp, pp = (int(x) for x in parts)
    try:
        check_sizes(dp, tp, pp, text)
    except PdgrpcError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return dp, tp, pp


def check(args: argparse.Namespace) -> None:
    if args.max_batch > args.max_rooms:  # a call may carry no more rooms than the table holds
        raise ValueError(f"--max-batch {args.max_batch} must be at most --max-rooms ({args.max_rooms})")


def serve(args: argparse.Namespace) -> int:
    try:
        check_discovery_args(args)
        run(_main(args))
    except PdgrpcError as exc:  # a bad flag value (max_batch > max_rooms)
        logging.getLogger("pdgrpc.bootstrap").error("%s", exc)
        return 2
    return 0


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda args: "bootstrap", check=check)
