"""Metadata rows (layout, write order), slot allocator and page allocator with quarantine."""

from __future__ import annotations

import math

import pytest
import torch

from pdgrpc.errors import ConfigError, SlotError
from pdgrpc.state import MetadataBuffers, MetadataLayout, MetadataRow, PageAllocator, SlotAllocator
from pdgrpc.state.metadata import FIELD_ALIGN, row_problem


@pytest.mark.parametrize("top_k, hidden", [(16, 0), (0, 0), (20, 0), (16, 4096), (5, 3)])
def test_every_field_is_padded_to_64_bytes_and_room_is_last(top_k: int, hidden: int) -> None:
    lay = MetadataLayout(top_k=top_k, hidden_size=hidden, hidden_dtype=torch.bfloat16)
    names = [f.name for f in lay]
    assert names[0] == "output_id" and names[-1] == "bootstrap_room"
    assert ("hidden_state" in names) == bool(hidden)
    off = 0
    for f in lay:
        assert f.offset == off and f.offset % FIELD_ALIGN == 0 and f.nbytes % FIELD_ALIGN == 0
        assert f.used_bytes <= f.nbytes
        off += f.nbytes
    assert lay.row_bytes == off
    assert lay.fields["bootstrap_room"].dtype is torch.int64
    assert "bootstrap_room" in lay.describe()


def test_default_layout_matches_the_documented_table() -> None:
    lay = MetadataLayout()
    assert {f.name: f.offset for f in lay} == {
        "output_id": 0,
        "cached_tokens": 64,
        "output_token_logprob_value": 128,
        "output_token_logprob_index": 192,
        "top_logprobs_values": 256,
        "top_logprobs_indices": 320,
        "bootstrap_room": 384,
    }
    assert lay.row_bytes == 448


def test_row_round_trip_and_views_share_memory() -> None:
    b = MetadataBuffers(4, MetadataLayout(top_k=4, hidden_size=8, hidden_dtype=torch.float32))
    row = MetadataRow(123, 7, -0.5, 123, (-0.5, -1.0, -2.0), (123, 9, 10), torch.arange(8, dtype=torch.float32))
    b.write_row(2, row, 555)
    got = b.read_row(2)
    assert (got.output_id, got.cached_tokens, got.output_token_logprob_value, got.output_token_logprob_index) == (123, 7, -0.5, 123)
    assert got.top_logprobs_values == (-0.5, -1.0, -2.0, 0.0) and got.top_logprobs_indices == (123, 9, 10, 0)
    assert got.hidden_state is not None and torch.equal(got.hidden_state, row.hidden_state)
    assert b.room(2) == 555 and b.room_column().tolist() == [0, 0, 555, 0]
    assert b.field("output_id")[2, 0].item() == 123
    assert b.row(2).data_ptr() == b.tensor.data_ptr() + 2 * b.layout.row_bytes  # a view, not a copy
    # A transport copying the row's bytes elsewhere copies every field (prefill send buffer -> decode slot).
    other = MetadataBuffers(4, b.layout)
    other.row(0).copy_(b.row(2))
    assert other.read_row(0).output_id == 123 and other.room(0) == 555


def test_a_reused_row_carries_no_top_logprobs_of_the_previous_request() -> None:
    """A send row is reused: a row without top logprobs must not keep the last one's."""
    b = MetadataBuffers(2, MetadataLayout(top_k=4))
    b.write_row(0, MetadataRow(5, top_logprobs_values=(-1.0, -2.0), top_logprobs_indices=(5000, 9)), 1)
    b.write_row(0, MetadataRow(6), 2)
    got = b.read_row(0)
    assert got.top_logprobs_indices == (0, 0, 0, 0) and got.top_logprobs_values == (0.0,) * 4


def test_row_problem_names_what_cannot_be_committed() -> None:
    assert row_problem(MetadataRow(5, output_token_logprob_value=-0.1, top_logprobs_values=(-0.1, -math.inf), top_logprobs_indices=(5, 7)), 10) is None
    assert row_problem(MetadataRow(10), 10) == "output_id 10 is not a token id in [0, 10)"
    assert row_problem(MetadataRow(-1), 10) == "output_id -1 is not a token id in [0, 10)"
    assert row_problem(MetadataRow(1, output_token_logprob_value=math.inf), 10) == "output_token_logprob_value inf is not finite"
    assert row_problem(MetadataRow(1, top_logprobs_indices=(3, 11)), 10) == "top_logprobs_indices holds 11, not a token id in [0, 10)"
    assert row_problem(MetadataRow(1, top_logprobs_values=(math.nan,)), 10) == "top_logprobs_values holds nan"


def test_payload_alone_leaves_the_row_unwritten() -> None:
    b = MetadataBuffers(1)
    b.write_payload(0, MetadataRow(9))
    assert b.room(0) == 0  # the room is a separate, final write


@pytest.mark.parametrize("bad, field", [(lambda b: b.write_payload(0, MetadataRow(1, top_logprobs_values=(0.0,) * 17)), "top_logprobs_values"),
                                        (lambda b: b.field("nope"), "nope")])
def test_bad_row_input_names_the_field(bad, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=field):
        bad(MetadataBuffers(1))


def test_slot_free_zeroes_the_room_before_reuse() -> None:
    b = MetadataBuffers(2)
    s = SlotAllocator(b)
    a = s.alloc()
    assert a == 0
    b.write_row(a, MetadataRow(1), 42)
    s.free(a)
    assert b.room(a) == 0
    assert [s.alloc(), s.alloc()] == [1, 0]  # FIFO: deterministic across TP ranks
    assert b.room_column().tolist() == [0, 0]


def test_slot_pool_full_returns_none_without_overwriting() -> None:
    b = MetadataBuffers(2)
    s = SlotAllocator(b)
    got = [s.alloc(), s.alloc()]
    b.write_row(0, MetadataRow(1), 11)
    assert s.alloc() is None and s.num_free == 0
    assert b.room(0) == 11 and sorted(got) == [0, 1]  # type: ignore[type-var]


@pytest.mark.parametrize("misuse, msg", [("double", "double free"), ("never", "not allocated"), ("range", "out of range")])
def test_slot_misuse_raises(misuse: str, msg: str) -> None:
    s = SlotAllocator(MetadataBuffers(2))
    x = s.alloc()
    assert x is not None
    with pytest.raises(SlotError, match=msg):
        if misuse == "double":
            s.free(x)
            s.free(x)
        elif misuse == "never":
            s.free(1)
        else:
            s.free(5)


def test_pages_all_or_nothing_and_quarantine() -> None:
    p = PageAllocator(5)
    a = p.alloc(3)
    assert a == (0, 1, 2)
    assert p.alloc(3) is None and p.num_free == 2  # not enough: nothing taken, caller waits
    p.quarantine(77, a)
    assert p.num_quarantined == 3 and all(p.is_quarantined(x) for x in a)
    assert p.alloc(3) is None  # quarantined pages are not reusable
    with pytest.raises(SlotError, match="quarantined"):
        p.free(a)
    assert p.release(77) == a
    assert p.num_free == 5 and p.alloc(5) is not None


def test_freed_pages_come_back_in_the_order_they_were_held() -> None:
    # A request that held an ascending run hands the next request an ascending run, so a
    # transport moves each region's share of a prompt as one op; pushed back as they came,
    # every other request got its pages descending (one op per page).
    p = PageAllocator(64)
    for _ in range(4):
        run = p.alloc(32)
        assert run is not None and list(run) == sorted(run) and run[-1] - run[0] == 31
        p.free(run)
    held = p.alloc(8)
    assert held is not None
    p.quarantine(5, held)
    p.release(5)
    assert p.alloc(8) == held


@pytest.mark.parametrize(
    "op, msg",
    [
        (lambda p: p.free([0]), "page 0 is free"),
        (lambda p: p.free([9]), "out of range"),
        (lambda p: p.release(5), "no quarantined pages"),
        (lambda p: p.alloc(0), "n must be > 0"),
        (lambda p: (p.alloc(2), p.free([0, 0])), "duplicate"),
        (lambda p: (p.alloc(2), p.quarantine(1, [0]), p.quarantine(1, [1])), "already has"),
    ],
)
def test_page_misuse_raises(op, msg: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((SlotError, ConfigError), match=msg):
        op(PageAllocator(4))
