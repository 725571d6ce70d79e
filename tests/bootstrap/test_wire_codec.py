"""The numpy codec writes what protobuf reads, and reads only what protobuf would read
the same way (declining anything else)."""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgrpc.bootstrap import wire
from pdgrpc.v1 import bootstrap_pb2 as pb

room = st.one_of(st.integers(1, 2**64 - 1), st.sampled_from([1, 127, 128, 2**56, 2**63, 2**64 - 1]))
rank = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 8))
entries = st.lists(st.tuples(room, rank), max_size=60)
rooms = st.lists(room, max_size=20)


def arrays(es: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([r for r, _ in es], np.uint64), np.array([k for _, k in es], np.uint32)


@settings(max_examples=150, deadline=None)
@given(es=entries, missing=rooms)
def test_encoded_response_is_protobuf(es: list[tuple[int, int]], missing: list[int]) -> None:
    data = wire.encode_query_response(*arrays(es), np.array(missing, np.uint64))
    msg = pb.QueryDpRanksResponse.FromString(data)
    assert [(e.bootstrap_room, e.dp_rank) for e in msg.entries] == es and list(msg.missing_rooms) == missing


@settings(max_examples=150, deadline=None)
@given(es=entries)
def test_encoded_request_is_protobuf_and_decodes_back(es: list[tuple[int, int]]) -> None:
    data = wire.encode_entries(*arrays(es))
    assert [(e.bootstrap_room, e.dp_rank) for e in pb.RegisterDpRanksRequest.FromString(data).entries] == es
    got = wire.decode_register_request(data)
    assert got is not None and list(zip(got[0].tolist(), got[1].tolist())) == es


@settings(max_examples=150, deadline=None)
@given(es=entries)
def test_other_encoders_output_is_read_right_or_declined(es: list[tuple[int, int]]) -> None:
    """Canonical protobuf omits zero ranks: the fast path must agree or say None."""
    msg = pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in es])
    got = wire.decode_register_request(msg.SerializeToString())
    if got is not None:
        assert list(zip(got[0].tolist(), got[1].tolist())) == es
    if any(k == 0 for _, k in es):
        assert got is None
    extra = msg.SerializeToString() + pb.QueryDpRanksResponse(missing_rooms=[5]).SerializeToString()
    assert wire.decode_register_request(extra) is None  # an unknown field: declined


@settings(max_examples=300, deadline=None)
@given(es=entries.filter(bool), data=st.data())
def test_corrupted_bytes_never_decode_to_a_wrong_answer(es: list[tuple[int, int]], data: st.DataObject) -> None:
    raw = bytearray(wire.encode_entries(*arrays(es)))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        ref = pb.RegisterDpRanksRequest.FromString(bytes(raw))
    except DecodeError:
        ref = None
    got = wire.decode_register_request(bytes(raw))
    if got is not None:
        assert ref is not None
        assert got[0].tolist() == [e.bootstrap_room for e in ref.entries]
        assert got[1].tolist() == [e.dp_rank for e in ref.entries]


@settings(max_examples=150, deadline=None)
@given(r=st.one_of(room, st.just(0)), k=rank)
def test_one_room_request_is_protobuf_byte_for_byte_and_decodes_back(r: int, k: int) -> None:
    data = wire.encode_one_room(r, k)
    want = pb.RegisterDpRanksRequest(packed_rooms=r.to_bytes(8, "little"), packed_dp_ranks=k.to_bytes(4, "little"))
    assert data == want.SerializeToString()
    assert wire.decode_one_room(data) == (r, k)


def test_one_room_decoder_declines_every_other_layout() -> None:
    rooms, ranks = (7).to_bytes(8, "little"), (1).to_bytes(4, "little")
    swapped = pb.RegisterDpRanksRequest(packed_dp_ranks=ranks).SerializeToString() + pb.RegisterDpRanksRequest(packed_rooms=rooms).SerializeToString()
    two_ranks = pb.RegisterDpRanksRequest(packed_rooms=rooms[:6], packed_dp_ranks=ranks * 1 + b"\0\0").SerializeToString()
    entries = pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=2**62, dp_rank=2**20)]).SerializeToString()
    for data in (swapped, two_ranks, entries, b"", wire.encode_one_room(7, 1)[:15]):
        assert wire.decode_one_room(data) is None, data.hex()
    assert len(swapped) == 16 and len(two_ranks) == 16
