"""Each client's share of a decode's pool: the pages and slots its calls hold before
their first token.

A ``Decode`` takes its pages and a metadata slot before its prefill writes a byte, and
holds them until the KV lands or a deadline ends the wait. A caller whose prefill never
writes (a room no prefill runs, or its own prefill) would so hold the whole pool with a
handful of calls, and every other caller's requests would wait for pages until they time
out. So the pages and slots that one client's calls hold *before their first token*
are capped at a share of the pool (``--max-decode-share``): a call past the share waits,
holding nothing, until that client's own earlier calls got their first token or ended,
and other clients are not held up by it. A call that needs more than the share by itself
runs once its client has no other call waiting. A client is who it proved to be
(:func:`pdgrpc.rpc.security.peer_identity`); smg's decode legs are the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math

from pdgrpc.rpc.open_calls import TooManyOpenCalls

__all__ = ["DEFAULT_MAX_DECODE_SHARE", "PoolShares", "share_arg"]

DEFAULT_MAX_DECODE_SHARE = 0.5


def share_arg(text: str) -> float:
    """argparse type of ``--max-decode-share``: a fraction in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not math.isfinite(v) or not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return v


class PoolShares:
    """At most ``share`` of ``num_pages`` and of ``num_slots`` held by one client's calls
    before their first token (see the module doc)."""

    def __init__(self, share: float, num_pages: int, num_slots: int) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {share}")
        self.share = share
        self.page_cap = max(1, int(share * num_pages))
        self.slot_cap = max(1, int(share * num_slots))
        self.pages: collections.Counter[str] = collections.Counter()  # client -> pages its waiting calls hold
        self.calls: collections.Counter[str] = collections.Counter()  # client -> its calls before their first token
        self._freed = asyncio.Event()

    def fits(self, client: str, pages: int) -> bool:
        """Whether one more call of ``client`` needing ``pages`` is within its share."""
        if self.calls[client] == 0:
            return True
        return self.pages[client] + pages <= self.page_cap and self.calls[client] < self.slot_cap

    async def take(self, client: str, pages: int, wait_s: float) -> None:
        """Count a call of ``client`` needing ``pages``, once it fits its share: waits up
        to ``wait_s`` for the client's own calls to free some, else :class:`~pdgrpc.rpc.open_calls.TooManyOpenCalls` (the message names the flag)."""
        try:
            async with asyncio.timeout(wait_s):
                while not self.fits(client, pages):
                    await self._freed.wait()
        except TimeoutError:
            raise TooManyOpenCalls(
                f"client {client} holds {self.pages[client]} of the pool's pages in {self.calls[client]} calls waiting "
                f"for their first token; {pages} more stay over its share ({self.share:g} of the pool: {self.page_cap} "
                f"pages, {self.slot_cap} slots; --max-decode-share) after {wait_s:g} s"
            ) from None
        self.pages[client] += pages
        self.calls[client] += 1

    def give_back(self, client: str, pages: int) -> None:
        """A call counted by :meth:`take` got its first token, or ended."""
        self.pages[client] -= pages
        self.calls[client] -= 1
        if self.calls[client] <= 0:
            del self.calls[client]
            del self.pages[client]
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()
