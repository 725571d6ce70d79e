"""pdgrpc.state.ejections: which instances a router passes over, with a fake clock (no
sockets; the router's use of it is in test_router_retry)."""

from __future__ import annotations

from pdgrpc.state.ejections import Ejections
from pdgrpc.state.routing import candidates

ADDRS = ["a:1", "b:2", "c:3"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def picks(e: Ejections, turns: range, role: str = "prefill") -> list[str]:
    """A round robin over the instances not ejected (all of them when every one is)."""
    pool = candidates(ADDRS, e.now(role))
    return [ADDRS[pool[t % len(pool)]] for t in turns]


def test_round_robin_passes_over_an_ejected_instance_until_its_time_is_up() -> None:
    clock = Clock()
    e = Ejections(5.0, clock)
    assert picks(e, range(3)) == ADDRS
    assert e.eject("prefill", "b:2")
    assert set(picks(e, range(10))) == {"a:1", "c:3"}
    assert picks(e, range(3), role="decode") == ADDRS  # roles apart: a decode at b:2 is fine
    clock.now += 4.9
    assert "b:2" not in picks(e, range(10))
    clock.now += 0.2
    assert picks(e, range(3)) == ADDRS


def test_a_second_failure_extends_the_ejection_and_is_not_a_new_one() -> None:
    clock = Clock()
    e = Ejections(5.0, clock)
    assert e.eject("decode", "a:1")
    clock.now += 4.0
    assert not e.eject("decode", "a:1")
    clock.now += 4.0
    assert e.now("decode") == {"a:1"}  # 8 s after the first failure, 4 after the second
    clock.now += 1.1
    assert not e.now("decode")


def test_with_every_instance_ejected_all_are_chosen_and_a_success_readmits() -> None:
    clock = Clock()
    e = Ejections(5.0, clock)
    for a in ADDRS:
        e.eject("prefill", a)
    assert picks(e, range(3)) == ADDRS  # better a likely failure than a certain refusal
    assert e.recovered("prefill", "c:3", clock()) and not e.recovered("prefill", "c:3", clock())
    assert set(picks(e, range(10))) == {"c:3"}


def test_only_a_call_admitted_since_the_ejection_ends_it() -> None:
    """A draining decode refuses new calls while the streams it admitted before finish:
    their successes say nothing of new requests, so it stays passed over until a call
    sent after its refusal succeeds there (a probe once the ejection ran out, or a pick
    when every decode is ejected)."""
    clock = Clock()
    e = Ejections(5.0, clock)
    before = clock()  # a long stream, admitted before the drain
    clock.now += 1.0
    assert e.eject("decode", "a:1")  # a new call refused: draining
    clock.now += 1.0
    assert not e.recovered("decode", "a:1", before)  # the old stream finished well
    assert e.now("decode") == {"a:1"}
    assert e.recovered("decode", "a:1", clock())  # a call sent after the refusal succeeded
    assert not e.now("decode")


def test_zero_seconds_never_ejects_and_expired_entries_are_dropped() -> None:
    clock = Clock()
    assert not Ejections(0.0, clock).eject("prefill", "a:1")
    e = Ejections(1.0, clock)
    for i in range(1000):  # instances that come and go under discovery
        e.eject("prefill", f"h{i}:1")
        clock.now += 2.0
    assert len(e) == 1  # only the latest, still ejected
