"""What a prefill instance's processes load as they start: the controller runs no engine
and loads no torch; a worker that computes in a process of its own starts that process
before it loads torch itself, so both load it at once."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest


def _lines(stream: "subprocess.IO[str]", out: "queue.Queue[str]") -> None:
    for line in stream:
        out.put(line)


def _wait_for(lines: "queue.Queue[str]", pattern: str, seen: list[str], timeout: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matched {pattern!r}:\n{''.join(seen[-20:])}")


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_controller_loads_no_torch_and_its_worker_and_compute_process_do() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgrpc.prefill", "--port", "0", "--transport", "tcp", "--model-size", "tiny", "--num-pages", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    threading.Thread(target=_lines, args=(proc.stdout, out), daemon=True).start()
    seen: list[str] = []
    try:
        worker = int(_wait_for(lines, r"compute process (\d+) ready", seen).group(1))
        # The controller's ready line: it stops on SIGTERM from here on.
        worker_pid = int(_wait_for(out, r'PDGRPC_READY .*"worker_pids": \[(\d+)\]', seen).group(1))
        assert "libtorch" not in _maps(proc.pid), "the controller loaded torch"
        assert "libtorch" in _maps(worker_pid) and "libtorch" in _maps(worker)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(seen[-20:])


# Runs a worker's start as its entry point does, with the compute process's start replaced
# by a probe that prints whether torch is loaded by then, and stops there.
_PROBE = """
import sys
import pdgrpc.prefill.worker_role as role
def probe(name):
    print("torch loaded:", "torch" in sys.modules, flush=True)
    raise SystemExit(0)
role.spawn = probe
from pdgrpc.serving.launch import launch
launch("pdgrpc.prefill.worker_role", ["--dp-rank", "0", "--dp-size", "1", "--bootstrap", "127.0.0.1:1",
       "--load-balance-method", "round_robin", "--transport", "tcp", "--compute-in", "process"])
"""


# Parsing a role's flags loads neither library, so its help answers at once: the worker's
# engine and transport flags, and the controller's, whose embedded bootstrap loads the
# room table's numpy only once it is built. Each case names a module the probe must see.
HELPS = [("pdgrpc.prefill.worker_main", "--tp-size", "pdgrpc.prefill.cli"), ("pdgrpc.prefill", "--dp-size", "pdgrpc.bootstrap.service")]


@pytest.mark.parametrize("module, flag, seen", HELPS, ids=[m for m, _, _ in HELPS])
def test_a_prefill_help_loads_no_torch_and_no_numpy(module: str, flag: str, seen: str) -> None:
    cmd = [sys.executable, "-X", "importtime", "-m", module, "--help"]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert flag in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert seen in imported, "the probe saw no imports"
    assert sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy")) == []


def test_a_worker_starts_its_compute_process_before_it_loads_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "torch loaded: False"
