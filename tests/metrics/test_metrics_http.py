"""The endpoint: real HTTP on 127.0.0.1, the --metrics-port flag, clean start and stop."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdgrpc.metrics import (
    DecodeMetrics,
    RouterMetrics,
    add_metrics_arguments,
    derived_metrics_port,
    start_metrics_from_args,
    start_metrics_server,
)
from pdgrpc.state import AbortReason
from tests.scrape import Scrape

from .conftest import scrape_text


def _metric_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pdgrpc-metrics")]


def _wait_no_extra_threads(before: set[threading.Thread], timeout: float = 2.0) -> set[threading.Thread]:
    deadline = time.monotonic() + timeout
    while True:
        extra = set(threading.enumerate()) - before
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)


def test_events_are_served_over_http_in_prometheus_text(serve) -> None:
    m = DecodeMetrics(transport="tcp")
    m.on_finished()
    m.on_finished()
    m.on_refused()
    m.on_abort(AbortReason.METADATA_CORRUPTION)
    m.on_transfer(4096, 0.002)
    m.on_dp_rank_query(8, missing=3)
    s = serve(m.registry)()
    assert s.value("pdgrpc_requests_total", role="decode", state="finished") == 2
    assert s.value("pdgrpc_requests_total", role="decode", state="refused") == 1
    assert s.value("pdgrpc_requests_total", role="decode", state="aborted") == 1
    assert s.value("pdgrpc_aborts_total", role="decode", reason="metadata_corruption") == 1
    assert s.value("pdgrpc_transfer_bytes_total", role="decode", transport="tcp") == 4096
    assert s.value("pdgrpc_transfer_seconds_count", role="decode", transport="tcp") == 1
    assert s.value("pdgrpc_transfer_seconds_sum", role="decode", transport="tcp") == pytest.approx(0.002)
    assert s.value("pdgrpc_dp_rank_queries_total", role="decode", outcome="ok") == 1
    assert s.value("pdgrpc_dp_rank_query_batch_size_sum", role="decode") == 8
    assert s.value("pdgrpc_dp_rank_query_rooms_missing_total", role="decode") == 3
    # Every family has its help text; the timestamp series prometheus-client adds are left out.
    assert all(f.documentation for f in s.families.values())
    assert "_created" not in s.text


def test_metrics_and_root_path_and_name_filter(serve) -> None:
    m = RouterMetrics()
    m.bind(lambda: {"active_requests": 2})
    port, stop = start_metrics_server(m.registry)
    try:
        only = Scrape(scrape_text(port, "/metrics?name[]=pdgrpc_active_requests"))
        assert list(only.families) == ["pdgrpc_active_requests"]
        assert only.value("pdgrpc_active_requests", role="router") == 2
    finally:
        stop()


def test_stop_joins_every_thread_and_closes_the_port() -> None:
    before = set(threading.enumerate())
    m = DecodeMetrics(transport="fake")
    port, stop = start_metrics_server(m.registry, "127.0.0.1", 0)
    assert _metric_threads(), "the server runs on a named thread"
    for _ in range(5):  # a few scrapes start request threads; stop must reap them too
        scrape_text(port)
    stop()
    assert _wait_no_extra_threads(before) == set()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    stop()  # idempotent


def test_stop_does_not_wait_for_an_idle_listener() -> None:
    m = DecodeMetrics(transport="fake")
    _, stop = start_metrics_server(m.registry)
    t = time.monotonic()
    stop()
    assert time.monotonic() - t < 1.0


def test_stop_cuts_off_a_client_that_never_sends_a_request() -> None:
    # A connection that sends nothing holds a request thread; stop() must still return
    # (after the per-connection timeout) and leave no thread behind.
    before = set(threading.enumerate())
    m = DecodeMetrics(transport="fake")
    port, stop = start_metrics_server(m.registry, request_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", port)) as idle:
        deadline = time.monotonic() + 2
        while len(set(threading.enumerate()) - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for the request thread to exist
        t = time.monotonic()
        stop()
        assert time.monotonic() - t < 3.0
        assert _wait_no_extra_threads(before) == set()
        idle.settimeout(1)
        assert idle.recv(1) == b""  # the server closed its end


def test_port_in_use_is_an_os_error() -> None:
    m = DecodeMetrics(transport="fake")
    port, stop = start_metrics_server(m.registry)
    try:
        with pytest.raises(OSError):
            start_metrics_server(m.registry, "127.0.0.1", port)
    finally:
        stop()


def test_a_port_in_use_from_the_flags_is_an_os_error_naming_them() -> None:
    m = DecodeMetrics(transport="fake")
    port, stop = start_metrics_server(m.registry)
    try:
        ns = _parser().parse_args(["--metrics-port", str(port)])
        with pytest.raises(OSError, match=rf"--metrics-port {port} --metrics-host 127\.0\.0\.1: cannot listen on "
                                               rf"http://127\.0\.0\.1:{port}: Address already in use"):
            start_metrics_from_args(ns, m.registry, "decode")
    finally:
        stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="server")
    add_metrics_arguments(p)
    return p


def test_flag_help_and_defaults() -> None:
    text = _parser().format_help()
    assert "--metrics-port PORT" in text
    assert "0 picks a free port" in text
    assert "Absent: no metrics endpoint" in text
    assert "--metrics-host HOST" in text
    assert _parser().parse_args([]).metrics_port is None
    assert _parser().parse_args(["--metrics-port", "0"]).metrics_port == 0


def test_absent_flag_starts_nothing() -> None:
    before = set(threading.enumerate())
    stop = start_metrics_from_args(_parser().parse_args([]), DecodeMetrics(transport="fake").registry, "decode")
    assert set(threading.enumerate()) == before
    stop()


def test_port_zero_serves_on_a_free_port_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    m = DecodeMetrics(transport="fake")
    m.on_finished()
    ns = _parser().parse_args(["--metrics-port", "0", "--metrics-host", "127.0.0.1"])
    with caplog.at_level(logging.INFO, logger="pdgrpc.metrics"):
        stop = start_metrics_from_args(ns, m.registry, "decode")
    try:
        (line,) = [r.getMessage() for r in caplog.records if "metrics on" in r.getMessage()]
        match = re.fullmatch(r"pdgrpc decode metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        s = Scrape(scrape_text(int(match.group(1))))
        assert s.value("pdgrpc_requests_total", role="decode", state="finished") == 1
    finally:
        stop()


def test_bad_port_is_refused_before_binding(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        _parser().parse_args(["--metrics-port", "70000"])
    assert ei.value.code == 2
    assert "argument --metrics-port: must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_two_registries_do_not_interfere(serve) -> None:
    a = DecodeMetrics(transport="tcp")
    b = DecodeMetrics(transport="tcp")
    a.bind(lambda: {"slots_in_use": 1, "slots_total": 4})
    b.bind(lambda: {"slots_in_use": 3, "slots_total": 16})
    a.on_abort(AbortReason.TRANSFER_TIMEOUT)
    b.on_finished()
    b.on_finished()
    sa, sb = serve(a.registry)(), serve(b.registry)()
    assert sa.value("pdgrpc_metadata_slots_in_use", role="decode") == 1
    assert sb.value("pdgrpc_metadata_slots_in_use", role="decode") == 3
    assert sa.value("pdgrpc_aborts_total", role="decode", reason="transfer_timeout") == 1
    assert sb.value("pdgrpc_aborts_total", role="decode", reason="transfer_timeout") == 0
    assert sa.value("pdgrpc_requests_total", role="decode", state="finished") == 0
    assert sb.value("pdgrpc_requests_total", role="decode", state="finished") == 2


def test_derived_ports_for_child_processes() -> None:
    assert derived_metrics_port(None, 3) is None  # metrics off stays off
    assert derived_metrics_port(0, 3) == 0  # free ports, each logged by its process
    # prefill controller on 9100, its dp workers 0..2 at offsets 1 + rank
    assert [derived_metrics_port(9100, 1 + r) for r in range(3)] == [9101, 9102, 9103]
    with pytest.raises(ValueError):
        derived_metrics_port(9100, 0)  # would collide with the parent's own port
    with pytest.raises(ValueError):
        derived_metrics_port(65535, 1)


def test_openmetrics_negotiation_as_prometheus_scrapes() -> None:
    # A Prometheus server asks for OpenMetrics first; the page must parse as that too,
    # with the info metric typed as such and the live counters ending in _total.
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    m = DecodeMetrics(transport="tcp")
    m.bind(lambda: {"slots_in_use": 2})
    m.on_abort(AbortReason.CANCELLED)
    port, stop = start_metrics_server(m.registry)
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = resp.read().decode()
    finally:
        stop()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["pdgrpc_server"].type == "info"
    assert fams["pdgrpc_metadata_slots_in_use"].samples[0].value == 2
    (cancelled,) = [s for s in fams["pdgrpc_aborts"].samples if s.labels["reason"] == "cancelled"]
    assert cancelled.name == "pdgrpc_aborts_total" and cancelled.value == 1
    assert "_created" not in text
