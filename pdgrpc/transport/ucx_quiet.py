"""How long a sender's UCX worker may poll on a timer instead of sleeping armed.

A write's data runs go as rendezvous messages that the receiver reads (cma on one
host, RDMA reads between hosts); for every one it has read, the receiver's UCX sends a
completion (ATS) back. A sender that sleeps armed on UCX's event fd asks to be woken by
the next of them, so the receiver's UCX signals it (a socket message, and on a VM an
inter-processor wake-up) for each run it reads: 48 times for an 8k-token write of a
24-layer model. That signalling runs on the receiver's thread, between its copies.

Nothing is waiting for those completions: the sender needs only the receiver's ACK,
which follows the last of them. So while a large send batch is in flight, the sender's
worker polls once per loop tick without arming, until shortly before the batch is
expected to end; from then on it sleeps armed again, in time for the last completions
and the ACK. The expected end comes from the fastest batch seen on that endpoint
(seconds per byte, whole batch from post to last completion), so the window adapts
to the fabric and never outlasts a batch that runs as fast as the fastest seen. The
first batch to an endpoint, small batches and workers with data receives pending
(whose messages must not wait for a tick) keep the armed sleep.

On one host the signal is a socket message sent by the receiver. Between hosts over verbs it is a
completion event of the sender's own NIC: there the window saves the sender's
wake-ups, not the receiver's CPU.
"""

from __future__ import annotations

__all__ = ["QuietSends"]

# Asked of the loop per poll. Both loops time in whole milliseconds: asyncio's epoll
# rounds a timeout up, but uvloop rounds a delay to the nearest one, and under 0.5 ms
# runs the callback at once, which would make every poll a spin.
TICK_S = 0.001
MARGIN_S = 0.0015  # the window ends this long before the batch's expected end
MIN_BYTES = 1 << 20  # batches below this teach nothing about the fabric's rate


class QuietSends:
    """The quiet window of one worker: :meth:`posted` and :meth:`finished` per send batch,
    :meth:`quiet` from the progress loop."""

    __slots__ = ("_fastest", "_started", "_until")

    def __init__(self) -> None:
        self._fastest: dict[int, float] = {}  # endpoint -> seconds per byte of its fastest batch
        self._started: dict[int, tuple[int, int, float]] = {}  # batch token -> (endpoint, bytes, posted at)
        self._until = 0.0  # monotonic seconds; poll without arming until then

    def posted(self, token: int, ep: int, nbytes: int, now: float) -> None:
        """A send batch of ``nbytes`` went out on ``ep`` at ``now``."""
        self._started[token] = (ep, nbytes, now)
        per_byte = self._fastest.get(ep)
        if per_byte is not None:
            self._until = max(self._until, now + nbytes * per_byte - MARGIN_S)

    def finished(self, token: int, ok: bool, now: float) -> None:
        """The batch's last message completed at ``now`` (``ok``: without error)."""
        started = self._started.pop(token, None)
        if started is None:
            return
        ep, nbytes, at = started
        if ok and nbytes >= MIN_BYTES and now > at:
            per_byte = (now - at) / nbytes
            self._fastest[ep] = min(self._fastest.get(ep, per_byte), per_byte)
        if not self._started:
            self._until = 0.0  # nothing of ours in flight: sleep armed

    def forget(self, ep: int) -> None:
        """``ep`` is closed: what was learnt about its rate goes with it."""
        self._fastest.pop(ep, None)

    @property
    def batches(self) -> int:
        """Send batches in flight."""
        return len(self._started)

    @property
    def learned(self) -> bool:
        """Whether a batch taught the rate of some endpoint."""
        return bool(self._fastest)

    def quiet(self, now: float) -> bool:
        """Poll without arming now?"""
        return now < self._until
