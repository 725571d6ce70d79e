"""The data-plane identity rules (pdgrpc.transport.peerauth), with no socket and no loop:
who can prove what, and when a writer counts as gone."""

from __future__ import annotations

from pdgrpc.transport import peerauth
from pdgrpc.transport.peerauth import CredentialStore, WriterTable, credential, new_key, new_nonce, proof, verify

KEY = new_key()
WRITER, RECEIVER = "prefill-1", "decode-1"
CRED = credential(KEY, WRITER, RECEIVER)


def test_the_issued_credential_proves_its_writer() -> None:
    nonce = new_nonce()
    assert verify(KEY, b"tcp", nonce, WRITER, RECEIVER, proof(CRED, b"tcp", nonce, WRITER, RECEIVER))


def test_what_a_forger_can_know_proves_nothing() -> None:
    nonce = new_nonce()
    cases = {
        "no proof": b"",
        "another nonce (a replay)": proof(CRED, b"tcp", new_nonce(), WRITER, RECEIVER),
        "another channel": proof(CRED, b"liveness", nonce, WRITER, RECEIVER),
        "another writer's credential": proof(credential(KEY, "prefill-2", RECEIVER), b"tcp", nonce, WRITER, RECEIVER),
        "another receiver's key": proof(credential(new_key(), WRITER, RECEIVER), b"tcp", nonce, WRITER, RECEIVER),
    }
    for what, answer in cases.items():
        assert not verify(KEY, b"tcp", nonce, WRITER, RECEIVER, answer), what
    good = proof(CRED, b"tcp", nonce, WRITER, RECEIVER)
    assert not verify(KEY, b"tcp", nonce, "prefill-2", RECEIVER, good)  # the proof names its writer
    assert not verify(KEY, b"tcp", b"", WRITER, RECEIVER, proof(CRED, b"tcp", b"", WRITER, RECEIVER))  # no challenge


def test_ids_cannot_be_shifted_between_writer_and_receiver() -> None:
    assert credential(KEY, "ab", "c") != credential(KEY, "a", "bc")


def test_a_writer_is_gone_only_when_its_last_connection_ended_from_its_side() -> None:
    t = WriterTable()
    assert not t.gone(WRITER)  # never seen: nothing confirmed
    t.opened(WRITER)
    t.opened(WRITER)
    t.closed(WRITER, by_peer=True)
    assert not t.gone(WRITER)  # one still open
    t.closed(WRITER, by_peer=True)
    assert t.gone(WRITER)
    t.opened(WRITER)  # it proved itself again: alive
    assert not t.gone(WRITER)


def test_a_writer_this_side_cut_off_is_not_gone() -> None:
    # A missed heartbeat (a hung writer) or a protocol error: this side closed it; the
    # writer may still hold bytes to send, so its rooms stay under the lease rule.
    t = WriterTable()
    t.opened(WRITER)
    t.opened(WRITER)
    t.closed(WRITER, by_peer=False)
    t.closed(WRITER, by_peer=True)
    assert not t.gone(WRITER)
    t.closed(WRITER, by_peer=True)  # more closes than opens change nothing
    assert not t.gone(WRITER) and t.open[WRITER] == 0


def test_tables_are_bounded() -> None:
    t = WriterTable(limit=3)
    for i in range(10):
        t.opened(f"w{i}")
        t.closed(f"w{i}", by_peer=True)
    assert [t.gone(f"w{i}") for i in range(10)] == [False] * 7 + [True] * 3
    store = CredentialStore(limit=2)
    for i in range(3):
        store.put(f"r{i}", bytes([i]) * 32)
    assert store.get("r0") == b"" and store.get("r2") == bytes([2]) * 32


def test_a_receiver_in_this_process_needs_no_control_plane() -> None:
    key = new_key()
    peerauth.remember_key("decode-local", key)
    assert peerauth.known_credential("decode-local", WRITER) == credential(key, WRITER, "decode-local")
    assert peerauth.known_credential("decode-elsewhere", WRITER) == b""
