"""One prefill worker process (started by the DP controller), once its role
(:mod:`pdgrpc.prefill.worker_role`) has started its compute process.

``python -m pdgrpc.prefill.worker_main --dp-rank R --dp-size N --bootstrap ADDR ...``:
builds the engine and the transport, serves PrefillService (worker level) and
HandshakeService on its own grpc.aio server, and the controller's Prefill calls on the
socket its controller passed (``--link-fd``, :mod:`pdgrpc.prefill.link`), registers with
bootstrap (transfer address = this server, transport endpoint = the transport
descriptor), prints one line ``PDGRPC_WORKER_READY {json}`` to stdout for the controller,
and serves until SIGTERM. It stops once its controller is gone, whether it serves or
still starts: a worker never outlives the process that started it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
from typing import Any, Iterator

import torch

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.engine.base import Engine
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import PdgrpcError
from pdgrpc.prefill.compute_child import Child
from pdgrpc.prefill.compute_process import ComputeProcess
from pdgrpc.metrics import PrefillMetrics, start_metrics_from_args
from pdgrpc.prefill.link import WorkerLinkServer
from pdgrpc.prefill.services import HANDSHAKE_SERVICE, PREFILL_SERVICE, HandshakeServicer, WirePrefillServicer, WorkerPrefillServicer
from pdgrpc.prefill.worker import PrefillWorker
from pdgrpc.prefill.worker_config import READY, WorkerConfig, worker_name
from pdgrpc.rpc.server import RpcServer, run, serve_until_signal, start_server
from pdgrpc.serving.flags import create_transport, engine_config_from_args, tune_malloc_from_args
from pdgrpc.serving.metadata import compat_hash_bytes
from pdgrpc.serving.engines import build_engine
from pdgrpc.serving.kv_events import KvEventFeed, batch_to_proto
from pdgrpc.serving.rendezvous import join_tp_group
from pdgrpc.v1 import bootstrap_pb2, handshake_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdgrpc.prefill.worker")

_GRACE_S = 5.0  # on SIGTERM, how long requests in flight may still run

_LB = {
    "round_robin": bootstrap_pb2.LOAD_BALANCE_METHOD_ROUND_ROBIN,
    "follow_bootstrap_room": bootstrap_pb2.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM,
    "shortest_queue": bootstrap_pb2.LOAD_BALANCE_METHOD_SHORTEST_QUEUE,
    "cache_aware": bootstrap_pb2.LOAD_BALANCE_METHOD_CACHE_AWARE,
}


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


@contextlib.contextmanager
def _cancelled_by(event: asyncio.Event) -> Iterator[None]:
    """End the block once ``event`` is set: the running task is cancelled where it waits,
    so the block unwinds as a SIGTERM at start-up unwinds it (pdgrpc.serving.launch),
    each step releasing what it started, and the code after the block runs. A stop
    already under way (a signal) is not cancelled again: its cleanup runs whole."""
    task = asyncio.current_task()
    assert task is not None
    inside, cancelled = True, False

    def cancel(waited: asyncio.Future[Any]) -> None:
        nonlocal cancelled
        if inside and not waited.cancelled() and task.cancelling() == 0:
            cancelled = True
            task.cancel()

    waiter = asyncio.ensure_future(event.wait())
    waiter.add_done_callback(cancel)
    try:
        yield
    except asyncio.CancelledError:
        if not cancelled or task.uncancel() > 0:  # stopped by a signal too: that stop goes on
            raise
    finally:
        inside = False
        waiter.cancel()


async def _init_tp(ns: argparse.Namespace) -> Engine:
    """The engine of this rank; with --tp-size > 1 after joining the dp group's gloo world."""
    if ns.tp_size == 1:
        return build_engine(ns)
    from pdgrpc.engine.tp import torch_distributed_all_reduce

    await join_tp_group(ns.tp_rank, ns.tp_size, ns.dist_init, ns.dist_timeout, who=worker_name(ns))
    return build_engine(ns, tp_rank=ns.tp_rank, tp_size=ns.tp_size, all_reduce=torch_distributed_all_reduce())


async def _serve_and_link(
    ns: argparse.Namespace, worker: PrefillWorker, kv_events: KvEventFeed, metrics: PrefillMetrics, orphaned: asyncio.Event,
) -> tuple[RpcServer, WorkerLinkServer | None]:
    """Serve the worker's services, and its controller's calls on ``--link-fd``."""
    name = worker_name(ns)
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
    if ns.link_fd is None:
        return server, None
    try:
        # Closed by the controller (it died): stop, as the parent watch would a moment later.
        link = await WorkerLinkServer.open(socket.socket(fileno=ns.link_fd), name, worker.prefill, on_lost=orphaned.set)
    except BaseException:
        await server.stop(0)
        raise

    # Only a TP group's first rank: the controller follows that rank's cache for the group.
    pusher = asyncio.ensure_future(_send_kv_events(kv_events, link)) if ns.tp_rank == 0 else None

    async def _drain_link() -> None:
        if pusher is not None:
            pusher.cancel()
        await link.close(grace=_GRACE_S, cancel=False)

    server.on_stop(_drain_link)
    return server, link


async def _send_kv_events(kv_events: KvEventFeed, link: WorkerLinkServer) -> None:
    """Send the controller every batch of ``kv_events``, from the first, until the feed closes."""
    try:
        async for batches in kv_events.follow(0):
            for b in batches:
                link.send_events(batch_to_proto(b).SerializeToString())
    except Exception:  # a bug: the controller's view of this rank's cache stops here, so say so
        log.exception("sending KV events to the controller failed; it sees no more of this rank's cache")


async def _register(
    ns: argparse.Namespace, worker: PrefillWorker, server: RpcServer, transport: str, descriptor: bytes,
) -> bootstrap_pb2.RegisterWorkerResponse | None:
    """Register with bootstrap; None if that failed (logged)."""
    client = BootstrapClient(ns.bootstrap)
    info = bootstrap_pb2.WorkerInfo(
        dp_rank=ns.dp_rank, tp_rank=ns.tp_rank, pp_rank=0,
        transfer_address=f"{ns.advertise_host}:{server.port}" if ns.advertise_host else server.address,
        transport=transport, transport_endpoint=descriptor,
    )
    try:
        return await client.register_worker(info, parallel_info(ns, worker))
    except Exception as exc:
        log.error("%s: registering with bootstrap %s failed: %s", worker_name(ns), ns.bootstrap, exc)
        return None


async def _engine(ns: argparse.Namespace, child: Child | None, started: contextlib.AsyncExitStack) -> tuple[Engine, ComputeProcess | None]:
    """This rank's engine, and its compute process when it computes in ``child``."""
    if child is None:
        return await _init_tp(ns), None
    try:
        config = engine_config_from_args(ns)
    except BaseException:
        child.discard()
        raise
    compute = await ComputeProcess.start(  # closes the child if it fails
        config, name=f"prefill {worker_name(ns)}", nice=ns.compute_nice, malloc_keep_bytes=ns.malloc_keep_mib << 20, child=child
    )
    started.push_async_callback(compute.aclose)
    return ReferenceEngine(config, kv_pool=compute.kv), compute


@dataclasses.dataclass(frozen=True)
class _Serving:
    """A started worker, registered with bootstrap: what it serves until it stops."""

    worker: PrefillWorker
    server: RpcServer


async def _start(ns: argparse.Namespace, child: Child | None, orphaned: asyncio.Event, started: contextlib.AsyncExitStack) -> _Serving | None:
    """Start the worker: its engine, transport, servers, and registration with bootstrap.
    Each thing started goes on ``started``, which releases it when the worker ends, or
    when the start-up fails or is stopped. None: registration failed (logged)."""
    name = worker_name(ns)
    engine, compute = await _engine(ns, child, started)
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
    try:
        descriptor = await worker.start()
    except BaseException:
        await transport.close()
        raise
    # Closed after the server stopped: in-flight requests finished (or were cancelled by
    # the server), so closing the transport interrupts nothing that could still succeed.
    started.push_async_callback(worker.close)  # its transport and compute too
    # Live gauges: the worker's own allocator and transport, read at scrape time.
    metrics.bind(worker.live_stats)
    started.callback(metrics.unbind)
    started.callback(start_metrics_from_args(ns, metrics.registry, f"prefill worker {name}"))
    server, link = await _serve_and_link(ns, worker, kv_events, metrics, orphaned)
    started.push_async_callback(server.stop, 0)
    if link is not None:
        started.push_async_callback(link.close)  # calls still running after the grace are cancelled
    reg = await _register(ns, worker, server, transport.name, descriptor)
    if reg is None:
        return None
    worker.generation = reg.generation
    log.info(
        "%s registered with bootstrap %s (generation %d, %d of %d workers); transport %s, %d KV pages, chunk %d",
        name, ns.bootstrap, reg.generation, reg.registered_workers, reg.expected_workers,
        transport.name, engine.num_pages, ns.chunk_size,
    )
    print(READY, json.dumps({"dp_rank": ns.dp_rank, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "address": server.address, "generation": reg.generation}), flush=True)
    return _Serving(worker, server)


async def _serve(ns: argparse.Namespace, serving: _Serving, orphaned: asyncio.Event) -> int:
    """Serve until SIGTERM, the controller's exit or a broken compute; the exit status."""
    worker, server = serving.worker, serving.server
    stop_on_orphan = asyncio.ensure_future(orphaned.wait())
    stop_on_orphan.add_done_callback(lambda f: None if f.cancelled() else asyncio.ensure_future(server.stop(1.0)))
    stop_on_broken = asyncio.ensure_future(worker.broken.wait())
    stop_on_broken.add_done_callback(lambda f: None if f.cancelled() else asyncio.ensure_future(server.stop(1.0)))
    try:
        await serve_until_signal(server, grace=_GRACE_S)
    finally:
        stop_on_orphan.cancel()
        stop_on_broken.cancel()
    if worker.broken.is_set():
        log.error("%s: exiting: %s", worker_name(ns), worker.broken_reason)
        return 1
    return 0


async def _main(ns: argparse.Namespace, child: Child | None, controller: int) -> int:
    # A worker never outlives its controller, not even while it starts: the watch runs
    # first, and the controller's exit ends a start-up step that can wait long (a TP
    # group's join, the compute process's start, registration) as a SIGTERM would.
    orphaned = asyncio.Event()
    async with contextlib.AsyncExitStack() as started:
        watcher = asyncio.ensure_future(watch_parent(controller, orphaned))
        started.callback(watcher.cancel)
        serving: _Serving | None = None
        with _cancelled_by(orphaned):
            serving = await _start(ns, child, orphaned, started)
        if serving is None:  # the controller is gone (logged), or registration failed (logged)
            return 1
        return await _serve(ns, serving, orphaned)


def serve(ns: argparse.Namespace, child: Child | None, controller: int) -> int:
    """Run the worker of flags ``ns``; ``child``: its compute process, started already
    (:func:`pdgrpc.prefill.worker_role.serve`), or None to compute on a thread;
    ``controller``: the pid of the process that started it, which it does not outlive."""
    tune_malloc_from_args(ns)
    torch.set_num_threads(ns.compute_threads)
    try:
        return run(_main(ns, child, controller))
    except PdgrpcError as exc:  # a flag value that fails here first (a --transport-host it cannot listen on): one line
        log.error("%s: %s", worker_name(ns), exc)
        return 1
