"""Names, units and labels follow the Prometheus conventions, and what a server exposes
is exactly what the catalog (and so docs/metrics.md) documents."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from pdgrpc.metrics import (
    CATALOG,
    BootstrapMetrics,
    DecodeMetrics,
    PrefillMetrics,
    Role,
    RouterMetrics,
    ServerAbortReason,
    markdown_table,
)
from pdgrpc.metrics.catalog import LABEL_NAMES
from pdgrpc.reasons import ABORT_REASON_LABELS, SAME_CAUSE, abort_label
from pdgrpc.state import AbortReason

from tests.scrape import Scrape

_SNAKE = re.compile(r"^[a-z][a-z0-9_]*[a-z0-9]$")
_RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created", "_info")
_UNIT_WORDS = {"seconds": "in seconds", "bytes": "in bytes", "": "count"}
_ALL_LIVE_FIELDS = {m.field: 1 for m in CATALOG if m.live}


@pytest.mark.parametrize("spec", CATALOG, ids=lambda m: m.name)
def test_catalog_entry_follows_prometheus_conventions(spec) -> None:
    assert spec.name.startswith("pdgrpc_")
    assert _SNAKE.match(spec.name), spec.name
    if spec.kind == "counter":
        assert spec.name.endswith("_total")
        base = spec.name.removesuffix("_total")
    elif spec.kind == "info":
        assert spec.name.endswith("_info")
        base = spec.name.removesuffix("_info")
    else:
        assert not spec.name.endswith(_RESERVED_SUFFIXES), f"a {spec.kind} must not end in a reserved suffix"
        base = spec.name
    if spec.unit:
        assert base.endswith("_" + spec.unit), f"{spec.name}: unit {spec.unit} must be the name's suffix"
    else:
        assert not base.endswith(("_seconds", "_bytes")), f"{spec.name}: declares no unit but is named like one"
    # The help text says what and in which unit (an info metric is a constant 1).
    assert spec.kind == "info" or _UNIT_WORDS[spec.unit] in spec.help, f"{spec.name}: help must say {_UNIT_WORDS[spec.unit]!r}"
    assert spec.help.endswith(".") and len(spec.help) > 30
    assert set(spec.labels) <= LABEL_NAMES, f"{spec.name}: labels {spec.labels} outside {sorted(LABEL_NAMES)}"
    assert "role" in spec.labels and spec.roles
    if spec.kind == "histogram":
        assert list(spec.buckets) == sorted(set(spec.buckets)) and spec.buckets


def test_catalog_names_are_unique() -> None:
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))


def test_transfer_latency_buckets_span_sub_millisecond_to_tens_of_seconds() -> None:
    (spec,) = [m for m in CATALOG if m.name == "pdgrpc_transfer_seconds"]
    assert spec.buckets[0] <= 0.0001
    assert sum(1 for b in spec.buckets if b < 0.001) >= 3  # resolution below a millisecond
    assert spec.buckets[-1] >= 30


def _every_role_on_one_registry() -> Scrape:
    from prometheus_client.exposition import generate_latest

    from pdgrpc.metrics.endpoint import WithoutCreated

    d = DecodeMetrics(transport="tcp")
    p = PrefillMetrics(d.registry, transport="tcp")
    b = BootstrapMetrics(d.registry)
    r = RouterMetrics(d.registry)
    full = {f: 1 for f in _ALL_LIVE_FIELDS}
    for m in (d, p, b, r):
        m.bind(lambda: full)
    r.on_first_token(0.1)
    return Scrape(generate_latest(WithoutCreated(d.registry)).decode())


def test_exposition_matches_the_catalog_exactly() -> None:
    s = _every_role_on_one_registry()
    exposed = {}
    for fam in s.families.values():
        # The parser names a counter family without "_total"; the text format has no info
        # type, so pdgrpc_server_info comes back as a gauge of that name.
        name = fam.name + ("_total" if fam.type == "counter" else "")
        exposed[name] = fam
    assert set(exposed) == {m.name for m in CATALOG}
    for spec in CATALOG:
        fam = exposed[spec.name]
        assert fam.type == ("gauge" if spec.kind == "info" else spec.kind)
        assert fam.documentation == spec.help
        roles = {smp.labels["role"] for smp in fam.samples}
        assert roles == {r.value for r in spec.roles}, f"{spec.name}: exposed for {roles}, documented for {spec.roles}"
        for smp in fam.samples:
            keys = set(smp.labels) - {"le"}
            if spec.kind == "info":
                continue  # info keys describe the process (transport, ranks, version)
            assert keys == set(spec.labels), f"{smp.name}: labels {keys}"
            assert "room" not in "".join(smp.labels)
            if spec.kind == "counter":
                assert smp.name.endswith("_total")


def test_abort_vocabulary_is_every_abort_reason_plus_the_server_causes() -> None:
    assert ABORT_REASON_LABELS[: len(AbortReason)] == tuple(r.name.lower() for r in AbortReason)
    assert ABORT_REASON_LABELS[len(AbortReason) :] == tuple(r.value for r in ServerAbortReason if r not in SAME_CAUSE)
    assert len(set(ABORT_REASON_LABELS)) == len(ABORT_REASON_LABELS), "a server cause shadows an AbortReason"
    # A cause both name is one label: the same meaning, counted in one place.
    assert all(abort_label(r) == abort_label(AbortReason[r.name]) for r in SAME_CAUSE)
    assert all(_SNAKE.match(label) for label in ABORT_REASON_LABELS)
    assert abort_label(AbortReason.WAITING_FOR_INPUT_TIMEOUT) == "waiting_for_input_timeout"


def test_every_reason_is_exposed_at_zero_before_any_abort(serve) -> None:
    m = DecodeMetrics(transport="tcp")
    s = serve(m.registry)()
    for label in ABORT_REASON_LABELS:
        assert s.value("pdgrpc_aborts_total", role="decode", reason=label) == 0


@pytest.mark.parametrize("bad", [1, "metadata_corruption", None])
def test_an_abort_reason_outside_the_vocabulary_is_refused(bad) -> None:
    m = DecodeMetrics(transport="tcp")
    with pytest.raises(TypeError):
        m.on_abort(bad)
    # Nothing was counted by the refused call.
    assert m.registry.get_sample_value("pdgrpc_requests_total", {"role": "decode", "state": "aborted"}) == 0


@pytest.mark.parametrize("readme_path", ["pdgrpc/metrics/README.md", "docs/metrics.md"])
def test_readme_lists_every_metric_as_generated(readme_path: str) -> None:
    readme = (pathlib.Path(__file__).parents[2] / readme_path).read_text()
    assert markdown_table() in readme, "regenerate the table: python -m pdgrpc.metrics"
    for spec in CATALOG:
        assert f"`{spec.name}`" in readme


def test_cli_prints_the_table() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.metrics"], capture_output=True, text=True, check=True).stdout
    assert out == markdown_table()


def test_bootstrap_facade_does_not_import_torch() -> None:
    # The bootstrap server is torch-free; its metrics must keep it so.
    code = (
        "import sys\n"
        "from pdgrpc.metrics import BootstrapMetrics, start_metrics_server\n"
        "BootstrapMetrics().bind_table(lambda: {'size': 1})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'pdgrpc.state' not in sys.modules, 'pdgrpc.state imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_roles_have_the_documented_live_fields() -> None:
    # Which role reads which snapshot field is part of the wiring contract in the README.
    fields = {r: {m.field for m in CATALOG if m.live and r in m.roles} for r in Role}
    assert fields[Role.DECODE] == {
        "active_requests", "slots_in_use", "slots_total", "pages_in_use", "pages_quarantined", "pages_total", "transport_rooms",
        "transport_foreign_writes",
    }
    assert fields[Role.PREFILL] == {
        "active_requests", "pages_in_use", "pages_total", "transport_rooms", "prefix_cache_pages", "prefix_cache_evictions",
    }
    assert fields[Role.BOOTSTRAP] == {"size", "max_rooms", "expired", "evicted", "evicted_full"}
    assert fields[Role.ROUTER] == {"active_requests", "identity_mismatches"}


def test_every_method_the_readme_tells_servers_to_call_exists() -> None:
    readme = (pathlib.Path(__file__).parents[2] / "pdgrpc" / "metrics" / "README.md").read_text()
    called = set(re.findall(r"\.(on_\w+|bind_table|bind|unbind|set_info)\(", readme))
    assert {"on_abort", "on_transfer", "on_dp_rank_query", "bind"} <= called  # the regex finds the calls
    facades = (DecodeMetrics, PrefillMetrics, BootstrapMetrics, RouterMetrics)
    missing = {name for name in called if not any(hasattr(f, name) for f in facades)}
    assert not missing, f"README tells servers to call {sorted(missing)}, which no facade has"
