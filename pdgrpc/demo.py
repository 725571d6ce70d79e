"""``python -m pdgrpc.demo`` (``make demo``): the bootstrap service at work.

Starts the bootstrap service on 127.0.0.1 (a free port) in this process, then, over a
real gRPC channel, the way prefill and decode use it: prefill workers register (the
first fixes the topology; a disagreeing one is refused; a restart bumps the
generation), prefill registers a batch of room → dp rank entries in one call, and
decode asks for them, plus a few unknown rooms, in one call. Exits 0 when every answer
was the expected one.
"""

from __future__ import annotations

import random
import sys

from pdgrpc.rpc.tuning import apply_grpc_defaults

apply_grpc_defaults()  # before grpc is imported (below)

from pdgrpc.bootstrap.client import BootstrapClient  # noqa: E402
from pdgrpc.bootstrap.service import BootstrapConfig, start_bootstrap_server  # noqa: E402
from pdgrpc.rpc.channels import ChannelPool  # noqa: E402
from pdgrpc.rpc.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable  # noqa: E402
from pdgrpc.rpc.server import run  # noqa: E402
from pdgrpc.v1 import bootstrap_pb2 as pb  # noqa: E402

DP, TP = 2, 2


def say(msg: str = "") -> None:
    print(msg, flush=True)


def parallel_info(tp_size: int = TP) -> pb.ParallelInfo:
    return pb.ParallelInfo(
        tp_size=tp_size,
        dp_size=DP,
        pp_size=1,
        page_size=16,
        kv_dtype="bfloat16",
        kv_layout="layer_kv_page_head_dim",
        compatibility_hash=bytes.fromhex("5eed0001"),
        load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN,
    )


def worker(dp: int, tp: int) -> pb.WorkerInfo:
    return pb.WorkerInfo(dp_rank=dp, tp_rank=tp, transfer_address=f"127.0.0.1:{17000 + 10 * dp + tp}", transport="tcp", transport_endpoint=b"demo")


async def main() -> int:
    server = await start_bootstrap_server("127.0.0.1", 0, BootstrapConfig(ttl=120.0))
    pool = ChannelPool()
    try:
        client = BootstrapClient(server.address, pool=pool, timeout=5.0)
        say(f"bootstrap service (pdgrpc.v1.BootstrapService) on {server.address}; health: {await client.health()}")

        say(f"\nprefill instance: dp_size={DP} tp_size={TP} -> {DP * TP} workers register")
        try:
            await client.get_parallel_info()
            raise AssertionError("parallel info before any worker registered")
        except Unavailable as e:
            say(f"  GetParallelInfo before any worker: UNAVAILABLE ({e.details})")
        for dp in range(DP):
            for tp in range(TP):
                r = await client.register_worker(worker(dp, tp), parallel_info())
                say(f"  worker dp{dp}/tp{tp} registered: generation {r.generation}, {r.registered_workers} of {r.expected_workers}")
                if (dp, tp) == (0, 0):
                    try:
                        await client.get_parallel_info()
                    except Unavailable as e:
                        say(f"  GetParallelInfo now: UNAVAILABLE ({e.details})")
        try:
            await client.register_worker(worker(0, 1), parallel_info(tp_size=4))
            raise AssertionError("a worker with another topology was accepted")
        except FailedPrecondition as e:
            say(f"  a worker claiming tp_size=4 is refused: FAILED_PRECONDITION ({e.details})")
        r = await client.register_worker(worker(1, 1), parallel_info())
        say(f"  worker dp1/tp1 restarts and registers again: generation {r.generation}")
        info = (await client.get_parallel_info()).parallel_info
        say(f"  GetParallelInfo: dp={info.dp_size} tp={info.tp_size} page_size={info.page_size} {info.kv_dtype} {pb.LoadBalanceMethod.Name(info.load_balance_method)}")
        ws = await client.get_workers(1)
        say("  GetWorkers(dp_rank=1): " + ", ".join(f"tp{w.tp_rank}@{w.transfer_address} (gen {w.generation})" for w in ws))

        rng = random.Random(7)
        rooms = {rng.getrandbits(63) | 1: rng.randrange(DP) for _ in range(1000)}
        say(f"\nprefill registers {len(rooms):,} rooms -> dp rank in one RegisterDpRanks call")
        reg = await client.register_dp_ranks(rooms)
        say(f"  {reg.added} added, {reg.unchanged} unchanged")
        assert reg.added == len(rooms)

        unknown = [rng.getrandbits(63) | 1 for _ in range(3)]
        asked = list(rooms) + unknown
        say(f"decode asks for {len(asked):,} rooms ({len(unknown)} never registered) in one QueryDpRanks call")
        res = await client.query_dp_ranks(asked)
        say(f"  {len(res.rooms)} found, {len(res.missing)} missing")
        for room in list(rooms)[:3]:
            say(f"    room {room:#018x} -> dp rank {res.ranks[room]}")
        say(f"    missing: {', '.join(f'{m:#018x}' for m in res.missing)}")
        assert res.ranks == rooms and sorted(res.missing) == sorted(unknown)

        first = next(iter(rooms))
        try:
            await client.register_dp_ranks({first: (rooms[first] + 1) % DP})
            raise AssertionError("a room was re-registered with another rank")
        except AlreadyExists as e:
            say(f"  the same room with another rank: ALREADY_EXISTS ({e.details})")
        try:
            await client.register_dp_ranks({0: 1})
            raise AssertionError("room 0 was accepted")
        except InvalidArgument as e:
            say(f"  room 0: INVALID_ARGUMENT ({e.details})")

        stats = server.table.stats
        say("  (timings: python -m pdgrpc.bench bootstrap)")
        say(f"\ndone: the service holds {stats.size:,} rooms ({stats.expired} expired, {stats.evicted} evicted); TTL {server.config.ttl:g} s")
        return 0
    finally:
        await pool.close()
        await server.stop(grace=1.0)


if __name__ == "__main__":
    sys.exit(run(main()))
