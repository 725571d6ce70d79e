"""Simulate a KV transfer between two engine instances by copying page bytes.

This is what a transport does, minus the network: for each layer and K/V, the bytes of
each source page go to the matching destination page, using only the byte layout that
:class:`~pdgrpc.engine.layout.KVLayout` documents (never tensor indexing). When the two
instances hold different KV head ranges (different TP sizes), only the heads both hold
are copied -- one contiguous range per page, which is how a head-sliced TP transfer
moves. Tests use it to prove that a decode continuing from copied pages produces the
colocated tokens; servers use the real transports.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdgrpc.engine.base import Engine
from pdgrpc.engine.layout import KVLayout
from pdgrpc.errors import CompatibilityError, ConfigError

__all__ = ["copy_pages", "head_slice_range"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def head_slice_range(layout: KVLayout, page: int, head_start: int, head_end: int) -> tuple[int, int]:
    """``(offset, length)`` in bytes, within any one pool tensor, of global KV heads
    ``[head_start, head_end)`` of page ``page`` (the layout's HND rule). The heads must
    be held there."""
    if not 0 <= page < layout.num_pages:
        raise ConfigError(f"head_slice_range: page {page} outside [0, {layout.num_pages})")
    if not layout.head_start <= head_start < head_end <= layout.head_end:
        raise ConfigError(
            f"head_slice_range: heads [{head_start}, {head_end}) not within this pool's "
            f"[{layout.head_start}, {layout.head_end})"
        )
    offset = page * layout.page_bytes + (head_start - layout.head_start) * layout.head_bytes
    return offset, (head_end - head_start) * layout.head_bytes


def copy_pages(src: Engine, src_pages: Sequence[int], dst: Engine, dst_pages: Sequence[int]) -> int:
    """Copy the KV heads that both instances hold from ``src_pages`` of ``src`` into
    ``dst_pages`` of ``dst`` (pairwise). Returns the number of bytes copied (0 when the
    head ranges do not overlap). Raises :class:`~pdgrpc.errors.CompatibilityError` when
    the compatibility hashes differ."""
    if src.compat_hash() != dst.compat_hash():
        raise CompatibilityError(
            f"copy_pages: compatibility hashes differ ({src.compat_hash()[:12]} vs {dst.compat_hash()[:12]}): "
            f"{src.kv_layout.compat_fields()} / {src.model_id} vs {dst.kv_layout.compat_fields()} / {dst.model_id}"
        )
    if len(src_pages) != len(dst_pages):
        raise ConfigError(f"copy_pages: {len(src_pages)} source pages but {len(dst_pages)} destination pages")
    sl, dl = src.kv_layout, dst.kv_layout
    h0, h1 = max(sl.head_start, dl.head_start), min(sl.head_end, dl.head_end)
    if h0 >= h1:
        return 0
    sb, db = src.kv_buffers(), dst.kv_buffers()
    copied = 0
    for s_pool, d_pool in zip(sb.k + sb.v, db.k + db.v):
        s_bytes, d_bytes = _bytes(s_pool), _bytes(d_pool)
        for sp, dp in zip(src_pages, dst_pages):
            s_off, n = head_slice_range(sl, sp, h0, h1)
            d_off, _ = head_slice_range(dl, dp, h0, h1)
            d_bytes[d_off : d_off + n] = s_bytes[s_off : s_off + n]
            copied += n
    return copied
