"""The prefill sender machine: transitions, chunked page writes with the partial last page
held back, write batching, metadata row last (with the final pages), failure from every
state, per-phase deadlines."""

from __future__ import annotations

import pytest

from pdgrpc.errors import ConfigError, IllegalTransition
from pdgrpc.state import KVPoll, PrefillSender, SenderDeadlines, SenderState
from pdgrpc.state.prefill_sender import (
    SENDER_TRANSITIONS,
    ChunkDone,
    DestinationReceived,
    Fail,
    MetadataWritten,
    PagesWritten,
    SenderEvent,
    SenderFailReason,
    WriteMetadata,
    WritePages,
    write_pages_for,
)

T = SenderState
DL = SenderDeadlines(waiting_for_destination_s=1, waiting_for_input_s=2, transferring_s=3)
SRC = (10, 11, 12)  # 40 tokens at page_size 16: two full pages and a partial one
DST = (20, 21, 22)


def sender(now: float = 0.0) -> PrefillSender:
    s = PrefillSender.create(5, SRC, 40, 16, now, deadlines=DL)
    assert s.state is T.WAITING_FOR_DESTINATION and s.poll() is KVPoll.BOOTSTRAPPING
    return s


def sender_in(state: SenderState) -> PrefillSender:
    s = sender()
    if state is T.WAITING_FOR_DESTINATION:
        return s
    s.handle(DestinationReceived(DST, 4), 0.0)
    if state is T.WAITING_FOR_INPUT:
        return s
    s.handle(ChunkDone(16), 0.0)
    if state is T.TRANSFERRING:
        return s
    s.handle(PagesWritten(1), 0.0)
    s.handle(ChunkDone(40, last=True), 0.0)
    if state is T.SENDING_METADATA:
        return s
    if state is T.SUCCESS:
        s.handle(MetadataWritten(), 0.0)
    else:
        s.handle(Fail(SenderFailReason.CANCELLED, "x"), 0.0)
    assert s.state is state
    return s


def test_chunked_transfer_holds_back_the_partial_page_and_sends_metadata_last() -> None:
    s = sender()
    assert s.handle(DestinationReceived(DST, 4), 0.0) == [] and s.poll() is KVPoll.WAITING_FOR_INPUT
    # chunk 1: 10 tokens, no page complete yet
    assert s.handle(ChunkDone(10), 0.1) == [] and s.state is T.TRANSFERRING
    # chunk 2: 20 tokens, page 0 complete
    assert s.handle(ChunkDone(20), 0.2) == [WritePages(5, (10,), (20,))]
    # chunk 3: 35 tokens, page 1 complete; page 2 is partial and held back
    assert s.handle(ChunkDone(35), 0.3) == [WritePages(5, (11,), (21,))]
    assert s.handle(PagesWritten(1), 0.4) == []  # no metadata before the last chunk
    # final chunk while a write is outstanding: the partial page goes now; the metadata
    # row waits for every page write to complete
    assert s.handle(ChunkDone(40, last=True), 0.5) == [WritePages(5, (12,), (22,))]
    assert s.state is T.TRANSFERRING and s.poll() is KVPoll.TRANSFERRING
    assert s.handle(PagesWritten(1), 0.6) == []
    assert s.handle(PagesWritten(1), 0.6) == [WriteMetadata(5, 4)]
    assert s.state is T.SENDING_METADATA and s.poll() is KVPoll.TRANSFERRING
    assert s.handle(MetadataWritten(), 0.7) == [] and s.poll() is KVPoll.SUCCESS and s.is_terminal


def test_final_chunk_with_nothing_outstanding_sends_the_rest_of_the_pages_with_the_row() -> None:
    s = sender_in(T.WAITING_FOR_INPUT)
    assert s.handle(ChunkDone(20), 0.0) == [WritePages(5, (10,), (20,))]
    assert s.handle(PagesWritten(1), 0.0) == []
    # one write: pages 11 and the partial 12, then the row (the transport lands it last)
    assert s.handle(ChunkDone(40, last=True), 0.0) == [WriteMetadata(5, 4, (11, 12), (21, 22))]
    assert s.state is T.SENDING_METADATA


def test_single_chunk_prompt_writes_all_pages_then_metadata() -> None:
    s = sender_in(T.WAITING_FOR_INPUT)
    assert s.handle(ChunkDone(40, last=True), 0.0) == [WriteMetadata(5, 4, SRC, DST)]
    assert s.state is T.SENDING_METADATA


def test_pages_are_held_back_until_min_write_pages_are_pending() -> None:
    src, dst = tuple(range(10, 20)), tuple(range(30, 40))  # 10 pages of 4 tokens
    s = PrefillSender.create(5, src, 40, 4, 0.0, deadlines=DL, min_write_pages=3)
    s.handle(DestinationReceived(dst, 1), 0.0)
    assert s.handle(ChunkDone(8), 0.0) == []  # 2 pages pending
    assert s.handle(ChunkDone(14), 0.0) == [WritePages(5, (10, 11, 12), (30, 31, 32))]  # 3: worth a write
    assert s.handle(PagesWritten(3), 0.0) == []
    assert s.handle(ChunkDone(22), 0.0) == []  # pages 13, 14 pending; 15 is partial
    assert s.handle(ChunkDone(40, last=True), 0.0) == [WriteMetadata(5, 1, src[3:], dst[3:])]


@pytest.mark.parametrize(
    ("num_tokens", "min_write_pages", "planned"),
    [(40, 3, True), (40, 2, False), (32, 1, False), (16, 1, True), (4, 0, True), (40, 0, False)],
)
def test_the_final_write_is_known_ahead_only_when_no_earlier_chunk_can_write(
    num_tokens: int, min_write_pages: int, planned: bool
) -> None:
    src = tuple(range(-(-num_tokens // 16)))
    s = PrefillSender.create(5, src, num_tokens, 16, 0.0, deadlines=DL, min_write_pages=min_write_pages)
    assert s.planned_final_write() is None  # no destination yet
    s.handle(DestinationReceived(src, 2), 0.0)
    plan = s.planned_final_write()
    assert (plan is not None) is planned
    if plan is not None:
        # whatever the chunking, the last chunk emits exactly the planned write
        for end in range(5, num_tokens, 5):
            assert s.handle(ChunkDone(end), 0.0) == []
        assert s.handle(ChunkDone(num_tokens, last=True), 0.0) == [plan]


def test_write_pages_for_rounds_up_to_whole_pages() -> None:
    assert [write_pages_for(b, 100) for b in (0, 1, 100, 101, 350)] == [0, 1, 1, 2, 4]
    with pytest.raises(ConfigError, match="page_nbytes"):
        write_pages_for(1, 0)


EVENTS: list[SenderEvent] = [DestinationReceived(DST, 4), ChunkDone(32), PagesWritten(1), MetadataWritten(), Fail(SenderFailReason.TRANSFER_FAILED, "peer died")]


@pytest.mark.parametrize("state", list(T), ids=lambda s: s.name)
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_state_event_pair(state: SenderState, event: SenderEvent) -> None:
    s = sender_in(state)
    before = (s.state, s.deadline, s.pages_sent, s.pages_written, s.tokens_done)
    allowed = SENDER_TRANSITIONS.get((state, type(event)))
    # PagesWritten with nothing outstanding is illegal even where the event type is allowed.
    if state is T.TRANSFERRING and isinstance(event, PagesWritten):
        allowed = None if s.pages_sent == s.pages_written else allowed
    if allowed is None:
        with pytest.raises(IllegalTransition):
            s.handle(event, 1.0)
        assert (s.state, s.deadline, s.pages_sent, s.pages_written, s.tokens_done) == before
    else:
        s.handle(event, 1.0)
        assert s.state in allowed


@pytest.mark.parametrize("state", [T.WAITING_FOR_DESTINATION, T.WAITING_FOR_INPUT, T.TRANSFERRING, T.SENDING_METADATA])
def test_failure_from_every_non_terminal_state(state: SenderState) -> None:
    s = sender_in(state)
    assert s.handle(Fail(SenderFailReason.TRANSFER_FAILED, "peer died"), 1.0) == []
    assert s.state is T.FAILED and s.poll() is KVPoll.FAILED and s.failure is not None


@pytest.mark.parametrize(
    "state, limit, reason",
    [
        (T.WAITING_FOR_DESTINATION, 1, SenderFailReason.WAITING_FOR_DESTINATION_TIMEOUT),
        (T.WAITING_FOR_INPUT, 2, SenderFailReason.WAITING_FOR_INPUT_TIMEOUT),
        (T.TRANSFERRING, 2, SenderFailReason.WAITING_FOR_INPUT_TIMEOUT),  # chunks still to compute
        (T.SENDING_METADATA, 3, SenderFailReason.TRANSFER_TIMEOUT),
    ],
)
def test_every_non_terminal_sender_state_has_a_deadline(state: SenderState, limit: float, reason: SenderFailReason) -> None:
    s = sender_in(state)  # entered at t=0
    assert s.deadline == limit
    assert s.tick(limit) is None and s.state is state
    f = s.tick(limit + 0.01)
    assert f is not None and f.reason is reason and state.name in f.message and s.state is T.FAILED
    assert s.failure == f and s.tick(limit + 100) is None  # terminal: no second failure


def test_each_chunk_restarts_the_compute_deadline() -> None:
    s = sender_in(T.WAITING_FOR_INPUT)
    s.handle(ChunkDone(10), 1.5)
    assert s.deadline == 3.5 and s.tick(3.4) is None
    s.handle(ChunkDone(20), 3.0)  # completes page 0: a write, and a new compute deadline
    assert s.deadline == 5.0 and s.tick(4.9) is None and s.state is T.TRANSFERRING


def test_after_the_last_chunk_the_wire_deadline_runs() -> None:
    s = sender_in(T.TRANSFERRING)  # page 0 written but not completed
    assert s.handle(ChunkDone(40, last=True), 1.0) == [WritePages(5, (11, 12), (21, 22))]
    assert s.deadline == 1.0 + 3  # transferring_s, not the compute's limit
    assert s.handle(PagesWritten(1), 2.0) == [] and s.deadline == 2.0 + 3  # progress on the wire
    f = s.tick(5.5)
    assert f is not None and f.reason is SenderFailReason.TRANSFER_TIMEOUT


def test_bad_destination_fails_with_a_message() -> None:
    s = sender()
    s.handle(DestinationReceived((1, 2), 4), 0.0)
    assert s.state is T.FAILED and s.failure is not None
    assert s.failure.reason is SenderFailReason.BAD_DESTINATION and "needs exactly 3 pages" in s.failure.message


@pytest.mark.parametrize(
    "event, msg",
    [(ChunkDone(0), "must grow"), (ChunkDone(41), "must grow"), (ChunkDone(40), r"last=False"), (ChunkDone(16, last=True), "last=True")],
)
def test_bad_chunks_raise_and_change_nothing(event: ChunkDone, msg: str) -> None:
    s = sender_in(T.WAITING_FOR_INPUT)
    with pytest.raises(IllegalTransition, match=msg):
        s.handle(event, 0.0)
    assert s.state is T.WAITING_FOR_INPUT and s.tokens_done == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [({"page_size": 0}, "page_size"), ({"num_tokens": 0}, "num_tokens"), ({"src_pages": (1,)}, "src_pages")],
)
def test_bad_construction_names_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"room": 5, "src_pages": SRC, "num_tokens": 40, "page_size": 16, "now": 0.0}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=field):
        PrefillSender.create(**args)  # type: ignore[arg-type]


def test_sender_deadlines_validation() -> None:
    with pytest.raises(ConfigError, match="transferring_s"):
        SenderDeadlines(transferring_s=-1)


def test_the_decodes_cached_pages_are_never_written() -> None:
    """cached_pages = 1: chunks that complete page 0 write nothing; pages 1.. and the row go."""
    s = sender_in(T.WAITING_FOR_DESTINATION)
    s.handle(DestinationReceived(DST, 4, cached_pages=1), 0.0)
    assert s.handle(ChunkDone(20), 0.0) == []  # page 0 complete: the decode holds it
    assert s.handle(ChunkDone(35), 0.0) == [WritePages(5, (11,), (21,))]
    assert s.handle(PagesWritten(1), 0.0) == []
    assert s.handle(ChunkDone(40, last=True), 0.0) == [WriteMetadata(5, 4, (12,), (22,))]


def test_a_decode_holding_every_page_gets_the_row_alone() -> None:
    s = sender_in(T.WAITING_FOR_DESTINATION)
    s.handle(DestinationReceived(DST, 4, cached_pages=3), 0.0)
    assert s.handle(ChunkDone(40, last=True), 0.0) == [WriteMetadata(5, 4)]
    assert s.state is T.SENDING_METADATA


@pytest.mark.parametrize("cached", [-1, 4])
def test_cached_pages_outside_the_prompt_fail_naming_them(cached: int) -> None:
    s = sender()
    s.handle(DestinationReceived(DST, 4, cached_pages=cached), 0.0)
    assert s.state is T.FAILED and s.failure is not None and f"({cached} of them cached)" in s.failure.message
