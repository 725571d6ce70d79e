"""Where a request's prompt is computed: on a prefill (disaggregated), or on its decode
itself (local prefill). Pure: the router passes what its prefix index and its call
counts say.

A decode computes a prompt locally when either rule holds:

- **short suffix**: the decode's prefix cache holds a prefix of the prompt and lacks at
  most ``max_tokens`` of it (``--local-prefill-tokens``; 0 turns the rule off).
  Computing a few pages next to the decode steps costs less than a prefill call, a
  handshake and a transfer, and the pages the decode holds are never sent again. A prompt
  the decode holds nothing of goes to a prefill however short: there it costs the decode
  no step time, and an idle prefill computes it at once.
- **busy prefills**: every prefill has more than ``queue_bound`` calls in flight
  (``--local-prefill-queue``; 0 turns the rule off), and the decode has fewer prompts of
  its own still to compute than the least busy prefill has calls. A request then waits
  less on its decode than in a prefill's queue, and each prompt goes to the shorter of
  the two queues, so a burst keeps both the prefill and the decode computing instead of
  leaving the decode's batch thin while the prefill works through it.

Only a decode that says it can compute locally takes part (it advertises the capability
on its KV event stream); any other gets the prompt from a prefill. The decode
computes at least the prompt's last token (its logits give the first generated token),
so a prompt it holds whole still lacks one token.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

__all__ = ["DEFAULT_LOCAL_PREFILL_QUEUE", "DEFAULT_LOCAL_PREFILL_TOKENS", "LocalPrefillRule", "Where", "prefill_where"]

DEFAULT_LOCAL_PREFILL_TOKENS = 256
# Prefill calls in flight past which a prompt may go to its decode: one computing, one
# transferring and one waiting is a queue; fewer is the pipeline at work.
DEFAULT_LOCAL_PREFILL_QUEUE = 2


class Where(enum.Enum):
    """Where the prompt is computed, and why."""

    PREFILL = "prefill"
    SHORT_SUFFIX = "short_suffix"  # local: the decode lacks at most max_tokens of it
    BUSY_PREFILLS = "busy_prefills"  # local: every prefill's queue is past the bound and longer than the decode's

    @property
    def local(self) -> bool:
        return self is not Where.PREFILL


@dataclasses.dataclass(frozen=True)
class LocalPrefillRule:
    max_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS  # --local-prefill-tokens; 0: off
    queue_bound: int = DEFAULT_LOCAL_PREFILL_QUEUE  # --local-prefill-queue; 0: off

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be >= 0, got {self.max_tokens}")
        if self.queue_bound < 0:
            raise ValueError(f"--local-prefill-queue must be >= 0, got {self.queue_bound}")


def prefill_where(
    rule: LocalPrefillRule, prompt_tokens: int, decode_matched: int, decode_can: bool, prefill_loads: Sequence[int],
    decode_local: int = 0,
) -> Where:
    """Where a prompt of ``prompt_tokens`` is computed, given that the chosen decode holds
    its first ``decode_matched`` tokens (by the router's index), whether that decode can
    compute locally, the calls in flight on each candidate prefill, and the prompts sent
    to that decode to compute locally whose first token has not come (``decode_local``)."""
    if not decode_can:
        return Where.PREFILL
    lacking = prompt_tokens - min(decode_matched, prompt_tokens - 1)
    if rule.max_tokens and decode_matched > 0 and lacking <= rule.max_tokens:
        return Where.SHORT_SUFFIX
    if rule.queue_bound and prefill_loads:
        least = min(prefill_loads)
        if least > rule.queue_bound and decode_local < least:
            return Where.BUSY_PREFILLS
    return Where.PREFILL
