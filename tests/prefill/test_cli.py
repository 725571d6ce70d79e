"""``python -m pdgrpc.prefill`` flags: every one is explained, bad values fail before any process starts."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from pdgrpc.prefill.__main__ import main
from pdgrpc.prefill.cli import build_parser, worker_argv
from tests.usage import usage_error


def listed_in_help(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments ``parser.format_help()`` lists, as its formatter is handed them."""
    listed: list[argparse.Action] = []

    class Recording(argparse.HelpFormatter):
        def add_argument(self, action: argparse.Action) -> None:
            listed.append(action)
            super().add_argument(action)

    parser.formatter_class = Recording
    parser.format_help()
    return listed


def test_every_flag_has_help_text() -> None:
    flags = [a for a in listed_in_help(build_parser()) if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    missing = [a.option_strings[0] for a in flags if not (a.help and len(a.help) > 15)]
    assert missing == []
    text = build_parser().format_help()
    for flag in ("--dp-size", "--load-balance-method", "--force-dp-rank-query", "--bootstrap", "--transport", "--chunk-size"):
        assert flag in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--transport", "nope"], "unknown transport 'nope'"),
        (["--max-prompt-tokens", "9000"], "--max-prompt-tokens (9000) must be < --max-seq-len (4096)"),
        (["--dp-size", "2049", "--tp-size", "2"], "--dp-size 2049 x --tp-size 2 = 4098 workers, over the limit of 4096"),
        (["--load-balance-method", "random"], "invalid choice: 'random'"),
        (["--malloc-keep-mib", "-1"], "--malloc-keep-mib: must be >= 0, got -1"),
        (["--malloc-keep-mib", "lots"], "--malloc-keep-mib: expected a whole number, got 'lots'"),
        # glibc keeps at most 2 GiB (mallopt takes an int): a larger value would be cut silently.
        (["--malloc-keep-mib", "4096"], "--malloc-keep-mib: must be <= 2047, got 4096"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in usage_error(lambda: main(argv), capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-write-bytes", "-1"], "argument --min-write-bytes: must be >= 0 bytes, got -1"),
        (["--min-write-bytes", "1M"], "argument --min-write-bytes: expected whole bytes, got '1M'"),
        (["--handshake-timeout", "-1"], "argument --handshake-timeout: must be a finite number of seconds > 0, got -1"),
        (["--transfer-timeout", "0"], "argument --transfer-timeout: must be a finite number of seconds > 0, got 0"),
        (["--dist-timeout", "0"], "argument --dist-timeout: must be a finite number of seconds > 0, got 0"),
        (["--bootstrap-ttl", "0"], "argument --bootstrap-ttl: must be a finite number of seconds > 0, got 0"),
        (["--worker-start-timeout", "0"], "argument --worker-start-timeout: must be a finite number of seconds > 0, got 0"),
        (["--compute-threads", "0"], "argument --compute-threads: must be >= 1 threads, got 0"),
        # Taken, 100000 threads crash the worker (a traceback, then SIGSEGV) as it starts them.
        (["--compute-threads", "100000"], f"argument --compute-threads: must be <= {os.cpu_count()} threads, got 100000"),
        (["--grace", "-1"], "argument --grace: must be a finite number of seconds >= 0, got -1"),
        (["--page-wait-timeout", "-1"], "argument --page-wait-timeout: must be a finite number of seconds >= 0, got -1"),
        (["--worker-respawn-max-backoff", "-1"], "argument --worker-respawn-max-backoff: must be a finite number of seconds >= 0, got -1"),
        (["--dp-register-window-ms", "-1"], "argument --dp-register-window-ms: must be a finite number of milliseconds >= 0, got -1"),
        (["--chunk-size", "0"], "argument --chunk-size: must be >= 1 tokens, got 0"),
        (["--chunk-size", "-4"], "argument --chunk-size: must be >= 1 tokens, got -4"),
    ],
)
def test_bad_values_are_refused_at_parse_time(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A value the workers or the embedded bootstrap would refuse must fail here, not with a
    # traceback once they start.
    assert message in usage_error(lambda: build_parser().parse_args(argv), capsys)


# A group size below 1 is refused as the decode refuses its --tp-size: one rule, one message.
SIZE_ERRORS = [
    (["--tp-size", "0"], "argument --tp-size: must be >= 1 ranks, got 0"),
    (["--tp-size", "-1"], "argument --tp-size: must be >= 1 ranks, got -1"),
    (["--dp-size", "0"], "argument --dp-size: must be >= 1 ranks, got 0"),
]


@pytest.mark.parametrize("flags, message", SIZE_ERRORS, ids=[" ".join(f) for f, _ in SIZE_ERRORS])
def test_a_group_size_below_1_is_a_usage_error_of_the_command(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "pdgrpc.prefill", "--transport", "fake", "--port", "0", *flags]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.prefill: error: {message}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


# The worker's own command refuses the same sizes with the same message: a worker started by
# hand (or by a controller of another version) fails as a usage error, not at start-up.
WORKER = ["--dp-rank", "0", "--bootstrap", "127.0.0.1:1", "--load-balance-method", "round_robin", "--transport", "fake"]
WORKER_SIZE_ERRORS = [
    (["--dp-size", "1", "--tp-size", "0"], "argument --tp-size: must be >= 1 ranks, got 0"),
    (["--dp-size", "0"], "argument --dp-size: must be >= 1 ranks, got 0"),
    (["--dp-size", "two"], "argument --dp-size: expected whole ranks, got 'two'"),
]


# A rank outside its group is refused before the worker starts anything: taken, it ends in a
# traceback from the worker's config or its bootstrap registration, or waits on a TP group
# that never forms.
WORKER_RANK_ERRORS = [
    (["--dp-size", "1", "--tp-size", "2", "--tp-rank", "2"], "--tp-rank must be in [0, --tp-size=2), got 2"),
    (["--dp-size", "1", "--tp-rank", "-1"], "--tp-rank must be in [0, --tp-size=1), got -1"),
    (["--dp-size", "2", "--dp-rank", "2"], "--dp-rank must be in [0, --dp-size=2), got 2"),
    (["--dp-size", "1", "--dp-rank", "-1"], "--dp-rank must be in [0, --dp-size=1), got -1"),
    # A TP rank with nowhere to meet its group: refused only once the worker had started.
    (["--dp-size", "1", "--tp-size", "2", "--tp-rank", "1"], "--dist-init is required with --tp-size > 1"),
    # Not a rank, but the same kind of failure: a worker's config refused it in a traceback.
    (["--dp-size", "1", "--chunk-size", "0"], "argument --chunk-size: must be >= 1 tokens, got 0"),
]


WORKER_ERRORS = WORKER_SIZE_ERRORS + WORKER_RANK_ERRORS


@pytest.mark.parametrize("flags, message", WORKER_ERRORS, ids=[" ".join(f) for f, _ in WORKER_ERRORS])
def test_a_size_below_1_or_a_rank_outside_its_group_is_a_usage_error_of_the_worker(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "pdgrpc.prefill.worker_main", *WORKER, *flags]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.prefill.worker_main: error: {message}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("address", ["nohost", ":8998", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:99999"])
def test_a_bootstrap_that_is_not_host_port_is_refused_before_any_worker_starts(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Taken, the workers would retry registering with it until --worker-start-timeout.
    from pdgrpc.prefill.controller_main import check

    ns = build_parser().parse_args(["--transport", "fake", "--bootstrap", address])
    with pytest.raises(ValueError, match=f"--bootstrap: '{address}' is not HOST:PORT"):
        check(ns)
    assert f"error: --bootstrap: '{address}' is not HOST:PORT" in usage_error(lambda: main(["--transport", "fake", "--bootstrap", address]), capsys)


def test_a_worker_that_cannot_start_its_transport_says_so_in_one_line() -> None:
    cmd = [sys.executable, "-m", "pdgrpc.prefill", "--transport", "tcp", "--transport-host", "no-such-host.invalid"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "prefill.dp0" in out.stderr and "tcp transport cannot listen" in out.stderr
    assert "prefill worker dp0 exited with code 1 before it was ready" in out.stderr
    assert "Traceback" not in out.stderr


def test_workers_get_the_engine_and_transport_flags_unchanged() -> None:
    ns = build_parser().parse_args(["--model-size", "tiny", "--page-size", "8", "--transport", "tcp", "--chunk-size", "7"])
    argv = worker_argv(ns)
    probe = argparse.ArgumentParser()
    from pdgrpc.prefill.cli import add_worker_arguments

    add_worker_arguments(probe)
    back = probe.parse_args(argv)
    assert (back.model_size, back.page_size, back.transport, back.chunk_size) == ("tiny", 8, "tcp", 7)
    assert vars(back) == {dest: getattr(ns, dest) for dest in vars(back)}


def test_kv_huge_pages_reaches_the_workers_and_their_engine_pools() -> None:
    from pdgrpc.engine.reference import ReferenceEngine
    from pdgrpc.prefill.cli import add_worker_arguments
    from pdgrpc.serving.flags import engine_config_from_args
    from pdgrpc.host_memory import HUGE_PAGE

    probe = argparse.ArgumentParser()
    add_worker_arguments(probe)
    for flags, huge in ((["--kv-huge-pages"], True), ([], False)):
        ns = build_parser().parse_args(["--model-size", "tiny", "--num-pages", "512", *flags])
        back = probe.parse_args(worker_argv(ns))
        config = engine_config_from_args(back)
        assert config.kv_huge_pages is huge
        bufs = ReferenceEngine(config).kv_buffers()
        pools = [*bufs.k, *bufs.v]
        # the huge-page allocator starts every pool on a 2 MiB boundary; torch.zeros does not
        assert all(p.data_ptr() % HUGE_PAGE == 0 for p in pools) is huge
        assert all(not p.any() for p in pools)


def test_malloc_keep_mib_reaches_the_workers() -> None:
    from pdgrpc.prefill.cli import add_worker_arguments

    probe = argparse.ArgumentParser()
    add_worker_arguments(probe)
    for flags, mib in ((["--malloc-keep-mib", "64"], 64), (["--malloc-keep-mib", "0"], 0), ([], 256)):
        ns = build_parser().parse_args(flags)
        assert probe.parse_args(worker_argv(ns)).malloc_keep_mib == mib
