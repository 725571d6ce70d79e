"""``python -m pdgrpc.decode``: run a decode server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys

from pdgrpc.rpc.tuning import apply_grpc_defaults

apply_grpc_defaults()  # before grpc is imported (below): see pdgrpc.rpc.tuning

from pdgrpc.decode.job import SchedulerConfig  # noqa: E402
from pdgrpc.decode.scheduler import DecodeScheduler  # noqa: E402
from pdgrpc.decode.service import start_decode_server  # noqa: E402
from pdgrpc.engine.reference import ReferenceEngine  # noqa: E402
from pdgrpc.errors import PdgrpcError  # noqa: E402
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

DESCRIPTION = """\
A pdgrpc decode server (gRPC, pdgrpc.v1.DecodeService).

For each Decode call (sent by the router together with the prefill request) it finds the
prefill dp rank that holds the request (routed rank, room % dp_size, or a batched
QueryDpRanks to the prefill's bootstrap), allocates KV pages and a metadata slot,
handshakes with that prefill worker, waits for the KV and the metadata row to land over
the transport, checks the row's bootstrap_room, then continues generation and streams
the tokens. Every phase has a deadline. GetStats reports what the server holds.
Also serves grpc.health.v1 and server reflection. Logs "pdgrpc decode listening on
HOST:PORT" once it accepts calls, and one line per request event (grep room=<room>)."""

_D = DecodeDeadlines()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.decode", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="TCP port of the gRPC server; 0 picks a free one, printed in the log line (default: %(default)s)")
    add_engine_arguments(p)
    add_transport_arguments(p)
    g = p.add_argument_group("scheduling")
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


async def main(ns: argparse.Namespace) -> int:
    engine = ReferenceEngine(engine_config_from_args(ns))
    transport = create_transport(ns)
    config = SchedulerConfig(
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
    metrics = DecodeMetrics(transport=transport.name)
    metrics.set_info(tp_rank=0, tp_size=1)
    scheduler = DecodeScheduler(engine, transport, ns.num_slots, config, metrics=metrics)
    server = await start_decode_server(scheduler, ns.host, ns.port)
    # Live gauges read the scheduler's own allocators at scrape time (one source of truth).
    metrics.bind(scheduler.stats)
    try:
        stop_metrics = start_metrics_from_args(ns, metrics.registry, "decode")
    except BaseException:
        metrics.unbind()
        await server.stop(0)
        raise
    logging.getLogger("pdgrpc.decode").info(
        "decode ready: transport=%s slots=%d pages=%d page_size=%d compat_hash=%s",
        transport.name, ns.num_slots, engine.num_pages, engine.kv_layout.page_size, scheduler.compat_hash.hex()[:16],
    )
    try:
        await serve_until_signal(server.rpc)
    finally:
        # After the gRPC server (and the scheduler) stopped: the last scrape still saw them.
        metrics.unbind()
        stop_metrics()
    logging.getLogger("pdgrpc.decode").info("decode stopped")
    return 0


def cli(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
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
