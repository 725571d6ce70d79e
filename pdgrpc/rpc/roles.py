"""Which roles may call each RPC: the one table every pdgrpc server enforces.

Every principal of a cluster has one role:

* ``router``: the router (and a colocated front door); also the launcher's own calls;
* ``prefill``: a prefill controller and its workers;
* ``decode``: a decode server and its TP ranks;
* ``bootstrap``: a stand-alone bootstrap server;
* ``gateway``: smg, which drives prefill and decode legs itself;
* ``client``: whoever sends prompts.

A caller's role comes from its client certificate (a URI SAN
``spiffe://pdgrpc/role/<role>``, :data:`ROLE_URI`) under mTLS, and from its bearer token
where the server has the roles' token digests (``--auth-roles-file``). A credential that
names no role (a certificate without the URI, the one shared token of
``--auth-token-file`` alone) is a member of the cluster with every role, as before roles
existed. :data:`CALLERS` is the table; docs/security.md shows it.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["CALLERS", "LOCAL_METHODS", "OPEN_METHODS", "ROLES", "ROLE_URI", "callers"]

ROUTER, PREFILL, DECODE, BOOTSTRAP, GATEWAY, CLIENT = ROLES = ("router", "prefill", "decode", "bootstrap", "gateway", "client")
ROLE_URI = "spiffe://pdgrpc/role/"

# Open to every caller, with or without credentials: probes (kubelets, load balancers)
# carry none, and health says nothing secret.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

_INTERNAL = frozenset({ROUTER, PREFILL, DECODE, BOOTSTRAP, GATEWAY})

# "/service/method", or "/service/" for every method of a service.
CALLERS: Mapping[str, frozenset[str]] = {
    "/pdgrpc.v1.GenerateService/Generate": frozenset({CLIENT}),
    # The router and smg place requests; a prefill controller forwards its share to its workers.
    "/pdgrpc.v1.PrefillService/Prefill": frozenset({ROUTER, GATEWAY, PREFILL}),
    "/pdgrpc.v1.PrefillService/PrefillStream": frozenset({ROUTER, GATEWAY, PREFILL}),
    "/pdgrpc.v1.PrefillService/GetStats": frozenset({ROUTER, PREFILL}),
    "/pdgrpc.v1.PrefillService/SubscribeKvEvents": frozenset({ROUTER, GATEWAY}),
    "/pdgrpc.v1.DecodeService/Decode": frozenset({ROUTER, GATEWAY}),
    "/pdgrpc.v1.DecodeService/GetStats": frozenset({ROUTER}),
    "/pdgrpc.v1.DecodeService/SubscribeKvEvents": frozenset({ROUTER, GATEWAY}),
    # A decode asks a prefill worker for its room's KV.
    "/pdgrpc.v1.HandshakeService/Handshake": frozenset({DECODE}),
    "/pdgrpc.v1.HandshakeService/AbortRoom": frozenset({DECODE}),
    "/pdgrpc.v1.HandshakeService/WatchRoom": frozenset({DECODE}),
    # Prefill workers register; decodes look them up.
    "/pdgrpc.v1.BootstrapService/RegisterWorker": frozenset({PREFILL}),
    "/pdgrpc.v1.BootstrapService/RegisterDpRanks": frozenset({PREFILL}),
    "/pdgrpc.v1.BootstrapService/RecordRoomFailures": frozenset({PREFILL}),
    "/pdgrpc.v1.BootstrapService/GetParallelInfo": frozenset({PREFILL, DECODE}),
    "/pdgrpc.v1.BootstrapService/GetWorkers": frozenset({DECODE}),
    "/pdgrpc.v1.BootstrapService/QueryDpRanks": frozenset({DECODE}),
    "/pdgrpc.v1.BootstrapService/QueryRoomFailures": frozenset({DECODE}),
    "/pdgrpc.v1.DrainService/Drain": frozenset({ROUTER}),
    "/sglang.grpc.scheduler.SglangScheduler/": frozenset({GATEWAY}),
    "/grpc.reflection.v1alpha.ServerReflection/": _INTERNAL,
}

# What a server's local socket (pdgrpc.rpc.local) serves: the router's calls alone. Its
# caller proves only its uid, which makes it the router on this host; every other method
# is refused PERMISSION_DENIED there, as a caller without the role is over gRPC.
LOCAL_METHODS = frozenset({
    "/pdgrpc.v1.PrefillService/Prefill", "/pdgrpc.v1.PrefillService/PrefillStream", "/pdgrpc.v1.DecodeService/Decode",
})


def callers(method: str) -> frozenset[str]:
    """The roles that may call ``method`` (``/service/name``); none for a method the
    table does not name."""
    found = CALLERS.get(method)
    if found is None:
        found = CALLERS.get(method[: method.rfind("/") + 1], frozenset())
    return found
