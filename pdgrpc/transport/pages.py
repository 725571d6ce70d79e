"""KV page lists -> write ops.

The KV pool is one tensor per layer and K/V, pages along the first dimension, each
page's bytes contiguous. Region ids follow one convention on both sides so a sender can
name the receiver's regions: ``kv_region_id(layer, kv) = 2 * layer + kv`` and
``METADATA_REGION_ID`` for the metadata rows.

Coalescing: a transfer maps source pages ``s0, s1, ...`` to destination pages
``d0, d1, ...``; wherever both advance by one, the pages form one run and each run
becomes a single :class:`WriteOp` per region (contiguous bytes on both sides).
Scattered pages give one op per page per region; backends batch many ops per message.

Head-sliced (TP) transfers: when sender and receiver pools hold different KV head
ranges, :func:`head_slice_ops` copies one head slice of every page (a contiguous block
per page in the HND layout), one op per page per region pair.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.transport.base import MemoryRegion, RegionInfo, RegionKind, WriteOp, WriteOps

METADATA_REGION_ID = 0xFFFF
K, V = 0, 1


def kv_region_id(layer: int, kv: int) -> int:
    if layer < 0 or kv not in (K, V) or 2 * layer + kv >= METADATA_REGION_ID:
        raise ConfigError(f"kv_region_id: bad layer {layer} or kv {kv}")
    return 2 * layer + kv


def kv_regions(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor]) -> list[MemoryRegion]:
    """Regions for per-layer K and V pool tensors (``[num_pages, ...]`` each)."""
    if len(k_pools) != len(v_pools):
        raise ConfigError(f"kv_regions: {len(k_pools)} K pools but {len(v_pools)} V pools")
    out = []
    for layer, (k, v) in enumerate(zip(k_pools, v_pools)):
        out.append(MemoryRegion(kv_region_id(layer, K), k, RegionKind.KV, f"layer{layer}.k"))
        out.append(MemoryRegion(kv_region_id(layer, V), v, RegionKind.KV, f"layer{layer}.v"))
    return out


def metadata_region(rows: torch.Tensor) -> MemoryRegion:
    """The metadata rows tensor (``[num_slots, ...]``)."""
    return MemoryRegion(METADATA_REGION_ID, rows, RegionKind.METADATA, "metadata")


def _page_arrays(src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Both page lists as int64 arrays, checked: same length, no negative page."""
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ConfigError(f"page lists differ in length: {src.size} source, {dst.size} destination")
    if src.size and (src.min() < 0 or dst.min() < 0):
        raise ConfigError("page indices must be >= 0")
    return src, dst


def _runs_np(src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst = _page_arrays(src_pages, dst_pages)
    if not src.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # a run continues where both lists advance by exactly one page
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, count)`` runs where both page lists advance by one."""
    s, d, n = _runs_np(src_pages, dst_pages)
    return list(zip(s.tolist(), d.tolist(), n.tolist()))


_RegionLike = MemoryRegion | RegionInfo


def page_ops(
    pairs: Iterable[tuple[_RegionLike, _RegionLike]],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> WriteOps:
    """Ops copying ``src_pages`` -> ``dst_pages`` for every ``(src, dst)`` region pair
    (typically every layer's K and V), one op per run per pair, region by region.
    Page sizes must match per pair. Built with numpy, so that ~100k ops stay cheap."""
    s, d, n = _runs_np(src_pages, dst_pages)
    # One (P, 4) table of the pairs, then the (P, runs, 5) ops by broadcasting: a
    # per-pair block of numpy assignments costs per region pair, which a small transfer
    # (or a prefill chunk) would pay on every write.
    meta = np.array([(src.region_id, src.item_bytes, dst.region_id, dst.item_bytes) for src, dst in pairs],
                    dtype=np.int64).reshape(-1, 4)
    bad = np.flatnonzero(meta[:, 1] != meta[:, 3])
    if len(bad):
        src, dst = list(pairs)[int(bad[0])]
        raise ConfigError(
            f"page size differs: source {src.name!r} has {src.item_bytes} B pages, "
            f"destination {dst.name!r} has {dst.item_bytes} B"
        )
    pb = meta[:, 1:2]
    out = np.empty((len(meta), s.size, 5), dtype=np.int64)
    out[:, :, 0] = meta[:, 0:1]
    out[:, :, 1] = s * pb
    out[:, :, 2] = meta[:, 2:3]
    out[:, :, 3] = d * pb
    out[:, :, 4] = n * pb
    return WriteOps(out.reshape(-1, 5))


def _head_range(what: str, r: tuple[int, int]) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in r)
    except (TypeError, ValueError):
        raise ConfigError(f"head_slice_ops: {what} must be a (start, end) pair of ints, got {r!r}") from None
    if a < 0 or b <= a:
        raise ConfigError(f"head_slice_ops: {what} [{a}, {b}) is empty or negative")
    return a, b


def head_slice_ops(
    pairs: Iterable[tuple[_RegionLike, _RegionLike]],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    *,
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
    heads: tuple[int, int],
    head_bytes: int,
) -> WriteOps:
    """Ops copying global KV heads ``heads = [h0, h1)`` of ``src_pages`` into
    ``dst_pages`` for every ``(src, dst)`` region pair, when the two pools hold different
    head ranges (TP sizes differ): the source pool's pages hold heads ``src_heads``, the
    destination's ``dst_heads``, each head ``head_bytes`` long within a page (HND layout,
    :mod:`pdgrpc.engine.layout`), so a head slice of a page is one contiguous block.

    Per pair and page ``i``: bytes ``[(h0 - src_heads[0]) * head_bytes, +n)`` of source
    page ``src_pages[i]`` go to ``[(h0 - dst_heads[0]) * head_bytes, +n)`` of destination
    page ``dst_pages[i]``, ``n = (h1 - h0) * head_bytes``. When the slice is the whole
    page on both sides the result is exactly :func:`page_ops` (runs coalesced);
    otherwise one op per page per pair (strided), region pair by region pair. Built
    with numpy like :func:`page_ops`."""
    h0, h1 = _head_range("heads", heads)
    s0, s1 = _head_range("src_heads", src_heads)
    d0, d1 = _head_range("dst_heads", dst_heads)
    hb = int(head_bytes)
    if hb <= 0:
        raise ConfigError(f"head_slice_ops: head_bytes must be > 0, got {head_bytes}")
    if not (s0 <= h0 and h1 <= s1):
        raise ConfigError(f"head_slice_ops: heads [{h0}, {h1}) are not inside the source's src_heads [{s0}, {s1})")
    if not (d0 <= h0 and h1 <= d1):
        raise ConfigError(
            f"head_slice_ops: heads [{h0}, {h1}) are not inside the destination's dst_heads [{d0}, {d1})"
        )
    pairs = list(pairs)
    meta = np.array([(src.region_id, src.item_bytes, dst.region_id, dst.item_bytes) for src, dst in pairs],
                    dtype=np.int64).reshape(-1, 4)
    for col, side, (a, b) in ((1, "source", (s0, s1)), (3, "destination", (d0, d1))):
        bad = np.flatnonzero(meta[:, col] != (b - a) * hb)
        if len(bad):
            region = pairs[int(bad[0])][0 if col == 1 else 1]
            raise ConfigError(
                f"head_slice_ops: {side} region {region.name!r} has {region.item_bytes} B pages, but heads "
                f"[{a}, {b}) x {hb} B per head make {(b - a) * hb} B: page size does not match the declared "
                f"head range"
            )
    if (h0, h1) == (s0, s1) == (d0, d1):
        return page_ops(pairs, src_pages, dst_pages)  # whole pages both sides: coalesced runs
    src, dst = _page_arrays(src_pages, dst_pages)
    out = np.empty((len(meta), src.size, 5), dtype=np.int64)
    out[:, :, 0] = meta[:, 0:1]
    out[:, :, 1] = src * meta[:, 1:2] + (h0 - s0) * hb
    out[:, :, 2] = meta[:, 2:3]
    out[:, :, 3] = dst * meta[:, 3:4] + (h0 - d0) * hb
    out[:, :, 4] = (h1 - h0) * hb
    return WriteOps(out.reshape(-1, 5))


def region_pairs(local: Sequence[_RegionLike], remote: Sequence[_RegionLike]) -> list[tuple[_RegionLike, _RegionLike]]:
    """Pair KV regions by region id (the shared convention)."""
    by_id = {r.region_id: r for r in remote if r.kind is RegionKind.KV}
    pairs = []
    for r in local:
        if r.kind is not RegionKind.KV:
            continue
        if r.region_id not in by_id:
            raise ConfigError(f"peer has no KV region {r.region_id} ({r.name!r})")
        pairs.append((r, by_id[r.region_id]))
    return pairs


def metadata_op(src: _RegionLike, src_slot: int, dst: _RegionLike, dst_slot: int) -> WriteOp:
    """The write of one metadata row (slot ``src_slot`` -> the receiver's ``dst_slot``)."""
    if src.item_bytes != dst.item_bytes:
        raise ConfigError(f"metadata row size differs: {src.item_bytes} B vs {dst.item_bytes} B")
    rb = src.item_bytes
    return WriteOp(src.region_id, src_slot * rb, dst.region_id, dst_slot * rb, rb)
