"""Decode as the client of the prefill workers' ``HandshakeService``.

:meth:`Handshaker.handshake` tells every worker (tp rank) of the request's prefill dp
rank where the room's KV and metadata row go. A worker that does not answer
(UNAVAILABLE: it restarted or moved) makes the directory drop what it cached about the
instance, and the handshake is retried against freshly fetched endpoints, with backoff,
until the bootstrap deadline; a worker that *refuses* (compatibility hash, transport,
a malformed field) ends the request with its status. Each worker holds its answer until
a Prefill RPC claims the room there, for at most ``claim_s``; one that says none came
ends the request ``claim_timeout`` (its prefill never shows: its pages go back now, not
at the waiting deadline). A worker whose answer carries
another registration generation than the one cached is a restarted process: the cache
is dropped so nothing about the old one is reused.

:meth:`Handshaker.handshake` also asks the prefill's bootstrap, when a worker does not
answer, whether the prefill's controller failed the room (:mod:`pdgrpc.prefill.notices`).

:meth:`Handshaker.abort_room` tells the workers that were sent a handshake to stop
writing into the room (their OK is the ack that frees the quarantined pages). A worker
that cannot be reached counts as acknowledged once this decode's transport confirms it can
no longer write (its process is gone and its data-plane connections drained:
``Transport.writer_gone``), or once bootstrap shows its slot registered by a newer
generation (its controller restarted it: the old process is gone). A worker that merely
hangs is neither: its pages wait for the abort lease. Whatever the decode's TP size, every
rank also follows the room's writers on its own transport and the quarantine ends once all
ranks confirmed them gone (:meth:`Handshaker.writers_by_rank`,
:meth:`pdgrpc.decode.rank.RankTransfers.check_writers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable, Final, Sequence

import grpc

from pdgrpc.decode.job import Job
from pdgrpc.decode.prefills import PrefillDirectory, restart_failure
from pdgrpc.decode.statuses import PeerAnswer, Refusal, ending, peer_answer, refused_by_prefill
from pdgrpc.errors import RequestFailed
from pdgrpc.reasons import AbortReason
from pdgrpc.rpc.channels import shared_pool
from pdgrpc.rpc.errors import RpcError, map_rpc_error
from pdgrpc.rpc.retry import Backoff
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.room_proof import abort_proof, handshake_proof
from pdgrpc.serving.tp import designated_sender, senders_of
from pdgrpc.state.decode_fate import CallFailed, FateState, NeverForwarded
from pdgrpc.transport import peerauth
from pdgrpc.transport.descriptor import Descriptor
from pdgrpc.transport.regions import BadDescriptor
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import handshake_pb2_grpc as hpb_grpc

log = logging.getLogger("pdgrpc.decode")

__all__ = ["ACCEPTED", "Handshaker"]

ACCEPTED: Final = "accepted"
# How often a held handshake (the worker waits for the room's claim) looks whether its request ended.
_HELD_CHECK_S = 0.05


def _worker_key(w: bpb.WorkerInfo) -> tuple[int, int, int]:
    """A worker registration: (tp rank, pp rank, generation); a restart is a new key."""
    return (w.tp_rank, w.pp_rank, w.generation)


class Handshaker:
    def __init__(
        self,
        directory: PrefillDirectory,
        transport_name: str,
        rpc_timeout_s: float,
        replaced_wait_s: float = 30.0,
        writer_gone: Callable[[str], bool] = lambda writer: False,
        quarantined: Callable[[int], bool] = lambda room: True,
        bind_writer: Callable[[int, int, int, str], Awaitable[None]] | None = None,
        claim_s: float = 0.0,
    ) -> None:
        """``replaced_wait_s``: how long an unreachable worker's replacement is looked for
        (the abort lease: past it the quarantine ends anyway). ``writer_gone``: this rank's
        Transport.writer_gone; ``quarantined``: whether a room is still quarantined (an
        unreachable worker is no longer waited for once not); ``bind_writer(room, decode
        rank, prefill tp rank, writer id)``: admits a writer into that decode rank's room,
        awaited before its handshake goes out (DecodeScheduler.bind_writer). ``claim_s``:
        how long each worker may wait for the room's Prefill RPC before it answers (0:
        answer at once, claim unknown)."""
        self.replaced_wait_s = replaced_wait_s
        self.claim_s = claim_s
        self.directory = directory
        self.transport_name = transport_name
        self.rpc_timeout_s = rpc_timeout_s
        self.writer_gone, self.quarantined, self.bind_writer = writer_gone, quarantined, bind_writer
        self.descriptor, self.key = b"", b""  # this rank's, and its data-plane key (pdgrpc.transport.peerauth)
        # TP > 1: every decode rank's descriptor and key, by rank (handshakes are sent for
        # all of them from rank 0); empty for TP 1.
        self.descriptors: tuple[bytes, ...] = ()
        self.keys: tuple[bytes, ...] = ()
        self._ids: dict[bytes, str] = {}  # descriptor bytes -> transport instance id

    def set_endpoints(self, ranks: Sequence[tuple[bytes, bytes]]) -> None:
        """Every decode rank's (descriptor, data-plane key), rank 0 (this one) first, once
        the transports registered their memory."""
        self.descriptor, self.key = ranks[0]
        if len(ranks) > 1:
            self.descriptors, self.keys = tuple(d for d, _ in ranks), tuple(k for _, k in ranks)

    def instance_of(self, descriptor: bytes) -> str:
        """The transport instance id a descriptor names ("" when it does not parse)."""
        iid = self._ids.get(descriptor)
        if iid is None:
            try:
                iid = Descriptor.from_bytes(descriptor).instance_id
            except BadDescriptor:
                iid = ""
            if len(self._ids) >= 4096:
                self._ids.clear()
            self._ids[descriptor] = iid
        return iid

    def credential(self, w: bpb.WorkerInfo, d: int) -> bytes:
        """The data-plane credential decode rank ``d`` issues to prefill worker ``w``."""
        key = self.keys[d] if self.keys else self.key
        writer = self.instance_of(w.transport_endpoint)
        receiver = self.instance_of(self.descriptors[d] if self.descriptors else self.descriptor)
        return peerauth.credential(key, writer, receiver) if key and writer and receiver else b""

    @property
    def tp_size(self) -> int:
        return max(1, len(self.descriptors))

    def _targets(self, job: Job, workers: list[bpb.WorkerInfo]) -> list[tuple[bpb.WorkerInfo, int]]:
        """(prefill worker, decode rank) pairs that need a handshake (pdgrpc.serving.tp)."""
        tp_p = max(1, int(job.prefill.info.tp_size))
        if self.tp_size == 1 and tp_p == 1:
            return [(w, 0) for w in workers]
        by_rank = {w.tp_rank: w for w in workers}
        out = []
        for d in range(self.tp_size):
            for p in senders_of(d, self.tp_size, tp_p):
                w = by_rank.get(p)
                if w is None:
                    raise ending(
                        Refusal.PREFILL_GONE,
                        f"bootstrap {job.prefill.address} lists no worker for dp rank {job.dp_rank} tp rank {p} (tp_size {tp_p})",
                    )
                out.append((w, d))
        return out

    async def handshake(self, job: Job, prompt_pages: tuple[int, ...], deadline: float) -> str | RequestFailed | None:
        """:data:`ACCEPTED` once every worker of the dp rank accepted; a
        :class:`~pdgrpc.errors.RequestFailed` (reason ``prefill_error``) when one refused,
        (reason ``claim_timeout``) when one answered that no Prefill RPC claimed the room
        within ``claim_s``; ``None`` when the deadline passed or the request ended first.
        Records the workers sent a handshake in ``job.contacted`` and tells the request's
        fate each retryable error."""
        addr, dp_rank = job.prefill.address, job.dp_rank
        assert dp_rank is not None
        backoff = Backoff(initial=0.05, maximum=1.0)
        accepted: set[tuple[tuple[int, int, int], int]] = set()
        attempt = 0
        while job.fate.state is FateState.WAITING:
            attempt += 1
            if deadline - time.monotonic() <= 0:
                return None
            try:
                workers, instance = await self.directory.workers(addr, dp_rank)
                if job.prefill.restarted(instance):  # admitted under the instance before: its prefill is lost
                    return restart_failure(job.room, addr)
                if not workers:
                    raise ending(Refusal.PREFILL_GONE, f"bootstrap {addr} lists no worker for dp rank {dp_rank}")
                for w in workers:  # each field within its limit (PrefillDirectory.workers)
                    if w.transport != self.transport_name:
                        raise ending(
                            Refusal.INCOMPATIBLE,
                            f"transport mismatch: prefill worker dp_rank={w.dp_rank} tp_rank={w.tp_rank} uses "
                            f"{w.transport!r}, this decode uses {self.transport_name!r}",
                        )
                # Only workers that have not accepted yet (a retry after one of several
                # failed must not hand the others the same room twice).
                todo = [(w, d) for w, d in self._targets(job, workers) if (_worker_key(w), d) not in accepted]
                known = {w.transfer_address for w in job.contacted}
                for w, _ in todo:
                    if w.transfer_address not in known:
                        known.add(w.transfer_address)
                        job.contacted.append(w)
                results = await asyncio.gather(
                    *(self._handshake_one(job, w, d, prompt_pages, deadline - time.monotonic()) for w, d in todo),
                    return_exceptions=True,
                )
                errors: list[RpcError] = []
                unclaimed = False
                for (w, d), r in zip(todo, results):
                    if isinstance(r, RpcError):
                        errors.append(r)
                    elif isinstance(r, BaseException):
                        raise r
                    else:
                        accepted.add((_worker_key(w), d))
                        unclaimed |= r == hpb.ROOM_CLAIM_UNCLAIMED
                if unclaimed:
                    request_event(log, job.room, "prefill never claimed the room", level=logging.WARNING, waited_s=f"{self.claim_s:g}")
                    return ending(AbortReason.CLAIM_TIMEOUT, (
                        f"room {job.room}: deadline exceeded: no Prefill RPC claimed the room on its prefill worker "
                        f"within {self.claim_s:g} s (--claim-timeout)"
                    ))
                if errors:  # a refusal decides; otherwise any error (all are retryable)
                    raise next((e for e in errors if not peer_answer(e.code).retryable), errors[0])
            except RequestFailed as exc:
                if peer_answer(exc.code) is not PeerAnswer.GONE:
                    return refused_by_prefill(exc.code, f"room {job.room}: {exc.message}")
                job.fate.handle(CallFailed(exc.message))
            except RpcError as exc:
                job.fate.handle(CallFailed(str(exc)))
                answer = peer_answer(exc.code)
                if answer is PeerAnswer.LATE:
                    return None  # the bootstrap deadline is up
                if answer is not PeerAnswer.GONE:
                    return refused_by_prefill(exc.code, f"room {job.room}: handshake refused: {exc}")
            else:
                request_event(log, job.room, "handshake accepted", workers=len(accepted), attempt=attempt,
                              writers=",".join(w.transfer_address for w in job.contacted))
                return ACCEPTED
            # UNAVAILABLE: the worker restarted or moved, or is dead. The prefill's controller
            # may have failed the room (pdgrpc.prefill.notices): ask its bootstrap.
            failed = (await self.directory.room_failures(addr, {job.room: job.room_secret}) or {}).get(job.room)
            if failed is not None:
                if failed[1]:
                    job.fate.handle(NeverForwarded())
                return failed[0]
            # Else refetch its endpoints, retry.
            self.directory.invalidate(addr, f"handshake for room {job.room}: {job.fate.last_error}")
            request_event(log, job.room, "handshake retry", level=logging.WARNING, attempt=attempt, error=job.fate.last_error)
            await asyncio.sleep(min(backoff.delay(attempt), max(0.0, deadline - time.monotonic())))
        return None

    async def _handshake_one(self, job: Job, w: bpb.WorkerInfo, d: int, prompt_pages: tuple[int, ...], timeout: float) -> int:
        """Send one handshake; the worker's claim answer (``hpb.RoomClaim``)."""
        assert job.slot is not None
        tp_p = max(1, int(job.prefill.info.tp_size))
        req = hpb.HandshakeRequest(
            bootstrap_room=job.room,
            dst_pages=prompt_pages,
            dst_slot=job.slot,
            transport=self.transport_name,
            transport_descriptor=self.descriptors[d] if self.descriptors else self.descriptor,
            # The prefill's own hash, which admission accepted: it names the protocol
            # version both speak for this request.
            compatibility_hash=bytes(job.prefill.info.compatibility_hash),
            decode_tp_rank=d,
            decode_tp_size=self.tp_size,
            # Exactly one sender per decode rank writes the gated row; the others write
            # theirs into the sink region (pdgrpc.serving.tp).
            wants_metadata=w.tp_rank == designated_sender(d, self.tp_size, tp_p),
            transport_credential=self.credential(w, d),
            cached_pages=job.cached_pages,
            # Below the call's deadline: the worker answers before it, claimed or not.
            claim_wait_ms=max(0, min(int(self.claim_s * 1000), int(timeout * 1000) - 100)),
        )
        if job.room_secret:
            req.room_proof = handshake_proof(job.room_secret, req)
        if self.bind_writer is not None:  # the room admits the writer it names, and no other
            await self.bind_writer(job.room, d, w.tp_rank, self.instance_of(w.transport_endpoint))
        stub = hpb_grpc.HandshakeServiceStub(shared_pool().get(w.transfer_address))
        try:
            call = stub.Handshake(req, timeout=max(0.001, timeout), metadata=None if job.trace is None else job.trace.metadata())
            resp = await (call if not req.claim_wait_ms else self._held(job, call))
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, method="Handshake", target=w.transfer_address) from exc
        if resp is None:
            return hpb.ROOM_CLAIM_UNSPECIFIED
        if resp.generation != w.generation:
            # Registered again since we cached it: never reuse what we know about it.
            self.directory.invalidate(
                job.prefill.address,
                f"worker dp_rank={w.dp_rank} tp_rank={w.tp_rank} answered generation {resp.generation}, cached {w.generation}",
            )
        return resp.claim

    @staticmethod
    async def _held(job: Job, call: "grpc.aio.UnaryUnaryCall[hpb.HandshakeRequest, hpb.HandshakeResponse]") -> hpb.HandshakeResponse | None:
        """The answer of a handshake the worker holds until the room is claimed; None once
        the request ended meanwhile (the call is cancelled: its AbortRoom need not wait,
        since the worker received the handshake before it held the answer)."""
        answer = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({answer}, timeout=_HELD_CHECK_S)
            if done:
                return answer.result()
            if job.fate.state is not FateState.WAITING:
                call.cancel()
                with contextlib.suppress(BaseException):
                    await answer
                return None

    async def abort_room(self, job: Job, reason: str) -> bool:
        """AbortRoom to every worker sent a handshake for ``job``, at once; True when all
        acknowledged (none of them will write into the room again)."""
        request = hpb.AbortRoomRequest(bootstrap_room=job.room, reason=reason[:1000])
        if job.room_secret:
            request.room_proof = abort_proof(job.room_secret, job.room)

        async def tell(w: bpb.WorkerInfo) -> bool:
            if job.fate.never_forwarded:
                return True  # no worker got the room's Prefill: none writes into it
            if self._writer_gone(w):
                request_event(log, job.room, "prefill worker gone (the transport confirmed it can no longer write)",
                              worker=w.transfer_address)
                return True
            stub = hpb_grpc.HandshakeServiceStub(shared_pool().get(w.transfer_address))
            try:
                await stub.AbortRoom(request, timeout=self.rpc_timeout_s)
                return True
            except grpc.RpcError as exc:
                unreachable = callable(getattr(exc, "code", None)) and peer_answer(exc.code()) is PeerAnswer.GONE
                request_event(
                    log, job.room, "AbortRoom failed (pages stay quarantined until the lease ends or the worker is replaced)",
                    level=logging.WARNING, worker=w.transfer_address,
                    error=map_rpc_error(exc, method="AbortRoom", target=w.transfer_address),
                )
                if unreachable and await self._replaced(job, w):
                    request_event(log, job.room, "prefill worker replaced (new generation): its old process cannot write",
                                  worker=w.transfer_address, generation=w.generation)
                    return True
                return False

        return all(await asyncio.gather(*(tell(w) for w in job.contacted)))

    def writers_by_rank(self, job: Job) -> tuple[tuple[str, ...], ...]:
        """Per decode rank, the transport instance ids of the workers sent a handshake for
        ``job`` that write to that rank ("" for a descriptor that does not parse)."""
        tp_p = max(1, int(job.prefill.info.tp_size))
        return tuple(
            tuple(
                self.instance_of(w.transport_endpoint) for w in job.contacted
                if self.tp_size == 1 and tp_p == 1 or w.tp_rank in senders_of(d, self.tp_size, tp_p)
            )
            for d in range(self.tp_size)
        )

    def _writer_gone(self, w: bpb.WorkerInfo) -> bool:
        """Whether this decode's transport confirmed that ``w`` can no longer write into
        it: it proved its identity on the data plane, and every such connection ended from
        its side (its process is gone) and was drained (Transport.writer_gone). Used with
        decode TP 1 only: rank 0 cannot see the other ranks' transports (with TP > 1 each
        rank's own poll votes on its writers: RankTransfers.check_writers)."""
        writer = self.instance_of(w.transport_endpoint)
        return self.tp_size == 1 and bool(writer) and self.writer_gone(writer)

    async def _replaced(self, job: Job, w: bpb.WorkerInfo) -> bool:
        """Whether, within ``replaced_wait_s``, the transport confirms the unreachable
        worker gone (:meth:`_writer_gone`) or bootstrap shows a newer registration of its
        slot: the worker's process is gone, since its controller starts a replacement
        only once the old process has exited (and a dead process's connections are
        closed, so none of its bytes can still land)."""
        deadline = time.monotonic() + self.replaced_wait_s
        address = job.prefill.address
        next_query = time.monotonic()
        while time.monotonic() < deadline and self.quarantined(job.room):
            if self._writer_gone(w):
                return True
            if time.monotonic() >= next_query:
                next_query = time.monotonic() + 0.5
                self.directory.invalidate(address, f"worker dp_rank={w.dp_rank} unreachable for AbortRoom")
                try:
                    now, _ = await self.directory.workers(address, w.dp_rank)
                except (RpcError, RequestFailed, asyncio.TimeoutError):  # RequestFailed: an answer over a limit
                    now = []
                if any(x.tp_rank == w.tp_rank and x.pp_rank == w.pp_rank and x.generation > w.generation for x in now):
                    return True
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return False
