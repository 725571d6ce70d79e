"""Host memory for registered regions (KV pools), backed by transparent huge pages.

Why: between processes on one host, UCX moves a rendezvous message with one
``process_vm_readv`` (cma), and a socket ``recv_into`` copies into the pool; both walk
and pin the buffers page by page, which huge pages make cheaper (``python -m
pdgrpc.bench transport --backend rdma`` with and without ``--no-huge-pages`` shows it).
``torch.zeros`` never asks for huge pages, and with the common kernel
setting ``transparent_hugepage=madvise`` a buffer gets them only if it asks. Engines opt
in (the reference engine with ``--kv-huge-pages``); the transport benchmark registers
huge-page regions unless told ``--no-huge-pages``.

:func:`host_zeros` asks: an anonymous mapping aligned to 2 MiB, advised
``MADV_HUGEPAGE``, then touched (zeroed) once so the page faults happen at start-up
rather than during the first transfer. Where the kernel has no THP (or says no) it is
simply ordinary zeroed memory: nothing depends on getting huge pages.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["HUGE_PAGE", "host_zeros"]

HUGE_PAGE = 2 << 20  # x86-64 / aarch64 (4 KiB base pages) PMD size
_MIN_BYTES = HUGE_PAGE  # smaller buffers cannot hold a huge page anyway


def _flat(nbytes: int) -> torch.Tensor:
    size = -(-(nbytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to align the start
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive
    offset = (-whole.data_ptr()) % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice, offset, size - offset)
        except OSError:  # THP disabled or unsupported: ordinary pages then
            pass
    flat = whole[offset : offset + nbytes]
    flat.zero_()  # fault the pages in now (anonymous memory reads as zero already)
    return flat


def host_zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` and ``dtype`` whose memory is
    2 MiB-aligned and advised for transparent huge pages (see the module docstring).
    Small tensors (under 2 MiB) are plain ``torch.zeros``."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _MIN_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    return _flat(nbytes).view(dtype).view(tuple(shape))
