"""Placing a topology's processes on hosts (network namespaces) and wiring discovery.

:class:`~pdgrpc.cluster.launcher.Cluster` asks here, per process: which address it has
(its host's, or 127.0.0.1), which command prefix runs it there (``ip netns exec``), the
etcd command line for the ``etcd`` role, and the discovery flags every server gets when
the topology has an etcd process (``--discovery``, ``--cluster-name`` = the topology's
name, ``--instance-id`` = the process name).

The hosts themselves are made by :class:`~pdgrpc.cluster.netns.NetworkHosts`;
``python -m pdgrpc.cluster`` makes them, then runs the launcher on the front door's host,
handing it the host map in ``PDGRPC_HOSTS`` (JSON ``{"h1": {"netns": ..., "address": ...}}``).
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from pdgrpc.cluster.topology import ProcessSpec, Topology
from pdgrpc.errors import ConfigError

__all__ = ["HOSTS_ENV", "HostMap", "discovery_flags", "hosts_from_env", "place"]

HOSTS_ENV = "PDGRPC_HOSTS"
HostMap = Mapping[str, Mapping[str, str]]  # host -> {"netns": name, "address": ip}


def hosts_from_env(topology: Topology) -> HostMap | None:
    """The host map for ``topology`` (None when it has no [network]); ConfigError when the
    hosts were not made (the launcher must run through ``python -m pdgrpc.cluster``)."""
    if not topology.subnet:
        return None
    raw = os.environ.get(HOSTS_ENV)
    if not raw:
        raise ConfigError(
            f"topology {topology.name!r} places processes on hosts: start it with `python -m pdgrpc.cluster "
            f"{topology.path or topology.name}` (it makes the network namespaces), or pass hosts="
        )
    hosts: HostMap = json.loads(raw)
    missing = set(topology.hosts) - set(hosts)
    if missing:
        raise ConfigError(f"{HOSTS_ENV} lacks hosts {sorted(missing)}")
    return hosts


def place(spec: ProcessSpec, hosts: HostMap | None, default: str) -> tuple[str, list[str]]:
    """``(address, argv prefix)`` of ``spec``'s process."""
    if hosts is None or not spec.host:
        return default, []
    h = hosts[spec.host]
    return h["address"], ["ip", "netns", "exec", h["netns"]]


def discovery_flags(topology: Topology, spec: ProcessSpec, etcd_address: str | None, etcd_tls: Sequence[str] = ()) -> list[str]:
    """Discovery flags of a server process (none without an etcd process); ``etcd_tls``:
    the process's ``--discovery-ca/cert/key`` flags when etcd serves TLS."""
    if etcd_address is None or spec.role not in ("bootstrap", "prefill", "decode", "router"):
        return []
    if spec.role == "router" and (spec.prefill or spec.decode):
        return []  # a router with static lists routes to those
    scheme = "etcds" if etcd_tls else "etcd"
    out = ["--discovery", f"{scheme}://{etcd_address}", *etcd_tls, "--cluster-name", topology.name.replace("_", "-")]
    if spec.role != "router":
        out += ["--instance-id", spec.name]
    return out
