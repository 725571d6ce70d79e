"""The page allocator: all-or-nothing allocation, exhaustion, misuse detection."""

from __future__ import annotations

import pytest

from pdgrpc.engine.pages import FifoPageAllocator
from pdgrpc.errors import ConfigError, SlotError


def test_exhaustion_returns_none_and_takes_nothing() -> None:
    a = FifoPageAllocator(5)
    got = a.alloc(3)
    assert got is not None and len(set(got)) == 3
    assert a.alloc(3) is None
    assert a.num_free == 2
    assert a.alloc(2) is not None and a.num_free == 0
    assert a.alloc(1) is None


def test_freed_pages_come_back_and_reuse_is_fifo() -> None:
    a = FifoPageAllocator(4)
    first = a.alloc(4)
    assert first is not None
    a.free([first[2], first[0]])
    assert a.num_free == 2
    assert a.alloc(2) == [first[2], first[0]]


def test_double_free_and_foreign_pages_raise_and_change_nothing() -> None:
    a = FifoPageAllocator(4)
    pages = a.alloc(2)
    assert pages is not None
    a.free([pages[0]])
    with pytest.raises(SlotError, match=f"page {pages[0]} is not allocated"):
        a.free([pages[1], pages[0]])  # all-or-nothing: pages[1] stays allocated
    assert a.num_free == 3
    with pytest.raises(SlotError, match=f"page {pages[1]} is not allocated"):
        a.free([pages[1], pages[1]])
    with pytest.raises(SlotError, match="outside the pool"):
        a.free([4])
    a.free([pages[1]])
    assert a.num_free == 4


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_pages"):
        FifoPageAllocator(0)
    with pytest.raises(ConfigError, match="n must be >= 0"):
        FifoPageAllocator(2).alloc(-1)
