"""The etcd record and the router's membership view (pure: no etcd here)."""

from __future__ import annotations

import logging

import grpc
import pytest

from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key
from pdgrpc.errors import ConfigError, RequestFailed
from pdgrpc.router.service import GenerateServicer, RouterConfig

PREFIX = cluster_prefix("c1")


def _inst(role: str, iid: str, *, compat: str = "aa" * 32, transport: str = "tcp", port: int = 7000, gen: int = 1) -> Instance:
    bootstrap = f"10.0.0.2:{port}" if role == "prefill" else ""
    return Instance(role=role, instance_id=iid, address=f"10.0.0.2:{port}", transport=transport, bootstrap=bootstrap,
                    compat_hash=compat, generation=gen)


def _put(view: MembershipView, inst: Instance, rev: int) -> None:
    view.put(instance_key("c1", inst.role, inst.instance_id), inst.to_json(), rev)


def test_record_round_trips_through_json() -> None:
    inst = _inst("prefill", "p1")
    assert Instance.from_json(inst.to_json()) == inst


@pytest.mark.parametrize(
    "value, why",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"format": 2}', "format 2"),
        (b'{"format": 1, "role": "decode", "instance_id": "d", "address": "x"}', "not HOST:PORT"),
        (b'{"format": 1, "role": "decode", "instance_id": "d", "address": "0.0.0.0:1", "transport": "tcp", "compat_hash": "a"}', "wildcard"),
        (b'{"format": 1, "role": "decode", "instance_id": "d", "address": "h:1", "dp_size": "2", "transport": "t", "compat_hash": "a"}', "dp_size"),
        (b'{"format": 1, "role": "decode", "instance_id": "d", "address": "h:1", "evil": 1}', "unknown fields"),
        (b'{"format": 1, "role": "decode", "instance_id": "d", "address": "h:1"}', "needs transport and compat_hash"),
    ],
)
def test_bad_records_are_refused_saying_why(value: bytes, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        Instance.from_json(value)


def test_bad_values_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    view = MembershipView(PREFIX)
    _put(view, _inst("decode", "d1"), 5)
    caplog.set_level(logging.WARNING, "pdgrpc.discovery")
    for _ in range(3):  # the same bad value seen again (a relisting) is not logged again
        view.put(PREFIX + "decode/junk", b"\xff\x00garbage", 6)
        view.put(PREFIX + "decode/d2", _inst("decode", "other").to_json(), 7)  # key and record disagree
        view.put("/pdgrpc/c1/cache/x", b"{}", 8)  # not a role of ours
    assert [i.instance_id for i in view.instances("decode")] == ["d1"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert any("decode/junk ignored: not JSON" in w for w in warnings)
    assert any("record says decode/other, key says decode/d2" in w for w in warnings)


def test_incompatible_instance_is_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    view = MembershipView(PREFIX)
    _put(view, _inst("prefill", "p1"), 5)  # the oldest: its hash is the cluster's
    _put(view, _inst("decode", "d1"), 6)
    _put(view, _inst("decode", "d2", compat="bb" * 32), 7)
    _put(view, _inst("decode", "d3", transport="rdma"), 8)
    caplog.set_level(logging.WARNING, "pdgrpc.discovery")
    for _ in range(3):
        assert [i.instance_id for i in view.instances("decode")] == ["d1"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("differs from the cluster's" in w for w in warnings), warnings


def test_relisting_drops_what_left_while_the_watch_was_down() -> None:
    view = MembershipView(PREFIX)
    _put(view, _inst("decode", "d1"), 5)
    _put(view, _inst("decode", "d2"), 6)
    d2 = _inst("decode", "d2", gen=2)  # restarted meanwhile: a new generation
    view.reset([(instance_key("c1", "decode", "d2"), d2.to_json(), 9)])
    assert view.instances("decode") == [d2]


def test_router_routes_only_to_live_instances_of_the_view() -> None:
    view = MembershipView(PREFIX)
    servicer = GenerateServicer(RouterConfig(prefills=(), decodes=(), discovery=True), view=view)
    with pytest.raises(RequestFailed) as info:
        servicer.pick(())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no live prefill" in info.value.message
    _put(view, _inst("prefill", "p1", port=7001), 5)
    _put(view, _inst("decode", "d1", port=7002), 6)
    _put(view, _inst("decode", "d2", port=7003), 7)
    picks = {servicer.pick(())[1] for _ in range(4)}
    assert picks == {"10.0.0.2:7002", "10.0.0.2:7003"}
    view.delete(instance_key("c1", "decode", "d2"))
    assert {servicer.pick(())[1] for _ in range(4)} == {"10.0.0.2:7002"}
    prefill, _ = servicer.pick(())
    assert (prefill.address, prefill.bootstrap) == ("10.0.0.2:7001", "10.0.0.2:7001")


def test_a_data_plane_left_on_loopback_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import argparse

    from pdgrpc.discovery.cli import add_discovery_arguments, registration_from_args
    from pdgrpc.serving.flags import add_transport_arguments

    parser = argparse.ArgumentParser()
    add_transport_arguments(parser)
    add_discovery_arguments(parser, "decode")
    caplog.set_level(logging.WARNING, "pdgrpc.discovery")
    common = ["--discovery", "etcd://10.0.0.1:2379", "--transport", "tcp"]
    ns = parser.parse_args([*common, "--advertise-host", "10.0.0.3"])
    ns.host = "0.0.0.0"
    reg = registration_from_args(ns, "decode", "0.0.0.0:7000", transport="tcp", compat_hash="ab")
    assert reg is not None and reg.instance.address == "10.0.0.3:7000" and reg.instance.instance_id == "10.0.0.3-7000"
    assert any("--transport-host 127.0.0.1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    ns = parser.parse_args([*common, "--advertise-host", "10.0.0.3", "--transport-host", "10.0.0.3"])
    ns.host = "0.0.0.0"
    registration_from_args(ns, "decode", "0.0.0.0:7000", transport="tcp", compat_hash="ab")
    assert not caplog.records
