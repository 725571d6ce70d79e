"""Run a topology as a local cluster on 127.0.0.1: start, wait healthy, watch, stop.

::

    async with Cluster("1p1d", transport="tcp", tls="auto") as c:
        stub = GenerateServiceStub(c.client_channel())   # presents the cluster's client credentials
        ...
        stats = await c.stats("decode")        # the server's own ResourceStats

* Every process gets a free port on 127.0.0.1 and its own log file (``log_dir``). Without
  ``log_dir`` the logs go to a fresh temporary directory, which :meth:`Cluster.stop`
  removes after a clean run (``keep_logs=True`` keeps it); a run that failed (a start
  that did not come up, a child that died, an error in the ``async with`` body) keeps
  it and logs where.
* With ``metrics=True`` (or ``metrics = true`` in the topology) every bootstrap, prefill,
  decode and router also serves Prometheus metrics on a free port
  (:meth:`Cluster.metrics_endpoints`); a prefill with ``dp-size`` N gets N + 1 consecutive
  ports: its controller's, then one per dp worker (``--metrics-port`` base + 1 + rank).
* With ``tls="auto"`` (``--tls auto``, or ``tls = "auto"`` under ``[security]``) the
  launcher makes a throwaway CA in ``LOG_DIR/security`` and one certificate per process
  (its name is the certificate's common name; it names the process's role), then deletes
  the CA's key: every process serves mTLS and presents its certificate on its own calls.
  ``auth_token="auto"`` writes one random bearer token per role there: every process
  sends its role's and takes any role's, and each RPC takes only its roles.
  :attr:`Cluster.client_security` is what a client of the cluster presents (certificate
  ``client``, the client's token); :meth:`Cluster.client_channel` opens a channel with
  it, :meth:`Cluster.channel` one with the launcher's own (a router's) or another
  process's credentials. A
  router whose args set ``public-tls-cert`` serves clients server-only TLS: pass
  ``public_ca`` (its certificate's CA) and the router's clients trust that and present
  nothing. smg presents no credential: in a secured cluster each worker it calls also
  listens for it on a loopback port (``--gateway-listen``, where every caller is the
  ``gateway`` role alone) and smg calls that, and smg's HTTP side takes only the key in
  ``LOG_DIR/security/smg-api-key``.
* :meth:`Cluster.start` starts them all at once (they find each other lazily), then waits
  until each one's ``grpc.health.v1`` check answers SERVING, bounded by
  ``start_timeout``; an smg process starts only then, and is ready when it says so. A process that exits meanwhile fails the start with its log tail.
* While the cluster runs a watcher notices a child that exits. With ``supervise=True``
  (what ``python -m pdgrpc.cluster`` runs) it starts the child again on the same port,
  logging why (its exit code, in its log and the launcher's), at once the first time and
  after an exponential backoff while it keeps dying within :data:`STABLE_S` of its start;
  a process whose topology entry says ``restart = false`` is not restarted. Otherwise --
  and always for a failure at start-up, which stops everything -- :meth:`Cluster.check`
  raises :class:`ChildDied` (with the log tail) and :meth:`Cluster.wait_failure` returns it.
* :meth:`Cluster.restart` restarts one process gently: SIGTERM makes it drain (its health
  turns NOT_SERVING, routers send new requests elsewhere, the running ones finish), then
  it starts again and is waited for until healthy. Restarting the processes one at a time
  is a rolling restart. ``LOG_DIR/cluster.json`` names each process's pid and address, so
  ``python -m pdgrpc.cluster restart NAME --log-dir LOG_DIR`` can do the same from outside.
* :meth:`Cluster.stop` sends SIGTERM to the router first (no new requests), then the
  rest, waits ``grace`` seconds, then SIGKILLs each child's whole process group (a
  prefill's DP workers are its children). Children also get SIGKILL if the launching
  process dies (``PR_SET_PDEATHSIG`` on Linux), so a killed test run leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.cluster.credentials import CLIENT, LAUNCHER, ClusterCredentials
from pdgrpc.cluster.errors import ClusterError
from pdgrpc.cluster.hosts import HostMap, discovery_flags, hosts_from_env, place
from pdgrpc.cluster.ports import HOST, METRICS_ROLES, free_port, free_port_block, metrics_children
from pdgrpc.cluster.smg import readiness, smg_argv
from pdgrpc.cluster.topology import SECURITY_MODES, ProcessSpec, Topology, TRANSPORTS, flags, load_topology
from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, etcd_argv, etcd_healthy, find_etcd
from pdgrpc.rpc.security import Security
from pdgrpc.serving.children import Spawned, guarded_argv, spawn
from pdgrpc.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

__all__ = ["ChildDied", "Cluster", "ClusterError", "Proc", "restart_running"]

log = logging.getLogger(__name__)

_TAIL_LINES = 40
# A supervised process that ran this long before it exited is restarted at once; one that
# keeps dying sooner waits BACKOFF_S, doubling up to BACKOFF_MAX_S, between starts.
STABLE_S = 30.0
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0
STATE_FILE = "cluster.json"
_PREFILL_READY = "PDGRPC_READY "  # python -m pdgrpc.prefill prints it once every worker serves


# What a server prints when its port is taken: gRPC's bind failure (pdgrpc.rpc.server)
# and errno EADDRINUSE (the metrics endpoint, a transport listener).
_BIND_FAILURES = ("cannot bind", "Address already in use")


def _lost_port_race(proc: "Proc") -> bool:
    tail = proc.log_tail()
    return any(marker in tail for marker in _BIND_FAILURES)


@dataclasses.dataclass
class Proc:
    spec: ProcessSpec
    port: int
    argv: list[str]
    log_path: Path
    process: Spawned | None = None
    ip: str = HOST  # its host's address (127.0.0.1 without [network])
    # Metrics endpoints ("" for the process itself, "dp<r>" for a prefill's dp workers).
    metrics_ports: dict[str, int] = dataclasses.field(default_factory=dict)
    restarts: int = 0  # times the launcher started it again
    quick_exits: int = 0  # exits in a row within STABLE_S of a start
    started_at: float = 0.0  # monotonic
    restarting: bool = False  # Cluster.restart is stopping it: its exit is no failure
    gateway_port: int | None = None  # its loopback listener for smg (--gateway-listen), in a secured cluster

    @property
    def gateway_address(self) -> str | None:
        return None if self.gateway_port is None else f"{HOST}:{self.gateway_port}"

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def log_has_line(self, prefix: str) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                return any(line.startswith(prefix.encode()) for line in f)
        except OSError:
            return False

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


class ChildDied(ClusterError):
    """A cluster process exited while the cluster was meant to run."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        super().__init__(
            f"{proc.spec.role} process {proc.spec.name!r} (pid {proc.pid}) exited with code {proc.returncode}; "
            f"last lines of {proc.log_path}:\n{proc.log_tail()}"
        )


class Cluster:
    """A running topology; see the module doc."""

    def __init__(
        self,
        topology: Topology | str | Path,
        *,
        transport: str | None = None,
        log_dir: str | Path | None = None,
        keep_logs: bool = False,
        start_timeout: float = 180.0,
        grace: float = 10.0,
        extra_env: dict[str, str] | None = None,
        python: str = sys.executable,
        metrics: bool | None = None,
        hosts: HostMap | None = None,
        tls: str | None = None,
        auth_token: str | None = None,
        public_ca: str | Path | None = None,
        supervise: bool = False,
        local_sockets: bool = True,
    ) -> None:
        """``local_sockets``: the router calls the prefills and decodes on its host over
        their local sockets (:meth:`local_socket`); False: over gRPC."""
        self.topology = topology if isinstance(topology, Topology) else load_topology(topology)
        self.local_sockets = local_sockets
        # With [network]: host -> netns and address (pdgrpc.cluster.hosts); the launcher runs on the front door's host.
        self.hosts = hosts if hosts is not None else hosts_from_env(self.topology)
        # The CA of the router's public certificate (its args set public-tls-cert): clients
        # of the router, the health checks included, trust it and present nothing.
        self.public_ca = None if public_ca is None else Path(public_ca)
        self.tls = tls or self.topology.tls or "off"
        self.auth_token = auth_token or self.topology.auth_token
        for flag, value in (("tls", self.tls), ("auth_token", self.auth_token)):
            if value not in SECURITY_MODES:
                raise ClusterError(f"{flag} must be one of {SECURITY_MODES}, got {value!r}")
        self.metrics = self.topology.metrics if metrics is None else metrics
        self.transport = transport or self.topology.transport
        if self.transport not in TRANSPORTS:
            raise ClusterError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        # A directory of the launcher's own goes when the cluster stops cleanly (with the
        # processes' keys in it), unless keep_logs; a failed run keeps it, since its
        # errors name the log files. A given log_dir belongs to the caller and stays.
        self._own_log_dir = log_dir is None
        self.keep_logs = keep_logs
        self._failed = False
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"pdgrpc-{self.topology.name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The local sockets' directory (local_socket): named now, made 0700 as the cluster
        # starts and removed as it stops, so a cluster never started leaves nothing behind.
        self._socket_dir = Path(tempfile.gettempdir()) / f"pdgrpc-{secrets.token_hex(6)}"
        self._sockets = False
        self.start_timeout = start_timeout
        self.grace = grace
        self.supervise = supervise
        self._running = False  # every process came up: from now on the supervisor restarts
        self._python = python
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.topology.env, **(extra_env or {})}
        self.procs: dict[str, Proc] = {}
        try:
            self.credentials = ClusterCredentials(
                self.log_dir / "security", {p.name: p.role for p in self.topology.processes}, tls=self.tls == "auto",
                token=self.auth_token == "auto", files=self.topology.security_files,
                addresses={p.name: place(p, self.hosts, HOST)[0] for p in self.topology.processes},
                smg=any(p.role == "smg" for p in self.topology.processes),
            )
            self._assign_ports()
        except BaseException:
            # A cluster refused before it started has no logs to keep: a directory of
            # the launcher's own goes, with the keys it made.
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
            raise
        self.client_security = self.credentials.client
        self._stopping = False
        self._died: asyncio.Future[Proc] | None = None
        self._watchers: list[asyncio.Task[None]] = []
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def client_channel(self, options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
        """A new channel to the router with :attr:`client_security` and ``options`` (e.g.
        :data:`~pdgrpc.rpc.channels.ROUTER_CLIENT_OPTIONS`, to ride through the router's
        restart); the caller closes it."""
        return self._security_for(self.router_address, CLIENT).channel(self.router_address, options)

    def _security_for(self, address: str, present: str) -> Security:
        if self.public_ca is not None and address == self.router_address:
            return Security(ca=self.public_ca)
        return self.credentials.security(present)

    def _assign_ports(self) -> None:
        """Fresh, pairwise distinct ports for every process (and metrics endpoint)."""
        taken: set[int] = set()
        for spec in self.topology.processes:
            port = free_port(taken)
            taken.add(port)
            ip, _ = place(spec, self.hosts, HOST)
            proc = self.procs[spec.name] = Proc(spec, port, [], self.log_dir / f"{spec.name}.log", ip=ip)
            if spec.role == "etcd":
                peer = free_port(taken)
                taken.add(peer)
                binary = find_etcd()
                if binary is None:
                    raise ClusterError(f"topology {self.topology.name!r} runs etcd, but there is none here: {ETCD_PACKAGE_HINT}")
                proc.argv = etcd_argv(binary, ip, port, peer, self.log_dir / f"{spec.name}-data", self.credentials.etcd)
            if spec.role == "smg":  # smg always gets its metrics port: it binds one either way
                proc.metrics_ports[""] = smg_metrics = free_port(taken)
                taken.add(smg_metrics)
            elif self.metrics and spec.role in METRICS_ROLES:
                children = metrics_children(spec)
                base = free_port_block(1 + len(children), exclude=taken)
                taken.update(range(base, base + 1 + len(children)))
                proc.metrics_ports[""] = base
                for offset, key in enumerate(children, start=1):
                    proc.metrics_ports[key] = base + offset  # derived_metrics_port(base, offset)
        for smg in self.topology.by_role("smg"):
            if self.credentials.secured:
                self._gateway_ports(smg, taken)
        for proc in self.procs.values():
            if proc.spec.role == "smg":
                proc.argv = smg_argv(
                    proc.spec, HOST, proc.port, proc.metrics_ports[""], self.smg_worker_address, self.bootstrap_address, self._python,
                    api_key_file=self.credentials.smg_api_key,
                )
            elif proc.spec.role != "etcd":
                proc.argv = [self._python, "-m", proc.spec.module, *self._flags(proc)]
            proc.argv = [*place(proc.spec, self.hosts, HOST)[1], *proc.argv]

    def _gateway_ports(self, smg: ProcessSpec, taken: set[int]) -> None:
        """A loopback listener for ``smg`` on each of its workers: smg presents no
        credential, so a secured worker serves it there, to the gateway role alone."""
        for name in (*smg.prefill, *smg.decode):
            if self.procs[name].spec.host != smg.host:
                raise ClusterError(
                    f"smg {smg.name!r} reaches {name!r} on a loopback listener only (it presents no credential to a secured "
                    f"worker): place them on one host, or run the cluster with neither --tls nor --auth-token"
                )
            self.procs[name].gateway_port = port = free_port(taken)
            taken.add(port)

    # ---- addresses ----------------------------------------------------------------------

    def smg_worker_address(self, name: str) -> str:
        """Where smg calls worker ``name``: its gateway listener in a secured cluster, else its port."""
        return self.procs[name].gateway_address or self.address(name)

    def address(self, name: str) -> str:
        return self.procs[name].address

    @property
    def router_address(self) -> str:
        return self.address(self.topology.router.name)

    @property
    def openai_base_url(self) -> str:
        """``http://HOST:PORT/v1`` of the topology's smg process (KeyError without one)."""
        smg = self.topology.by_role("smg")
        if not smg:
            raise KeyError(f"topology {self.topology.name!r} has no smg process")
        return f"http://{self.address(smg[0].name)}/v1"

    def metrics_endpoints(self, role: str | None = None) -> dict[str, str]:
        """Every metrics endpoint (``HOST:PORT``), by ``name`` or ``name/dp<r>`` (a prefill's
        workers), optionally of one role only; empty when metrics are off."""
        return {
            name if key == "" else f"{name}/{key}": f"{proc.ip}:{port}"
            for name, proc in self.procs.items()
            if (role is None and proc.spec.role != "smg") or proc.spec.role == role  # smg's are not pdgrpc's
            for key, port in proc.metrics_ports.items()
        }

    def bootstrap_address(self, prefill_name: str) -> str:
        spec = self.procs[prefill_name].spec
        return self.address(spec.bootstrap) if spec.bootstrap else self.address(prefill_name)

    def local_socket(self, name: str) -> str:
        """The local socket (:mod:`pdgrpc.rpc.local`) the prefill or decode ``name`` serves and
        a router on its host calls it at, whatever the security (the socket takes its
        user's processes alone, as the router); "" when no router on its host calls it,
        when its args set ``local-socket``, or without ``local_sockets``."""
        proc = self.procs[name]
        if not self.local_sockets or "local-socket" in proc.spec.args or not any(
            name in (*r.prefill, *r.decode) and self._same_host(r.name, name) for r in self.topology.by_role("router")
        ):
            return ""
        self._sockets = True
        return str(self._socket_dir / f"{name}.sock")

    def _same_host(self, a: str, b: str) -> bool:
        return self.procs[a].ip == self.procs[b].ip

    def _flags(self, proc: Proc) -> list[str]:
        spec = proc.spec
        out = ["--host", proc.ip, "--port", str(proc.port), *self.credentials.flags(spec.name)]
        if proc.ip != HOST and (not self.credentials.flags(spec.name) or "" in proc.metrics_ports):
            # A [network] host is a namespace on the launcher's private bridge; without
            # [security] its servers listen there in plaintext, and its metrics endpoint
            # (plain HTTP) always does, which they refuse unless told.
            out.append("--insecure")
        if "" in proc.metrics_ports:
            out += ["--metrics-port", str(proc.metrics_ports[""]), "--metrics-host", proc.ip]
        if proc.gateway_address is not None:
            out += ["--gateway-listen", proc.gateway_address]
        if spec.role in ("prefill", "decode"):
            out += ["--transport", self.transport, *flags(self.topology.engine)]
            local = self.local_socket(spec.name)
            if local:
                out += ["--local-socket", local]
            if self.credentials.smg_room_key is not None:
                out += ["--smg-room-key-file", str(self.credentials.smg_room_key)]
            if proc.ip != HOST:  # on a host: the data plane listens on (and advertises) the host's address
                out += ["--transport-host", proc.ip]
        etcd = self.topology.etcd
        out += discovery_flags(self.topology, spec, None if etcd is None else self.address(etcd.name), self.credentials.etcd_flags(spec.name))
        if spec.role == "colocated":
            out += flags(self.topology.engine)
        if spec.role == "prefill" and spec.bootstrap:
            out += ["--bootstrap", self.address(spec.bootstrap)]
        if spec.role == "router":
            for name in spec.prefill:
                p = self.procs[name].spec
                extra = f",bootstrap={self.address(p.bootstrap)}" if p.bootstrap else ""
                local = self.local_socket(name) if self._same_host(spec.name, name) else ""
                out += ["--prefill", self.address(name) + extra + (f",local={local}" if local else "")]
            for name in spec.decode:
                local = self.local_socket(name) if self._same_host(spec.name, name) else ""
                out += ["--decode", self.address(name) + (f",local={local}" if local else "")]
            if self.topology.engine.get("model"):  # the router tokenizes with the served checkpoint's tokenizer
                out += ["--model", str(self.topology.engine["model"])]
            if "max-prompt-tokens" in self.topology.engine:  # refused at the router, not after forwarding
                out += ["--max-prompt-tokens", str(self.topology.engine["max-prompt-tokens"])]
        return out + flags(spec.args)

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> "Cluster":
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._failed = True
        await self.stop()

    async def start(self, port_retries: int = 3) -> None:
        """Start every process, then wait until all are healthy (see the module doc).

        Ports are picked here and bound by the children a moment later; when a child
        dies because another program took its port in between, the whole cluster is
        stopped and started again on fresh ports, up to ``port_retries`` times."""
        for attempt in range(port_retries + 1):
            self._failed = False  # a lost port race that the next attempt recovers is no failure
            try:
                await self._start_once()
                return
            except ChildDied as exc:
                if attempt == port_retries or not _lost_port_race(exc.proc):
                    raise
                log.warning(
                    "topology %r: %s could not bind its port (taken since it was picked); restarting on fresh ports",
                    self.topology.name, exc.proc.spec.name,
                )
                for proc in self.procs.values():  # keep the failed attempt's logs aside
                    with contextlib.suppress(OSError):
                        proc.log_path.rename(proc.log_path.with_suffix(f".attempt{attempt + 1}.log"))
                self._assign_ports()
                self._stopping = False

    async def _start_once(self) -> None:
        loop = asyncio.get_running_loop()
        self._died = loop.create_future()
        self._running = False
        # smg last, once its workers answer: smg's first health check of a worker that is
        # not up yet fails, and smg then waits out its retry delay before it is ready.
        first = [p for p in self.procs.values() if p.spec.role != "smg"]
        last = [p for p in self.procs.values() if p.spec.role == "smg"]
        try:
            if self._sockets:  # private to this user: its servers refuse a directory others may enter
                self._socket_dir.mkdir(mode=0o700, exist_ok=True)
            for group in (first, last):
                began = time.monotonic()
                for proc in group:
                    await self._spawn(proc)
                await self._wait_healthy(group)
            if last:
                log.info("topology %r: smg ready %.2f s after its start", self.topology.name, time.monotonic() - began)
        except BaseException:
            self._failed = True
            await self.stop()
            raise
        self._running = True
        self._write_state()

    async def _spawn(self, proc: Proc) -> None:
        with open(proc.log_path, "ab") as log_file:
            log_file.write(f"$ {' '.join(proc.argv)}\n".encode())
            log_file.flush()
            proc.process = await spawn(guarded_argv(proc.argv), stdout=log_file, stderr=log_file, env=self._env, new_session=True)
        proc.started_at = time.monotonic()
        self._watchers.append(asyncio.ensure_future(self._watch(proc, proc.process)))

    async def _watch(self, proc: Proc, process: Spawned) -> None:
        await process.wait()
        if self._stopping or proc.restarting or self._died is None or self._died.done():
            return
        if not (self.supervise and self._running and proc.spec.restart):
            self._died.set_result(proc)
            return
        ran = time.monotonic() - proc.started_at
        if process.returncode != 0:  # 0: it drained and stopped as asked (SIGTERM, Drain), no crash
            proc.quick_exits = proc.quick_exits + 1 if ran < STABLE_S else 0
        delay = 0.0 if process.returncode == 0 or proc.quick_exits <= 1 else min(BACKOFF_S * 2 ** (proc.quick_exits - 2), BACKOFF_MAX_S)
        why = f"exited with code {process.returncode} after {ran:.1f} s; restarting it" + (f" in {delay:.1f} s" if delay else "")
        log.warning("topology %r: %s %r (pid %d) %s", self.topology.name, proc.spec.role, proc.spec.name, process.pid, why)
        with open(proc.log_path, "ab") as log_file:
            log_file.write(f"[cluster] {why}\n".encode())
        # Whatever is left of its process group (a prefill's DP workers) goes first.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.sleep(delay)
        if self._stopping or proc.restarting:
            return
        await self._spawn(proc)
        proc.restarts += 1
        self._write_state()

    def _write_state(self) -> None:
        """``LOG_DIR/cluster.json``: each process's role, address and pid (what
        ``python -m pdgrpc.cluster restart`` reads)."""
        c = self.client_security
        state = {
            "processes": {name: self._state_of(p) for name, p in self.procs.items()},
            "client": {k: None if v is None else str(v) for k, v in (("cert", c.cert), ("key", c.key), ("ca", c.ca), ("token_file", c.token_file))},
        }
        tmp = self.log_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.log_dir / STATE_FILE)

    @staticmethod
    def _state_of(p: Proc) -> dict[str, Any]:
        gateway = {} if p.gateway_address is None else {"gateway_address": p.gateway_address}
        return {"role": p.spec.role, "address": p.address, "pid": p.pid, **gateway}

    async def restart(self, name: str, timeout: float = 60.0) -> None:
        """Restart process ``name`` gently: SIGTERM (it drains: new requests go elsewhere,
        the running ones finish), wait for its exit (SIGKILL after ``timeout`` s), start it
        again on the same port and wait until it is healthy."""
        proc = self.procs[name]
        process = proc.process
        if process is None:
            raise ClusterError(f"process {name!r} was never started")
        proc.restarting = True
        try:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("topology %r: %r did not drain within %.0f s: SIGKILL", self.topology.name, name, timeout)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            with open(proc.log_path, "ab") as log_file:
                log_file.write(f"[cluster] restart: drained, exited with code {process.returncode}; starting it again\n".encode())
            proc.restarts += 1
            await self._spawn(proc)
        finally:
            proc.restarting = False
        self._write_state()
        await self.wait_serving(name)

    async def wait_serving(self, name: str) -> None:
        """Wait until process ``name`` (as started last) answers SERVING, bounded by
        ``start_timeout``; raises :class:`ChildDied` if it exits meanwhile."""
        proc = self.procs[name]
        deadline = time.monotonic() + self.start_timeout
        while not await self._serving(proc):
            if proc.returncode is not None:
                raise ChildDied(proc)
            if time.monotonic() > deadline:
                raise ClusterError(f"process {name!r} not healthy within {self.start_timeout:.0f} s:\n{proc.log_tail(15)}")
            await asyncio.sleep(0.2)

    async def _wait_healthy(self, procs: list[Proc]) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = {p.spec.name: p for p in procs}
        while waiting:
            self.check()
            results = await asyncio.gather(*(self._serving(p) for p in waiting.values()))
            for name, ok in zip(list(waiting), results):
                if ok:
                    del waiting[name]
            if not waiting:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.spec.name} ({p.log_path}):\n{p.log_tail(15)}" for p in waiting.values())
                raise ClusterError(
                    f"topology {self.topology.name!r}: {sorted(waiting)} not healthy within {self.start_timeout:.0f} s\n{tails}"
                )
            await asyncio.sleep(0.2)

    async def _serving(self, proc: Proc) -> bool:
        if proc.spec.role == "etcd":
            return await asyncio.to_thread(etcd_healthy, proc.ip, proc.port, self.credentials.etcd)
        # A prefill controller reports NOT_SERVING until its DP workers are ready; its ready
        # line (printed at the same moment) is checked too, as the documented signal.
        if proc.spec.role == "prefill" and not proc.log_has_line(_PREFILL_READY):
            return False
        if proc.spec.role == "smg":
            return await readiness(HOST, proc.port)
        stub = health_pb2_grpc.HealthStub(self._channel(proc.address, LAUNCHER))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def check(self) -> None:
        """Raise :class:`ChildDied` if a process exited while the cluster should run."""
        if self._died is not None and self._died.done():
            raise ChildDied(self._died.result())

    async def wait_failure(self) -> ChildDied:
        """Wait until a process exits unexpectedly; returns the error describing it."""
        assert self._died is not None, "start() first"
        return ChildDied(await asyncio.shield(self._died))

    async def stop(self) -> None:
        """Stop every process: SIGTERM (router first), then SIGKILL after ``grace`` s."""
        self._stopping = True
        order = sorted(self.procs.values(), key=lambda p: {"smg": 0, "router": 0, "colocated": 0, "decode": 1, "prefill": 2, "bootstrap": 3, "etcd": 4}[p.spec.role])
        for proc in order:
            if proc.process is not None and proc.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self._reap(p) for p in order))
        for w in self._watchers:
            w.cancel()
        self._watchers.clear()
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._tidy_logs()

    def _tidy_logs(self) -> None:
        if not self._own_log_dir or not self.log_dir.exists():
            return
        if self.keep_logs or self._failed or (self._died is not None and self._died.done()):
            log.info("topology %r: logs kept in %s", self.topology.name, self.log_dir)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    async def _reap(self, proc: Proc) -> None:
        if proc.process is None:
            return
        try:
            await asyncio.wait_for(proc.process.wait(), self.grace)
        except asyncio.TimeoutError:
            with open(proc.log_path, "ab") as log:
                log.write(f"[cluster] no exit {self.grace:.0f} s after SIGTERM: SIGKILL\n".encode())
        # Whatever is left of the process group (a prefill's DP workers) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.process.pid, signal.SIGKILL)
        await proc.process.wait()

    # ---- what the servers hold ----------------------------------------------------------

    def _channel(self, address: str, present: str) -> grpc.aio.Channel:
        ch = self._channels.get((address, present))
        if ch is None:
            ch = self._channels[(address, present)] = self._security_for(address, present).channel(address)
        return ch

    def channel(self, name: str, present: str = LAUNCHER) -> grpc.aio.Channel:
        """A channel to process ``name`` (owned by the cluster: closed on stop), presenting
        the credentials of process ``present`` (its role, docs/security.md), by default
        the launcher's own (a router's)."""
        return self._channel(self.address(name), present)

    async def stats(self, name: str) -> common_pb2.ResourceStats:
        """``GetStats`` of a prefill or decode process: what it holds right now."""
        role = self.procs[name].spec.role
        stub: Any
        if role == "prefill":
            stub = prefill_pb2_grpc.PrefillServiceStub(self.channel(name))
        elif role == "decode":
            stub = decode_pb2_grpc.DecodeServiceStub(self.channel(name))
        else:
            raise ClusterError(f"process {name!r} is a {role}: only prefill and decode have GetStats")
        reply = await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5.0)
        return reply.stats

    def describe(self) -> str:
        security = "" if self.tls == self.auth_token == "off" else f", tls {self.tls}, auth token {self.auth_token}"
        lines = [f"topology {self.topology.name} (transport {self.transport}{security}); logs in {self.log_dir}"]
        for p in self.procs.values():
            pid = "" if p.pid is None else f"  pid {p.pid}"
            lines.append(f"  {p.spec.name:<12} {p.spec.role:<9} {p.address}{pid}")
            if p.gateway_address is not None:
                lines.append(f"  {'':<12} {'':<9} gateway listener (smg's, loopback): {p.gateway_address}")
            for key, port in p.metrics_ports.items():
                what = "metrics" if key == "" else f"metrics {key}"
                lines.append(f"  {'':<12} {'':<9} {what}: http://{p.ip}:{port}/metrics")
        c = self.client_security
        if c.cert is not None or c.token_file is not None:
            shown = [f"{flag} {path}" for flag, path in (("--tls-cert", c.cert), ("--tls-key", c.key), ("--tls-ca", c.ca),
                                                         ("--auth-token-file", c.token_file)) if path is not None]
            lines.append(f"  clients present: {' '.join(shown)}")
        if self.credentials.smg_api_key is not None:
            lines.append(f"  smg's clients present: Authorization: Bearer <the key in {self.credentials.smg_api_key}>")
        return "\n".join(lines)


async def restart_running(log_dir: str | Path, name: str, timeout: float = 120.0) -> str:
    """Restart process ``name`` of the cluster that ``python -m pdgrpc.cluster`` runs with
    ``log_dir``: SIGTERM makes it drain and exit, its launcher (which supervises) starts it
    again; returns once the new process answers SERVING. The message says what happened."""
    path = Path(log_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ClusterError(f"{path}: no running cluster's state here ({exc}); give the --log-dir the cluster runs with") from None
    procs = state["processes"]
    if name not in procs:
        raise ClusterError(f"no process {name!r} in {path}; processes: {', '.join(sorted(procs))}")
    old = procs[name]["pid"]
    if procs[name]["role"] in ("etcd", "smg"):
        raise ClusterError(f"process {name!r} is a {procs[name]['role']}: only pdgrpc servers drain")
    try:
        os.kill(old, signal.SIGTERM)
    except ProcessLookupError:
        raise ClusterError(f"process {name!r} (pid {old}) is not running") from None
    client = {k: None if v is None else Path(v) for k, v in state["client"].items()}
    channel = Security(cert=client["cert"], key=client["key"], ca=client["ca"], token_file=client["token_file"]).channel(procs[name]["address"])
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            with contextlib.suppress(OSError, ValueError):
                now = json.loads(path.read_text())["processes"][name]["pid"]
                if now != old:
                    try:
                        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    except grpc.RpcError:
                        continue
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return f"{name}: drained (pid {old}), restarted (pid {now}), serving on {procs[name]['address']}"
    finally:
        await channel.close()
    raise ClusterError(f"{name}: not serving again within {timeout:.0f} s of its SIGTERM (is the launcher running, and supervising it?)")
