"""``python -m pdgrpc.bootstrap`` as a process: --help, bad flags, memory of 1M rooms."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys

import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.rpc.channels import ChannelPool
from tests.usage import usage_error

CMD = [sys.executable, "-m", "pdgrpc.bootstrap"]


def test_help_explains_every_option() -> None:
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    for flag, words in {
        "--host": "listen on",
        "--port": "0 picks a free one",
        "--dp-rank-ttl": "renews it",
        "--max-rooms": "queried",
        "--max-rooms-per-registrant": "crowd",
        "--max-batch": "INVALID_ARGUMENT",
        "--sweep-interval": "expired rooms are freed",
        "--expire-budget": "pause",
        "--grace": "in-flight calls",
        "--log-level": "verbosity",
    }.items():
        assert re.search(rf"{flag}\b.*?{words}", out, re.S), f"{flag} undocumented"


def test_help_loads_no_numpy() -> None:
    # The room table's numpy loads only once a server is built: --help answers without it.
    out = subprocess.run([sys.executable, "-X", "importtime", *CMD[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "pdgrpc.bootstrap.service" in imported, "the probe saw no imports"
    assert sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy")) == []


def test_bad_configuration_exits_2_with_a_message() -> None:
    # The table's own refusal names its fields (max_batch); the command names the flags.
    out = subprocess.run([*CMD, "--port", "0", "--max-rooms", "10"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "python -m pdgrpc.bootstrap: error: --max-batch 65536 must be at most --max-rooms (10)" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep-interval", "0"], "argument --sweep-interval: must be a finite number of seconds > 0, got 0"),
        (["--sweep-interval", "-1"], "argument --sweep-interval: must be a finite number of seconds > 0, got -1"),
        (["--expire-budget", "0"], "argument --expire-budget: must be >= 1 records, got 0"),
    ],
)
def test_a_sweep_that_would_spin_is_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Taken, the expiry sweep would never sleep (an interval of 0) or never free a room
    # (a budget of 0): either way it holds a core at 100%.
    from pdgrpc.bootstrap.server import build_parser

    assert message in usage_error(lambda: build_parser().parse_args(argv), capsys)


BOUND_ERRORS = [
    (["--max-rooms", "0"], "argument --max-rooms: must be >= 1 rooms, got 0"),
    (["--max-rooms", "-5"], "argument --max-rooms: must be >= 1 rooms, got -5"),
    (["--max-rooms", "2000000000"], "argument --max-rooms: must be <= 1073741824 rooms, got 2000000000"),
    (["--max-batch", "0"], "argument --max-batch: must be >= 1 rooms, got 0"),
    (["--max-rooms-per-registrant", "-1"], "argument --max-rooms-per-registrant: must be >= 0 rooms, got -1"),
    (["--dp-rank-ttl", "0"], "argument --dp-rank-ttl: must be a finite number of seconds > 0, got 0"),
    (["--dp-rank-ttl", "-1"], "argument --dp-rank-ttl: must be a finite number of seconds > 0, got -1"),
]


@pytest.mark.parametrize("flags, message", BOUND_ERRORS, ids=[" ".join(f) for f, _ in BOUND_ERRORS])
def test_a_bound_below_its_least_is_a_usage_error_naming_the_flag(flags: list[str], message: str) -> None:
    # Taken, the table refuses it once the server is being built, naming its field and
    # not the flag.
    out = subprocess.run([*CMD, "--port", "0", *flags], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.bootstrap: error: {message}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_topology_over_max_workers_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    from pdgrpc.bootstrap.registry import MAX_WORKERS
    from pdgrpc.bootstrap.server import build_parser

    err = usage_error(lambda: build_parser().parse_args(["--topology", "100000,64,1"]), capsys)
    assert f"argument --topology: 100000,64,1: dp_size 100000 x tp_size 64 x pp_size 1 = 6400000 workers, over the limit of {MAX_WORKERS}" in err
    assert build_parser().parse_args(["--topology", "64,64,1"]).topology == (64, 64, 1)


TOPOLOGY_ERRORS = ["-1,1,1", "0,1,1", "1,-2,1", "1,1,0", "\u00b2,1,1", "\u0661,1,1", "1,1", "1,1,1,1", "a,b,c", "1,,1"]


@pytest.mark.parametrize("value", TOPOLOGY_ERRORS)
def test_a_topology_member_that_is_not_a_whole_number_of_at_least_1_is_a_usage_error(value: str) -> None:
    # Taken, a size of 0 or less makes a topology no worker can complete, and the
    # instance never serves; a digit outside ASCII is no size a worker announces.
    out = subprocess.run([*CMD, "--port", "0", f"--topology={value}"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"python -m pdgrpc.bootstrap: error: argument --topology: expected DP,TP,PP (three whole numbers >= 1), got {value!r}", last
    assert "Traceback" not in out.stderr


def test_a_topology_is_read_as_three_sizes() -> None:
    from pdgrpc.bootstrap.server import build_parser

    assert build_parser().parse_args(["--topology", "2,4,1"]).topology == (2, 4, 1)
    assert build_parser().parse_args([]).topology is None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_a_million_rooms_cost_well_under_200_mb_of_server_rss() -> None:
    proc = subprocess.Popen([*CMD, "--host", "127.0.0.1", "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = re.search(r"listening on [\d.]+:(\d+)", proc.stderr.readline()).group(1)  # type: ignore[union-attr]
        before = rss_mb(proc.pid)

        async def fill() -> int:
            pool = ChannelPool()
            client = BootstrapClient(f"127.0.0.1:{port}", pool=pool, timeout=30)
            rng = random.Random(0)
            added = 0
            for _ in range(16):  # 16 x 62,500 = 1,000,000 rooms
                reply = await client.register_dp_ranks([(rng.getrandbits(63) | 1, rng.randrange(8)) for _ in range(62_500)])
                added += reply.added
            await pool.close()
            return added

        assert asyncio.run(fill()) == 1_000_000
        after = rss_mb(proc.pid)
        assert after < 160, f"server RSS {after:.0f} MB with 1M rooms (was {before:.0f} MB empty)"
        assert after - before < 100, f"1M rooms grew RSS by {after - before:.0f} MB"
    finally:
        proc.terminate()
        proc.wait(10)


async def _read_line(stream: asyncio.StreamReader, pattern: str, timeout: float = 60.0) -> re.Match[str]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"no log line matching {pattern!r}"
        line = (await asyncio.wait_for(stream.readline(), left)).decode()
        assert line, f"the process exited before logging {pattern!r}"
        m = re.search(pattern, line)
        if m:
            return m


async def test_metrics_endpoint_shows_the_table_size_evictions_and_calls() -> None:
    from pdgrpc.errors import PdgrpcError
    from tests.scrape import scrape

    proc = await asyncio.create_subprocess_exec(
        *CMD, "--host", "127.0.0.1", "--port", "0", "--max-rooms", "4", "--max-batch", "4", "--metrics-port", "0",
        stderr=asyncio.subprocess.PIPE,
    )
    pool = ChannelPool()
    try:
        assert proc.stderr is not None
        address = (await _read_line(proc.stderr, r"listening on (\S+:\d+)")).group(1)
        metrics = (await _read_line(proc.stderr, r"pdgrpc bootstrap metrics on http://(\S+:\d+)/metrics")).group(1)
        s = await asyncio.to_thread(scrape, metrics)
        assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 0
        assert s.value("pdgrpc_bootstrap_rooms_capacity", role="bootstrap") == 4

        client = BootstrapClient(address, pool=pool, timeout=10)
        await client.register_dp_ranks([(room, 0) for room in (1, 2, 3, 4)])
        assert (await client.query_dp_ranks([1])).ranks == {1: 0}  # a decode found room 1
        await client.register_dp_ranks([(5, 1), (6, 1)])  # over --max-rooms: evicts 2 and 3, never the queried 1
        with pytest.raises(PdgrpcError, match="4"):
            await client.register_dp_ranks([(4, 1)])  # room 4 is on rank 0: a conflict
        result = await client.query_dp_ranks([1, 2, 5])
        assert sorted(result.missing) == [2]

        s = await asyncio.to_thread(scrape, metrics)
        assert s.value("pdgrpc_bootstrap_rooms", role="bootstrap") == 4
        assert s.value("pdgrpc_bootstrap_rooms_evicted_total", role="bootstrap") == 2
        assert s.value("pdgrpc_bootstrap_rooms_evicted_full_total", role="bootstrap") == 2
        assert s.value("pdgrpc_bootstrap_rooms_expired_total", role="bootstrap") == 0
        assert s.value("pdgrpc_dp_rank_registrations_total", role="bootstrap", outcome="ok") == 2
        assert s.value("pdgrpc_dp_rank_registrations_total", role="bootstrap", outcome="error") == 1
        assert s.value("pdgrpc_dp_rank_registration_batch_size_sum", role="bootstrap") == 4 + 2 + 1
        assert s.value("pdgrpc_dp_rank_queries_total", role="bootstrap", outcome="ok") == 2
        assert s.value("pdgrpc_dp_rank_query_rooms_missing_total", role="bootstrap") == 1
    finally:
        await pool.close()
        if proc.returncode is None:
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    # Stopped with the server: nothing listens on the metrics port any more.
    with pytest.raises(OSError):
        await asyncio.to_thread(scrape, metrics, timeout=2)
