"""The prefill controller process: its servers, its startup and its shutdown.

:data:`ROLE` is ``python -m pdgrpc.prefill`` (:mod:`pdgrpc.prefill.__main__`):

* Serves ``PrefillService`` through a :class:`~pdgrpc.prefill.controller.Controller`
  (smg's worker protocol too, with ``pdgrpc[gateway]``), and embeds ``BootstrapService``
  on the same port unless ``--bootstrap`` names an external one.
* Starts the worker processes and waits until every one reported ready (it registered
  with bootstrap). Until then its gRPC health reports NOT_SERVING (the embedded
  BootstrapService alone is SERVING, since the workers register with it); then SERVING,
  and the ready line ``PDGRPC_READY {json}`` on stdout.
* On SIGTERM stops accepting requests, lets in-flight ones finish (``--grace``), then
  stops the workers (SIGTERM, then SIGKILL). A signal while the workers start stops them
  too.
"""

from __future__ import annotations

import argparse
import json
import logging

from pdgrpc.argtypes import check_address
from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import MAX_WORKERS, WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME as BOOTSTRAP_SERVICE
from pdgrpc.bootstrap.service import BootstrapConfig, BootstrapServer, BootstrapServicer, add_bootstrap_servicer, room_table
from pdgrpc.discovery.cli import check_discovery_args, register_on, registration_from_args
from pdgrpc.errors import ConfigError
from pdgrpc.gateway import prefill_service
from pdgrpc.metrics import BootstrapMetrics, PrefillMetrics, derived_metrics_port, start_metrics_from_args
from pdgrpc.prefill.cli import build_parser
from pdgrpc.prefill.controller import Controller
from pdgrpc.prefill.notices import notices_for
from pdgrpc.prefill.registrar import DpRankRegistrar, counted
from pdgrpc.prefill.services import PREFILL_SERVICE, WirePrefillServicer
from pdgrpc.rpc.drain import Drain
from pdgrpc.rpc.server import RpcServer, StopSignal, run, serve_until_signal, start_server
from pdgrpc.serving.engines import check_engine_args
from pdgrpc.serving.kv_zmq import ZmqKvPublisher, check_zmq_args
from pdgrpc.serving.launch import Role
from pdgrpc.transport import registry
from pdgrpc.v1 import prefill_pb2_grpc

log = logging.getLogger("pdgrpc.prefill")

__all__ = ["READY_LINE", "ROLE", "main_async"]

READY_LINE = "PDGRPC_READY"


async def main_async(ns: argparse.Namespace) -> int:
    metrics = PrefillMetrics(transport=ns.transport)
    metrics.set_info(dp_size=ns.dp_size)
    controller = Controller(ns, metrics)
    wire = WirePrefillServicer(controller, metrics.on_refused, ns.max_prefills_per_client)
    services = [(PREFILL_SERVICE, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(wire, s))]
    embedded: BootstrapServicer | None = None
    bootstrap_metrics: BootstrapMetrics | None = None
    if not ns.bootstrap:
        cfg = BootstrapConfig(ttl=ns.bootstrap_ttl)
        # Same registry: the embedded bootstrap is served on the controller's endpoint.
        bootstrap_metrics = BootstrapMetrics(metrics.registry)
        embedded = BootstrapServicer(
            room_table(cfg),
            WorkerRegistry(expect=(ns.dp_size, getattr(ns, "tp_size", 1), 1)),  # its own workers' sizes only
            metrics=bootstrap_metrics,
        )
        services.append((BOOTSTRAP_SERVICE, lambda s: add_bootstrap_servicer(embedded, s)))
    # smg's worker protocol, with pdgrpc[gateway]: its legs carry no room secret, and are counted per client as smg's.
    drain = Drain()
    gateway = prefill_service(controller, ns, wire.per_client, drain)
    if gateway is not None:
        services.append(gateway)
    # NOT_SERVING until every worker registered and is ready (set_serving below): a health
    # check that says SERVING must mean a Prefill call can be served.
    server: RpcServer = await start_server(services, host=ns.host, port=ns.port, what="pdgrpc prefill controller", serving=False, drain=drain,
                                            gateway_listen=getattr(ns, "gateway_listen", None),
                                            gateway_uids=getattr(ns, "gateway_uid", ()))
    controller.server = server
    server.on_stop(controller.kv_events.close)
    if ns.kv_events_zmq:
        try:
            zmq_events = ZmqKvPublisher(controller.kv_events, ns.kv_events_zmq, ns.kv_events_zmq_replay)
        except BaseException:
            await server.stop(0)
            raise
        server.on_stop(zmq_events.close)
    controller.notices = notices_for(embedded, ns.bootstrap)
    if embedded is not None:
        table = embedded.table
        assert bootstrap_metrics is not None
        bootstrap_metrics.bind_table(lambda: table.stats)
        BootstrapServer(server, embedded, BootstrapConfig(ttl=ns.bootstrap_ttl))  # runs the expiry sweeper
        controller.bootstrap_address = server.address
        # The embedded bootstrap works from the start (the workers register with it).
        await server.set_serving([BOOTSTRAP_SERVICE])
    try:
        stop_metrics = start_metrics_from_args(ns, metrics.registry, "prefill")
    except BaseException:
        await server.stop(0)
        raise
    try:
        return await _serve(ns, controller, server, metrics)
    finally:
        if bootstrap_metrics is not None:
            bootstrap_metrics.unbind()
        stop_metrics()


async def _serve(ns: argparse.Namespace, controller: Controller, server: RpcServer, metrics: PrefillMetrics) -> int:
    client = BootstrapClient(controller.bootstrap_address)
    controller.registrar = DpRankRegistrar(counted(client.register_dp_ranks, metrics), window_s=ns.dp_register_window_ms / 1000.0)
    try:
        await controller.start_workers()
    except BaseException as exc:
        # A failed start, or a stop while the workers start (SIGTERM or Ctrl-C cancels the
        # start-up: pdgrpc.serving.launch): the workers started so far stop too.
        await controller.stop_workers()
        await server.stop(0)
        if not isinstance(exc, Exception):
            raise
        log.error("%s", exc)
        return 1
    # Before the ready line: whoever reads it may send SIGTERM at once, which drains.
    stop = StopSignal()
    try:
        return await _serve_ready(ns, controller, server, metrics, client, stop)
    finally:
        stop.close()


async def _serve_ready(
    ns: argparse.Namespace, controller: Controller, server: RpcServer, metrics: PrefillMetrics, client: BootstrapClient,
    stop: StopSignal,
) -> int:
    embedded = not ns.bootstrap
    log.info(
        "prefill ready: %d dp rank(s) x %d tp rank(s), %s, transport %s, bootstrap %s (%s)",
        ns.dp_size, getattr(ns, "tp_size", 1), ns.load_balance_method, ns.transport, controller.bootstrap_address,
        "embedded" if embedded else "external",
    )
    await server.set_serving()
    print(
        READY_LINE,
        json.dumps({
            "address": server.address, "bootstrap": controller.bootstrap_address,
            "workers": [w.address for w in controller.workers], "worker_pids": [w.proc.pid for w in controller.workers],
        }),
        flush=True,
    )

    async def _stop_workers() -> None:
        await controller.registrar.close() if controller.registrar else None
        await controller.notices.close() if controller.notices else None

    server.on_stop(_stop_workers)
    if ns.discovery:
        # The hash the workers' engines registered with bootstrap: the one decodes check.
        info = await client.wait_parallel_info(wait_for=30.0)
        register_on(server, registration_from_args(
            ns, "prefill", f"{ns.host}:{server.port}", transport=ns.transport, bootstrap=ns.bootstrap,
            dp_size=ns.dp_size, tp_size=getattr(ns, "tp_size", 1), compat_hash=info.parallel_info.compatibility_hash.hex(),
        ))
    server.on_drain(metrics.on_draining)
    await serve_until_signal(server, grace=ns.grace, drain_timeout=ns.drain_timeout, stop=stop)
    await controller.stop_workers()
    log.info("prefill stopped")
    return controller.exit_code


def check(ns: argparse.Namespace) -> None:
    if ns.dp_size * ns.tp_size > MAX_WORKERS:  # what its bootstrap registers at most
        raise ConfigError(
            f"--dp-size {ns.dp_size} x --tp-size {ns.tp_size} = {ns.dp_size * ns.tp_size} workers, "
            f"over the limit of {MAX_WORKERS} for one instance"
        )
    if ns.bootstrap:  # else the workers retry registering with it until --worker-start-timeout
        check_address(ns.bootstrap, "--bootstrap")
    # The last worker's metrics port (offset 1 + r * tp_size + t, at most dp_size *
    # tp_size): one past 65535 fails here, before the controller serves.
    derived_metrics_port(ns.metrics_port, ns.dp_size * ns.tp_size)
    check_engine_args(ns, tp_size=ns.tp_size)  # fail here, not in every worker
    registry.check(ns.transport)  # a missing backend names what to install; the workers load it
    check_discovery_args(ns)
    check_zmq_args(ns.kv_events_zmq, ns.kv_events_zmq_replay)


def serve(ns: argparse.Namespace) -> int:
    try:
        return run(main_async(ns))
    except ConfigError as exc:  # a non-loopback --host with neither TLS nor a token
        log.error("%s", exc)
        return 2


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: "prefill", check=check)
