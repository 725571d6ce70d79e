"""What a decode process loads before it serves: its help and its flag errors load no
torch, and its help no numpy either, so they answer at once; a TP decode starts its other
ranks before it loads torch itself, so every rank loads it at the same time."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imported(stderr: str) -> set[str]:
    """The modules a run under ``-X importtime`` imported, from its stderr."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _modules_of(package: str, stderr: str) -> list[str]:
    return sorted(m for m in _imported(stderr) if m.split(".")[0] == package)


def _torch_modules(stderr: str) -> list[str]:
    return _modules_of("torch", stderr)


def _decode(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-X", "importtime", "-m", "pdgrpc.decode", *flags]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def test_help_loads_no_torch_and_no_numpy() -> None:
    out = _decode("--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--tp-size N" in out.stdout
    assert "pdgrpc.decode.cli" in _imported(out.stderr), "the probe saw no imports"
    assert _torch_modules(out.stderr) == []
    assert _modules_of("numpy", out.stderr) == []


# (flags, the error line's message): each names the flag it refuses.
FLAG_ERRORS = [
    (["--transport", "bogus"], "unknown transport 'bogus'"),
    (["--transport", "fake", "--tp-size", "0"], "argument --tp-size: must be >= 1 ranks, got 0"),
    (["--transport", "fake", "--tp-size", "-2"], "argument --tp-size: must be >= 1 ranks, got -2"),
    (["--transport", "fake", "--model-size", "tiny", "--tp-size", "3"], "--tp-size 3 must divide the model's num_heads"),
    (["--transport", "fake", "--tp-size", "2", "--metrics-port", "65535"], "--metrics-port 65535 leaves no port at offset 1"),
    (["--transport", "fake", "--discovery", "bogus://x"], "--discovery 'bogus://x'"),
    # Taken, its metadata rows (57 TB) fail to allocate in a traceback once torch loads.
    (["--transport", "fake", "--num-slots", "99999999999"], "argument --num-slots: must be <= 1048576 slots, got 99999999999"),
    # A flag the decode does not take, never the one it abbreviates (--bootstrap-timeout).
    (["--transport", "fake", "--bootstrap", "127.0.0.1:1"], "unrecognized arguments: --bootstrap 127.0.0.1:1"),
]


@pytest.mark.parametrize("flags, message", FLAG_ERRORS, ids=[" ".join(f[0][2:]) or f[0][1] for f in FLAG_ERRORS])
def test_a_flag_error_is_refused_before_torch_loads(flags: list[str], message: str) -> None:
    out = _decode(*flags, "--port", "0")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert f"python -m pdgrpc.decode: error: {message}" in "\n".join(errors), "\n".join(errors[-20:])
    assert not any("Traceback" in line for line in errors), "\n".join(errors[-40:])
    assert _torch_modules(out.stderr) == []


# Runs a TP decode's start as its entry point does, with the start of its other ranks
# replaced by a probe that prints whether torch is loaded by then, and stops there.
_PROBE = """
import sys
import pdgrpc.decode.server as role
def probe(ns):
    print("torch loaded:", "torch" in sys.modules, flush=True)
    raise SystemExit(0)
role.start_followers = probe
from pdgrpc.serving.launch import launch
launch("pdgrpc.decode.server", ["--transport", "fake", "--model-size", "tiny", "--tp-size", "2", "--port", "0"])
"""


def test_a_tp_decode_starts_its_other_ranks_before_it_loads_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "torch loaded: False"
