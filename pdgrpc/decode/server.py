"""The decode server as a process (``python -m pdgrpc.decode``): start-up, TP ranks and
shutdown (flags: :mod:`pdgrpc.decode.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdgrpc.decode.cli import build_parser, scheduler_config_from_args
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.discovery.cli import check_discovery_args, register_on, registration_from_args
from pdgrpc.engine.base import Engine
from pdgrpc.errors import ConfigError, PdgrpcError
from pdgrpc.gateway import decode_service
from pdgrpc.metrics import DecodeMetrics, start_metrics_from_args
from pdgrpc.rpc.server import run, serve_until_signal
from pdgrpc.serving.children import guarded_argv
from pdgrpc.serving.rendezvous import dist_init_method
from pdgrpc.serving.flags import create_transport, tune_malloc_from_args
from pdgrpc.serving.engines import build_engine, check_engine_args, engine_limits_argv
from pdgrpc.serving.launch import Role
from pdgrpc.serving.threads import abandonable
from pdgrpc.transport import registry
from pdgrpc.transport.base import Transport


async def _start_ranks(ns: argparse.Namespace) -> tuple[list[asyncio.subprocess.Process], str]:
    """Start TP ranks 1..N-1 with this process's flags; returns them and the gloo address."""
    from pdgrpc.metrics import derived_metrics_port

    # Every rank's metrics port first: one past 65535 fails before any rank starts.
    ports = {rank: derived_metrics_port(ns.metrics_port, rank) for rank in range(1, ns.tp_size)}
    init = dist_init_method()
    procs = []
    for rank, port in ports.items():
        argv = [sys.executable, "-m", "pdgrpc.decode.follower", *getattr(ns, "argv", []), *engine_limits_argv(ns), "--tp-rank", str(rank), "--dist-init", init]
        if port is not None:
            argv += ["--metrics-port", str(port)]
        # Guarded: a rank whose rank 0 died (SIGTERM or SIGKILL during start-up, before any
        # stop could reach it) is killed by the kernel, not left waiting for a group that is gone.
        procs.append(await asyncio.create_subprocess_exec(*guarded_argv(argv), stdin=asyncio.subprocess.DEVNULL))
    return procs, init


async def _watch_ranks(procs: list[asyncio.subprocess.Process], scheduler: DecodeScheduler) -> None:
    done, _ = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], return_when=asyncio.FIRST_COMPLETED)
    dead = next(p for p in procs if p.returncode is not None)
    scheduler.rank_lost(f"decode TP rank {procs.index(dead) + 1} (pid {dead.pid}) exited with code {dead.returncode}")


async def _main(ns: argparse.Namespace) -> int:
    if ns.tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {ns.tp_size}")
    config = scheduler_config_from_args(ns)
    tp = None
    procs: list[asyncio.subprocess.Process] = []
    if ns.tp_size > 1:  # the engine flags passed the role's check (ROLE): bad sizes started no process
        from pdgrpc.decode.tp import TpGroup

        procs, init = await _start_ranks(ns)
        try:
            # Abandoned if the start-up is stopped: the ranks are killed, so it could only time out.
            tp = await abandonable(TpGroup.join, 0, ns.tp_size, init, ns.dist_timeout, name="decode-tp-join")
        except BaseException:
            for p in procs:
                p.kill()
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
        return await _serve(ns, engine, transport, scheduler, metrics, procs)
    except asyncio.CancelledError:
        # Stopped before it served (SIGTERM or Ctrl-C at start-up): no "stop" command
        # reaches the other ranks, so they are killed rather than waited for.
        for p in procs:
            if p.returncode is None:
                p.kill()
        raise
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
    ns: argparse.Namespace, engine: Engine, transport: Transport, scheduler: DecodeScheduler,
    metrics: DecodeMetrics, procs: list[asyncio.subprocess.Process],
) -> int:
    # smg's worker protocol beside DecodeService, with pdgrpc[gateway] installed.
    server = await start_decode_server(
        scheduler, ns.host, ns.port, extra=lambda d, drain: decode_service(d, ns, ns.transport, drain), max_per_client=ns.max_decodes_per_client,
        max_share=ns.max_decode_share, gateway_listen=getattr(ns, "gateway_listen", None),
        gateway_uids=getattr(ns, "gateway_uid", ()),
    )
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


def serve(ns: argparse.Namespace) -> int:
    tune_malloc_from_args(ns)
    try:
        check_discovery_args(ns)
        return run(_main(ns))
    except PdgrpcError as exc:  # bad flag values, transport unavailable: one clear line
        logging.getLogger("pdgrpc.decode").error("%s", exc)
        return 2
    except OSError as exc:
        logging.getLogger("pdgrpc.decode").error("%s", exc)
        return 1


def check(ns: argparse.Namespace) -> None:
    """Flag values no decode can start with, refused before its engine is built."""
    check_engine_args(ns, tp_size=ns.tp_size)
    registry.check(ns.transport)  # a missing backend names what to install


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: "decode", check=check)
