"""Property-based test of the decode queues across 1-4 simulated TP ranks.

Hypothesis interleaves admissions, handshakes, page-transfer reports, metadata landing per
rank (random order and delay), slot reuse, corruption, cancels, transport failures, late
writes from aborted prefills, acks, writers confirmed gone on some ranks, and clock ticks,
and checks after every step (see ``state_sim.Cluster``): nothing commits with a wrong room
or token; nothing commits before its metadata landed on every rank; all ranks pop the same
requests in the same order; no request aborts on a stale room; every request ends by its
deadline; every page and slot is free, quarantined, in a transfer or committed; and at
quiescence every slot and page is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdgrpc.kvpoll import KVPoll
from state_sim import Cluster


class DecodeCluster(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.c: Cluster | None = None
        self.next_room = 1

    @initialize(tp=st.integers(1, 4), num_slots=st.integers(1, 8), pages_per_slot=st.integers(1, 3))
    def start(self, tp: int, num_slots: int, pages_per_slot: int) -> None:
        # At least 3 pages (the largest request), usually fewer than the slots could use.
        self.c = Cluster(tp, num_slots=num_slots, num_pages=max(3, num_slots * pages_per_slot))

    @property
    def cl(self) -> Cluster:
        assert self.c is not None
        return self.c

    def _open(self) -> list[int]:
        return sorted(r for r, t in self.cl.truth.items() if t.outcome is None and t.slot is not None)

    def _aborted_live(self) -> list[int]:
        return sorted(t.room for t in self.cl.live_writers())

    @rule(n=st.integers(1, 20), pages=st.integers(1, 3))
    def add_requests(self, n: int, pages: int) -> None:
        for _ in range(n):
            # Rooms are arbitrary 63-bit values; a multiplier spreads them.
            self.cl.add((self.next_room * 0x9E3779B97F4A7C15) % (1 << 63) or 1, pages)
            self.next_room += 1

    @rule()
    def prealloc(self) -> None:
        self.cl.prealloc()

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data(), status=st.sampled_from([KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING, KVPoll.SUCCESS]))
    def kv_progress(self, data: st.DataObject, status: KVPoll) -> None:
        room = data.draw(st.sampled_from(self._open()))
        ranks = data.draw(st.sets(st.integers(0, self.cl.tp - 1), min_size=1))
        for r in ranks:
            self.cl.report(r, room, status)

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data())
    def transfer_completes(self, data: st.DataObject) -> None:
        """KV done on every rank; the row lands on some of them (the others later, or never)."""
        room = data.draw(st.sampled_from(self._open()))
        for r in range(self.cl.tp):
            self.cl.report(r, room, KVPoll.SUCCESS)
        for r in data.draw(st.sets(st.integers(0, self.cl.tp - 1))):
            self.cl.land(r, room)

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data())
    def wave_of_completions(self, data: st.DataObject) -> None:
        """Every open transfer finishes its KV; each rank's row lands with probability ~3/4,
        then a driver iteration runs (moves many requests through the slots, reusing them)."""
        for room in self._open():
            for r in range(self.cl.tp):
                self.cl.report(r, room, KVPoll.SUCCESS)
                if data.draw(st.integers(0, 3)) > 0:
                    self.cl.land(r, room)
        self.cl.prealloc()
        self.cl.poll()

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data())
    def metadata_lands(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(self._open()))
        self.cl.land(data.draw(st.integers(0, self.cl.tp - 1)), room)

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data())
    def corrupt_slot(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(self._open()))
        wrong = data.draw(st.integers(1, (1 << 63) - 1).filter(lambda w: w != room))
        self.cl.corrupt(data.draw(st.integers(0, self.cl.tp - 1)), room, wrong)

    @precondition(lambda self: self.c is not None and self._open())
    @rule(data=st.data())
    def transport_fails(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(self._open()))
        self.cl.report(data.draw(st.integers(0, self.cl.tp - 1)), room, KVPoll.FAILED)

    @precondition(lambda self: self.c is not None and any(t.outcome is None for t in self.c.truth.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(sorted(r for r, t in self.cl.truth.items() if t.outcome is None)))
        self.cl.cancel(room)

    @precondition(lambda self: self.c is not None and self._aborted_live())
    @rule(data=st.data())
    def late_write_from_aborted_prefill(self, data: st.DataObject) -> None:
        self.cl.late_write(data.draw(st.sampled_from(self._aborted_live())))

    @precondition(lambda self: self.c is not None and self._aborted_live())
    @rule(data=st.data())
    def prefill_acks_abort(self, data: st.DataObject) -> None:
        self.cl.ack(data.draw(st.sampled_from(self._aborted_live())))

    @precondition(lambda self: self.c is not None and self._aborted_live())
    @rule(data=st.data())
    def writers_gone(self, data: st.DataObject) -> None:
        """Some or every rank's transport confirms an aborted room's writers gone: the
        room is released only once every rank did."""
        room = data.draw(st.sampled_from(self._aborted_live()))
        self.cl.writers_gone(room, data.draw(st.sets(st.integers(0, self.cl.tp - 1), min_size=1)))

    @rule()
    def poll(self) -> None:
        self.cl.poll()

    @rule()
    def driver_iteration(self) -> None:
        """What a decode loop does each iteration: prealloc, then the transfer poll."""
        self.cl.prealloc()
        self.cl.poll()

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 40.0]))
    def time_passes(self, dt: float) -> None:
        self.cl.advance(dt)
        self.cl.settle()

    @rule()
    def engine_finishes_committed(self) -> None:
        self.cl.release_committed()

    @invariant()
    def invariants_hold(self) -> None:
        if self.c is not None:
            self.c.check()

    def teardown(self) -> None:
        if self.c is not None:
            self.c.quiesce()


DecodeCluster.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_decode_cluster = DecodeCluster.TestCase
