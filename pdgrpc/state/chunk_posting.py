"""When a prefill compute tells its driver about a chunk (pure; one rule for every mode).

Every post wakes the driver's event loop, whose Python then competes with the compute for
the GIL and the cores. So a computed chunk is posted only when the driver has something
to do with it: the pages completed since the last post reach ``min_pages`` (the sender
writes them), it is the last chunk, or it failed. The compute time of the chunks kept
back travels with the next post. Posting every chunk of a prompt whose KV is written at
the end anyway only takes the GIL from the compute.
"""

from __future__ import annotations

import dataclasses

from pdgrpc.errors import ConfigError

__all__ = ["ChunkPosting"]


@dataclasses.dataclass
class ChunkPosting:
    """One prompt's posting rule: ``num_tokens`` prompt tokens, ``page_size`` tokens a page."""

    num_tokens: int
    page_size: int
    min_pages: int
    posted_pages: int = 0  # complete pages at the last post
    unposted_s: float = 0.0  # compute seconds since the last post

    def __post_init__(self) -> None:
        if self.num_tokens <= 0 or self.page_size <= 0 or self.min_pages < 0:
            raise ConfigError(
                f"ChunkPosting needs num_tokens > 0, page_size > 0 and min_pages >= 0, got "
                f"{self.num_tokens}, {self.page_size}, {self.min_pages}"
            )

    def computed(self, end: int, seconds: float) -> float | None:
        """The chunk ending at token ``end`` took ``seconds``: the compute seconds to post
        with it, or None to keep it back."""
        self.unposted_s += seconds
        complete = end // self.page_size
        if end < self.num_tokens and complete - self.posted_pages < self.min_pages:
            return None
        secs, self.posted_pages, self.unposted_s = self.unposted_s, complete, 0.0
        return secs

    def failed(self, seconds: float = 0.0) -> float:
        """A chunk failed after ``seconds``: always posted; the compute seconds to post."""
        secs, self.unposted_s = self.unposted_s + seconds, 0.0
        return secs
