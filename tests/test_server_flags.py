"""The servers' flags refuse a bad value as a CLI error naming the flag (exit 2),
before anything listens: a server must not start with a value that makes it fail later,
or serve otherwise than the user asked."""

from __future__ import annotations

import argparse
import importlib
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdgrpc.serving.launch import Role
from tests.prefill.procs import session_pids
from tests.usage import usage_error

# the module holding the ROLE of every server a user starts
SERVERS = ["pdgrpc.bootstrap.server", "pdgrpc.router.server", "pdgrpc.colocated.server", "pdgrpc.prefill.controller_main", "pdgrpc.decode.server"]


def _parser(module: str) -> argparse.ArgumentParser:
    role = importlib.import_module(module).ROLE
    assert isinstance(role, Role)
    return role.build_parser()


# every flag that names a port a server listens on
PORT_FLAGS = [(m, "--port") for m in SERVERS] + [(m, "--metrics-port") for m in SERVERS if m != "pdgrpc.colocated.server"]


@pytest.mark.parametrize("module, flag", PORT_FLAGS, ids=[f"{m.split('.')[1]}{f}" for m, f in PORT_FLAGS])
@pytest.mark.parametrize("value", ["99999", "65536", "-1", "http"])
def test_a_port_outside_0_to_65535_is_refused(module: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Outside the range the socket layer would listen on the value modulo 65536 instead.
    with pytest.raises(SystemExit) as ei:
        _parser(module).parse_args([flag, value])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and value in err and "65535" in err


@pytest.mark.parametrize("module", SERVERS, ids=[m.split(".")[1] for m in SERVERS])
def test_ports_in_range_are_taken(module: str) -> None:
    assert _parser(module).parse_args(["--port", "0"]).port == 0
    assert _parser(module).parse_args(["--port", "65535"]).port == 65535


@pytest.mark.parametrize("value", ["0", "-1"])
def test_colocated_refuses_a_chunk_size_below_1(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Taken, such a chunk size fails every request, over a value no request set.
    assert f"argument --chunk-size: must be >= 1 tokens, got {value}" in usage_error(lambda: _parser("pdgrpc.colocated.server").parse_args(["--chunk-size", value]), capsys)


# (module, flag, the most it takes, unit in the refusal): counts a user types whose
# largest sensible value is far below what an int holds.
COUNT_BOUNDS = [
    ("pdgrpc.router.server", "--retries", 100, ""),
    ("pdgrpc.prefill.controller_main", "--chunk-size", 1 << 20, " tokens"),
    ("pdgrpc.colocated.server", "--chunk-size", 1 << 20, " tokens"),
    ("pdgrpc.decode.server", "--local-prefill-chunk", 1 << 20, " tokens"),
]


@pytest.mark.parametrize("module, flag, most, unit", COUNT_BOUNDS, ids=[f"{m.split('.')[1]}{f}" for m, f, _, _ in COUNT_BOUNDS])
def test_a_count_past_its_documented_maximum_is_refused(module: str, flag: str, most: int, unit: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Taken, 10**12 retries keep a request on a failing cluster until its deadline, and a
    # chunk of 10**15 tokens is no chunk at all: each says the user meant something else.
    for value in (most + 1, 10**12, 10**15):
        err = usage_error(lambda: _parser(module).parse_args([flag, str(value)]), capsys)
        assert f"argument {flag}: must be <= {most}{unit}, got {value}" in err
    assert getattr(_parser(module).parse_args([flag, str(most)]), flag[2:].replace("-", "_")) == most
    entry = re.search(rf"^  +{flag} .*?(?=^  +-|\Z)", _parser(module).format_help(), re.M | re.S)
    assert entry is not None and f"at most {most}" in " ".join(entry.group().lower().split()), f"{flag}'s --help does not state its maximum"


DECODE_DEADLINES = [
    "--resolve-timeout", "--allocate-timeout", "--bootstrap-timeout", "--waiting-timeout", "--claim-timeout",
    "--transfer-timeout", "--abort-lease", "--rpc-timeout", "--dp-rank-query-interval", "--dist-timeout",
]


@pytest.mark.parametrize("flag", DECODE_DEADLINES)
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_decode_refuses_a_deadline_of_0_or_less(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A deadline of 0 fails every call it bounds: with --rpc-timeout 0 every bootstrap call, so every request.
    assert f"argument {flag}: must be a finite number of seconds > 0, got {value}" in usage_error(lambda: _parser("pdgrpc.decode.server").parse_args([flag, value]), capsys)


def test_decode_refuses_a_metrics_port_that_leaves_a_tp_rank_none() -> None:
    # TP rank r serves its metrics on --metrics-port + r: past 65535 before any rank starts.
    cmd = [sys.executable, "-m", "pdgrpc.decode", "--transport", "fake", "--model-size", "tiny", "--tp-size", "2",
           "--metrics-port", "65535"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--metrics-port 65535 leaves no port at offset 1 (would be 65536)" in out.stderr
    assert "Traceback" not in out.stderr


def test_prefill_refuses_a_metrics_port_that_leaves_a_worker_none(capsys: pytest.CaptureFixture[str]) -> None:
    # Worker (dp r, tp t) serves its metrics on --metrics-port + 1 + r * tp_size + t.
    from pdgrpc.prefill.__main__ import main
    from pdgrpc.prefill.controller_main import check

    argv = ["--transport", "fake", "--dp-size", "2", "--metrics-port", "65534"]
    with pytest.raises(ValueError, match="--metrics-port 65534 leaves no port at offset 2"):
        check(_parser("pdgrpc.prefill.controller_main").parse_args(argv))
    assert "error: --metrics-port 65534 leaves no port at offset 2 (would be 65536)" in usage_error(lambda: main(argv), capsys)


ENGINE_SERVERS = ["pdgrpc.colocated", "pdgrpc.prefill", "pdgrpc.decode"]


@pytest.mark.parametrize("module", ENGINE_SERVERS, ids=[m.split(".")[1] for m in ENGINE_SERVERS])
def test_a_kv_pool_larger_than_the_memory_is_refused_before_it_is_allocated(module: str) -> None:
    # Taken, a pool of 100 M pages is an allocation of 1.6 TB: a traceback from torch, or
    # a prefill worker that faults the pool in until the kernel kills something.
    transport = [] if module == "pdgrpc.colocated" else ["--transport", "fake"]
    cmd = [sys.executable, "-m", module, *transport, "--model-size", "tiny", "--num-pages", "100000000"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: --num-pages 100000000 of --page-size 16 tokens: the KV pool needs 1638.40 GB, more than the" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_a_kv_pool_too_large_for_its_page_size_names_the_page_size() -> None:
    # The pool is --num-pages x --page-size tokens: a huge page size with the default page count
    # must not read as a --num-pages the user never typed.
    cmd = [sys.executable, "-m", "pdgrpc.colocated", "--model-size", "tiny", "--page-size", "99999999999", "--port", "0"]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: --num-pages 1024 of --page-size 99999999999 tokens: the KV pool needs" in out.stderr, out.stderr[-2000:]
    assert "pass a smaller --num-pages or --page-size" in out.stderr


GRACE_SERVERS = ["pdgrpc.bootstrap.server", "pdgrpc.router.server"]


@pytest.mark.parametrize("module", GRACE_SERVERS, ids=[m.split(".")[1] for m in GRACE_SERVERS])
def test_a_negative_grace_is_refused(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --grace: must be a finite number of seconds >= 0, got -1" in usage_error(lambda: _parser(module).parse_args(["--grace", "-1"]), capsys)


ENGINE_ROLES = ["pdgrpc.colocated.server", "pdgrpc.prefill.controller_main", "pdgrpc.decode.server"]
SIZE_FLAGS = [("--page-size", "tokens"), ("--num-pages", "pages"), ("--max-prompt-tokens", "tokens"), ("--max-seq-len", "tokens")]


@pytest.mark.parametrize("module", ENGINE_ROLES, ids=[m.split(".")[1] for m in ENGINE_ROLES])
@pytest.mark.parametrize("flag, unit", SIZE_FLAGS)
def test_an_engine_size_below_1_is_refused_naming_the_flag(module: str, flag: str, unit: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Not the engine's field (EngineConfig.num_pages) once the flags are read: the flag the user typed.
    assert f"argument {flag}: must be >= 1 {unit}, got 0" in usage_error(lambda: _parser(module).parse_args([flag, "0"]), capsys)


@pytest.mark.parametrize("module", ENGINE_ROLES, ids=[m.split(".")[1] for m in ENGINE_ROLES])
@pytest.mark.parametrize("value, message", [(str(2**64), f"must be <= {2**64 - 1}, got {2**64}"), ("-1", "must be >= 0, got -1")])
def test_a_model_seed_outside_64_bits_is_refused_naming_the_flag(module: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"argument --model-seed: {message}" in usage_error(lambda: _parser(module).parse_args(["--model-seed", value]), capsys)
    assert _parser(module).parse_args(["--model-seed", str(2**64 - 1)]).model_seed == 2**64 - 1


def test_a_model_seed_past_64_bits_exits_2_from_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.decode", "--transport", "fake", "--model-seed", str(2**64 + 5)],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"python -m pdgrpc.decode: error: argument --model-seed: must be <= {2**64 - 1}, got {2**64 + 5}"


def test_decode_refuses_no_slots_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --num-slots: must be >= 1 slots, got 0" in usage_error(lambda: _parser("pdgrpc.decode.server").parse_args(["--num-slots", "0"]), capsys)


ENGINE_LAUNCHES = ["pdgrpc.colocated.server", "pdgrpc.prefill.controller_main", "pdgrpc.decode.server"]
REFERENCE_SIZES = [
    (["--max-prompt-tokens", "5000"], "--max-prompt-tokens (5000) must be < --max-seq-len (4096)"),
    (["--max-seq-len", "8", "--max-prompt-tokens", "8"], "--max-prompt-tokens (8) must be < --max-seq-len (8)"),
    (["--max-seq-len", "1"], "--max-seq-len 1: must be at least 2 (one prompt token and one generated token)"),
    (["--max-seq-len", "100000"], "--max-seq-len 100000: the reference engine takes at most 65536 tokens"),
    # Both typed: the length leaves no room for any prompt, whatever --max-prompt-tokens says.
    (["--max-seq-len", "1", "--max-prompt-tokens", "1"], "--max-seq-len 1: must be at least 2 (one prompt token and one generated token)"),
]


@pytest.mark.parametrize("module", ENGINE_LAUNCHES, ids=[m.split(".")[1] for m in ENGINE_LAUNCHES])
@pytest.mark.parametrize("argv, message", REFERENCE_SIZES, ids=[" ".join(a) for a, _ in REFERENCE_SIZES])
def test_reference_engine_sizes_that_disagree_name_the_flags(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not the engine's fields (EngineConfig.max_prompt_tokens): the flags the user typed.
    from pdgrpc.serving.launch import launch

    transport = [] if module == "pdgrpc.colocated.server" else ["--transport", "fake"]
    err = usage_error(lambda: launch(module, [*transport, "--model-size", "tiny", *argv]), capsys)
    assert f"error: {message}" in err and "EngineConfig" not in err


def test_huge_pages_on_a_gpu_are_refused_naming_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgrpc.serving.flags import add_engine_arguments, engine_config_from_args

    monkeypatch.setattr("pdgrpc.engine.config.device_type", lambda spec: "cuda")  # this host may have no GPU
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    ns = parser.parse_args(["--kv-huge-pages", "--device", "cuda"])
    with pytest.raises(ValueError, match=r"^--kv-huge-pages applies to a host KV pool; it cannot be combined with --device cuda$"):
        engine_config_from_args(ns)


@pytest.mark.parametrize("argv, limit", [([], 2048), (["--max-seq-len", "100"], 99), (["--max-seq-len", "2"], 1)])
def test_an_unset_prompt_limit_is_2048_or_one_under_the_length(argv: list[str], limit: int) -> None:
    # The checkpoint engine's default is the same (tests/engine/test_hf_sizing.py).
    from pdgrpc.serving.flags import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(argv)).max_prompt_tokens == limit


TP_SIZES = [
    (["--tp-size", "3"], "--tp-size 3 must divide the model's num_heads (8)"),
    (["--model-size", "tiny", "--tp-size", "4"], "--tp-size 4 must divide the model's num_kv_heads (2)"),
]


@pytest.mark.parametrize("module", ["pdgrpc.prefill.controller_main", "pdgrpc.decode.server"], ids=["prefill", "decode"])
@pytest.mark.parametrize("argv, message", TP_SIZES, ids=[" ".join(a) for a, _ in TP_SIZES])
def test_a_tp_size_that_does_not_divide_the_heads_names_the_flag(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdgrpc.serving.launch import launch

    err = usage_error(lambda: launch(module, ["--transport", "fake", *argv]), capsys)
    assert f"error: {message}" in err and "EngineConfig" not in err


@pytest.mark.parametrize("argv, message", [REFERENCE_SIZES[0], TP_SIZES[0]], ids=["max-prompt-tokens", "tp-size"])
def test_an_engine_size_refusal_from_the_command_line_exits_2_naming_the_flags(argv: list[str], message: str) -> None:
    # The real entry point, as a user runs it: usage, the message, no traceback.
    cmd = [sys.executable, "-m", "pdgrpc.prefill", "--transport", "fake", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: {message}" in out.stderr and "usage:" in out.stderr
    assert "Traceback" not in out.stderr and "EngineConfig" not in out.stderr


# The checkpoint engine (--model) names the flags too. The tiny checkpoint has 4 query heads,
# 2 KV heads and max_position_embeddings 4096; "{config}" stands for its config.json.
CHECKPOINT_SIZES = [
    (["--max-prompt-tokens", "5000"], "--max-prompt-tokens (5000) must be < --max-seq-len (4096)"),
    (["--max-seq-len", "8", "--max-prompt-tokens", "8"], "--max-prompt-tokens (8) must be < --max-seq-len (8)"),
    (["--max-seq-len", "1"], "--max-seq-len 1: must be at least 2 (one prompt token and one generated token)"),
    (["--max-seq-len", "8192"], "--max-seq-len 8192 exceeds {config} max_position_embeddings = 4096"),
]
CHECKPOINT_TP_SIZES = [(["--tp-size", "3"], "--tp-size 3 must divide {config} num_heads (4)")]


def _checkpoint_refusal(module: str, checkpoint: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from pdgrpc.serving.launch import launch

    transport = [] if module == "pdgrpc.colocated.server" else ["--transport", "fake"]
    return usage_error(lambda: launch(module, [*transport, "--model", str(checkpoint), *argv]), capsys)


# Every engine server for the size rules; the TP rule only where --tp-size is a flag.
_CHECKPOINT_REFUSALS = [(m, a, msg) for m in ENGINE_LAUNCHES for a, msg in CHECKPOINT_SIZES] + [
    (m, a, msg) for m in ("pdgrpc.prefill.controller_main", "pdgrpc.decode.server") for a, msg in CHECKPOINT_TP_SIZES
]


@pytest.mark.parametrize(
    "module, argv, message", _CHECKPOINT_REFUSALS, ids=[f"{m.split('.')[1]}-{' '.join(a)}" for m, a, _ in _CHECKPOINT_REFUSALS]
)
def test_checkpoint_engine_sizes_that_disagree_name_the_flags(
    module: str, argv: list[str], message: str, hf_checkpoint: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not the checkpoint engine's fields (HFEngineConfig.max_seq_len): the flags the user typed.
    checkpoint = hf_checkpoint("qwen2")
    err = _checkpoint_refusal(module, checkpoint, argv, capsys)
    assert f"error: {message.format(config=checkpoint / 'config.json')}" in err and "HFEngineConfig" not in err


def test_a_checkpoint_engine_size_refusal_from_the_command_line_exits_2_naming_the_flags(hf_checkpoint: Any) -> None:
    # The real entry point, as a user runs it: usage, the message, no traceback.
    checkpoint = hf_checkpoint("qwen2")
    argv, message = CHECKPOINT_TP_SIZES[0]
    cmd = [sys.executable, "-m", "pdgrpc.prefill", "--transport", "fake", "--model", str(checkpoint), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: {message.format(config=checkpoint / 'config.json')}" in out.stderr and "usage:" in out.stderr
    assert "Traceback" not in out.stderr and "HFEngineConfig" not in out.stderr


@pytest.mark.parametrize("module", ["pdgrpc.prefill.controller_main", "pdgrpc.decode.server"], ids=["prefill", "decode"])
def test_an_unknown_transport_is_refused_before_anything_starts(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pdgrpc.serving.launch import launch

    err = usage_error(lambda: launch(module, ["--transport", "nonsense", "--model-size", "tiny"]), capsys)
    assert "error: unknown transport 'nonsense'; available: fake, rdma, tcp" in err


def test_only_the_servers_with_rooms_take_an_smg_room_key(capsys: pytest.CaptureFixture[str]) -> None:
    # The key derives an smg request's room secret on its prefill and decode legs; a
    # colocated server has no rooms, so the flag there would be taken and never read.
    colocated = _parser("pdgrpc.colocated.server")
    assert "--smg-room-key-file" not in colocated.format_help()
    err = usage_error(lambda: colocated.parse_args(["--smg-room-key-file", "key"]), capsys)
    assert "error: unrecognized arguments: --smg-room-key-file key" in err
    for module in ("pdgrpc.prefill.controller_main", "pdgrpc.decode.server"):
        assert _parser(module).parse_args(["--smg-room-key-file", "key"]).smg_room_key_file == Path("key")


# Every server a user starts, as `python -m MODULE` with the flags it needs besides --port.
PORT_USERS = [
    ("pdgrpc.bootstrap", []),
    ("pdgrpc.router", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]),
    ("pdgrpc.prefill", ["--transport", "fake", "--model-size", "tiny"]),
    ("pdgrpc.decode", ["--transport", "fake", "--model-size", "tiny"]),
    ("pdgrpc.colocated", ["--model-size", "tiny"]),
]


@pytest.mark.parametrize("module, argv", PORT_USERS, ids=[m.split(".")[1] for m, _ in PORT_USERS])
def test_a_port_another_process_holds_ends_every_server_alike(module: str, argv: list[str]) -> None:
    # A failure at run time, not a usage error (2): status 1, one line naming --port and
    # the reason; and nothing it started (a prefill's workers) outlives it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "cannot bind" in line]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].endswith(f"cannot bind 127.0.0.1:{port} (--host 127.0.0.1 --port {port}): address in use"), lines[0]
    assert "Traceback" not in err
    assert session_pids(proc.pid) == [], f"left running: {session_pids(proc.pid)}"


# (--host, the reason its bind failure gives): grpc gives none, so the server finds it.
BIND_FAILURES = [("192.0.2.1", "not an address of this host"), ("no-such-host.invalid", "unknown host")]


@pytest.mark.parametrize("host, reason", BIND_FAILURES, ids=[h for h, _ in BIND_FAILURES])
def test_a_host_that_cannot_be_bound_says_why_in_one_line(host: str, reason: str) -> None:
    cmd = [sys.executable, "-m", "pdgrpc.bootstrap", "--host", host, "--port", "0", "--insecure"]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "pdgrpc bootstrap: cannot bind" in line]
    assert len(lines) == 1 and lines[0].endswith(f"pdgrpc bootstrap: cannot bind {host}:0 (--host {host} --port 0): {reason}"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
