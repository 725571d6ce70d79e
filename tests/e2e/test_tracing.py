"""Tracing (``--trace``): one request through a real 1p1d cluster is one trace with a span
per hop, each under the span that caused it, under the client's ``traceparent`` when it
sent one; and ``bench e2e --json`` reports each hop's p50."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.rpc.tracing import read_spans
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.e2e.harness import skip_unless_transport
from tests.eventually import eventually_async

# span -> the span it is a child of (None: the client's span, or the root)
TREE: dict[str, str | None] = {
    "router": None,
    "router.prepare": "router",
    "controller.dispatch": "router",
    "worker": "controller.dispatch",
    "worker.queue": "worker",
    "compute": "worker",
    "write": "worker",
    "transfer": "worker",
    "decode": "router",
    "handshake": "decode",
    "decode.commit": "decode",
    "first_token": "decode",
}
PROMPT = [256] + [ord(c) for c in "Where does the time to the first token go? " * 4]


async def _trace(directory: Path, trace_id: str | None = None) -> dict[str, dict[str, Any]]:
    """The spans of one trace by name (``trace_id``: the one trace written), once all are in."""

    def spans() -> dict[str, dict[str, Any]] | None:
        found = [s for s in read_spans(directory) if trace_id is None or s["trace_id"] == trace_id]
        by_name = {s["name"]: s for s in found}
        return by_name if set(by_name) >= set(TREE) and len(found) == len(by_name) else None

    return await eventually_async(spans, timeout=20, interval=0.1, what=lambda: f"spans of every hop in {directory}: {sorted({s['name'] for s in read_spans(directory)})}")


def _check_tree(spans: dict[str, dict[str, Any]], root_parent: str | None) -> None:
    assert {s["trace_id"] for s in spans.values()} == {spans["router"]["trace_id"]}, "one request, one trace"
    for name, parent in TREE.items():
        want = root_parent if parent is None else spans[parent]["span_id"]
        assert spans[name]["parent_id"] == want, f"{name}: parent {spans[name]['parent_id']}, want {parent or root_parent}"
        assert spans[name]["start_ns"] <= spans[name]["end_ns"]
    # The hops within a process follow each other; a call starts after its caller's span.
    hops = [spans[n]["end_ns"] for n in ("worker.queue", "compute", "write", "transfer")]
    assert hops == sorted(hops)
    assert spans["decode.commit"]["end_ns"] <= spans["first_token"]["end_ns"]
    assert spans["router"]["start_ns"] <= spans["decode"]["start_ns"] <= spans["handshake"]["start_ns"]
    assert spans["router.prepare"]["end_ns"] <= spans["controller.dispatch"]["start_ns"]  # issued, then served


@pytest.mark.parametrize("transport", ["tcp"])
async def test_one_request_is_one_trace_with_every_hop_under_the_clients_traceparent(tmp_path: Path, transport: str) -> None:
    skip_unless_transport(transport)
    env = {"PDGRPC_TRACE": f"file:{tmp_path / 'spans'}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    async with Cluster("1p1d", transport=transport, log_dir=tmp_path / "logs", extra_env=env) as cluster:
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            # Without a traceparent the router's span is the root of the request's trace.
            await generate(stub, input_ids=PROMPT, max_new_tokens=3)
            first = await _trace(tmp_path / "spans")
            _check_tree(first, root_parent=None)
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            # Another prompt: the decode holds the first one's pages now, and would compute
            # a repeat itself (local prefill), with no prefill hop to trace.
            done = await generate(
                stub, input_ids=PROMPT[:1] + PROMPT[:0:-1], max_new_tokens=3,
                metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),),
            )
            assert len(done.token_ids) == 3
            _check_tree(await _trace(tmp_path / "spans", trace_id), root_parent=client_span)


async def test_colocated_serving_traces_its_queue_and_compute_under_the_clients_span(tmp_path: Path) -> None:
    """The baseline's spans bear the prefill worker's hop names, so the bench can set the
    two computes side by side."""
    env = {"PDGRPC_TRACE": f"file:{tmp_path / 'spans'}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    async with Cluster("colocated", log_dir=tmp_path / "logs", extra_env=env) as cluster:
        async with cluster.client_channel() as channel:
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            done = await generate(
                GenerateServiceStub(channel), input_ids=PROMPT, max_new_tokens=3,
                metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),),
            )
            assert len(done.token_ids) == 3

            def spans() -> dict[str, dict[str, Any]] | None:
                by_name = {s["name"]: s for s in read_spans(tmp_path / "spans") if s["trace_id"] == trace_id}
                return by_name if {"colocated", "colocated.queue", "compute"} <= set(by_name) else None

            got = await eventually_async(spans, timeout=20, interval=0.1, what="the colocated server's spans")
    assert got["colocated"]["parent_id"] == client_span
    assert got["colocated.queue"]["parent_id"] == got["compute"]["parent_id"] == got["colocated"]["span_id"]
    assert got["colocated"]["start_ns"] <= got["colocated.queue"]["end_ns"] <= got["compute"]["end_ns"] <= got["colocated"]["end_ns"]
    # The compute is the request's bulk: a 173-token prefill against a queue of one request.
    assert got["compute"]["end_ns"] - got["compute"]["start_ns"] > got["colocated.queue"]["end_ns"] - got["colocated.queue"]["start_ns"]


def test_bench_e2e_json_reports_the_p50_of_every_hop(tmp_path: Path) -> None:
    skip_unless_transport("tcp")
    out = tmp_path / "e2e.json"
    argv = [
        sys.executable, "-m", "pdgrpc.bench", "e2e", "--transports", "tcp", "--ttft-requests", "3", "--warmup", "1",
        "--prompt-tokens", "64", "--throughput-requests", "2", "--concurrency", "2", "--throughput-prompt-tokens", "16",
        "--max-new-tokens", "2", "--json", str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["metric"]: r for r in json.loads(out.read_text())["results"] if r["case"] == "ttft/64tok/1p1d-tcp"}
    for hop in TREE:
        row = rows.get(f"span_p50_ms/{hop}")
        assert row is not None, f"no span_p50_ms/{hop} row; rows: {sorted(rows)}"
        assert row["unit"] == "ms" and 0 <= row["value"] < 60_000
    for gap in (
        "router->controller.dispatch", "router.prepare->controller.dispatch", "controller.dispatch->worker",
        "write->decode.commit", "first_token->router", "compute->router",
    ):
        assert f"gap_p50_ms/{gap}" in rows, f"no gap_p50_ms/{gap} row; rows: {sorted(rows)}"
    # The TTFT rows come from the untraced requests, and the traced ones are reported apart.
    assert "ttft_overhead_paired_p50" in rows and "ttft_overhead_paired_p50_traced" in rows
    # A hop inside the request is shorter than the request as the router saw it.
    assert rows["span_p50_ms/compute"]["value"] <= rows["span_p50_ms/router"]["value"]
    # The colocated baseline's compute, traced alike, and the difference per prompt.
    base = {r["metric"]: r for r in json.loads(out.read_text())["results"] if r["case"] == "ttft/64tok/colocated"}
    for hop in ("colocated", "colocated.queue", "compute"):
        assert f"span_p50_ms/{hop}" in base, f"no colocated span_p50_ms/{hop} row; rows: {sorted(base)}"
    assert base["span_p50_ms/compute"]["value"] <= base["span_p50_ms/colocated"]["value"]
    assert "compute_over_colocated_paired_p50" in rows
