"""Entry point of one prefill worker process (started by the DP controller).

``python -m pdgrpc.prefill.worker_main --dp-rank R --dp-size N --bootstrap ADDR ...``:
builds the engine and the transport, serves PrefillService (worker level) and
HandshakeService on its own grpc.aio server, and the controller's Prefill calls on the
socket its controller passed (``--link-fd``, :mod:`pdgrpc.prefill.link`), registers with
bootstrap (transfer address = this server, transport endpoint = the transport
descriptor), prints one line ``PDGRPC_WORKER_READY {json}`` to stdout for the controller,
and serves until SIGTERM -- or until its controller is gone (a worker never outlives the
process that started it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from typing import Awaitable, TypeVar

import torch

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.engine.base import Engine
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import PdgrpcError
from pdgrpc.prefill.compute_process import ComputeProcess
from pdgrpc.metrics import PrefillMetrics, add_metrics_arguments, start_metrics_from_args
from pdgrpc.prefill.cli import add_worker_arguments
from pdgrpc.prefill.dispatch import METHODS
from pdgrpc.prefill.link import WorkerLinkServer
from pdgrpc.prefill.services import HANDSHAKE_SERVICE, PREFILL_SERVICE, HandshakeServicer, WirePrefillServicer, WorkerPrefillServicer
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig
from pdgrpc.rpc.server import run, serve_until_signal, start_server
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.serving.flags import create_transport, engine_config_from_args, tune_malloc_from_args
from pdgrpc.serving.metadata import compat_hash_bytes
from pdgrpc.serving.engines import build_engine, uses_checkpoint
from pdgrpc.serving.kv_events import KvEventFeed
from pdgrpc.serving.launch import Role
from pdgrpc.v1 import bootstrap_pb2, handshake_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdgrpc.prefill.worker")

READY = "PDGRPC_WORKER_READY"

T = TypeVar("T")

_GRACE_S = 5.0  # on SIGTERM, how long requests in flight may still run

_LB = {
    "round_robin": bootstrap_pb2.LOAD_BALANCE_METHOD_ROUND_ROBIN,
    "follow_bootstrap_room": bootstrap_pb2.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM,
    "shortest_queue": bootstrap_pb2.LOAD_BALANCE_METHOD_SHORTEST_QUEUE,
    "cache_aware": bootstrap_pb2.LOAD_BALANCE_METHOD_CACHE_AWARE,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.prefill.worker_main", description=__doc__)
    p.add_argument("--dp-rank", type=int, required=True, help="this worker's dp rank")
    p.add_argument("--dp-size", type=int, required=True, help="dp ranks of the instance")
    p.add_argument("--tp-rank", type=int, default=0, help="this worker's tp rank in its dp group")
    p.add_argument("--tp-size", type=int, default=1, help="tp ranks per dp group")
    p.add_argument(
        "--dist-init", default="",
        help="torch.distributed init_method of this dp group (tcp://HOST:PORT); required with --tp-size > 1",
    )
    p.add_argument("--bootstrap", required=True, help="HOST:PORT of the BootstrapService to register with")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument(
        "--advertise-host", default="",
        help="host part of the HandshakeService address registered with bootstrap (decodes on other hosts dial it); "
        "default: --host (127.0.0.1 when --host is a wildcard)",
    )
    p.add_argument("--load-balance-method", choices=METHODS, required=True)
    p.add_argument("--force-dp-rank-query", action="store_true")
    p.add_argument(
        "--link-fd", type=int, default=None,
        help="inherited Unix socket on which the controller sends Prefill calls (set by the controller; "
        "without it the worker is reached over gRPC only)",
    )
    add_worker_arguments(p)
    # Not in add_worker_arguments: each worker gets its own port from the controller
    # (derived_metrics_port), not the controller's flag passed through.
    add_metrics_arguments(p)
    add_security_arguments(p)
    return p


def parallel_info(ns: argparse.Namespace, worker: PrefillWorker) -> bootstrap_pb2.ParallelInfo:
    layout = worker.engine.kv_layout
    return bootstrap_pb2.ParallelInfo(
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        pp_size=1,
        page_size=layout.page_size,
        kv_dtype=layout.kv_dtype,
        kv_layout=layout.name,
        compatibility_hash=compat_hash_bytes(worker.engine),
        load_balance_method=_LB[ns.load_balance_method],
        force_dp_rank_query=ns.force_dp_rank_query,
    )


async def watch_parent(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once the controller (``parent``) exits. Its pidfd wakes the loop, so an
    idle worker never polls for it; without pidfds (an old kernel, a sandbox) it polls."""
    try:
        fd = os.pidfd_open(parent)
    except OSError:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
    else:
        loop, gone = asyncio.get_running_loop(), asyncio.Event()
        loop.add_reader(fd, gone.set)
        try:
            if os.getppid() == parent:  # else it exited before the fd was opened
                await gone.wait()
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    log.error("controller (pid %d) is gone; stopping", parent)
    stop.set()


async def _unless(aw: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``aw``'s result, or None (``aw`` cancelled) if ``stop`` is set first."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def worker_name(ns: argparse.Namespace) -> str:
    return f"dp{ns.dp_rank}" if ns.tp_size == 1 else f"dp{ns.dp_rank}.tp{ns.tp_rank}"


def _init_tp(ns: argparse.Namespace) -> Engine:
    """The engine of this rank; with --tp-size > 1 after joining the dp group's gloo world."""
    if ns.tp_size == 1:
        return build_engine(ns)
    import datetime

    import torch.distributed as dist

    from pdgrpc.engine.tp import torch_distributed_all_reduce

    if not ns.dist_init:
        raise SystemExit("--dist-init is required with --tp-size > 1")
    dist.init_process_group(
        "gloo", init_method=ns.dist_init, rank=ns.tp_rank, world_size=ns.tp_size,
        timeout=datetime.timedelta(seconds=ns.dist_timeout),
    )
    log.info("%s joined the TP group at %s (%d ranks)", worker_name(ns), ns.dist_init, ns.tp_size)
    return build_engine(ns, tp_rank=ns.tp_rank, tp_size=ns.tp_size, all_reduce=torch_distributed_all_reduce())


def compute_in(ns: argparse.Namespace) -> str:
    """Where this worker computes: ``--compute-in``, unless that cannot be had here
    (said in the log)."""
    if ns.compute_in != "process":
        return "thread"
    if uses_checkpoint(ns):
        log.info("%s: --compute-in process: a --model engine computes on a thread (in a compute process its "
                 "prompts computed slower: docs/performance.md)", worker_name(ns))
        return "thread"
    if getattr(ns, "device", "cpu") != "cpu":
        log.info("%s: --compute-in process: a --device %s pool is not shared memory; computing on a thread", worker_name(ns), ns.device)
        return "thread"
    if ns.tp_size > 1:
        log.info("%s: --compute-in process: a TP rank computes on a thread (its gloo group lives in the worker)", worker_name(ns))
        return "thread"
    if not hasattr(os, "memfd_create"):
        log.info("%s: --compute-in process needs memfd_create (Linux); computing on a thread", worker_name(ns))
        return "thread"
    return "process"


async def _main(ns: argparse.Namespace) -> int:
    name = worker_name(ns)
    compute: ComputeProcess | None = None
    if compute_in(ns) == "process":
        config = engine_config_from_args(ns)
        engine: Engine
        compute = await ComputeProcess.start(
            config, name=f"prefill {name}", nice=ns.compute_nice, malloc_keep_bytes=ns.malloc_keep_mib << 20
        )
        engine = ReferenceEngine(config, kv_pool=compute.kv)
    else:
        engine = _init_tp(ns)
    transport = create_transport(ns)
    metrics = PrefillMetrics(transport=transport.name)
    metrics.set_info(dp_rank=ns.dp_rank, dp_size=ns.dp_size)
    kv_events = KvEventFeed()  # this rank's prefix cache reports here; the controller follows it
    worker = PrefillWorker(
        engine,
        transport,
        WorkerConfig(
            dp_rank=ns.dp_rank,
            tp_rank=ns.tp_rank,
            tp_size=ns.tp_size,
            chunk_size=ns.chunk_size,
            min_write_bytes=ns.min_write_bytes,
            handshake_timeout_s=ns.handshake_timeout,
            transfer_timeout_s=ns.transfer_timeout,
            page_wait_s=ns.page_wait_timeout,
            compute_nice=ns.compute_nice,
            prefix_cache=not ns.no_prefix_cache,
        ),
        metrics=metrics,
        compute=compute,
        cache_events=kv_events,
    )
    descriptor = await worker.start()
    # Live gauges: the worker's own allocator and transport, read at scrape time.
    metrics.bind(worker.live_stats)
    try:
        stop_metrics = start_metrics_from_args(ns, metrics.registry, f"prefill worker {name}")
    except BaseException:
        metrics.unbind()
        await worker.close()
        raise
    # Watch the controller from the start: a worker must not outlive it, not even while
    # it is still registering (bootstrap registration retries for a while).
    orphaned = asyncio.Event()
    watcher = asyncio.ensure_future(watch_parent(os.getppid(), orphaned))
    wire = WirePrefillServicer(WorkerPrefillServicer(worker, kv_events), metrics.on_refused, ns.max_prefills_per_client)
    server = await start_server(
        [
            (PREFILL_SERVICE, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(wire, s)),
            (HANDSHAKE_SERVICE, lambda s: handshake_pb2_grpc.add_HandshakeServiceServicer_to_server(HandshakeServicer(worker), s)),
        ],
        host=ns.host,
        port=0,
        what=f"pdgrpc prefill worker {name}",
    )
    server.on_stop(kv_events.close)
    link: WorkerLinkServer | None = None
    if ns.link_fd is not None:
        # Closed by the controller (it died): stop, as the parent watch would a moment later.
        link = await WorkerLinkServer.open(
            socket.socket(fileno=ns.link_fd), name, worker.prefill, on_lost=orphaned.set
        )

        async def _drain_link() -> None:
            assert link is not None
            await link.close(grace=_GRACE_S, cancel=False)

        server.on_stop(_drain_link)
    client = BootstrapClient(ns.bootstrap)
    info = bootstrap_pb2.WorkerInfo(
        dp_rank=ns.dp_rank, tp_rank=ns.tp_rank, pp_rank=0,
        transfer_address=f"{ns.advertise_host}:{server.port}" if ns.advertise_host else server.address,
        transport=transport.name, transport_endpoint=descriptor,
    )
    try:
        reg = await _unless(client.register_worker(info, parallel_info(ns, worker)), orphaned)
    except Exception as exc:
        log.error("%s: registering with bootstrap %s failed: %s", name, ns.bootstrap, exc)
        reg = None
    if reg is None:
        watcher.cancel()
        if link is not None:
            await link.close()
        await server.stop(0)
        metrics.unbind()
        stop_metrics()
        await worker.close()
        return 1
    worker.generation = reg.generation
    log.info(
        "%s registered with bootstrap %s (generation %d, %d of %d workers); transport %s, %d KV pages, chunk %d",
        name, ns.bootstrap, reg.generation, reg.registered_workers, reg.expected_workers,
        transport.name, engine.num_pages, ns.chunk_size,
    )
    print(READY, json.dumps({"dp_rank": ns.dp_rank, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "address": server.address, "generation": reg.generation}), flush=True)
    stop_on_orphan = asyncio.ensure_future(orphaned.wait())
    stop_on_orphan.add_done_callback(lambda f: None if f.cancelled() else asyncio.ensure_future(server.stop(1.0)))
    stop_on_broken = asyncio.ensure_future(worker.broken.wait())
    stop_on_broken.add_done_callback(lambda f: None if f.cancelled() else asyncio.ensure_future(server.stop(1.0)))
    try:
        await serve_until_signal(server, grace=_GRACE_S)
    finally:
        if link is not None:
            await link.close()  # calls still running after the grace are cancelled
        watcher.cancel()
        stop_on_orphan.cancel()
        stop_on_broken.cancel()
        # After the grace period: in-flight requests finished (or were cancelled by the
        # server), so closing the transport interrupts nothing that could still succeed.
        await worker.close()
        metrics.unbind()
        stop_metrics()
    if worker.broken.is_set():
        log.error("%s: exiting: %s", name, worker.broken_reason)
        return 1
    return 0


def serve(ns: argparse.Namespace) -> int:
    tune_malloc_from_args(ns)
    torch.set_num_threads(ns.compute_threads)
    try:
        return run(_main(ns))
    except PdgrpcError as exc:  # a flag value that fails here first (a --transport-host it cannot listen on): one line
        log.error("%s: %s", worker_name(ns), exc)
        return 1


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: f"prefill.{worker_name(ns)}")
