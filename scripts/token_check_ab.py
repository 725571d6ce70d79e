"""What the server's bearer-token check costs a call: wrapped handlers against a
``grpc.aio`` server interceptor, in one process, calls alternated.

    .venv/bin/python scripts/token_check_ab.py [--calls 400] [--rounds 10]

Three bootstrap servers in this process: ``wrapped`` (the token check as
:func:`pdgrpc.rpc.security.require_token` wraps each handler, today's servers),
``interceptor`` (the check as the ``grpc.aio`` server interceptor it was before
issue 19, reproduced below) and ``no check`` (no token on the server). One client with
the token calls ``QueryDpRanks`` with one room on each in turn, call by call (order
flipped every call), so that load from other processes falls on all three alike.
Printed: per server, the median over rounds of the p50 wall time and of the median
process CPU time per call (client and server are in the same process and the client
is the same, so differences are the servers').
"""

from __future__ import annotations

import argparse
import hmac
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def _main(calls: int, rounds: int) -> None:
    import grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.bootstrap.registry import WorkerRegistry
    from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapServicer, add_bootstrap_servicer
    from pdgrpc.bootstrap.table import RoomTable
    from pdgrpc.rpc import server as rpc_server
    from pdgrpc.rpc.certs import write_token
    from pdgrpc.rpc.channels import ChannelPool
    from pdgrpc.rpc.roles import OPEN_METHODS
    from pdgrpc.rpc.security import AUTH_HEADER, BEARER, Security

    class InterceptorTokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        """The check as it was: a grpc.aio server interceptor (allowed calls only here)."""

        def __init__(self, token: str) -> None:
            self._expected = (BEARER + token).encode()

        async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
            handler = await continuation(details)
            if handler is None or details.method in OPEN_METHODS:
                return handler
            got = next((v for k, v in details.invocation_metadata or () if k == AUTH_HEADER), "")
            if hmac.compare_digest(got.encode() if isinstance(got, str) else bytes(got), self._expected):
                return handler
            raise RuntimeError("this bench's client always sends the token")

    class NoWrapper(Security):
        def server_handler_wrapper(self) -> None:
            return None

    token = write_token(Path(tempfile.mkdtemp()) / "token")
    with_token = Security(token_file=token)
    real_server = grpc.aio.server

    async def start(security: Security, interceptors: list[Any] | None) -> Any:
        servicer = BootstrapServicer(RoomTable(max_rooms=1 << 16, max_batch=1024), WorkerRegistry())
        grpc.aio.server = lambda options=None, **_: real_server(options=options, interceptors=interceptors)
        try:
            return await rpc_server.start_server([(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))], security=security)
        finally:
            grpc.aio.server = real_server

    servers = {
        "wrapped": await start(with_token, None),
        "interceptor": await start(NoWrapper(token_file=token), [InterceptorTokenCheck(with_token.token)]),
        "no check": await start(Security(), None),
    }
    rng = random.Random(1)
    known = [rng.getrandbits(63) | 1 for _ in range(1024)]
    pool = ChannelPool(security=with_token)
    clients = {}
    for name, server in servers.items():
        clients[name] = BootstrapClient(server.address, pool=pool, timeout=10)
        await clients[name].register_dp_ranks({r: 1 for r in known})
    names = list(clients)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    j = 0
    for r in range(rounds + 1):  # round 0 warms up
        w: dict[str, list[float]] = {n: [] for n in names}
        c: dict[str, list[float]] = {n: [] for n in names}
        for i in range(calls):
            for n in names if i % 2 else names[::-1]:
                j += 1
                t0, p0 = time.perf_counter(), time.process_time()
                await clients[n].query_dp_ranks([known[j % len(known)]])
                w[n].append(time.perf_counter() - t0)
                c[n].append(time.process_time() - p0)
        if r:
            for n in names:
                wall[n].append(statistics.median(w[n]) * 1e6)
                cpu[n].append(statistics.median(c[n]) * 1e6)
    print(f"QueryDpRanks, 1 room, token sent; {rounds} rounds x {calls} calls per server, alternated: "
          "p50 wall / median process CPU per call, µs (median of rounds); CPU per round")
    for n in names:
        print(f"  {n:12} {statistics.median(wall[n]):4.0f} / {statistics.median(cpu[n]):4.0f}   {[round(x) for x in cpu[n]]}")
    await pool.close()
    for server in servers.values():
        await server.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    import uvloop

    uvloop.run(_main(args.calls, args.rounds))


if __name__ == "__main__":
    from pdgrpc.rpc.tuning import apply_grpc_defaults

    apply_grpc_defaults()  # as pdgrpc's entry points do, before grpc is imported
    main()
