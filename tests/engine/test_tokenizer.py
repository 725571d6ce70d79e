"""The byte tokenizer: exact round trips, specials, streaming, and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgrpc.engine import BOS_ID, EOS_ID, ByteTokenizer
from pdgrpc.errors import EngineError

tok = ByteTokenizer()


@settings(deadline=None)  # no timing assertions: CI boxes are shared
@given(st.binary(max_size=300))
def test_any_bytes_round_trip(data: bytes) -> None:
    ids = tok.encode(data)
    assert ids[0] == BOS_ID and len(ids) == len(data) + 1
    assert tok.decode_bytes(ids) == data


@settings(deadline=None)  # no timing assertions: CI boxes are shared
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_any_text_round_trips_through_utf8(text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_specials_are_dropped_from_text_and_broken_utf8_is_replaced() -> None:
    assert tok.decode([BOS_ID, *b"ok", EOS_ID]) == "ok"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a truncated 3-byte character


@settings(deadline=None)  # no timing assertions: CI boxes are shared
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_stream_decoder_never_splits_a_character(text: str) -> None:
    dec = tok.stream_decoder()
    pieces = [dec.feed([t]) for t in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)


def test_bad_inputs_raise_engine_errors_naming_the_problem() -> None:
    with pytest.raises(EngineError, match="not encodable as UTF-8"):
        tok.encode("lone \udc80 surrogate")
    with pytest.raises(EngineError, match="must be str or bytes"):
        tok.encode(123)  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=r"token_ids\[1\] = 258"):
        tok.decode([65, 258])
    with pytest.raises(EngineError, match=r"token_ids\[0\] = -1"):
        tok.decode_bytes([-1])
