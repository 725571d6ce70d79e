"""``--trace`` and the W3C trace context (:mod:`pdgrpc.rpc.tracing`), in one process: what
a caller's ``traceparent`` makes of a server's spans, and the flag's refusals."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from pdgrpc.rpc import tracing

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Tracing on into ``tmp_path``; call the fixture's value for the spans written so far."""
    for name in ("enabled", "_tracer", "_sampler", "_ids", "_shutdown", "_api"):
        monkeypatch.setattr(tracing, name, getattr(tracing, name))  # restored after the test
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracing.setup_tracing(f"file:{tmp_path}", "test")

    def written() -> dict[str, dict[str, Any]]:
        tracing.shutdown()
        return {s["name"]: s for s in tracing.read_spans(tmp_path)}

    yield written


async def _served(metadata: Any) -> tracing.Hops:
    h = tracing.server("decode", metadata)
    h.hop("first_token")
    h.end()
    await asyncio.sleep(0)  # spans are made on the loop's next turn
    return h


async def test_a_sampled_traceparent_is_the_parent_of_the_server_span(spans: Any) -> None:
    h = await _served((("user-agent", "x"), ("traceparent", f"00-{TRACE}-{PARENT}-01")))
    got = spans()
    assert got["decode"]["trace_id"] == TRACE and got["decode"]["parent_id"] == PARENT
    assert got["first_token"]["parent_id"] == got["decode"]["span_id"]
    assert h.metadata() == (("traceparent", f"00-{TRACE}-{got['decode']['span_id']}-01"),)


async def test_an_unsampled_traceparent_records_nothing_and_says_so_downstream(spans: Any) -> None:
    h = await _served((("traceparent", f"00-{TRACE}-{PARENT}-00"),))
    assert spans() == {}
    assert h.metadata()[0][1].startswith(f"00-{TRACE}-") and h.metadata()[0][1].endswith("-00")


@pytest.mark.parametrize("bad", [f"00-{TRACE}-{PARENT}", f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-xyz{PARENT[3:]}-01", "garbage"])
async def test_a_malformed_traceparent_starts_a_trace_of_its_own(spans: Any, bad: str) -> None:
    await _served((("traceparent", bad),))
    got = spans()
    assert got["decode"]["parent_id"] is None and got["decode"]["trace_id"] != TRACE


def test_the_flag_takes_the_environment_and_refuses_an_unknown_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    tracing.add_tracing_arguments(p)
    monkeypatch.delenv(tracing.ENV, raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert p.parse_args([]).trace == "off"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert p.parse_args([]).trace == "console"
    monkeypatch.setenv(tracing.ENV, "file:/tmp/spans")
    assert p.parse_args([]).trace == "file:/tmp/spans"
    assert p.parse_args(["--trace", "off"]).trace == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--trace", "jaeger"])
    with pytest.raises(ValueError, match="otlp, console, file:DIR"):
        tracing.choice("file:")


def test_off_the_servers_never_import_opentelemetry() -> None:
    code = (
        "import sys; import pdgrpc.router.service, pdgrpc.prefill.controller, pdgrpc.decode.service; "
        "from pdgrpc.rpc import tracing; tracing.setup_tracing('off', 'x'); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_file_dir_that_cannot_be_a_directory_is_one_line(where: str, tmp_path: Path) -> None:
    file = tmp_path / "taken"
    file.write_text("not a directory")
    directory = file if where == "a file" else file / "spans"
    cmd = [sys.executable, "-m", "pdgrpc.router", "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
           "--trace", f"file:{directory}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--trace file:{directory}: cannot make the directory" in out.stderr
    assert "Traceback" not in out.stderr


# (the flag's value or None, the environment, the error's message): a bad mode is named by
# where it came from, the flag or the variable, never as the flag the user did not type.
BAD_MODES = [
    (["--trace", "jaeger"], {}, "argument --trace: 'jaeger' is not one of off, otlp, console, file:DIR"),
    ([], {"PDGRPC_TRACE": "jaeger"}, "argument --trace: $PDGRPC_TRACE 'jaeger' is not one of off, otlp, console, file:DIR"),
    ([], {"OTEL_TRACES_EXPORTER": "zipkin"}, "argument --trace: $OTEL_TRACES_EXPORTER 'zipkin' is not one of off, otlp, console, file:DIR"),
]


@pytest.mark.parametrize("argv, env, message", BAD_MODES, ids=["flag", "PDGRPC_TRACE", "OTEL_TRACES_EXPORTER"])
def test_a_bad_trace_mode_names_where_it_came_from(argv: list[str], env: dict[str, str], message: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("PDGRPC_TRACE", "OTEL_TRACES_EXPORTER")}
    cmd = [sys.executable, "-m", "pdgrpc.router", "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *argv]
    out = subprocess.run(cmd, env={**environ, **env}, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"python -m pdgrpc.router: error: {message}" in out.stderr, out.stderr[-2000:]
