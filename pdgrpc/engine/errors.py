"""The engine's narrower errors (the shared tree is :mod:`pdgrpc.errors`)."""

from __future__ import annotations

from typing import Sequence

from pdgrpc.errors import EngineError

__all__ = ["InvalidRequest", "check_token_ids"]


class InvalidRequest(EngineError, ValueError):
    """A request (prompt, pages, sampling parameters) the engine refuses; the message
    names the offending field. Servers map it to INVALID_ARGUMENT."""


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Raise :class:`InvalidRequest` naming ``field[i]`` unless every id is an int in
    ``[0, vocab_size)``. The common case is checked in C, because every prompt token of
    every request passes here; only a failing prompt is walked, to name its bad id."""
    if set(map(type, token_ids)) <= {int} and (not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size)):
        return
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"{field}[{i}] = {t!r} is not a token id in [0, {vocab_size})")
