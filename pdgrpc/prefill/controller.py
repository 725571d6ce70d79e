"""The prefill DP controller: starts the worker processes and routes each request.

* Starts ``--dp-size`` worker processes (:mod:`pdgrpc.prefill.worker_server`), each with its
  own gRPC server, and waits until every one reported ready (it registered with bootstrap).
  The process around it -- its servers, health, ready line and signals -- is
  :mod:`pdgrpc.prefill.controller_main`.
* Serves ``PrefillService``: picks the dp rank (:mod:`pdgrpc.prefill.dispatch`), registers
  room -> rank with bootstrap when decode must query (batched,
  :mod:`pdgrpc.prefill.registrar`) **before** forwarding, then forwards the request to the
  worker over its link (:mod:`pdgrpc.prefill.link`: a socketpair, not gRPC) and relays its
  answer or its status unchanged. ``GetStats`` sums the workers' (over gRPC).
* ``SubscribeKvEvents`` streams the instance's prefix cache events: it follows each dp
  rank's worker (tp rank 0; its tp peers hold the same pages) over the same RPC and merges
  the ranks into one log (:class:`~pdgrpc.state.kv_event_log.KvEventMerge`): a block
  several ranks hold is stored once and removed with its last holder, and a rank whose
  worker exits has its blocks removed at once. The same events feed a per-rank
  :class:`~pdgrpc.state.prefix_index.PrefixIndex`, which ``cache_aware`` dispatch reads.
* Every request that fails -- refused here, failed on a worker, lost with a dead worker,
  cancelled by its caller -- is recorded for its decode (:mod:`pdgrpc.prefill.notices`).
* A worker that exits is logged with its exit code; the requests it held fail with
  UNAVAILABLE naming it, and later requests for its rank fail the same way (round_robin
  and shortest_queue skip it) until it serves again: its dp rank's workers (the whole tp
  group) are started again, with a backoff doubling from 0.5 s up to
  ``--worker-respawn-max-backoff`` (:mod:`pdgrpc.prefill.respawn`), so the instance heals
  without a person. With respawn off (``0``), the controller exits with code 1 when no
  dp rank is left.
  On SIGTERM it stops the workers (SIGTERM, then SIGKILL) once in-flight requests
  finished (:meth:`Controller.stop_workers`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import socket
import sys
from typing import AsyncIterator, NoReturn, Sequence, cast

import grpc

from pdgrpc.metrics import PrefillMetrics, ServerAbortReason, derived_metrics_port
from pdgrpc.prefill.cli import worker_argv
from pdgrpc.prefill.dispatch import Dispatcher, DpRankConflict, InvalidRoute, NoLiveRank
from pdgrpc.prefill.errors import RequestFailed, WorkerLinkLost
from pdgrpc.prefill.link import ControllerLink, FirstToken, LinkCallFailed
from pdgrpc.prefill.notices import FailureNotices, NotForwarded
from pdgrpc.prefill.registrar import DpRankRegistrar
from pdgrpc.prefill.respawn import restart_group
from pdgrpc.prefill.statuses import Refusal, ending, peer_status, status
from pdgrpc.prefill.worker_config import READY
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.security import security_argv
from pdgrpc.rpc.server import RpcServer
from pdgrpc.rpc import tracing
from pdgrpc.serving.children import Spawned, spawn
from pdgrpc.serving.kv_events import KvEventFeed, batch_from_proto, serve_kv_events
from pdgrpc.serving.logs import request_event
from pdgrpc.state.kv_event_log import Cleared, KvEvent, KvEventMerge
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.serving.rendezvous import dist_init_method
from pdgrpc.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdgrpc.prefill")

__all__ = ["Controller"]

# How long a tp group's ABORTED or UNAVAILABLE answer waits for a rank's death to show:
# a peer's death reaches the survivors (through the decode's abort) as soon as the
# controller sees the dead worker's link close.
DEATH_WINDOW_S = 0.25


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    rank: int
    proc: Spawned
    tp_rank: int = 0
    tp_size: int = 1
    link: ControllerLink | None = None  # Prefill calls travel here
    address: str = ""
    stub: prefill_pb2_grpc.PrefillServiceStub | None = None  # GetStats
    alive: bool = True
    exit_code: int | None = None
    in_flight: int = 0  # forwarded requests not answered yet
    # Set by _watch once it has handled the exit (logged the calls in flight, closed the link).
    gone: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def queue_length(self) -> int:
        return self.in_flight

    @property
    def name(self) -> str:
        return f"dp{self.rank}" if self.tp_size == 1 else f"dp{self.rank}.tp{self.tp_rank}"


async def _abort(context: grpc.aio.ServicerContext, failure: RequestFailed) -> NoReturn:
    await context.abort(failure.code, failure.message)
    raise AssertionError("unreachable")


class Controller:
    """The prefill instance behind its checks (:class:`~pdgrpc.prefill.services.WirePrefillServicer`
    serves it): dispatches each Prefill to a dp rank's workers over their links, and starts,
    watches and respawns them."""

    def __init__(self, ns: argparse.Namespace, metrics: PrefillMetrics | None = None) -> None:
        self.ns = ns
        # Counts only the requests that end here (never forwarded, or their worker died);
        # a worker counts every request it ran, so none is counted twice.
        self.metrics = metrics or PrefillMetrics(transport=ns.transport)
        # What each dp rank's cache holds, by content: cache_aware dispatch reads it.
        self.rank_index = PrefixIndex()
        self.dispatcher = Dispatcher(ns.dp_size, ns.load_balance_method, ns.force_dp_rank_query, self._cached_prefixes)
        self.workers: list[WorkerHandle] = []  # every worker process, dp-major
        self.groups: list[list[WorkerHandle]] = []  # groups[dp] = its tp ranks' workers
        self.pool = ChannelPool()
        self.bootstrap_address = ns.bootstrap
        self.registrar: DpRankRegistrar | None = None
        self.notices: FailureNotices | None = None  # tells a failed room's decode
        self.stopping = False
        self.server: RpcServer | None = None
        self.exit_code = 0
        self._watchers: list[asyncio.Task[None]] = []
        self._restarting: set[int] = set()  # dp ranks whose tp group restart_group is starting again
        self.kv_events = KvEventFeed(on_subscribers=self.metrics.on_kv_event_streams)  # the instance's merged log (built on the serving loop)
        self.kv_merge = KvEventMerge(self.kv_events.log)

    # ---- PrefillService -----------------------------------------------------------

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse:
        """Forward ``request`` to a dp rank's workers; ``first_token``: told the first
        output token by the group's first worker (its tp rank 0) once sampled."""
        room = request.bootstrap_room
        span = tracing.server("controller.dispatch", context.invocation_metadata()) if tracing.enabled else None
        routed = request.routed_dp_rank if request.HasField("routed_dp_rank") else None
        try:
            d = self.dispatcher.pick(
                room, routed, [g[0].queue_length for g in self.groups], [all(w.alive for w in g) for g in self.groups],
                request.input_ids,
            )
        except InvalidRoute as exc:
            self.metrics.on_refused()
            request_event(log, room, "rejected", reason=str(exc))
            await self._refuse(request, context, ending(Refusal.BAD_REQUEST, f"room {room}: {exc}"))
        except DpRankConflict as exc:
            self.metrics.on_abort(ServerAbortReason.DP_RANK_CONFLICT)
            request_event(log, room, "rejected", reason=str(exc))
            await self._refuse(request, context, ending(Refusal.INCOMPATIBLE, str(exc)))
        except NoLiveRank as exc:
            self.metrics.on_abort(ServerAbortReason.PEER_FAILURE)
            await self._refuse(request, context, ending(Refusal.GONE, f"room {room}: {exc}"))
        group = self.groups[d.rank]
        dead = next((w for w in group if not w.alive), None)
        if dead is not None:
            self.metrics.on_abort(ServerAbortReason.PEER_FAILURE)
            await self._refuse(request, context, ending(Refusal.GONE, f"room {room}: prefill worker {dead.name} is dead (exit code {dead.exit_code})"))
        if d.register:
            assert self.registrar is not None
            try:
                await self.registrar.register(room, d.rank)
            except Exception as exc:
                self.metrics.on_abort(ServerAbortReason.PEER_FAILURE)
                request_event(log, room, "failed", reason=f"registering dp rank: {exc}")
                message = f"room {room}: registering dp rank {d.rank} with bootstrap failed: {exc}"
                await self._refuse(request, context, RequestFailed(peer_status(exc), message))
        request.routed_dp_rank = d.rank  # ours to change: forwarded as it is, no copy
        # No deadline is forwarded: when ours passes, grpc cancels this handler, and
        # cancelling a link call cancels the worker's (as does a caller that goes away).
        for w in group:
            w.in_flight += 1
        request_event(log, room, "dispatched", dp_rank=d.rank, routed=routed is not None, registered=d.register, defer=True)
        trace = b""
        if span is not None:  # the workers' spans are its children
            trace = span.pack()
            span.end()
        tasks: list[asyncio.Future[prefill_pb2.PrefillResponse | RequestFailed]] = []
        try:
            if len(group) == 1:  # one worker (TP 1): no fan-out to watch, no task per call
                results = [await self._forward(room, group[0], request, trace, first_token)]
            else:
                tasks = [
                    asyncio.ensure_future(self._forward(room, w, request, trace, first_token if i == 0 else None))
                    for i, w in enumerate(group)
                ]
                results = await self._gather(tasks)
        except asyncio.CancelledError:
            if self.notices is not None:  # its caller gave up: so does its decode
                self.notices.failed(request, ending(Refusal.CANCELLED, f"room {room}: the prefill's caller cancelled it"), forwarded=True)
            raise
        finally:
            for t in tasks:
                t.cancel()
            for w in group:
                w.in_flight -= 1
        failure = next((r for r in results if isinstance(r, RequestFailed)), None)
        if isinstance(failure, LinkCallFailed) and len(group) > 1 and failure.code in (status(Refusal.ABORTED), status(Refusal.GONE)):
            # A rank's death fails the others' part of the room too (the decode aborts it,
            # the gloo group breaks), often before the death is noticed: name the death.
            failure = await self._group_death(room, group) or failure
        if failure is not None:
            # A worker counts the failures it answers; a dead worker's requests are counted here.
            if not isinstance(failure, LinkCallFailed) and failure.reason is ServerAbortReason.PEER_FAILURE:
                self.metrics.on_abort(failure.reason)
                request_event(log, room, "failed", reason=failure.message)
            unsent = isinstance(failure, NotForwarded) and len(group) == 1  # a tp group's others got it
            await self._refuse(request, context, failure, forwarded=not unsent)
        resps = cast("list[prefill_pb2.PrefillResponse]", results)
        if len(resps) == 1:
            return resps[0]
        return prefill_pb2.PrefillResponse(
            dp_rank=d.rank,
            prompt_tokens=resps[0].prompt_tokens,
            bytes_transferred=sum(r.bytes_transferred for r in resps),
            transfer_seconds=max(r.transfer_seconds for r in resps),
            compute_seconds=max(r.compute_seconds for r in resps),
            cached_tokens=resps[0].cached_tokens,  # the ranks agreed on it before computing
        )

    async def _refuse(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, failure: RequestFailed, forwarded: bool = False) -> NoReturn:
        """Fail ``request``: tell its decode first (:mod:`pdgrpc.prefill.notices`)."""
        if self.notices is not None:
            self.notices.failed(request, failure, forwarded)
        await _abort(context, failure)

    async def _gather(self, tasks: "list[asyncio.Future[prefill_pb2.PrefillResponse | RequestFailed]]") -> "list[prefill_pb2.PrefillResponse | RequestFailed]":
        """Every worker's answer; on the first failure the other calls are cancelled and
        the answer is ``[failure]``."""
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failure = next((r for t in tasks if t in done and isinstance(r := t.result(), RequestFailed)), None)
            if failure is not None:
                for t in pending:
                    t.cancel()  # cancels that worker's call
                return [failure]
        return [t.result() for t in tasks]

    async def _forward(
        self, room: int, w: WorkerHandle, request: prefill_pb2.PrefillRequest, trace: bytes = b"",
        first_token: FirstToken | None = None,
    ) -> "prefill_pb2.PrefillResponse | RequestFailed":
        """One worker's answer to a forwarded Prefill (a failure as :class:`RequestFailed`);
        ``trace``: the packed span context the worker's spans go under."""
        assert w.link is not None
        sent = not w.link.lost.is_set()  # a closed link sends nothing
        try:
            return await w.link.prefill(request, trace, first_token)
        except LinkCallFailed as exc:
            return exc
        except WorkerLinkLost:
            lost = await self._lost(room, w)
            return lost if sent else NotForwarded(lost.code, lost.message, lost.reason)

    async def _lost(self, room: int, w: WorkerHandle) -> RequestFailed:
        """What ``room`` fails with once the link to ``w`` closed."""
        if not w.gone.is_set():
            # The socket closes a moment before the exit is noticed: let _watch handle
            # it first, so its log counts this request among the lost ones.
            try:
                await asyncio.wait_for(asyncio.shield(w.gone.wait()), 1.0)
            except asyncio.TimeoutError:
                pass
        if not w.alive or w.proc.returncode is not None:
            w.exit_code = w.proc.returncode
            died = f"room {room}: prefill worker {w.name} died (exit code {w.exit_code})"
            return ending(Refusal.GONE, died, ServerAbortReason.PEER_FAILURE)
        return ending(Refusal.GONE, f"room {room}: the link to prefill worker {w.name} broke (see the log); it is stopping")

    async def _group_death(self, room: int, group: list[WorkerHandle]) -> RequestFailed | None:
        """The failure a dead worker of ``group`` gives ``room``, if one's link closed or
        closes within :data:`DEATH_WINDOW_S`."""
        lost = {w.link.lost: w for w in group if w.link is not None}
        if not any(e.is_set() for e in lost):
            waits = [asyncio.ensure_future(e.wait()) for e in lost]
            try:
                await asyncio.wait(waits, timeout=DEATH_WINDOW_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in waits:
                    t.cancel()
        dead = next((w for e, w in lost.items() if e.is_set()), None)
        return None if dead is None else await self._lost(room, dead)

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse:
        total = common_pb2.ResourceStats()
        for w in self.workers:
            if not w.alive or w.stub is None:
                continue
            try:
                s = (await w.stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5.0)).stats
            except grpc.aio.AioRpcError as exc:
                await _abort(context, ending(Refusal.GONE, f"GetStats of prefill worker {w.name} failed: {exc.details()}"))
            for field in common_pb2.ResourceStats.DESCRIPTOR.fields:
                setattr(total, field.name, getattr(total, field.name) + getattr(s, field.name))
        return prefill_pb2.GetStatsResponse(stats=total)

    async def SubscribeKvEvents(self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KvEventBatch]:
        async for b in serve_kv_events(self.kv_events, request, context):
            yield b

    def _worker_events(self, w: WorkerHandle, batch: bytes) -> None:
        """A KV event batch from ``w``'s link, in order from its first: into the merge while
        ``w`` lives (its exit clears its rank; a frame read after that is stale)."""
        if w.alive and not self.stopping:
            self._rank_events(w.rank, batch_from_proto(prefill_pb2.KvEventBatch.FromString(batch)).events)

    def _rank_events(self, rank: int, events: "tuple[KvEvent, ...]") -> None:
        self.kv_merge.apply(rank, events)
        self.rank_index.apply(str(rank), events)

    def _rank_gone(self, rank: int) -> None:
        """Dp rank ``rank``'s worker exited or was replaced: its cache is gone with it."""
        self._rank_events(rank, (Cleared(),))

    def _cached_prefixes(self, prompt: "Sequence[int]") -> dict[int, int]:
        return {int(name): tokens for name, tokens in self.rank_index.match(prompt).items()}

    # ---- workers ----------------------------------------------------------------------

    async def spawn(self, rank: int, tp: int, dist: list[str]) -> WorkerHandle:
        """Start one worker process (not yet ready: see :meth:`await_ready`)."""
        tp_size = getattr(self.ns, "tp_size", 1)
        argv = [
            sys.executable, "-m", "pdgrpc.prefill.worker_main",
            "--dp-rank", str(rank), "--dp-size", str(self.ns.dp_size),
            *(["--tp-rank", str(tp), "--tp-size", str(tp_size), *dist] if tp_size > 1 else []),
            "--bootstrap", self.bootstrap_address, "--host", self.ns.host,
            *(["--advertise-host", self.ns.advertise_host] if getattr(self.ns, "advertise_host", "") else []),
            "--load-balance-method", self.ns.load_balance_method,
            *(["--force-dp-rank-query"] if self.ns.force_dp_rank_query else []),
            *self._worker_metrics_argv(1 + rank * tp_size + tp),
            *security_argv(self.ns),
            *worker_argv(self.ns),
        ]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv += ["--link-fd", str(theirs.fileno())]
        # Own session: a terminal's Ctrl-C reaches the controller only, which drains its
        # requests first and then stops the workers in order (they also exit on their own
        # if the controller dies).
        try:
            proc = await spawn(argv, stdout="read", stderr=None, new_session=True, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        w = WorkerHandle(rank, proc, tp, tp_size)
        # A TP group's cache is its first rank's.
        w.link = await ControllerLink.open(ours, w.name, (lambda batch: self._worker_events(w, batch)) if tp == 0 else None)
        return w

    async def start_workers(self) -> None:
        tp_size = getattr(self.ns, "tp_size", 1)
        for rank in range(self.ns.dp_size):
            dist = ["--dist-init", dist_init_method()] if tp_size > 1 else []
            group: list[WorkerHandle] = []
            for tp in range(tp_size):
                w = await self.spawn(rank, tp, dist)
                group.append(w)
                self.workers.append(w)
            self.groups.append(group)
        tasks = [asyncio.ensure_future(self.await_ready(w)) for w in self.workers]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.ns.worker_start_timeout, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
        for t in done:
            t.result()  # a worker that exited before it was ready
        if pending:
            raise RuntimeError(f"prefill workers did not start within {self.ns.worker_start_timeout} s")
        self.watch(self.workers)

    @property
    def respawns(self) -> bool:
        """Whether a dead worker's dp rank (its whole tp group) is started again
        (:mod:`pdgrpc.prefill.respawn`), unless ``--worker-respawn-max-backoff 0``."""
        return getattr(self.ns, "worker_respawn_max_backoff", 0.0) > 0

    def watch(self, workers: list[WorkerHandle]) -> None:
        """Handle each of ``workers``' exits from now on (:meth:`_watch`)."""
        self._watchers.extend(asyncio.ensure_future(self._watch(w)) for w in workers)

    async def _restart(self, rank: int) -> None:
        try:
            await restart_group(self, rank)
        finally:
            self._restarting.discard(rank)

    def _worker_metrics_argv(self, index: int) -> list[str]:
        port = derived_metrics_port(getattr(self.ns, "metrics_port", None), index)
        if port is None:
            return []
        return ["--metrics-port", str(port), "--metrics-host", self.ns.metrics_host]

    async def await_ready(self, w: WorkerHandle) -> None:
        assert w.proc.stdout is not None
        while True:
            line = await w.proc.stdout.readline()
            if not line:
                code = await w.proc.wait()
                raise RuntimeError(f"prefill worker {w.name} exited with code {code} before it was ready (see its log above)")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY + " "):
                info = json.loads(text[len(READY) + 1 :])
                w.address = info["address"]
                w.stub = prefill_pb2_grpc.PrefillServiceStub(self.pool.get(w.address))
                log.info("prefill worker %s (pid %d) ready at %s", w.name, w.proc.pid, w.address)
                return

    async def _watch(self, w: WorkerHandle) -> None:
        assert w.proc.stdout is not None
        while await w.proc.stdout.readline():  # keep the pipe drained
            pass
        w.exit_code = await w.proc.wait()
        w.alive = False
        if w.tp_rank == 0:
            self._rank_gone(w.rank)
        try:
            if self.stopping:
                return
            log.log(
                logging.INFO if w.rank in self._restarting else logging.ERROR,  # INFO: stopped by its group's restart
                "prefill worker %s (pid %d) exited with code %s; failing its %d in-flight request(s)",
                w.name, w.proc.pid, w.exit_code, w.in_flight,
            )
        finally:
            if w.link is not None:
                w.link.close_socket()  # fails the calls in flight (the exit closed it already)
            w.gone.set()
        if self.respawns:
            if w.rank not in self._restarting:  # the group's other workers are killed by the restart
                self._restarting.add(w.rank)
                self._watchers.append(asyncio.ensure_future(self._restart(w.rank)))
            return
        if not any(all(x.alive for x in g) for g in self.groups) and self.server is not None:
            # Nothing left to serve: exit non-zero so a supervisor (or the cluster
            # launcher) notices, instead of answering UNAVAILABLE forever.
            log.error("every prefill worker is gone; stopping the controller")
            self.exit_code = 1
            asyncio.ensure_future(self.server.stop(0))

    async def stop_workers(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for w in self.workers:
            if w.proc.returncode is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                await asyncio.wait_for(w.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.error("prefill worker %s did not stop within %.0f s; killing it", w.name, timeout)
                w.proc.kill()
                await w.proc.wait()
        for t in self._watchers:
            t.cancel()
        for w in self.workers:
            if w.link is not None:
                w.link.close_socket()
        await self.pool.close()

