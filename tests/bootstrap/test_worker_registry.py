"""WorkerRegistry, pure: topology fixed by the first complete registration, generations,
completeness."""

from __future__ import annotations

import tracemalloc

import pytest

from pdgrpc.bootstrap.errors import InvalidBootstrapRequest, PendingWorkersFull, TopologyMismatch, WorkersPending
from pdgrpc.bootstrap.registry import MAX_CANDIDATES, MAX_PENDING_WORKERS, MAX_WORKERS, WorkerRegistry
from pdgrpc.rpc.limits import MAX_ADDRESS_CHARS, MAX_COMPATIBILITY_HASH_BYTES, MAX_NAME_CHARS, MAX_TRANSPORT_ENDPOINT_BYTES
from pdgrpc.v1 import bootstrap_pb2 as pb


def info(**over: object) -> pb.ParallelInfo:
    base = dict(
        tp_size=2, dp_size=2, pp_size=1, page_size=16, kv_dtype="bfloat16", kv_layout="L",
        compatibility_hash=b"\x01\x02", load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN,
    )
    base.update(over)
    return pb.ParallelInfo(**base)  # type: ignore[arg-type]


def worker(dp: int, tp: int, addr: str = "") -> pb.WorkerInfo:
    return pb.WorkerInfo(dp_rank=dp, tp_rank=tp, transfer_address=addr or f"w{dp}-{tp}:7000", transport="fake")


def test_pending_until_every_worker_registered() -> None:
    r = WorkerRegistry()
    with pytest.raises(WorkersPending, match=r"0 of \? workers"):
        r.parallel_info()
    assert r.dp_size is None
    for n, (dp, tp) in enumerate([(0, 0), (0, 1), (1, 0)], start=1):
        assert r.register(worker(dp, tp), info()) == (1, n, 4)
        with pytest.raises(WorkersPending, match=f"{n} of 4 workers registered"):
            r.parallel_info()
        with pytest.raises(WorkersPending):
            r.workers(0)
    assert r.dp_size is None  # not fixed until complete
    r.register(worker(1, 1), info())
    assert r.dp_size == 2
    assert r.parallel_info() == info()
    assert [w.transfer_address for w in r.workers(1)] == ["w1-0:7000", "w1-1:7000"]
    assert [w.tp_rank for w in r.workers(0, [1])] == [1]


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("tp_size", 4, "the instance has 2, this worker has 4"),
        ("kv_dtype", "float16", "the instance has 'bfloat16', this worker has 'float16'"),
        ("compatibility_hash", b"\xff", "the instance has 0x0102, this worker has 0xff"),
        ("load_balance_method", pb.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM, "LOAD_BALANCE_METHOD_ROUND_ROBIN, this worker has LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM"),
        ("force_dp_rank_query", True, "the instance has False, this worker has True"),
    ],
)
def test_disagreeing_topology_names_field_and_both_values(field: str, value: object, shown: str) -> None:
    r = WorkerRegistry()
    for dp, tp in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info())
    with pytest.raises(TopologyMismatch) as e:
        r.register(worker(0, 1), info(**{field: value}))
    assert f"parallel_info.{field}" in str(e.value) and shown in str(e.value)
    assert r.registered == 4


def test_a_bogus_first_registrant_cannot_lock_the_real_workers_out() -> None:
    """Audit (issue 16): a standalone bootstrap let the first registrant fix the topology
    (dp_size=7) and then refused the real workers. The first complete registration wins."""
    r = WorkerRegistry()
    r.register(worker(0, 0, "evil:1"), info(dp_size=7))
    for dp, tp in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info())
    assert r.parallel_info() == info()
    assert [w.transfer_address for w in r.workers(0)] == ["w0-0:7000", "w0-1:7000"]
    with pytest.raises(TopologyMismatch, match="dp_size disagrees: the instance has 2, this worker has 7"):
        r.register(worker(3, 0, "evil:1"), info(dp_size=7))


def test_many_bogus_topologies_stay_bounded() -> None:
    """Each pending topology keeps its registrants, whatever the others registered, and
    none is kept once the real topology is fixed."""
    r = WorkerRegistry()
    bogus = [f"evil:{n}" for n in range(3, 3 + 4 * MAX_CANDIDATES)]
    for n, who in enumerate(bogus, start=3):
        r.register(worker(0, 0, who), info(dp_size=n), owner=who)
    assert r.identities() == len(bogus) and r.held == len(bogus)
    assert all(r.registered_by(who) for who in bogus)
    for dp, tp in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info(), owner="real")
    assert r.parallel_info() == info()
    assert r.identities() == 1 and not any(r.registered_by(who) for who in bogus)


def test_expected_sizes_refuse_any_other_topology_from_the_start() -> None:
    r = WorkerRegistry(expect=(2, 2, 1))
    with pytest.raises(TopologyMismatch, match="dp_size disagrees: the instance has 2, this worker has 7"):
        r.register(worker(0, 0), info(dp_size=7))
    assert r.registered == 0


def test_restart_bumps_generation_and_replaces_entry() -> None:
    r = WorkerRegistry()
    assert r.register(worker(0, 0, "a:1"), info(dp_size=1, tp_size=1))[0] == 1
    assert r.register(worker(0, 0, "a:2"), info(dp_size=1, tp_size=1))[0] == 2
    assert r.registered == 1
    (w,) = r.workers(0)
    assert (w.transfer_address, w.generation) == ("a:2", 2)


@pytest.mark.parametrize(
    "w, i, match",
    [
        (worker(2, 0), info(), r"worker.dp_rank 2 is outside \[0, 2\)"),
        (worker(0, 5), info(), r"worker.tp_rank 5"),
        (pb.WorkerInfo(dp_rank=0), info(), "transfer_address"),
        (worker(0, 0, "10.0.0.1"), info(), r"worker.transfer_address: '10.0.0.1' is not HOST:PORT"),
        (worker(0, 0, "h:0"), info(), r"worker.transfer_address: 'h:0' is not HOST:PORT"),
        (worker(0, 0, ":7000"), info(), r"worker.transfer_address: ':7000' is not HOST:PORT"),
        (worker(0, 0), info(page_size=0), "page_size must be >= 1"),
        (worker(0, 0), info(load_balance_method=pb.LOAD_BALANCE_METHOD_UNSPECIFIED), "load_balance_method"),
    ],
)
def test_invalid_registrations(w: pb.WorkerInfo, i: pb.ParallelInfo, match: str) -> None:
    r = WorkerRegistry()
    with pytest.raises(InvalidBootstrapRequest, match=match):
        r.register(w, i)
    assert r.info is None


def test_get_workers_checks_ranks() -> None:
    r = WorkerRegistry()
    r.register(worker(0, 0), info(dp_size=1, tp_size=1))
    with pytest.raises(InvalidBootstrapRequest, match="dp_rank 1"):
        r.workers(1)
    with pytest.raises(InvalidBootstrapRequest, match="tp_rank 3"):
        r.workers(0, [3])


def test_a_topology_over_max_workers_is_refused_before_anything_is_held() -> None:
    """A registrant announcing dp_size=2**20 registered one slot after another, each held
    (with its generation) for good; the sizes' product overflowed the response's count."""
    r = WorkerRegistry()
    for sizes in [dict(dp_size=MAX_WORKERS + 1, tp_size=1), dict(dp_size=256, tp_size=64, pp_size=2), dict(dp_size=2**16, tp_size=2**16, pp_size=2**16)]:
        with pytest.raises(InvalidBootstrapRequest, match=rf"parallel_info: dp_size \d+ x tp_size \d+ x pp_size \d+ = \d+ workers, over the limit of {MAX_WORKERS}"):
            r.register(worker(1, 0), info(**sizes))
    assert r.registered == 0 and r.identities() == 0
    r.register(worker(0, 0), info(dp_size=MAX_WORKERS // 64, tp_size=64))  # the largest topology is fine
    assert r.registered == 1


def test_one_registrant_cycling_topologies_holds_a_bounded_amount() -> None:
    """Each pending topology kept its workers, and every slot ever named kept a
    generation: one registrant announcing topology after topology, each with slots the
    others lack, made the bootstrap hold up to MAX_CANDIDATES times the largest one. At
    most MAX_WORKERS workers are pending, all topologies together."""
    r = WorkerRegistry()
    most = 0
    for k in range(1, 13):  # dp_size x tp_size = 2048 x 2, 1024 x 4, ..., 1 x 4096
        tp_size = 2**k
        for tp in range(tp_size // 2, tp_size):  # slots no other of these topologies has
            for dp in range(MAX_WORKERS // tp_size):  # never complete
                r.register(worker(dp, tp, "evil:1"), info(dp_size=MAX_WORKERS // tp_size, tp_size=tp_size), owner="evil")
                most = max(most, r.held)
    assert most <= MAX_WORKERS
    for dp, tp in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info(), owner="real")
    assert [w.transfer_address for w in r.workers(1)] == ["w1-0:7000", "w1-1:7000"]
    assert r.held == 4 and r.identities() == 1


def test_a_dropped_pending_topology_takes_its_generations_along() -> None:
    r = WorkerRegistry()
    assert r.register(worker(0, 0, "evil:1"), info(dp_size=7))[0] == 1
    for n in range(MAX_CANDIDATES):  # push the dp_size=7 topology out: a slot of each
        r.register(worker(7 + n, 0, "evil:1"), info(dp_size=8 + n))
    assert r.register(worker(0, 0), info())[0] == 1  # nothing of the dropped entry is left
    assert r.register(worker(0, 0), info())[0] == 2  # a restart still bumps it


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("worker.transfer_address", "h" * 9000, f"9000 characters, over the limit of {MAX_ADDRESS_CHARS}"),
        ("worker.transport", "t" * 9000, f"9000 characters, over the limit of {MAX_NAME_CHARS}"),
        ("worker.transport_endpoint", b"e" * (MAX_TRANSPORT_ENDPOINT_BYTES + 1),
         f"{MAX_TRANSPORT_ENDPOINT_BYTES + 1} bytes, over the limit of {MAX_TRANSPORT_ENDPOINT_BYTES}"),
        ("parallel_info.kv_dtype", "d" * 9000, f"9000 characters, over the limit of {MAX_NAME_CHARS}"),
        ("parallel_info.kv_layout", "l" * 9000, f"9000 characters, over the limit of {MAX_NAME_CHARS}"),
        ("parallel_info.compatibility_hash", b"\x01" * 9000, f"9000 bytes, over the limit of {MAX_COMPATIBILITY_HASH_BYTES}"),
    ],
)
def test_oversized_fields_are_refused_naming_field_and_limit(field: str, value: object, shown: str) -> None:
    """Each was kept whole, logged whole, and repeated (in hex: twice its size) in every
    TopologyMismatch message; even against a fixed topology it is refused for its size."""
    r = WorkerRegistry()
    r.register(worker(0, 0), info(dp_size=1, tp_size=1))
    w, i = worker(0, 0, "h:2"), info(dp_size=1, tp_size=1)
    part, name = field.split(".")
    setattr(w if part == "worker" else i, name, value)
    with pytest.raises(InvalidBootstrapRequest) as e:
        r.register(w, i)
    assert str(e.value) == f"RegisterWorkerRequest.{field}: {shown}"
    (kept,) = r.workers(0)
    assert (kept.transfer_address, kept.generation) == ("w0-0:7000", 1)


def test_another_identity_cannot_pull_a_worker_out_of_its_pending_topology() -> None:
    """A slot belongs to the topology it last announced, but only its own registrant may
    move it: another identity announcing the real workers' slots under a bogus topology
    took them out of the real one, which then never completed."""
    r = WorkerRegistry()
    r.register(worker(0, 0), info(), owner="real")
    r.register(worker(0, 0, "evil:1"), info(dp_size=7), owner="evil")
    for dp, tp in [(0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info(), owner="real")
    assert [w.transfer_address for w in r.workers(0)] == ["w0-0:7000", "w0-1:7000"]
    assert r.identities() == 1


def test_a_registrant_still_moves_its_own_slot_to_another_topology() -> None:
    r = WorkerRegistry()
    assert r.register(worker(0, 0, "h:1"), info(dp_size=7), owner="real")[0] == 1
    assert r.register(worker(0, 0), info(), owner="real")[0] == 2  # a restart with the real sizes
    for dp, tp in [(0, 1), (1, 0), (1, 1)]:
        r.register(worker(dp, tp), info(), owner="real")
    assert r.held == 4


def test_get_workers_refuses_more_tp_ranks_than_the_topology_has_before_building_a_set() -> None:
    """A GetWorkers naming two million tp ranks fits in a message; the registry built a
    set of them all before it looked at one."""
    r = WorkerRegistry()
    r.register(worker(0, 0), info(dp_size=1, tp_size=1))
    ranks = list(range(2_000_000))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidBootstrapRequest, match=r"GetWorkersRequest.tp_ranks: 2000000 ranks, more than tp_size=1"):
            r.workers(0, ranks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes at the peak"
    assert [w.tp_rank for w in r.workers(0, [0])] == [0]


@pytest.mark.parametrize("flood", ["topologies", "workers"])
def test_another_identity_cannot_push_the_real_pending_topology_out(flood: str) -> None:
    """Pending topologies were bounded for all registrants together, the least recently
    updated dropped first: one credential announcing MAX_CANDIDATES topologies (or
    MAX_WORKERS workers) of its own dropped the real workers' pending topology, and the
    real workers, which register once, never completed it."""
    r = WorkerRegistry()
    for dp, tp in [(0, 0), (0, 1), (1, 0)]:
        r.register(worker(dp, tp), info(), owner="real")
    if flood == "topologies":
        for n in range(3, 3 + 4 * MAX_CANDIDATES):  # a slot of each, so none moves the other
            r.register(worker(n - 1, 0, "evil:1"), info(dp_size=n), owner="evil")
    else:
        for dp in range(MAX_WORKERS - 1):  # one short of complete
            r.register(worker(dp, 0, "evil:1"), info(dp_size=MAX_WORKERS, tp_size=1), owner="evil")
    assert r.held <= MAX_PENDING_WORKERS
    assert r.register(worker(1, 1), info(), owner="real") == (1, 4, 4)
    assert [w.transfer_address for w in r.workers(1)] == ["w1-0:7000", "w1-1:7000"]
    assert r.held == 4 and r.identities() == 1


def test_one_identity_over_its_caps_drops_its_own_least_recently_updated_topology() -> None:
    """Each identity holds at most MAX_CANDIDATES pending topologies and MAX_WORKERS
    pending workers; past either, its own least recently updated topology goes."""
    r = WorkerRegistry()
    r.register(worker(0, 0), info(), owner="real")
    for n in range(3, 3 + MAX_CANDIDATES + 1):
        r.register(worker(n - 1, 0, "evil:1"), info(dp_size=n), owner="evil")
    assert r.held == 1 + MAX_CANDIDATES  # evil's dp_size=3 topology went; real's stayed
    for dp in range(MAX_WORKERS - 1):
        r.register(worker(dp, 0, "evil:2"), info(dp_size=MAX_WORKERS, tp_size=1), owner="evil")
    assert r.held == 1 + MAX_WORKERS - 1  # evil's other topologies made room for its largest
    assert r.registered_by("real") and r.registered_by("evil")


def test_pending_workers_of_all_identities_are_bounded_and_the_refusal_names_the_limit() -> None:
    """Past MAX_PENDING_WORKERS pending workers of all identities together, a worker that
    would add one is refused naming the limit, and nothing it sent is held; a restart of a
    held slot, and a worker completing its topology, still register."""
    r = WorkerRegistry()
    big = [info(dp_size=MAX_WORKERS, tp_size=1, page_size=p) for p in (16, 32, 64)]
    for who, topology in (("a", big[0]), ("b", big[1])):
        for dp in range(MAX_WORKERS - 1):
            r.register(worker(dp, 0), topology, owner=who)
    for dp in range(MAX_PENDING_WORKERS - 2 * (MAX_WORKERS - 1)):
        r.register(worker(dp, 0), big[2], owner="c")
    assert r.held == MAX_PENDING_WORKERS
    with pytest.raises(PendingWorkersFull) as e:
        r.register(worker(MAX_WORKERS - 1, 0), big[2], owner="c")
    assert str(e.value) == (
        f"RegisterWorker: {MAX_PENDING_WORKERS} workers of topologies not yet complete are held, the limit for all "
        f"registrants together (MAX_PENDING_WORKERS={MAX_PENDING_WORKERS}); refusing worker dp_rank={MAX_WORKERS - 1} "
        "tp_rank=0 pp_rank=0 of c (one registrant holds at most 4096; they are freed once a topology is complete)"
    )
    assert r.held == MAX_PENDING_WORKERS
    assert r.register(worker(0, 0, "h:999"), big[2], owner="c")[0] == 2  # a restart adds nothing
    assert r.register(worker(MAX_WORKERS - 1, 0), big[0], owner="a") == (1, MAX_WORKERS, MAX_WORKERS)
    assert r.held == MAX_WORKERS and r.identities() == 1
