"""The decode server as a process once its flags passed (``python -m pdgrpc.decode``,
:mod:`pdgrpc.decode.server`): rank 0's engine, its TP group, serving and shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdgrpc.decode.cli import scheduler_config_from_args
from pdgrpc.decode.followers import Followers
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.discovery.cli import register_on, registration_from_args
from pdgrpc.engine.base import Engine
from pdgrpc.errors import PdgrpcError
from pdgrpc.gateway import decode_service
from pdgrpc.metrics import DecodeMetrics, start_metrics_from_args
from pdgrpc.rpc.server import run, serve_until_signal
from pdgrpc.serving.flags import create_transport, tune_malloc_from_args
from pdgrpc.serving.engines import build_engine
from pdgrpc.transport.base import Transport


async def _watch_ranks(followers: Followers, scheduler: DecodeScheduler) -> None:
    scheduler.rank_lost(await followers.first_exit())


async def _main(ns: argparse.Namespace, followers: Followers | None) -> int:
    config = scheduler_config_from_args(ns)
    tp = None
    if followers is not None:
        from pdgrpc.decode.tp import TpGroup

        try:
            tp = await TpGroup.join(0, ns.tp_size, followers.init, ns.dist_timeout)
        except BaseException:
            followers.kill()
            raise
        from pdgrpc.engine.tp import torch_distributed_all_reduce

        engine = build_engine(ns, tp_rank=0, tp_size=ns.tp_size, all_reduce=torch_distributed_all_reduce())
    else:
        engine = build_engine(ns)
    transport = create_transport(ns, tp_rank=0)
    metrics = DecodeMetrics(transport=transport.name)
    metrics.set_info(tp_rank=0, tp_size=ns.tp_size)
    scheduler = DecodeScheduler(engine, transport, ns.num_slots, config, metrics=metrics, tp=tp)
    try:
        return await _serve(ns, engine, transport, scheduler, metrics, followers)
    except asyncio.CancelledError:
        # Stopped before it served (SIGTERM or Ctrl-C at start-up): no "stop" command
        # reaches the other ranks, so they are killed rather than waited for.
        if followers is not None:
            followers.kill()
        raise
    finally:
        if followers is not None:
            await followers.wait(10.0)
        if tp is not None:
            tp.close()


async def _serve(
    ns: argparse.Namespace, engine: Engine, transport: Transport, scheduler: DecodeScheduler,
    metrics: DecodeMetrics, followers: Followers | None,
) -> int:
    # smg's worker protocol beside DecodeService, with pdgrpc[gateway] installed.
    server = await start_decode_server(
        scheduler, ns.host, ns.port, extra=lambda d, drain: decode_service(d, ns, ns.transport, drain), max_per_client=ns.max_decodes_per_client,
        max_share=ns.max_decode_share, gateway_listen=getattr(ns, "gateway_listen", None),
        gateway_uids=getattr(ns, "gateway_uid", ()),
    )
    watcher = asyncio.ensure_future(_watch_ranks(followers, scheduler)) if followers is not None else None
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
    register_on(server.rpc, registration_from_args(
        ns, "decode", f"{ns.host}:{server.rpc.port}", transport=transport.name, tp_size=ns.tp_size,
        compat_hash=engine.compat_hash(),
    ))
    try:
        server.rpc.on_drain(metrics.on_draining)
        await serve_until_signal(server.rpc, drain_timeout=ns.drain_timeout)
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


def serve(ns: argparse.Namespace, followers: Followers | None) -> int:
    """Serve as rank 0 with the flags that passed :func:`pdgrpc.decode.server.check`, and
    the other ranks it started (None: TP 1)."""
    tune_malloc_from_args(ns)
    try:
        return run(_main(ns, followers))
    except PdgrpcError as exc:  # transport unavailable, a checkpoint that fails to load: one clear line
        logging.getLogger("pdgrpc.decode").error("%s", exc)
        return 2
