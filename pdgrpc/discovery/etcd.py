"""The etcd side of discovery: an instance's registration under a lease, and a prefix watch.

Both run as background tasks over :class:`~pdgrpc.discovery.etcd_client.EtcdClient`
(etcd v3 on grpc.aio, plain or TLS) and survive etcd outages:

* :class:`Registration` grants a lease of ``ttl`` seconds, puts the instance's key under
  it, and renews it every ``ttl / 3``. When a renewal finds the lease gone (the process
  was stopped for longer than the TTL, or etcd lost it) it grants a new lease and puts
  the key again. Meanwhile it watches its key: one deleted or overwritten by anyone
  while the lease lives is put back at once (:attr:`Registration.restored` counts it).
  :meth:`Registration.close` revokes the lease at once (clean shutdown).
* :class:`Watcher` lists the prefix, then watches it from the listing's revision; each
  (re)connection lists again, so deletes missed while etcd was away still apply.
  Meanwhile a probe (every ``probe_s``) catches a watch stream that hangs silently.
  Given a :class:`~pdgrpc.discovery.identity.DialIdentity` (a router under mTLS), it
  checks each signed record's address for the signer's key before the view lists it,
  retrying with backoff while nothing answers there.

While etcd is unreachable both keep what they had (the instance keeps serving, the
router keeps its last view), retry with capped exponential backoff over every endpoint in
turn, and log the outage once, then once more when etcd is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pdgrpc.discovery.etcd_client import EtcdClient, EtcdTarget, Watch, parse_discovery_url
from pdgrpc.discovery.identity import DialIdentity, NotTheSigner
from pdgrpc.discovery.record import Instance, MembershipView
from pdgrpc.discovery.signing import RecordSigner
from pdgrpc.errors import ConfigError

__all__ = ["EtcdTarget", "Registration", "Watcher", "parse_discovery_url"]

log = logging.getLogger("pdgrpc.discovery")

BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0
_CALL_TIMEOUT_S = 3  # one etcd call (grant, put, renew, list) may take this long


class _Outage:
    """Logs an etcd outage once when it starts and once when it ends; computes backoff."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.down = False
        self.delay = BACKOFF_FIRST_S

    def failed(self, endpoint: tuple[str, int], exc: BaseException) -> float:
        if not self.down:
            self.down = True
            log.warning("discovery: %s: etcd at %s:%d unreachable (%s: %s); keeping the last state and retrying "
                        "every <= %.0f s", self.what, *endpoint, type(exc).__name__, exc, BACKOFF_CAP_S)
        delay, self.delay = self.delay, min(self.delay * 2, BACKOFF_CAP_S)
        return delay

    def ok(self, endpoint: tuple[str, int]) -> None:
        if self.down:
            log.warning("discovery: %s: etcd at %s:%d reachable again", self.what, *endpoint)
        self.down = False
        self.delay = BACKOFF_FIRST_S


class _Endpoints:
    def __init__(self, target: EtcdTarget) -> None:
        if not target.endpoints:
            raise ConfigError("--discovery needs at least one etcd endpoint")
        self._target = target
        self._all = target.endpoints
        self._i = 0

    @property
    def current(self) -> tuple[str, int]:
        return self._all[self._i]

    def client(self) -> EtcdClient:
        host, port = self.current
        return EtcdClient(host, port, self._target, _CALL_TIMEOUT_S)

    def rotate(self) -> None:
        self._i = (self._i + 1) % len(self._all)

    async def fail_over(self, outage: "_Outage", client: EtcdClient, exc: Exception) -> None:
        """After a failed call: log it through ``outage``, drop ``client``, move to the next
        endpoint and wait out the back-off."""
        delay = outage.failed(self.current, exc)
        await _close(client)
        self.rotate()
        await asyncio.sleep(delay)


async def _close(client: EtcdClient) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), _CALL_TIMEOUT_S)


class Registration:
    """Keeps ``key`` -> ``instance`` in etcd under a lease while it runs; see the module doc."""

    def __init__(
        self, target: EtcdTarget, key: str, instance: Instance, ttl: int, signer: RecordSigner | None = None,
    ) -> None:
        if ttl < 1:
            raise ConfigError(f"--discovery-ttl must be >= 1 second, got {ttl}")
        self._ep = _Endpoints(target)
        self.key = key
        self.instance = instance
        self.ttl = ttl
        # Under mTLS the value is the record sealed with this instance's certificate.
        self.value = instance.to_json() if signer is None else signer.seal(instance.to_json())
        self.lease_id: int | None = None
        self.leases_granted = 0  # how many leases this registration took (re-registrations + 1)
        self.restored = 0  # times the key was put back after someone else deleted or overwrote it
        self.registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: EtcdClient | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        outage = _Outage(f"registration of {self.key}")
        while True:
            self._client = client = self._ep.client()
            try:
                # Watched from before the first put: a delete right after it is seen too.
                watch = await client.watch(self.key.encode())
                keeper = asyncio.ensure_future(self._keep(client, watch))
                try:
                    await self._renew(client, outage, keeper)
                finally:
                    keeper.cancel()
                    with contextlib.suppress(BaseException):
                        await keeper
                    watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._ep.fail_over(outage, client, exc)

    async def _renew(self, client: EtcdClient, outage: "_Outage", keeper: asyncio.Future[None]) -> None:
        while True:
            if self.lease_id is None:
                lease = await client.lease(self.ttl)
                # Before the put: a close() that comes while the put is in flight
                # (its key may already be visible) still revokes this lease.
                self.lease_id = lease
                self.leases_granted += 1
                await client.put(self.key.encode(), self.value, lease=lease)
                log.info("discovery: registered %s at %s (lease %x, ttl %d s, generation %d)",
                         self.key, self.instance.address, lease, self.ttl, self.instance.generation)
                self.registered.set()
                outage.ok(self._ep.current)
            else:
                left = await client.refresh_lease(self.lease_id)
                outage.ok(self._ep.current)
                if left <= 0:
                    log.warning("discovery: lease %x of %s lapsed (process stopped or etcd lost it); "
                                "registering again with a new lease", self.lease_id, self.key)
                    self.lease_id = None
                    self.registered.clear()
                    continue
            # Sleep until the next renewal; a keeper that failed (its watch broke) fails this connection.
            await asyncio.wait({keeper}, timeout=max(self.ttl / 3, 0.3))
            if keeper.done():
                keeper.result()
                raise ConnectionError("etcd ended the watch of the registration's key")

    async def _keep(self, client: EtcdClient, watch: Watch) -> None:
        """Puts the key back whenever it is deleted or overwritten while the lease lives:
        a writer that deletes an instance's key does not remove it from routers for the
        rest of its lease."""
        async for event in watch:
            lease = self.lease_id
            put = event.type == event.PUT
            if lease is None or (put and event.kv.value == self.value):
                continue
            try:
                await client.put(self.key.encode(), self.value, lease=lease)
            except Exception as exc:  # the lease ended meanwhile: the renewal registers again
                log.warning("discovery: %s was %s and could not be put back (%s)", self.key,
                            "overwritten" if put else "deleted", exc)
                continue
            self.restored += 1
            log.warning("discovery: %s was %s while its lease %x lives; put it back", self.key,
                        "overwritten" if put else "deleted", lease)
        raise ConnectionError("etcd ended the watch of the registration's key")  # pragma: no cover - the watch raises

    async def close(self) -> None:
        """Stop renewing and revoke the lease now, so watchers see the instance leave at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        client, lease_id = self._client, self.lease_id
        if client is not None and lease_id is not None:
            try:
                await asyncio.wait_for(client.revoke_lease(lease_id), _CALL_TIMEOUT_S)
                log.info("discovery: revoked lease %x of %s", lease_id, self.key)
            except Exception as exc:
                log.warning("discovery: could not revoke lease %x of %s (%s); it ends within %d s",
                            lease_id, self.key, exc, self.ttl)
        if client is not None:
            await _close(client)


class Watcher:
    """Feeds a :class:`MembershipView` from etcd; see the module doc."""

    def __init__(
        self,
        target: EtcdTarget,
        view: MembershipView,
        probe_s: float = 2.0,
        identity: DialIdentity | None = None,
    ) -> None:
        self._ep = _Endpoints(target)
        self.view = view
        self.probe_s = probe_s
        self._identity = identity
        self._proving: dict[str, asyncio.Task[None]] = {}  # key -> its address's check
        self.synced = asyncio.Event()  # set once the first listing landed
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def wait_changed(self, version: int, timeout: float) -> bool:
        """Wait until the view's version differs from ``version``; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.view.version != version), timeout)
            except asyncio.TimeoutError:
                return False
        return True

    async def _notify(self) -> None:
        self._prove()
        async with self._changed:
            self._changed.notify_all()

    def _prove(self) -> None:
        """Check the address of every signed record the view has not proven yet."""
        if self._identity is None:
            return
        for key, address, signer in self.view.unproven():
            if key not in self._proving:
                self._proving[key] = asyncio.ensure_future(self._prove_one(self._identity, key, address, signer))

    async def _prove_one(self, identity: DialIdentity, key: str, address: str, signer: bytes) -> None:
        delay = BACKOFF_FIRST_S
        try:
            while (key, address, signer) in self.view.unproven():
                try:
                    shown: bytes | None = await identity.presented(address)
                except NotTheSigner:
                    shown = None
                except (OSError, asyncio.TimeoutError, ValueError):  # nothing answers there (yet)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_CAP_S)
                    continue
                self.view.prove(key, address, signer, shown)
                break
        finally:
            self._proving.pop(key, None)
        await self._notify()  # listed, or the record changed meanwhile: check it again

    async def _run(self) -> None:
        outage = _Outage(f"watch of {self.view.prefix}")
        prefix = self.view.prefix.encode()
        while True:
            client = self._ep.client()
            try:
                listing = await client.get_prefix(prefix)
                self.view.reset((kv.key.decode(errors="replace"), kv.value, kv.create_revision) for kv in listing.kvs)
                self.synced.set()
                await self._notify()
                outage.ok(self._ep.current)
                watch = await client.watch(prefix, prefix=True, start_revision=listing.header.revision + 1)
                probe = asyncio.ensure_future(self._probe(client))
                try:
                    await self._consume(watch, probe)
                finally:
                    probe.cancel()
                    with contextlib.suppress(BaseException):
                        await probe
                    watch.cancel()
            except asyncio.CancelledError:
                await _close(client)
                raise
            except Exception as exc:
                await self._ep.fail_over(outage, client, exc)

    async def _consume(self, watch: Watch, probe: asyncio.Future[None]) -> None:
        events = watch.__aiter__()
        while True:
            nxt = asyncio.ensure_future(events.__anext__())
            try:
                await asyncio.wait({nxt, probe}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
            if nxt.cancelled():
                probe.result()  # raises: the probe failed
                raise ConnectionError("etcd probe ended")  # pragma: no cover - the probe never returns
            try:
                event = nxt.result()  # raises when the stream broke
            except StopAsyncIteration:
                raise ConnectionError("etcd ended the watch") from None
            key = event.kv.key.decode(errors="replace")
            if event.type == event.PUT:
                self.view.put(key, event.kv.value, event.kv.create_revision)
            else:
                self.view.delete(key)
            await self._notify()

    async def _probe(self, client: EtcdClient) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            await client.status()  # raises when etcd is gone; the watch is restarted then

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._proving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
