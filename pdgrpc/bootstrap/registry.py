"""The registry of one prefill instance's workers. Pure: no I/O, no clock.

* The instance's :class:`ParallelInfo` (topology and KV format) is fixed by the **first
  complete, consistent registration**: workers are grouped by the parallel info they
  announce, and the first group in which every slot of its topology has registered
  wins. Until then nothing is refused for its topology, so a stray or hostile first
  registrant (``dp_size=7``) cannot lock the real workers out. Pending workers count
  against the identity that registered them: one identity holds at most
  :data:`MAX_CANDIDATES` pending topologies and :data:`MAX_WORKERS` pending workers
  (past either, its own pending topology it updated least recently is dropped with its
  workers), so no registrant's entries are dropped by another's registrations. All
  identities together hold at most :data:`MAX_PENDING_WORKERS`; past it, a worker that
  would add an entry is refused with :class:`PendingWorkersFull` naming the limit,
  unless it completes its topology. Once fixed, a worker whose parallel info differs in
  any field is refused with :class:`TopologyMismatch` naming the field and both values.
* Every size a registration names is bounded before anything else is looked at, so
  nothing a caller sends is held, logged or repeated in a refusal at more than its
  limit: a topology has at most :data:`MAX_WORKERS` workers (dp_size x tp_size x
  pp_size), and each string and bytes field its limit of :mod:`pdgrpc.rpc.limits`.
* ``expect`` (the ``(dp_size, tp_size, pp_size)`` from flags or config, e.g. the prefill
  controller's own for its embedded bootstrap) refuses any other sizes from the start.
* A worker is identified by its ``(dp_rank, tp_rank, pp_rank)`` slot. Registering a
  slot again (a restart) replaces the entry and bumps the slot's ``generation``
  (1, 2, ...), which clients compare to drop connections cached for the old process.
  The generation lives in the slot's entry, and goes with it when a pending topology is
  dropped: clients see workers only once the topology is fixed, and a fixed topology's
  entries are never dropped, so what a client compared never goes backwards.
* With an ``owner`` (the caller's authenticated identity: its certificate's name under
  mTLS, else its host), a slot may be registered again only by the identity that first
  registered it; another is refused with :class:`~pdgrpc.bootstrap.errors.NotPermitted`, so a registration can never
  redirect a live slot to someone else's address.
* :meth:`parallel_info` and :meth:`workers` raise :class:`WorkersPending` ("k of n
  workers registered") until every slot of the topology has registered.

Messages are the generated ``pdgrpc.v1`` protobuf types; the registry keeps copies.
"""

from __future__ import annotations

from typing import Sequence

from pdgrpc.argtypes import check_address
from pdgrpc.bootstrap.errors import InvalidBootstrapRequest, NotPermitted, PendingWorkersFull, TopologyMismatch, WorkersPending
from pdgrpc.rpc.limits import (
    MAX_ADDRESS_CHARS, MAX_COMPATIBILITY_HASH_BYTES, MAX_NAME_CHARS, MAX_TRANSPORT_ENDPOINT_BYTES, Limited, over_limit,
)
from pdgrpc.v1 import bootstrap_pb2 as pb

Slot = tuple[int, int, int]  # (dp_rank, tp_rank, pp_rank)
MAX_CANDIDATES = 16  # topologies one identity has pending workers of before one is complete (count)
# Workers of one topology (dp_size * tp_size * pp_size), and pending workers of one
# identity (count): dp 512 at tp 8, or dp 64 at tp 64, is one instance.
MAX_WORKERS = 4096
# Pending workers of all identities together (count): one identity holds at most
# MAX_WORKERS, so the real instance's workers fit beside any one other identity's.
MAX_PENDING_WORKERS = 2 * MAX_WORKERS
_SIZES = ("dp_size", "tp_size", "pp_size")


class _Candidate:
    """Workers that announced one parallel info, while no topology is fixed."""

    def __init__(self, info: pb.ParallelInfo, key: bytes) -> None:
        self.info = pb.ParallelInfo()
        self.info.CopyFrom(info)
        self.key = key  # the parallel info, serialized: the registry's key for it
        self.workers: dict[Slot, pb.WorkerInfo] = {}
        self.owners: dict[Slot, str] = {}

    @property
    def expected(self) -> int:
        return self.info.dp_size * self.info.tp_size * self.info.pp_size


def _show(info: pb.ParallelInfo, field: str) -> str:
    value = getattr(info, field)
    if field == "load_balance_method":
        return pb.LoadBalanceMethod.Name(value)
    if isinstance(value, bytes):
        return f"0x{value.hex()}" if value else "(empty)"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def check_sizes(dp_size: int, tp_size: int, pp_size: int, what: str) -> None:
    """Raise :class:`InvalidBootstrapRequest` when the topology ``what`` names has more
    than :data:`MAX_WORKERS` workers: the registry holds an entry per slot."""
    n = dp_size * tp_size * pp_size
    if n > MAX_WORKERS:
        raise InvalidBootstrapRequest(
            f"{what}: dp_size {dp_size} x tp_size {tp_size} x pp_size {pp_size} = {n} workers, over the limit of {MAX_WORKERS}"
        )


def worker_limits(worker: pb.WorkerInfo) -> tuple[Limited, ...]:
    """A worker's fields with their limits (:func:`~pdgrpc.rpc.limits.over_limit`): who
    keeps a worker logs its address and transport and dials its descriptor."""
    return (
        ("transfer_address", worker.transfer_address, MAX_ADDRESS_CHARS, "characters"),
        ("transport", worker.transport, MAX_NAME_CHARS, "characters"),
        ("transport_endpoint", worker.transport_endpoint, MAX_TRANSPORT_ENDPOINT_BYTES, "bytes"),
    )


def parallel_info_limits(info: pb.ParallelInfo) -> tuple[Limited, ...]:
    """Parallel info's fields with their limits: who keeps it compares them, and a
    :class:`TopologyMismatch` repeats them."""
    return (
        ("kv_dtype", info.kv_dtype, MAX_NAME_CHARS, "characters"),
        ("kv_layout", info.kv_layout, MAX_NAME_CHARS, "characters"),
        ("compatibility_hash", info.compatibility_hash, MAX_COMPATIBILITY_HASH_BYTES, "bytes"),
    )


def check_field_sizes(worker: pb.WorkerInfo, info: pb.ParallelInfo) -> None:
    """Raise :class:`InvalidBootstrapRequest` naming the first field of a registration
    over its limit: the registry keeps each whole, logs the address and the transport,
    and a :class:`TopologyMismatch` repeats the parallel info's."""
    problem = over_limit(
        [(f"worker.{n}", v, limit, u) for n, v, limit, u in worker_limits(worker)]
        + [(f"parallel_info.{n}", v, limit, u) for n, v, limit, u in parallel_info_limits(info)]
    )
    if problem is not None:
        raise InvalidBootstrapRequest(f"RegisterWorkerRequest.{problem}")


def check_parallel_info(info: pb.ParallelInfo) -> None:
    """Raise :class:`InvalidBootstrapRequest` unless ``info`` is usable on its own."""
    for field in ("tp_size", "dp_size", "pp_size", "page_size"):
        if getattr(info, field) < 1:
            raise InvalidBootstrapRequest(f"parallel_info.{field} must be >= 1, got {getattr(info, field)}")
    check_sizes(info.dp_size, info.tp_size, info.pp_size, "RegisterWorkerRequest.parallel_info")
    if info.load_balance_method == pb.LOAD_BALANCE_METHOD_UNSPECIFIED:
        raise InvalidBootstrapRequest("parallel_info.load_balance_method must be set (it is LOAD_BALANCE_METHOD_UNSPECIFIED)")


class WorkerRegistry:
    """Workers of one prefill instance; see the module docstring."""

    def __init__(self, expect: tuple[int, int, int] | None = None) -> None:
        """``expect``: the (dp_size, tp_size, pp_size) the instance must have (None: any)."""
        if expect is not None:
            check_sizes(*expect, what="the expected topology")
        self.expect = expect
        self._info: pb.ParallelInfo | None = None
        self._workers: dict[Slot, pb.WorkerInfo] = {}  # each entry carries its slot's generation
        self._owners: dict[Slot, str] = {}
        # Pending topologies (serialized parallel info -> its workers); empty once the
        # topology is fixed.
        self._candidates: dict[bytes, _Candidate] = {}
        # Per identity that registered pending workers (None: registered without an
        # owner), its pending topologies -> its workers there, least recently updated
        # first: what its caps count and what its own overflow drops.
        self._pending: dict[str | None, dict[bytes, int]] = {}
        self._held_pending = 0  # pending workers of all identities together

    @property
    def info(self) -> pb.ParallelInfo | None:
        """The instance's parallel info once it is fixed (see the module docstring)."""
        return self._info

    @property
    def dp_size(self) -> int | None:
        return self._info.dp_size if self._info is not None else None

    def _leading(self) -> _Candidate | None:
        """While no topology is fixed: the pending one with the most workers."""
        return max(self._candidates.values(), key=lambda c: len(c.workers), default=None)

    @property
    def expected(self) -> int | None:
        """Workers the topology has: dp_size * tp_size * pp_size (while none is fixed: the
        leading pending one's; None before the first registration)."""
        i = self._info
        if i is None:
            lead = self._leading()
            return None if lead is None else lead.expected
        return i.dp_size * i.tp_size * i.pp_size

    @property
    def registered(self) -> int:
        if self._info is None:
            lead = self._leading()
            return 0 if lead is None else len(lead.workers)
        return len(self._workers)

    def registered_by(self, identity: str) -> bool:
        """Whether ``identity`` registered a worker of this instance (fixed or pending)."""
        return identity in self._pending or identity in self._owners.values()

    def identities(self) -> int:
        """How many distinct identities registered workers of this instance (fixed or pending)."""
        names = set(self._owners.values())
        names.update(who for who in self._pending if who is not None)
        return len(names)

    @property
    def held(self) -> int:
        """Worker entries held, pending and fixed, each with its generation and owner: at
        most :data:`MAX_PENDING_WORKERS` while no topology is fixed and
        :data:`MAX_WORKERS` once one is, whatever registrations came."""
        return len(self._workers) + self._held_pending

    @property
    def complete(self) -> bool:
        return self._info is not None and self.registered == self.expected

    def register(self, worker: pb.WorkerInfo, info: pb.ParallelInfo, owner: str | None = None) -> tuple[int, int, int]:
        """Record ``worker``, registered by ``owner`` (None: nobody's checked); returns
        ``(generation, registered, expected)``."""
        check_field_sizes(worker, info)
        check_parallel_info(info)
        if self.expect is not None:
            for field, want in zip(_SIZES, self.expect):
                if getattr(info, field) != want:
                    raise TopologyMismatch(field, str(want), _show(info, field))
        if self._info is not None:
            for field in (f.name for f in pb.ParallelInfo.DESCRIPTOR.fields):
                if getattr(self._info, field) != getattr(info, field):
                    raise TopologyMismatch(field, _show(self._info, field), _show(info, field))
        for rank, size in (("dp_rank", info.dp_size), ("tp_rank", info.tp_size), ("pp_rank", info.pp_size)):
            if getattr(worker, rank) >= size:
                raise InvalidBootstrapRequest(f"worker.{rank} {getattr(worker, rank)} is outside [0, {size})")
        if not worker.transfer_address:
            raise InvalidBootstrapRequest("worker.transfer_address must be set (host:port of its handshake service)")
        try:  # every decode that asks dials it: an address no one can dial fails their requests
            check_address(worker.transfer_address, "worker.transfer_address")
        except ValueError as exc:
            raise InvalidBootstrapRequest(str(exc)) from None
        slot = (worker.dp_rank, worker.tp_rank, worker.pp_rank)
        key = info.SerializeToString(deterministic=True)
        cand = None if self._info is not None else self._candidates.get(key)
        owners = self._owners if self._info is not None else (cand.owners if cand is not None else {})
        holder = owners.get(slot)
        if owner is not None and holder is not None and holder != owner:
            raise NotPermitted(
                f"worker slot dp_rank={slot[0]} tp_rank={slot[1]} pp_rank={slot[2]} is registered by {holder}; "
                f"refusing {owner} (only the identity that registered a slot may register it again)"
            )
        # The entries this registration replaces: the slot's own, and, while no topology
        # is fixed, the slot's entries of the same registrant in other pending topologies
        # (a slot belongs to the topology it last announced; another identity's entry
        # stays where it is, so no one pulls a worker out of the real topology).
        if self._info is not None:
            replaced = [self._workers[slot]] if slot in self._workers else []
            moved: list[_Candidate] = []
        else:
            moved = [
                c for c in self._candidates.values()
                if slot in c.workers and (c is cand or owner is None or c.owners.get(slot, owner) == owner)
            ]
            replaced = [c.workers[slot] for c in moved]
        generation = 1 + max((int(w.generation) for w in replaced), default=0)
        entry = pb.WorkerInfo()
        entry.CopyFrom(worker)
        entry.generation = generation
        if self._info is not None:
            self._workers[slot] = entry
            if owner is not None:
                self._owners[slot] = owner
            return generation, self.registered, self.expected or 0
        # No topology fixed yet: slots are owned within their announced topology only, so
        # a first registrant with another topology owns nothing of the real one.
        if cand is None:
            cand = _Candidate(info, key)
        mine = self._pending.get(owner, {})
        # Refused before anything changes: a worker adding an entry while all identities'
        # together are at their limit, unless its identity's own overflow makes the room
        # or it completes its topology (which frees every other pending entry).
        adds = not moved
        overflows = sum(mine.values()) + 1 > MAX_WORKERS or (key not in mine and len(mine) + 1 > MAX_CANDIDATES)
        completes = len(cand.workers) + 1 == cand.expected
        if adds and not overflows and not completes and self._held_pending >= MAX_PENDING_WORKERS:
            raise PendingWorkersFull(
                f"RegisterWorker: {self._held_pending} workers of topologies not yet complete are held, the limit for all "
                f"registrants together (MAX_PENDING_WORKERS={MAX_PENDING_WORKERS}); refusing worker dp_rank={slot[0]} "
                f"tp_rank={slot[1]} pp_rank={slot[2]} of {owner or 'an unauthenticated caller'} "
                f"(one registrant holds at most {MAX_WORKERS}; they are freed once a topology is complete)"
            )
        for other in moved:
            self._unhold(other, slot)
        self._hold(cand, slot, entry, owner)
        # Only the registrant's own entries make room for its registration, its least
        # recently updated topology first; this one alone fits (check_sizes), so it stays.
        mine = self._pending[owner]
        while sum(mine.values()) > MAX_WORKERS or len(mine) > MAX_CANDIDATES:
            self._drop(owner, self._candidates[next(iter(mine))])
        if len(cand.workers) == cand.expected:  # the first complete one fixes the topology
            self._info, self._workers, self._owners = cand.info, cand.workers, cand.owners
            self._candidates.clear()
            self._pending.clear()
            self._held_pending = 0
        return generation, len(cand.workers), cand.expected

    def _hold(self, cand: _Candidate, slot: Slot, entry: pb.WorkerInfo, owner: str | None) -> None:
        """Keep ``entry`` as ``slot``'s pending entry in ``cand`` (which holds none for it),
        counted against ``owner``."""
        self._candidates[cand.key] = cand
        cand.workers[slot] = entry
        if owner is not None:
            cand.owners[slot] = owner
        mine = self._pending.setdefault(owner, {})
        mine[cand.key] = mine.pop(cand.key, 0) + 1  # now its most recently updated
        self._held_pending += 1

    def _unhold(self, cand: _Candidate, slot: Slot) -> None:
        """Forget ``slot``'s pending entry in ``cand``, and ``cand`` once it holds none."""
        del cand.workers[slot]
        owner = cand.owners.pop(slot, None)
        mine = self._pending[owner]
        mine[cand.key] -= 1
        if not mine[cand.key]:
            del mine[cand.key]
            if not mine:
                del self._pending[owner]
        self._held_pending -= 1
        if not cand.workers:
            del self._candidates[cand.key]

    def _drop(self, owner: str | None, cand: _Candidate) -> None:
        """Forget ``owner``'s pending entries in ``cand`` (the others' stay)."""
        for slot in [s for s in cand.workers if cand.owners.get(s) == owner]:
            self._unhold(cand, slot)

    def parallel_info(self) -> pb.ParallelInfo:
        """The instance's parallel info; :class:`WorkersPending` until all registered."""
        self._require_complete()
        assert self._info is not None
        return self._info

    def workers(self, dp_rank: int, tp_ranks: Sequence[int] = ()) -> list[pb.WorkerInfo]:
        """Workers of ``dp_rank`` (those with ``tp_ranks`` if given), ordered by
        ``(tp_rank, pp_rank)``; :class:`WorkersPending` until all registered."""
        self._require_complete()
        info = self._info
        assert info is not None
        if dp_rank >= info.dp_size:
            raise InvalidBootstrapRequest(f"dp_rank {dp_rank} is outside [0, dp_size={info.dp_size})")
        if len(tp_ranks) > info.tp_size:  # checked before the set is built: a request may name millions
            raise InvalidBootstrapRequest(f"GetWorkersRequest.tp_ranks: {len(tp_ranks)} ranks, more than tp_size={info.tp_size}")
        wanted = set(tp_ranks)
        for tp in wanted:
            if tp >= info.tp_size:
                raise InvalidBootstrapRequest(f"tp_rank {tp} is outside [0, tp_size={info.tp_size})")
        return [
            self._workers[(dp_rank, tp, pp)]
            for tp in range(info.tp_size)
            if not wanted or tp in wanted
            for pp in range(info.pp_size)
        ]

    def _require_complete(self) -> None:
        if not self.complete:
            raise WorkersPending(self.registered, self.expected)
