"""The discovery flags every server takes, and what they build.

``--discovery etcd://HOST:PORT[,...]`` turns discovery on (``etcds://`` for TLS, with
``--discovery-ca``, ``--discovery-cert``/``--discovery-key`` and/or ``--discovery-user``/
``--discovery-password-file``); ``--discovery-ttl`` (lease
seconds), ``--cluster-name`` (the key prefix), ``--instance-id`` (the key's last
segment) and ``--advertise-host`` (the host part of the address peers are told) shape it.
Without ``--discovery`` nothing here runs and the static flags work as before.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdgrpc.argtypes import whole_number
from pdgrpc.discovery.etcd import Registration, Watcher
from pdgrpc.discovery.identity import DialIdentity
from pdgrpc.discovery.etcd_client import EtcdTarget, parse_discovery_url, rpc
from pdgrpc.discovery.record import Instance, MembershipView, check_name, cluster_prefix, instance_key
from pdgrpc.discovery.signing import RecordSigner, RecordVerifier
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.security import current

if TYPE_CHECKING:
    from pdgrpc.rpc.server import RpcServer

__all__ = [
    "DEFAULT_CLUSTER",
    "DEFAULT_TTL_S",
    "add_discovery_arguments",
    "advertised_address",
    "check_discovery_args",
    "etcd_target",
    "membership_watcher",
    "register_on",
    "registration_from_args",
]

log = logging.getLogger("pdgrpc.discovery")

DEFAULT_TTL_S = 10
DEFAULT_CLUSTER = "default"
_WILDCARDS = ("0.0.0.0", "::", "")


_ttl = whole_number(1, "seconds")


def add_discovery_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """Add the discovery flags to a server's parser (``role``: prefill, decode, router, bootstrap)."""
    g = parser.add_argument_group("discovery (etcd; off unless --discovery is given)")
    what = (
        "watch the cluster's prefix in etcd and route to the live, compatible prefill and decode instances "
        "registered there (no --prefill/--decode needed)"
        if role == "router" else
        "register this instance in etcd under a lease, so routers find it; the lease is revoked on a clean shutdown"
    )
    g.add_argument(
        "--discovery", metavar="etcd[s]://HOST:PORT[,HOST:PORT...]", default="",
        help=f"{what}. etcds:// speaks TLS to etcd (give --discovery-ca). Default: off",
    )
    g.add_argument("--discovery-ca", type=Path, metavar="PEM", help="CA certificate that signed etcd's (etcds:// only)")
    g.add_argument(
        "--discovery-cert", type=Path, metavar="PEM",
        help="client certificate presented to etcd (etcds:// only; for etcd's --client-cert-auth)",
    )
    g.add_argument("--discovery-key", type=Path, metavar="PEM", help="private key of --discovery-cert (mode 600)")
    g.add_argument("--discovery-user", default="", metavar="NAME", help="etcd user to authenticate as (etcds:// only)")
    g.add_argument(
        "--discovery-password-file", type=Path, metavar="FILE", help="file holding --discovery-user's password (mode 600)",
    )
    g.add_argument(
        "--cluster-name", default=DEFAULT_CLUSTER, metavar="NAME",
        help="keys live under /pdgrpc/NAME/<role>/<instance id>; instances of other clusters are not seen. "
        "Default: %(default)s",
    )
    if role == "router":
        return
    g.add_argument(
        "--discovery-ttl", type=_ttl, default=DEFAULT_TTL_S, metavar="SECONDS",
        help="lease time to live: a dead instance stops receiving new requests within this time; "
        "keep-alive renews it every third of it. Default: %(default)s",
    )
    g.add_argument(
        "--instance-id", default="", metavar="ID",
        help="this instance's name in etcd (a restart under the same id reappears with a new generation). "
        "Default: <advertise host>-<port>",
    )
    g.add_argument(
        "--advertise-host", default="", metavar="HOST",
        help="host part of the gRPC address written to etcd: an address routers and peers can reach. "
        "Needed when --host is a wildcard (0.0.0.0). Default: --host",
    )


def check_discovery_args(ns: argparse.Namespace) -> None:
    """Validate the discovery flags early (ConfigError naming the flag)."""
    if not ns.discovery:
        return
    etcd_target(ns)
    rpc()  # a missing client fails here, naming what to install
    check_name(ns.cluster_name, "--cluster-name")
    if getattr(ns, "instance_id", ""):
        check_name(ns.instance_id, "--instance-id")
    if hasattr(ns, "advertise_host"):
        _advertise_host(ns)


def etcd_target(ns: argparse.Namespace) -> EtcdTarget:
    """Where etcd is and what this process presents to it, from the flags (ConfigError naming the wrong one)."""
    return parse_discovery_url(ns.discovery).with_files(
        ns.discovery_ca, ns.discovery_cert, ns.discovery_key, ns.discovery_user, ns.discovery_password_file,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _advertise_host(ns: argparse.Namespace) -> str:
    host = ns.advertise_host or ns.host
    if host in _WILDCARDS:
        raise ConfigError(f"--advertise-host: --host is {ns.host!r} (a wildcard); give the address peers reach this host at")
    return host


def advertised_address(ns: argparse.Namespace, bound: str) -> str:
    """``bound`` (HOST:PORT a server listens on) with the advertised host in front."""
    host = _advertise_host(ns)
    port = bound.rpartition(":")[2]
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a DNS name
    return f"{host}:{port}"


def registration_from_args(
    ns: argparse.Namespace,
    role: str,
    bound: str,
    *,
    transport: str = "",
    bootstrap: str = "",
    dp_size: int = 1,
    tp_size: int = 1,
    compat_hash: str = "",
) -> Registration | None:
    """The :class:`Registration` the flags ask for (not started), or None without ``--discovery``.

    ``bound`` is the address the server listens on; its port is advertised with
    ``--advertise-host`` (or ``--host``). ``bootstrap`` (prefill) is advertised as given,
    except that an embedded bootstrap (the same address as ``bound``) gets the advertised
    address too."""
    if not ns.discovery:
        return None
    address = advertised_address(ns, bound)
    data_host = getattr(ns, "transport_host", None)
    if data_host is not None and _is_loopback(data_host) and not _is_loopback(_advertise_host(ns)):
        log.warning(
            "discovery: this %s is advertised at %s, but its data plane at --transport-host %s: peers on other "
            "hosts cannot reach that; give --transport-host an address they can", role, address, data_host,
        )
    if role == "prefill" and (not bootstrap or bootstrap == bound):
        bootstrap = address
    instance_id = ns.instance_id or f"{_advertise_host(ns).strip('[]').replace(':', '.')}-{bound.rpartition(':')[2]}"
    instance = Instance(
        role=role, instance_id=instance_id, address=address, transport=transport, bootstrap=bootstrap,
        dp_size=dp_size, tp_size=tp_size, compat_hash=compat_hash, generation=time.time_ns() // 1000,
    )
    instance.check()
    security = current()
    # Under mTLS the record is signed with this instance's certificate: readers with the CA take nothing else.
    signer = RecordSigner(security.cert, security.key) if security.cert and security.key and security.ca else None
    return Registration(
        etcd_target(ns), instance_key(ns.cluster_name, role, instance_id), instance, ns.discovery_ttl, signer,
    )


def membership_watcher(ns: argparse.Namespace) -> Watcher:
    """The router's watch of ``--cluster-name``'s prefix (not started). Under mTLS (this
    process's installed security has a CA) its view takes only records signed by a
    certificate of that CA naming the record's role, and lists one only once the server
    at its address shows the signer's key (:mod:`pdgrpc.discovery.identity`)."""
    security = current()
    prefix = cluster_prefix(ns.cluster_name)
    if security.ca is None:
        return Watcher(etcd_target(ns), MembershipView(prefix))
    view = MembershipView(prefix, RecordVerifier(security.ca).open, prove=True)
    return Watcher(etcd_target(ns), view, identity=DialIdentity(security.ca, security.cert, security.key))


def register_on(server: "RpcServer", registration: Registration | None) -> None:
    """Start ``registration`` (if any) and revoke its lease as soon as ``server`` begins
    to drain or stop (routers stop choosing it at once)."""
    if registration is None:
        return
    registration.start()
    server.on_drain(registration.close)
