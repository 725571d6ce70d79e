"""Registered host memory: huge-page backed pools (pdgrpc.host_memory)."""

from __future__ import annotations

import gc
import pathlib

import pytest
import torch

from pdgrpc.host_memory import HUGE_PAGE, host_zeros

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        text = THP.read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


def huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory that the kernel backs with
    transparent huge pages right now (0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_a_pool_is_zeroed_contiguous_aligned_and_outlives_its_mapping_handle() -> None:
    t = host_zeros((8, 2, 16, 64), torch.float16)  # 32 KiB: below the huge-page cut, plain zeros
    assert t.shape == (8, 2, 16, 64) and t.dtype == torch.float16 and not t.any()
    big = host_zeros((64, 16, 2, 64, 64), torch.float16)  # 16 MiB
    assert big.is_contiguous() and big.data_ptr() % HUGE_PAGE == 0 and not big.any()
    view = big[3]
    del big
    gc.collect()
    view.fill_(1.5)  # the mapping stays alive as long as any view of it
    assert float(view.double().sum()) == 1.5 * view.numel()


@pytest.mark.skipif(_thp_mode() in ("never", "absent"), reason="this kernel has transparent huge pages off")
def test_a_large_pool_gets_transparent_huge_pages() -> None:
    before = huge_page_bytes()
    pool = host_zeros((32 << 20,), torch.uint8)  # 32 MiB: 16 huge pages
    gained = huge_page_bytes() - before
    # compaction may not find every 2 MiB block on a busy host; most of them it does
    assert gained >= 8 * HUGE_PAGE, f"only {gained} bytes of huge pages for a 32 MiB pool"
    del pool
