"""What decode knows about the prefill instances it receives KV from, keyed by the
address of each instance's BootstrapService (the ``prefill_bootstrap_address`` of every
DecodeRequest).

Per address it caches the instance's ParallelInfo (dp size, load-balance method,
force-query, compatibility hash) and, per dp rank, the workers' endpoints with their
registration **generation**. A cache entry is dropped as soon as anything says the
instance changed -- a handshake answered with another generation, a worker that no
longer answers, a bootstrap answering with another **instance id**, or the connection
to the bootstrap dropped since the info was fetched -- so connections, endpoints and
parallel info of a restarted prefill are never reused (a peer's "stale connection"
bug). Rooms admitted under the previous instance fail with :func:`restart_failure`:
their prefill went down with it. Every call goes through one pooled channel per
address (:class:`~pdgrpc.bootstrap.client.BootstrapClient`), never a connection per call.
A bootstrap is named by a request, so its answers are untrusted: parallel info that no
prefill could have registered (:func:`~pdgrpc.bootstrap.registry.check_parallel_info`, a
field over its limit of :mod:`pdgrpc.rpc.limits`), a GetWorkers answer listing more than
:data:`~pdgrpc.bootstrap.registry.MAX_WORKERS` workers, or a worker whose field is over its
limit, ends the request INTERNAL naming it and is not kept; what is kept is bounded to :data:`MAX_WORKER_LISTS` answers
and :data:`MAX_WORKER_LIST_BYTES` bytes, the least recently used forgotten first.
:meth:`PrefillDirectory.room_failures` asks whether rooms' prefills failed, as their
prefill's controller records them with its bootstrap (:mod:`pdgrpc.prefill.notices`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc

from pdgrpc.bootstrap.client import BootstrapClient, RpcError
from pdgrpc.bootstrap.errors import InvalidBootstrapRequest
from pdgrpc.bootstrap.registry import MAX_WORKERS, check_parallel_info, parallel_info_limits, worker_limits
from pdgrpc.decode.statuses import PeerAnswer, Refusal, ending, peer_answer, prefill_failure
from pdgrpc.errors import RequestFailed
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.limits import over_limit
from pdgrpc.serving.room_proof import failure_tag
from pdgrpc.state import DpConfig
from pdgrpc.v1 import bootstrap_pb2 as bpb

log = logging.getLogger("pdgrpc.decode.prefills")

__all__ = ["PrefillInfo", "PrefillDirectory", "restart_failure"]

T = TypeVar("T")

# Prefill bootstrap addresses one decode keeps a client and answers for (count).
MAX_PREFILLS = 4096
# GetWorkers answers, one per prefill address and dp rank, one decode keeps (count): a
# request names any dp rank below the dp_size its prefill's bootstrap claims.
MAX_WORKER_LISTS = 16384
# Bytes of the workers of those answers together (serialized): about 2000 answers of
# tp-8 rdma workers (15 KB each), whatever a bootstrap lists.
MAX_WORKER_LIST_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class PrefillInfo:
    """The parallel info of one prefill instance, as decode uses it."""

    address: str
    info: bpb.ParallelInfo
    dp: DpConfig  # how decode resolves this instance's dp ranks
    instance_id: int = 0  # the bootstrap's instance id when the info was fetched; 0: not told

    @property
    def dp_size(self) -> int:
        return self.info.dp_size

    def restarted(self, instance_id: int) -> bool:
        """Whether an answer carrying ``instance_id`` came from another instance than
        this info (never when either side does not say)."""
        return bool(self.instance_id and instance_id and instance_id != self.instance_id)


def restart_failure(room: int, address: str) -> RequestFailed:
    """What a request admitted under a prefill instance that has since restarted ends with:
    UNAVAILABLE, so that the caller sends it again (both legs)."""
    return ending(
        Refusal.PREFILL_GONE,
        f"room {room}: the prefill at {address} restarted after this request was admitted "
        "(its bootstrap answers with another instance id); the request's prefill was lost with it, send the request again",
    )


M = TypeVar("M", bpb.ParallelInfo, bpb.WorkerInfo)


def _known(message: M) -> M:
    """A copy of ``message`` without the fields this build does not know: they are bytes
    the limits of its known fields do not see."""
    copy = type(message)()
    copy.CopyFrom(message)
    copy.DiscardUnknownFields()
    return copy


def _checked_info(address: str, info: bpb.ParallelInfo) -> bpb.ParallelInfo:
    """A copy of the parallel info a bootstrap answered, without fields this build does not
    know; a :class:`~pdgrpc.errors.RequestFailed` (INTERNAL) naming what no prefill could
    have registered: the decode keeps it for as long as the address."""
    try:
        check_parallel_info(info)
    except InvalidBootstrapRequest as exc:
        raise ending(Refusal.INTERNAL, f"bootstrap {address} answers parallel info no prefill registers: {exc}") from None
    problem = over_limit(parallel_info_limits(info))
    if problem is not None:
        raise ending(Refusal.INTERNAL, f"bootstrap {address} answers parallel_info.{problem}")
    return _known(info)


def _checked_workers(address: str, dp_rank: int, listed: Sequence[bpb.WorkerInfo]) -> list[bpb.WorkerInfo]:
    """Copies of the workers a bootstrap listed for ``dp_rank``, without fields this
    build does not know; a :class:`~pdgrpc.errors.RequestFailed` (INTERNAL) naming the
    first count or field over its limit: the decode keeps, logs and dials them."""
    if len(listed) > MAX_WORKERS:  # no topology has more
        raise ending(Refusal.INTERNAL, f"bootstrap {address} lists {len(listed)} workers for dp_rank={dp_rank}, over the limit of {MAX_WORKERS}")
    kept = []
    for w in listed:
        problem = over_limit(worker_limits(w))
        if problem is not None:
            raise ending(Refusal.INTERNAL, f"bootstrap {address} lists worker dp_rank={w.dp_rank} tp_rank={w.tp_rank} at {problem}")
        kept.append(_known(w))
    return kept


def dp_config_of(info: bpb.ParallelInfo, query_interval_s: float) -> DpConfig:
    return DpConfig(
        dp_size=int(info.dp_size),
        follow_bootstrap_room=info.load_balance_method == bpb.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM,
        force_query=bool(info.force_dp_rank_query),
        query_interval_s=query_interval_s,
    )


class PrefillDirectory:
    """Cached ParallelInfo and workers per prefill bootstrap address (one event loop)."""

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        query_interval_s: float = 0.05,
        max_prefills: int = MAX_PREFILLS,
        max_worker_lists: int = MAX_WORKER_LISTS,
        max_worker_list_bytes: int = MAX_WORKER_LIST_BYTES,
        pool: ChannelPool | None = None,
    ) -> None:
        self.timeout = timeout
        self.query_interval_s = query_interval_s
        self.max_prefills = max_prefills
        self.max_worker_lists, self.max_worker_list_bytes = max_worker_lists, max_worker_list_bytes
        self._pool = pool  # None: the running loop's shared pool
        # Least recently used first: past max_prefills the first address is forgotten.
        self._clients: collections.OrderedDict[str, BootstrapClient] = collections.OrderedDict()
        self._info: dict[str, PrefillInfo] = {}
        # (address, dp rank) -> (workers, instance id, their bytes), least recently used
        # first; the dp ranks kept per address, for invalidate().
        self._workers: collections.OrderedDict[tuple[str, int], tuple[list[bpb.WorkerInfo], int, int]] = collections.OrderedDict()
        self._ranks: dict[str, set[int]] = {}
        self._worker_bytes = 0
        # One in-flight fetch per key: a burst of requests for a new prefill costs one call.
        self._inflight: dict[object, asyncio.Future[Any]] = {}
        self._no_failures: set[str] = set()  # addresses whose bootstrap has no QueryRoomFailures
        # Per address with cached info: the task that drops it once the connection the info
        # came over leaves READY (a channel may reconnect, to a restarted instance, unasked).
        self._followers: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        """Prefill addresses the directory holds a client for (at most ``max_prefills``)."""
        return len(self._clients)

    def cached_workers(self) -> tuple[int, int]:
        """GetWorkers answers kept, and their workers' bytes (at most
        ``max_worker_lists`` and ``max_worker_list_bytes``)."""
        return len(self._workers), self._worker_bytes

    def client(self, address: str) -> BootstrapClient:
        c = self._clients.get(address)
        if c is not None:
            self._clients.move_to_end(address)
            return c
        c = self._clients[address] = BootstrapClient(address, timeout=self.timeout, pool=self._pool)
        if len(self._clients) > self.max_prefills:
            # Every Decode call names an address: a caller cycling through them must not
            # grow the decode. A request still using the forgotten one keeps its own info.
            gone, _ = self._clients.popitem(last=False)
            self.invalidate(gone, f"over {self.max_prefills} prefill addresses, least recently used")
            self._no_failures.discard(gone)
        return c

    async def parallel_info(self, address: str, *, wait_for: float) -> PrefillInfo:
        """The instance's info, fetched once and cached; retried while its workers are
        still registering (UNAVAILABLE), for at most ``wait_for`` seconds."""
        cached = self._info.get(address)
        if cached is not None:
            state = self.client(address).channel.get_state(try_to_connect=False)
            if state == grpc.ChannelConnectivity.READY:
                return cached
            # The connection the info came over dropped: the instance may have restarted
            # (with other parallel info) since. One GetParallelInfo tells.
            self.invalidate(address, f"connection to its bootstrap dropped since the info was fetched ({state.name})")

        async def fetch() -> PrefillInfo:
            resp = await self.client(address).wait_parallel_info(wait_for=wait_for)
            checked = _checked_info(address, resp.parallel_info)
            info = PrefillInfo(address, checked, dp_config_of(checked, self.query_interval_s), int(resp.instance_id))
            if address in self._clients:  # not forgotten (max_prefills) while the call ran
                self._info[address] = info
                self._follow(address)
            log.info(
                "prefill %s: dp_size=%d tp_size=%d method=%s force_query=%s instance=%016x",
                address,
                info.info.dp_size,
                info.info.tp_size,
                bpb.LoadBalanceMethod.Name(info.info.load_balance_method),
                info.info.force_dp_rank_query,
                info.instance_id,
            )
            return info

        return await self._once(("info", address), fetch)

    async def workers(self, address: str, dp_rank: int) -> tuple[list[bpb.WorkerInfo], int]:
        """The workers (every tp rank) of prefill ``dp_rank``, and the instance id of the
        bootstrap that listed them; cached until invalidated."""
        key = (address, dp_rank)
        cached = self._workers.get(key)
        if cached is not None:
            self._workers.move_to_end(key)
            return cached[0], cached[1]

        async def fetch() -> tuple[list[bpb.WorkerInfo], int]:
            resp = await self.client(address).get_workers_response(dp_rank)
            self._seen(address, int(resp.instance_id))
            workers = _checked_workers(address, dp_rank, resp.workers)
            if address in self._clients:
                self._keep(key, workers, int(resp.instance_id))
            return workers, int(resp.instance_id)

        return await self._once(("workers", key), fetch)

    def _keep(self, key: tuple[str, int], workers: list[bpb.WorkerInfo], instance_id: int) -> None:
        """Cache an answer; past either bound the least recently used answers go (fetched
        again when next used)."""
        self._forget(key)
        size = sum(w.ByteSize() for w in workers)
        self._workers[key] = (workers, instance_id, size)
        self._ranks.setdefault(key[0], set()).add(key[1])
        self._worker_bytes += size
        while self._workers and (len(self._workers) > self.max_worker_lists or self._worker_bytes > self.max_worker_list_bytes):
            self._forget(next(iter(self._workers)))

    def _forget(self, key: tuple[str, int]) -> bool:
        gone = self._workers.pop(key, None)
        if gone is None:
            return False
        self._worker_bytes -= gone[2]
        ranks = self._ranks[key[0]]
        ranks.discard(key[1])
        if not ranks:
            del self._ranks[key[0]]
        return True

    def _follow(self, address: str) -> None:
        """Drop ``address``'s cache once the connection its info came over is no longer
        READY: a channel reconnects on its own, so READY later may be another instance."""
        old = self._followers.pop(address, None)
        if old is not None:
            old.cancel()
        channel = self.client(address).channel

        async def follow() -> None:
            state = channel.get_state(try_to_connect=False)
            try:
                while state is grpc.ChannelConnectivity.READY:
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=False)
            except Exception as exc:  # the channel was closed under it (the pool closed)
                log.debug("prefill %s: stopped following its bootstrap's connection: %s", address, exc)
            if self._followers.get(address) is task:
                del self._followers[address]
                self.invalidate(address, f"connection to its bootstrap left READY ({state.name}) since the info was fetched")

        task = self._followers[address] = asyncio.ensure_future(follow())

    def close(self) -> None:
        """Stop following connections (the decode is stopping)."""
        for task in self._followers.values():
            task.cancel()
        self._followers.clear()

    def invalidate(self, address: str, why: str) -> None:
        """Forget everything cached about the instance at ``address``."""
        follower = self._followers.pop(address, None)
        if follower is not None:
            follower.cancel()
        dropped = self._info.pop(address, None) is not None
        for rank in list(self._ranks.get(address, ())):
            dropped |= self._forget((address, rank))
        if dropped:
            log.info("prefill %s: dropped cached info and workers (%s)", address, why)

    def _seen(self, address: str, instance_id: int) -> None:
        """An answer from ``address`` carried ``instance_id``: drop the cache if the
        instance restarted since it was filled."""
        cached = self._info.get(address)
        if cached is not None and cached.restarted(instance_id):
            self.invalidate(address, f"its bootstrap restarted: instance {instance_id:016x}, cached {cached.instance_id:016x}")

    async def query_dp_ranks(self, address: str, rooms: tuple[int, ...]) -> tuple[dict[int, int | None], int]:
        """One batched QueryDpRanks: room -> dp rank, None for rooms not known yet; and
        the answering bootstrap's instance id."""
        result = await self.client(address).query_dp_ranks(rooms)
        self._seen(address, result.instance_id)
        answers: dict[int, int | None] = {room: None for room in rooms}
        answers.update(result.ranks)
        return answers, result.instance_id

    async def room_failures(
        self, address: str, secrets: dict[int, bytes], wait_s: float = 0.0
    ) -> dict[int, tuple[RequestFailed, bool]] | None:
        """Rooms of ``secrets`` (room -> its secret) whose prefill failed, as recorded
        with the bootstrap at ``address`` (:mod:`pdgrpc.bootstrap.failures`): the failure
        their request ends with, and whether no worker got the request
        (``never_forwarded``). The call is held up to ``wait_s`` while none has a record.
        None when the bootstrap cannot say (an error; an older server is not asked again)."""
        keys = [bpb.RoomFailureKey(bootstrap_room=r, tag=failure_tag(s, r)) for r, s in secrets.items() if s]
        if not keys or address in self._no_failures:
            return None
        try:
            # A failure path: a brief timeout beyond the held wait.
            found = await self.client(address).query_room_failures(keys, max_wait_s=wait_s, timeout=wait_s + min(self.timeout, 1.0))
        except RpcError as exc:
            if peer_answer(exc.code) is PeerAnswer.UNSUPPORTED:
                self._no_failures.add(address)
            log.debug("QueryRoomFailures to %s failed: %s", address, exc)
            return None
        return {f.key.bootstrap_room: (prefill_failure(f.key.bootstrap_room, f.code, f.reason), f.never_forwarded) for f in found}

    async def _once(self, key: object, fetch: Callable[[], Awaitable[T]]) -> T:
        fut: asyncio.Future[T] | None = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(fetch())
            self._inflight[key] = fut
            fut.add_done_callback(lambda f: self._fetched(key, f))
        # Shielded: one caller giving up (its client cancelled) must not cancel the fetch
        # the other callers wait for.
        return await asyncio.shield(fut)

    def _fetched(self, key: object, fut: asyncio.Future[Any]) -> None:
        self._inflight.pop(key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: a failure nobody awaited any more is not "never retrieved"
