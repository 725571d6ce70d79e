"""glibc malloc tuning for engine processes (pdgrpc.engine.malloc): each case runs in a
fresh interpreter, since malloc settings are process-wide and cannot be undone."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from pdgrpc.engine.malloc import keep_freed_memory
from pdgrpc.errors import ConfigError


def _is_glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    return True


# A fresh process: optionally apply the tuning, then allocate an 8 MiB tensor and report
# how many chunks glibc serves by mmap (mallinfo2().hblks) while it is alive.
_PROBE = """
import ctypes, sys, torch
from pdgrpc.engine.malloc import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
outcome = keep_freed_memory(int(sys.argv[1]) << 20)
before = libc.mallinfo2().hblks
t = torch.empty(8 << 20, dtype=torch.uint8)
t.fill_(1)
print(outcome, libc.mallinfo2().hblks - before)
"""


def _probe(mib: int, env: dict[str, str] | None = None) -> tuple[str, int]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    run_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", _PROBE, str(mib)], capture_output=True, text=True, env=run_env,
                         timeout=120, check=True).stdout.split()
    return " ".join(out[:-1]), int(out[-1])


@pytest.mark.skipif(not _is_glibc(), reason="the tuning is glibc's mallopt; other C libraries are left alone")
def test_tuned_process_serves_large_tensors_from_the_heap() -> None:
    assert _probe(256) == ("applied", 0)
    # glibc's own behaviour, for contrast: the 8 MiB tensor is a fresh mmap
    assert _probe(0) == ("skipped: disabled (0)", 1)


@pytest.mark.skipif(not _is_glibc(), reason="the tuning is glibc's mallopt; other C libraries are left alone")
def test_the_operators_own_malloc_settings_win() -> None:
    outcome, mmapped = _probe(256, {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert outcome == "skipped: the environment sets MALLOC_MMAP_THRESHOLD_"
    assert mmapped == 1  # their 128 KiB threshold still applies
    outcome, _ = _probe(256, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert outcome == "skipped: the environment sets GLIBC_TUNABLES"


def test_negative_keep_is_refused() -> None:
    with pytest.raises(ConfigError, match="keep_bytes must be >= 0"):
        keep_freed_memory(-1)
