"""The role facades against the servers' real objects: live gauges follow the objects
they are bound to, events land in the documented series."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pdgrpc.bootstrap.errors import RoomTableFull
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.metrics import BootstrapMetrics, DecodeMetrics, PrefillMetrics, RouterMetrics, ServerAbortReason
from pdgrpc.reasons import ABORT_REASON_LABELS
from pdgrpc.state import AbortReason, NewRequest
from pdgrpc.v1 import common_pb2


@pytest.fixture(scope="module")
def scheduler():
    """A real decode scheduler (not started: no loop, no sockets) on a tiny engine."""
    from pdgrpc.decode.scheduler import DecodeScheduler
    from pdgrpc.engine.config import EngineConfig, ModelConfig
    from pdgrpc.engine.reference import ReferenceEngine
    from pdgrpc.serving.flags import MODEL_SIZES
    from pdgrpc.transport.fake import FakeTransport

    engine = ReferenceEngine(EngineConfig(model=ModelConfig(**MODEL_SIZES["tiny"]), num_pages=32, intra_op_threads=0))
    return DecodeScheduler(engine, FakeTransport(), num_slots=4)


def test_decode_gauges_read_the_scheduler_state_at_scrape_time(serve, scheduler) -> None:
    m = DecodeMetrics(transport="fake")
    m.bind(scheduler.stats)  # the wiring the README gives
    scrape = serve(m.registry)
    s = scrape()
    assert s.value("pdgrpc_metadata_slots_capacity", role="decode") == 4
    assert s.value("pdgrpc_kv_pages_capacity", role="decode") == 32
    assert s.value("pdgrpc_metadata_slots_in_use", role="decode") == 0
    assert s.value("pdgrpc_kv_pages_in_use", role="decode") == 0

    # Allocate for two requests through the scheduler's own queues: nothing told the
    # metrics, and the next scrape still shows it.
    q = scheduler.queues
    q.add(NewRequest(11, "p:1", 3, dp_rank=0), 0.0)
    q.add(NewRequest(12, "p:1", 5, dp_rank=0), 0.0)
    assert len(q.prealloc(0.0)) == 2
    s = scrape()
    assert s.value("pdgrpc_metadata_slots_in_use", role="decode") == 2
    assert s.value("pdgrpc_kv_pages_in_use", role="decode") == 8
    assert s.value("pdgrpc_kv_pages_quarantined", role="decode") == 0

    # Abort one after its handshake: its pages move to quarantine, its slot stays held.
    q.cancel(12, 0.0)
    (aborted,) = q.poll_transfers(0.0)
    assert aborted.awaiting_ack
    s = scrape()
    assert s.value("pdgrpc_kv_pages_in_use", role="decode") == 3
    assert s.value("pdgrpc_kv_pages_quarantined", role="decode") == 5
    assert s.value("pdgrpc_metadata_slots_in_use", role="decode") == 2

    # The prefill acks; the other request is cancelled and acked too: back to zero.
    q.on_abort_ack(12)
    q.cancel(11, 0.0)
    q.poll_transfers(0.0)
    q.on_abort_ack(11)
    q.poll_transfers(0.0)
    assert q.is_idle()
    s = scrape()
    for name in ("pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined", "pdgrpc_active_requests"):
        assert s.value(name, role="decode") == 0, name


def test_prefill_gauges_read_a_resource_stats_proto(serve) -> None:
    # A prefill worker's stats() is a ResourceStats proto: attributes, not a mapping.
    stats = common_pb2.ResourceStats(active_requests=2, pages_in_use=7, pages_total=64, transport_rooms=2)
    m = PrefillMetrics(transport="tcp")
    m.bind(lambda: stats)
    scrape = serve(m.registry)
    s = scrape()
    assert s.value("pdgrpc_kv_pages_in_use", role="prefill") == 7
    assert s.value("pdgrpc_kv_pages_capacity", role="prefill") == 64
    assert s.value("pdgrpc_active_requests", role="prefill") == 2
    # The proto also has slot fields (always 0 on prefill); a prefill has no slots, so
    # they are not exposed for it.
    assert "pdgrpc_metadata_slots_in_use" not in s.families
    stats.pages_in_use = 0
    assert scrape().value("pdgrpc_kv_pages_in_use", role="prefill") == 0


def test_bootstrap_table_size_expirations_and_evictions(serve) -> None:
    table = RoomTable(ttl=10.0, max_rooms=4, max_batch=4, seed=1)
    m = BootstrapMetrics()
    m.bind_table(lambda: table.stats)
    scrape = serve(m.registry)
    table.register([1, 2, 3], [0, 0, 1], now=0.0)
    s = scrape()
    assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 3
    assert s.value("pdgrpc_bootstrap_rooms_capacity", role="bootstrap") == 4
    table.register([4], [1], now=1.0)
    table.query([3, 4], now=1.0)  # a decode found rooms 3 and 4
    table.register([5, 6], [1, 1], now=1.0)  # over the cap: evicts 1 and 2, never queried
    s = scrape()
    assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 4
    assert s.value("pdgrpc_bootstrap_rooms_evicted_total", role="bootstrap") == 2
    assert s.value("pdgrpc_bootstrap_rooms_evicted_full_total", role="bootstrap") == 2
    table.query([5, 6], now=1.0)
    with pytest.raises(RoomTableFull):
        table.register([7], [1], now=1.0)  # every live room is queried: refused
    assert s.value("pdgrpc_bootstrap_rooms_expired_total", role="bootstrap") == 0
    table.expire(now=100.0)
    s = scrape()
    assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 0
    assert s.value("pdgrpc_bootstrap_rooms_expired_total", role="bootstrap") == 4
    assert s.families["pdgrpc_bootstrap_rooms_expired"].type == "counter"


def test_embedded_bootstrap_shares_the_prefill_endpoint(serve) -> None:
    p = PrefillMetrics(transport="tcp")
    b = BootstrapMetrics(p.registry)
    p.on_dp_rank_registration(5)
    b.on_dp_rank_registration(5)
    b.on_dp_rank_query(3, missing=1)
    s = serve(p.registry)()
    assert s.value("pdgrpc_dp_rank_registrations_total", role="prefill", outcome="ok") == 1
    assert s.value("pdgrpc_dp_rank_registrations_total", role="bootstrap", outcome="ok") == 1
    assert s.value("pdgrpc_dp_rank_registration_batch_size_sum", role="prefill") == 5
    assert s.value("pdgrpc_dp_rank_query_rooms_missing_total", role="bootstrap") == 1
    # The bootstrap has no requests of its own: no request series for it.
    assert not s.has("pdgrpc_requests_total", role="bootstrap")


def test_aborted_requests_equal_the_sum_of_aborts_by_reason(serve) -> None:
    m = DecodeMetrics(transport="tcp")
    reasons = [AbortReason.BOOTSTRAP_TIMEOUT, AbortReason.BOOTSTRAP_TIMEOUT, AbortReason.CANCELLED, ServerAbortReason.PREFILL_ERROR]
    for r in reasons:
        m.on_abort(r)
    m.on_finished()
    s = serve(m.registry)()
    by_reason = {label: s.value("pdgrpc_aborts_total", role="decode", reason=label) for label in ABORT_REASON_LABELS}
    assert by_reason["bootstrap_timeout"] == 2
    assert by_reason["cancelled"] == 1
    assert by_reason["prefill_error"] == 1
    assert sum(by_reason.values()) == s.value("pdgrpc_requests_total", role="decode", state="aborted") == 4


def test_latency_buckets_place_fast_and_slow_transfers(serve) -> None:
    m = PrefillMetrics(transport="rdma")
    m.on_transfer(100, 0.0002)  # a small transfer over shared memory
    m.on_transfer(100, 30.0)  # a stalled one
    s = serve(m.registry)()
    le = lambda b: s.value("pdgrpc_transfer_seconds_bucket", role="prefill", transport="rdma", le=b)  # noqa: E731
    assert le("0.0001") == 0
    assert le("0.00025") == 1
    assert le("25.0") == 1
    assert le("60.0") == 2  # the slow one is in a finite bucket, not only in +Inf
    assert s.value("pdgrpc_transfer_bytes_total", role="prefill", transport="rdma") == 200


def test_router_first_token_and_tokens(serve) -> None:
    m = RouterMetrics()
    active = {"active_requests": 1}
    m.bind(lambda: active)
    m.on_first_token(0.12)
    m.on_tokens(16)
    m.on_abort(ServerAbortReason.DECODE_ERROR)
    scrape = serve(m.registry)
    s = scrape()
    assert s.value("pdgrpc_time_to_first_token_seconds_count", role="router") == 1
    assert s.value("pdgrpc_time_to_first_token_seconds_bucket", role="router", le="0.25") == 1
    assert s.value("pdgrpc_time_to_first_token_seconds_bucket", role="router", le="0.1") == 0
    assert s.value("pdgrpc_output_tokens_total", role="router") == 16
    assert s.value("pdgrpc_aborts_total", role="router", reason="decode_error") == 1
    assert s.value("pdgrpc_active_requests", role="router") == 1
    active["active_requests"] = 0
    assert scrape().value("pdgrpc_active_requests", role="router") == 0


def test_server_info_tells_ranks_apart(serve) -> None:
    m = DecodeMetrics(transport="tcp")
    m.set_info(tp_rank=1, tp_size=2)
    s = serve(m.registry)()
    assert s.value("pdgrpc_server_info", role="decode", transport="tcp", tp_rank="1", tp_size="2") == 1


def test_a_failing_snapshot_drops_only_its_own_gauges(serve, caplog: pytest.LogCaptureFixture) -> None:
    d = DecodeMetrics(transport="tcp")
    b = BootstrapMetrics(d.registry)

    def broken() -> dict[str, int]:
        raise RuntimeError("scheduler gone")

    d.bind(broken)
    b.bind_table(lambda: {"size": 9})
    d.on_finished()
    with caplog.at_level(logging.WARNING, logger="pdgrpc.metrics"):
        s = serve(d.registry)()
    assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 9
    assert s.value("pdgrpc_requests_total", role="decode", state="finished") == 1
    assert "pdgrpc_metadata_slots_in_use" not in s.families
    assert any("decode snapshot callable failed" in r.getMessage() for r in caplog.records)


def test_one_snapshot_per_scrape_and_none_before(serve) -> None:
    # All gauges of one scrape come from one snapshot (consistent with each other), and
    # nothing reads the server's objects before the first scrape (they may not be ready).
    calls = []

    def snapshot() -> dict[str, int]:
        calls.append(1)
        return {"slots_in_use": len(calls), "slots_total": len(calls), "pages_in_use": len(calls)}

    m = DecodeMetrics(transport="tcp")
    m.bind(snapshot)
    scrape = serve(m.registry)
    assert calls == []
    for n in (1, 2):
        s = scrape()
        assert len(calls) == n
        assert s.value("pdgrpc_metadata_slots_in_use", role="decode") == n
        assert s.value("pdgrpc_metadata_slots_capacity", role="decode") == n
        assert s.value("pdgrpc_kv_pages_in_use", role="decode") == n


def test_one_snapshot_source_per_role_and_registry() -> None:
    m = DecodeMetrics(transport="tcp")
    m.bind(dict)
    with pytest.raises(ValueError, match="already bound"):
        DecodeMetrics(m.registry, transport="tcp").bind(dict)
    m.unbind()
    m.bind(dict)  # rebinding after unbind is fine (a restarted scheduler)


def test_a_second_facade_of_the_same_role_shares_the_series() -> None:
    # Two facades on one registry must not clash at registration; they count into the same series.
    a = DecodeMetrics(transport="tcp")
    b = DecodeMetrics(a.registry, transport="tcp")
    a.on_finished()
    b.on_finished()
    assert a.registry.get_sample_value("pdgrpc_requests_total", {"role": "decode", "state": "finished"}) == 2


@dataclasses.dataclass
class _Bad:
    pages_in_use: str = "many"


def test_a_non_numeric_snapshot_field_is_left_out(serve) -> None:
    m = PrefillMetrics(transport="tcp")
    m.bind(_Bad)
    s = serve(m.registry)()
    assert "pdgrpc_kv_pages_in_use" not in s.families


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.on_transfer(-1, 0.1),
        lambda m: m.on_transfer(10, -0.5),
        lambda m: m.on_transfer(10, float("nan")),
        lambda m: m.on_dp_rank_query(2, missing=3),
        lambda m: m.on_dp_rank_query(-1),
    ],
)
def test_impossible_values_are_refused(call) -> None:
    m = DecodeMetrics(transport="tcp")
    with pytest.raises(ValueError):
        call(m)


def test_transport_must_be_a_short_name() -> None:
    with pytest.raises(ValueError):
        DecodeMetrics(transport="")
    with pytest.raises(ValueError):
        DecodeMetrics(transport="tcp rdma {x}")


def test_a_dropped_facade_frees_its_registry() -> None:
    # Servers (and tests) create facades freely; the per-registry cache must not keep them.
    import gc
    import weakref

    m = DecodeMetrics(transport="tcp")
    BootstrapMetrics(m.registry).bind_table(dict)
    m.bind(dict)
    ref = weakref.ref(m.registry)
    del m
    gc.collect()
    assert ref() is None
