"""Configuration of the state machines (frozen; validated on construction).

Bad values raise :class:`~pdgrpc.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses

from pdgrpc.errors import ConfigError

__all__ = ["DecodeDeadlines", "DpConfig", "SenderDeadlines"]


def _positive(owner: object, *names: str) -> None:
    for name in names:
        v = getattr(owner, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(f"{type(owner).__name__}.{name} must be a positive number of seconds, got {v!r}")


@dataclasses.dataclass(frozen=True)
class DecodeDeadlines:
    """Seconds a decode request may spend in each non-terminal state (from entering it)."""

    resolve_dp_rank_s: float = 30.0  # waiting for a QueryDpRanks answer
    allocate_s: float = 600.0  # waiting for free KV pages + a metadata slot
    bootstrap_s: float = 30.0  # handshake sent, prefill not yet ready for input
    # Prefill ready, no KV byte written yet (prefill queueing). As long as a prefill keeps a
    # handshake whose Prefill RPC has not come (its early-handshake TTL).
    waiting_for_input_s: float = 60.0
    # Handshake sent, no Prefill RPC claimed the room on the prefill worker yet: a caller
    # whose prefill never shows holds pages this long, not waiting_for_input_s (a worker
    # that cannot say whether the room is claimed -- an older one -- leaves it to that).
    claim_s: float = 10.0
    transferring_s: float = 120.0  # KV arriving, or done while metadata has not landed
    abort_lease_s: float = 30.0  # aborted request's slot/pages held for the prefill's ack at most this long

    def __post_init__(self) -> None:
        _positive(self, *(f.name for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class SenderDeadlines:
    """Seconds a prefill sender may spend in each phase (pdgrpc.state.prefill_sender)."""

    waiting_for_destination_s: float = 30.0  # until the decode's handshake
    waiting_for_input_s: float = 600.0  # until the next chunk is computed (restarted by each chunk)
    transferring_s: float = 120.0  # from the last chunk until the decode acknowledges the metadata row

    def __post_init__(self) -> None:
        _positive(self, *(f.name for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class DpConfig:
    """How a request's prefill data-parallel rank is found (DESIGN.md, "Request lifecycle").

    ``follow_bootstrap_room``: the prefill dispatches room ``r`` to rank ``r % dp_size``
    and refuses requests that an external ``routed_dp_rank`` sent elsewhere, so decode can
    compute the rank. ``force_query``: the prefill registers every room's rank and decode
    always asks (use when a router may pin ranks). ``query_interval_s``: at most one
    QueryDpRanks per prefill address per interval (no query storm).
    """

    dp_size: int = 1
    follow_bootstrap_room: bool = True
    force_query: bool = False
    query_interval_s: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.dp_size, int) or isinstance(self.dp_size, bool) or self.dp_size < 1:
            raise ConfigError(f"DpConfig.dp_size must be an integer >= 1, got {self.dp_size!r}")
        _positive(self, "query_interval_s")
