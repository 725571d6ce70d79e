"""A minimal etcd v3 client on grpc.aio: plain (``etcd://``) or TLS (``etcds://``) with a
client certificate, and/or a user and password.

It uses the generated etcd stubs that :mod:`aetcd` ships (``aetcd.rpc``) and nothing
else of it: aetcd's own client opens insecure channels only. One client is one channel
to one endpoint; :mod:`pdgrpc.discovery.etcd` makes a new one after any failure.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, AsyncIterator

import grpc

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.security import read_secret

__all__ = ["EtcdClient", "EtcdTarget", "Watch", "parse_discovery_url", "prefix_end", "rpc"]

SCHEMES = ("etcd", "etcds")


def rpc() -> Any:
    """The generated etcd v3 stubs and messages (``aetcd.rpc``), or ConfigError naming what to install."""
    try:
        from aetcd import rpc as stubs
    except ImportError as exc:  # pragma: no cover - the etcd extra is not installed
        raise ConfigError(f"--discovery etcd needs the aetcd package: pip install 'pdgrpc[etcd]' ({exc})") from None
    return stubs


@dataclasses.dataclass(frozen=True)
class EtcdTarget:
    """Where etcd is and what to present to it. ``tls``: ``etcds://`` (verify etcd against
    ``ca``; present ``cert``/``key`` when given); ``user``/``password``: etcd's own auth."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = dataclasses.field(default=None, repr=False)  # secrets stay out of logs
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)

    def with_files(
        self, ca: Path | None = None, cert: Path | None = None, key: Path | None = None, user: str = "",
        password_file: Path | None = None,
    ) -> "EtcdTarget":
        """This target with credentials read from files; ConfigError naming the flag that is wrong."""
        if not self.tls and (ca or cert or key):
            raise ConfigError("--discovery-ca/--discovery-cert/--discovery-key need --discovery etcds://")
        if self.tls and ca is None:
            raise ConfigError("--discovery etcds:// needs --discovery-ca (the CA that signed etcd's certificate)")
        if (cert is None) != (key is None):
            raise ConfigError("--discovery-cert and --discovery-key go together")
        if bool(user) != (password_file is not None):
            raise ConfigError("--discovery-user and --discovery-password-file go together")
        if user and not self.tls:
            raise ConfigError("--discovery-user needs --discovery etcds:// (the password would cross the network in clear)")
        password = ""
        if password_file is not None:
            password = read_secret(password_file, "--discovery-password-file").decode().strip()
            if not password:
                raise ConfigError(f"--discovery-password-file {str(password_file)!r} is empty")
        return dataclasses.replace(
            self, ca=_read(ca, "--discovery-ca"), cert=_read(cert, "--discovery-cert"),
            key=None if key is None else read_secret(key, "--discovery-key"), user=user, password=password,
        )


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def parse_discovery_url(url: str) -> EtcdTarget:
    """``etcd[s]://HOST:PORT[,HOST:PORT...]`` -> a target without credentials; ConfigError naming ``--discovery``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ConfigError(f"--discovery {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] (or etcds:// for TLS)")
    out = []
    for item in rest.rstrip("/").split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--discovery {url!r}: {item!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return EtcdTarget(tuple(out), tls=scheme == "etcds")


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


class Watch:
    """One watch stream: iterate it for events (``aetcd.rpc.Event``: ``type`` PUT or
    DELETE, ``kv``); it ends with ConnectionError when etcd cancels it or the stream breaks."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            reply = await self._call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("etcd ended the watch")
            if reply.canceled:
                raise ConnectionError(f"etcd cancelled the watch: {reply.cancel_reason or 'compacted'}")
            for event in reply.events:
                yield event

    def cancel(self) -> None:
        self._call.cancel()


class EtcdClient:
    """The etcd v3 calls discovery needs, on one channel to ``host:port``; each call may take ``timeout`` seconds."""

    def __init__(self, host: str, port: int, target: EtcdTarget, timeout: float) -> None:
        self._rpc = rpc()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if target.tls:
            creds = grpc.ssl_channel_credentials(target.ca, target.key, target.cert)
            self._channel = grpc.aio.secure_channel(address, creds)
        else:
            self._channel = grpc.aio.insecure_channel(address)
        self._target = target
        self._timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._kv = self._rpc.KVStub(self._channel)
        self._lease = self._rpc.LeaseStub(self._channel)
        self._watch = self._rpc.WatchStub(self._channel)
        self._maintenance = self._rpc.MaintenanceStub(self._channel)

    async def _md(self) -> tuple[tuple[str, str], ...] | None:
        """etcd's auth token for this channel (None without a user)."""
        if self._target.user and self._metadata is None:
            reply = await self._rpc.AuthStub(self._channel).Authenticate(
                self._rpc.AuthenticateRequest(name=self._target.user, password=self._target.password), timeout=self._timeout,
            )
            self._metadata = (("token", reply.token),)
        return self._metadata

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._kv.Put(self._rpc.PutRequest(key=key, value=value, lease=lease), timeout=self._timeout, metadata=await self._md())

    async def delete(self, key: bytes) -> None:
        await self._kv.DeleteRange(self._rpc.DeleteRangeRequest(key=key), timeout=self._timeout, metadata=await self._md())

    async def get_prefix(self, prefix: bytes) -> Any:
        """The RangeResponse of every key under ``prefix`` (``kvs``, ``header.revision``)."""
        request = self._rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        return await self._kv.Range(request, timeout=self._timeout, metadata=await self._md())

    async def lease(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        reply = await self._lease.LeaseGrant(self._rpc.LeaseGrantRequest(TTL=ttl), timeout=self._timeout, metadata=await self._md())
        return int(reply.ID)

    async def refresh_lease(self, lease_id: int) -> int:
        """Renew lease ``lease_id``; the seconds it has left (<= 0: it is gone)."""
        call = self._lease.LeaseKeepAlive(timeout=self._timeout, metadata=await self._md())
        try:
            await call.write(self._rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
        finally:
            call.cancel()
        return 0 if reply is grpc.aio.EOF else int(reply.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        await self._lease.LeaseRevoke(self._rpc.LeaseRevokeRequest(ID=lease_id), timeout=self._timeout, metadata=await self._md())

    async def watch(self, key: bytes, *, prefix: bool = False, start_revision: int = 0) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision`` (0: now)."""
        call = self._watch.Watch(metadata=await self._md())
        create = self._rpc.WatchCreateRequest(key=key, range_end=prefix_end(key) if prefix else b"", start_revision=start_revision)
        try:
            await call.write(self._rpc.WatchRequest(create_request=create))
            reply = await call.read()
        except BaseException:
            call.cancel()
            raise
        if reply is grpc.aio.EOF or not reply.created or reply.canceled:
            call.cancel()
            raise ConnectionError(f"etcd refused the watch of {key!r}: {getattr(reply, 'cancel_reason', '') or 'stream ended'}")
        return Watch(call)

    async def status(self) -> None:
        """Raises when etcd does not answer."""
        await self._maintenance.Status(self._rpc.StatusRequest(), timeout=self._timeout, metadata=await self._md())

    async def close(self) -> None:
        await self._channel.close()
