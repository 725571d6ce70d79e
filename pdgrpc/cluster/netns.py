"""Hosts as Linux network namespaces: several "machines" with their own addresses on one box.

::

    with NetworkHosts(["h1", "h2", "h3"]) as hosts:
        hosts.address("h2")           # "10.77.0.2"
        hosts.exec_prefix("h2")       # ["ip", "netns", "exec", "pd1234a-h2"]: run a command there

Layout: one namespace per host, each with ``lo`` and an ``eth0`` holding its address in
``subnet`` (a /24), plus one more namespace holding only a bridge that every host's
``eth0`` is plugged into (through a veth pair). The subnet exists only inside these
namespaces: the calling namespace gets no address or route into it, so traffic goes only
between the hosts (or to each host's own loopback). Sets never collide with each other,
even on the same subnet: each has its own bridge.

Needs root (CAP_NET_ADMIN) and the ``ip`` command (iproute2). :meth:`NetworkHosts.close`
deletes every namespace (veth pairs go with them), also after a failure half-way through
:meth:`create`; :func:`remove_stale` deletes the sets of processes that died without
cleaning up.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import subprocess
from typing import Sequence

from pdgrpc.errors import ConfigError, PdgrpcError

__all__ = ["DEVICE", "NetnsUnavailable", "NetworkHosts", "netns_unavailable_reason", "remove_stale"]

DEVICE = "eth0"  # each host's interface on the shared subnet (UCX_NET_DEVICES names it)
_PREFIX = "pd"
_counter = itertools.count()
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class NetnsUnavailable(PdgrpcError):
    """Network namespaces cannot be made here (not root, or no iproute2)."""


def netns_unavailable_reason() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is missing"
    return None


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if res.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {res.stderr.strip() or f'exit code {res.returncode}'}")


class NetworkHosts:
    """Named hosts on a private subnet; see the module doc."""

    def __init__(self, hosts: Sequence[str], subnet: str = "10.77.0.0/24") -> None:
        if not hosts or len(set(hosts)) != len(hosts):
            raise ConfigError(f"hosts must be distinct names, got {list(hosts)}")
        for h in hosts:
            if not _NAME.match(h):
                raise ConfigError(f"host name {h!r}: 1-8 lower-case letters and digits, starting with a letter")
        try:
            net = ipaddress.ip_network(subnet)
        except ValueError as exc:
            raise ConfigError(f"[network] subnet {subnet!r}: {exc}") from None
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise ConfigError(f"[network] subnet {subnet!r} must be a private IPv4 /24 (e.g. 10.77.0.0/24)")
        if len(hosts) > 250:
            raise ConfigError("at most 250 hosts")
        self.hosts = tuple(hosts)
        self.subnet = net
        self.tag = f"{_PREFIX}{os.getpid()}{chr(ord('a') + next(_counter) % 26)}"
        self._made: list[str] = []

    def netns(self, host: str) -> str:
        if host not in self.hosts:
            raise ConfigError(f"no host {host!r} (hosts: {', '.join(self.hosts)})")
        return f"{self.tag}-{host}"

    @property
    def bridge_netns(self) -> str:
        return f"{self.tag}-net"

    def address(self, host: str) -> str:
        self.netns(host)
        return str(self.subnet.network_address + 1 + self.hosts.index(host))

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command on ``host`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns(host)]

    def create(self) -> "NetworkHosts":
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        try:
            br = self.bridge_netns
            _ip("netns", "add", br)
            self._made.append(br)
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.netns(host)
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", DEVICE, "netns", ns)
                _ip("-n", br, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", DEVICE)
                _ip("-n", ns, "link", "set", DEVICE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace this set made (idempotent)."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def __enter__(self) -> "NetworkHosts":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, dict[str, str]]:
        return {h: {"netns": self.netns(h), "address": self.address(h)} for h in self.hosts}


def remove_stale() -> list[str]:
    """Delete the namespaces of host sets whose creating process no longer exists."""
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{_PREFIX}(\d+)[a-z]-[a-z0-9]+$", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            removed.append(name)
    return removed
