"""KV layout: pool tensors as documented, head-slice byte ranges, compat hash."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdgrpc.engine import KVLayout, compat_hash
from pdgrpc.engine.layout import PROTOCOL_VERSION
from pdgrpc.errors import ConfigError

from engine_helpers import TINY, make_engine, prefill_into
from transfer_sim import head_slice_range

BASE = KVLayout(num_layers=4, num_pages=64, page_size=16, num_kv_heads=2, head_dim=32, kv_dtype="float32")


def test_pool_tensors_are_pages_first_contiguous_and_match_the_layout() -> None:
    e = make_engine(TINY, kv_dtype="float16", num_pages=10)
    bufs, lay = e.kv_buffers(), e.kv_layout
    assert len(bufs.k) == len(bufs.v) == TINY.num_layers
    for t in bufs.k + bufs.v:
        assert tuple(t.shape) == lay.pool_shape == (10, 2, 16, 32)
        assert t.is_contiguous() and t.dtype == torch.float16
        assert t.numel() * t.element_size() == 10 * lay.page_bytes


def test_token_t_lands_in_page_t_div_page_size_row_t_mod_page_size() -> None:
    """Semantic check of the documented layout: a prompt's K for token t sits at
    pages[t // page_size], row t % page_size, and nowhere else."""
    e = make_engine(TINY, num_pages=8)
    ids = list(range(1, 21))  # 20 tokens: page 0 full, page 1 rows 0..3
    pages = [5, 2]
    prefill_into(e, ids, pages)
    k0 = e.kv_buffers().k[0]
    written = (k0 != 0).flatten(2).any(dim=-1).any(dim=-1)  # [pages] any nonzero K
    assert written.nonzero().flatten().tolist() == [2, 5]
    rows_used = (k0[2] != 0).any(dim=-1).any(dim=0)  # rows of page 2 with data
    assert rows_used.nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_head_slice_range_is_the_bytes_of_those_heads_in_that_page() -> None:
    lay = KVLayout(num_layers=1, num_pages=5, page_size=4, num_kv_heads=8, head_dim=6, kv_dtype="bfloat16", head_start=2, head_end=6)
    pool = torch.arange(lay.num_pages * lay.local_kv_heads * lay.page_size * lay.head_dim, dtype=torch.float32)
    pool = pool.to(torch.bfloat16).reshape(lay.pool_shape)
    flat = pool.view(-1).view(torch.uint8)
    for page, h0, h1 in [(0, 2, 6), (3, 3, 5), (4, 5, 6)]:
        off, n = head_slice_range(lay, page, h0, h1)
        expected = pool[page, h0 - 2 : h1 - 2].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(flat[off : off + n], expected)
    with pytest.raises(ConfigError, match=r"heads \[1, 3\) not within this pool's \[2, 6\)"):
        head_slice_range(lay, 0, 1, 3)
    with pytest.raises(ConfigError, match="page 5 outside"):
        head_slice_range(lay, 5, 2, 3)


def test_compat_hash_covers_every_shared_fact_and_no_per_instance_one() -> None:
    h = compat_hash(BASE, "m")
    # Per-instance facts: pool size and this rank's head slice.
    assert compat_hash(dataclasses.replace(BASE, num_pages=7), "m") == h
    assert compat_hash(dataclasses.replace(BASE, head_start=1, head_end=2), "m") == h
    # Everything both sides must agree on.
    changed = [
        compat_hash(dataclasses.replace(BASE, page_size=8), "m"),
        compat_hash(dataclasses.replace(BASE, kv_dtype="float16"), "m"),
        compat_hash(dataclasses.replace(BASE, num_layers=3), "m"),
        compat_hash(dataclasses.replace(BASE, num_kv_heads=4, head_end=4), "m"),
        compat_hash(dataclasses.replace(BASE, head_dim=64), "m"),
        compat_hash(BASE, "other-model"),
        compat_hash(BASE, "m", protocol_version=PROTOCOL_VERSION - 1),  # a peer of the previous protocol
    ]
    assert len(set(changed + [h])) == len(changed) + 1


def test_engines_of_different_tp_ranks_share_the_hash_other_seeds_do_not() -> None:
    a = make_engine(TINY)
    assert a.compat_hash() == make_engine(TINY, num_pages=3).compat_hash()
    assert a.compat_hash() != make_engine(dataclasses.replace(TINY, seed=1)).compat_hash()


@pytest.mark.parametrize(
    "field, value",
    [("num_layers", 0), ("page_size", -1), ("head_dim", 0), ("kv_dtype", "int8"), ("head_start", 2)],
)
def test_bad_layout_fields_are_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field if field != "head_start" else "head range"):
        dataclasses.replace(BASE, **{field: value})
