"""Which instance holds how much of a prompt's prefix in its cache (pure: no I/O).

Fed by the KV events of each instance (a prefill, or a dp rank of one): blocks stored,
blocks removed, everything cleared. It answers, for a prompt, the longest cached prefix
per instance, by walking the prompt's pages from the first.

Blocks are keyed by their content, not by the publisher's hash: a block is the child of
its parent block holding exactly its tokens. Two instances that cached the same prefix
share the same nodes whatever hash function (or salt) they use, and the index never needs
to reproduce a publisher's hashes; a publisher's ``block_hash`` names a block only within
that instance's own events. One instance may name the same block under several hashes (a
per-request cache salt, an adapter): it holds the block while any of them is stored. A
block whose parent the instance never stored cannot be reached from a prompt's first page,
so it is not indexed.

:class:`SequenceCursor` follows one event stream's sequence numbers and says when a batch
is applied, skipped or shows a gap (after which the subscriber drops the instance and
subscribes afresh, getting a snapshot).

Bounded: an instance's events index at most ``max_blocks`` of its blocks (its further
stores are left out until removals make room), so no instance, whatever it sends, grows
the index without end; the trie's nodes are those blocks.

A prompt routed to an instance counts as cached there at once, as *pending*
(:class:`PendingPrefixes`): requests of one prefix that arrive while its first still
computes follow it, instead of being spread before any instance reports storing it.

What a match weighs against load is :func:`pdgrpc.state.routing.cache_aware_choice`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from pdgrpc.state.kv_event_log import Block, KvEvent, Removed, Stored

__all__ = [
    "Batch", "MAX_BLOCKS", "PENDING_CHUNK", "PENDING_GRACE_S", "PENDING_LIMIT", "PendingPrefixes", "PrefixIndex", "SequenceCursor",
]

MAX_BLOCKS = 1 << 18  # blocks indexed per instance: 4 Mi tokens of 16-token pages
PENDING_CHUNK = 16  # tokens per step of a pending prompt's path
PENDING_GRACE_S = 2.0  # how long a finished request's prompt stays pending without its stored events
PENDING_LIMIT = 256  # pending prompts kept at most; the oldest goes first


@dataclass
class _Node:
    parent: _Node | None
    tokens: tuple[int, ...]
    holders: dict[str, int] = field(default_factory=dict)  # instance -> its hashes naming this node
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class PrefixIndex:
    """A trie of pages shared by every instance; each node lists the instances holding it."""

    def __init__(self, pending: PendingPrefixes | None = None, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self._max_blocks = max_blocks
        self._root = _Node(None, ())
        self._blocks: dict[str, dict[int, _Node]] = {}  # instance -> its block_hash -> node
        self._page: dict[str, int] = {}  # instance -> its page size, from its first stored block
        self._pending = pending if pending is not None else PendingPrefixes()

    def routed(self, instance: str, prompt: Sequence[int], now: float) -> int:
        """``prompt`` was sent to ``instance``, which caches it once computed; until then it
        counts as pending there. Returns the ticket that :meth:`ended` takes."""
        return self._pending.add(instance, prompt, now)

    def leader(self, instance: str, prompt: Sequence[int]) -> int | None:
        """The ticket of a request still running on ``instance`` that computes more of
        ``prompt``'s prefix than ``instance`` has stored (the longest such), or None. A
        request sent after its leader ended finds that prefix cached, instead of
        computing it a second time beside it."""
        stored = self._stored_match(prompt).get(instance, 0)
        return self._pending.leader(instance, prompt, stored)

    def ended(self, ticket: int, ok: bool, now: float) -> None:
        """The request of ``ticket`` ended: a failed one's prompt stops counting at once; a
        successful one's once the instance's stored events cover its pages, or
        :data:`PENDING_GRACE_S` after ``now`` (its pages may be evicted before they are
        reported)."""
        instance, prompt = self._pending.entry(ticket)
        if not ok or self._covers(instance, prompt):
            self._pending.remove(ticket)
        else:
            self._pending.finish(ticket, now)

    def instances(self) -> list[str]:
        return sorted(self._blocks)

    def block_count(self, instance: str) -> int:
        return len(self._blocks.get(instance, {}))

    def size(self, instance: str) -> int:
        """Tokens ``instance`` caches or has pending: its stored pages and the distinct
        steps of its pending prompts."""
        return self.block_count(instance) * self._page.get(instance, 0) + self._pending.tokens(instance)

    def apply(self, instance: str, events: Iterable[KvEvent]) -> int:
        """``instance``'s events, in order. Returns how many stored blocks were left out
        for the bound (:meth:`stored`)."""
        over = 0
        for e in events:
            if isinstance(e, Stored):
                over += self.stored(instance, e.blocks)
            elif isinstance(e, Removed):
                self.removed(instance, e.block_hashes)
            else:
                self.cleared(instance)
        return over

    def stored(self, instance: str, blocks: Sequence[Block]) -> int:
        """``blocks`` (parents first) became reusable on ``instance``. Returns how many new
        blocks were left out because ``instance`` already has ``max_blocks`` indexed."""
        mine = self._blocks.setdefault(instance, {})
        over = 0
        for b in blocks:
            if not b.token_ids:
                continue
            page = self._page.setdefault(instance, len(b.token_ids))
            if len(b.token_ids) != page:  # only full pages match a prompt's pages
                continue
            if b.parent_hash is None:
                parent: _Node | None = self._root
            else:
                parent = mine.get(b.parent_hash)
            if parent is None:  # unreachable from any prompt's first page
                continue
            old = mine.get(b.block_hash)
            if old is None and len(mine) >= self._max_blocks:
                over += 1
                continue
            if old is not None:
                if old.parent is parent and old.tokens == b.token_ids:
                    continue
                self._release(instance, old)
            node = parent.children.get(b.token_ids)
            if node is None:
                node = parent.children[b.token_ids] = _Node(parent, b.token_ids)
            node.holders[instance] = node.holders.get(instance, 0) + 1
            mine[b.block_hash] = node
        for ticket, prompt in self._pending.finished(instance):
            if self._covers(instance, prompt):
                self._pending.remove(ticket)
        return over

    def removed(self, instance: str, block_hashes: Sequence[int]) -> None:
        """``block_hashes`` are no longer reusable on ``instance`` (unknown ones are ignored)."""
        mine = self._blocks.get(instance)
        if mine is None:
            return
        for h in block_hashes:
            node = mine.pop(h, None)
            if node is not None:
                self._release(instance, node)

    def cleared(self, instance: str) -> None:
        """``instance`` holds nothing any more (it cleared its cache, restarted, lost its
        lease or its stream): it is dropped at once."""
        mine = self._blocks.pop(instance, {})
        self._page.pop(instance, None)
        self._pending.cleared(instance)
        for node in mine.values():
            self._release(instance, node)

    def match(self, prompt: Sequence[int]) -> dict[str, int]:
        """Tokens of ``prompt``'s longest cached or pending prefix on each instance (0 when none)."""
        out = self._stored_match(prompt)
        for name, depth in self._pending.match(prompt).items():
            out[name] = max(out.get(name, 0), depth)
        return out

    def _covers(self, instance: str, prompt: Sequence[int]) -> bool:
        """Whether ``instance``'s stored blocks hold every page of ``prompt`` its cache keeps
        (all full pages but one token: the last prompt token is never cached)."""
        page = self._page.get(instance)
        if page is None:
            return False
        return self._stored_match(prompt).get(instance, 0) >= (len(prompt) - 1) // page * page

    def _stored_match(self, prompt: Sequence[int]) -> dict[str, int]:
        out = {name: 0 for name in self._blocks}
        for page in sorted(set(self._page.values())):
            users = {name for name, p in self._page.items() if p == page}
            node = self._root
            depth = 0
            while users and depth + page <= len(prompt):
                child = node.children.get(tuple(prompt[depth : depth + page]))
                if child is None:
                    break
                users &= child.holders.keys()
                depth += page
                for name in users:
                    out[name] = depth
                node = child
        return out

    def _release(self, instance: str, node: _Node) -> None:
        """One of ``instance``'s hashes no longer names ``node``."""
        left = node.holders.pop(instance, 0) - 1
        if left > 0:
            node.holders[instance] = left
        while node.parent is not None and not node.holders and not node.children:
            del node.parent.children[node.tokens]
            node = node.parent


@dataclass
class _Pending:
    parent: _Pending | None
    chunk: tuple[int, ...]
    holders: dict[str, int] = field(default_factory=dict)  # instance -> pending prompts through here
    children: dict[tuple[int, ...], _Pending] = field(default_factory=dict)


@dataclass
class _Entry:
    instance: str
    prompt: tuple[int, ...]
    path: list[_Pending]
    expires: float | None = None  # set once its request ended


class PendingPrefixes:
    """Prompts routed to an instance that has not yet reported storing them: a trie of
    ``chunk``-token steps, each node counting the pending prompts per instance through it.

    Bounded: at most ``limit`` prompts, the oldest dropped first; a finished request's
    prompt expires ``grace_s`` after it ended. Expired prompts go at the next :meth:`add`
    or :meth:`finish`."""

    def __init__(self, chunk: int = PENDING_CHUNK, grace_s: float = PENDING_GRACE_S, limit: int = PENDING_LIMIT) -> None:
        if chunk < 1 or limit < 1 or grace_s < 0:
            raise ValueError(f"pending prefixes need chunk >= 1, limit >= 1, grace_s >= 0; got {chunk}, {limit}, {grace_s}")
        self._chunk = chunk
        self._grace_s = grace_s
        self._limit = limit
        self._root = _Pending(None, ())
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # ticket -> entry, oldest first
        self._steps: dict[str, int] = {}  # instance -> nodes it holds
        self._finished: OrderedDict[int, float] = OrderedDict()  # ticket -> expiry, soonest first
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, instance: str) -> int:
        """Distinct tokens of ``instance``'s pending prompts (their whole steps)."""
        return self._steps.get(instance, 0) * self._chunk

    def add(self, instance: str, prompt: Sequence[int], now: float) -> int:
        self._expire(now)
        while len(self._entries) >= self._limit:
            self.remove(next(iter(self._entries)))
        node = self._root
        path = []
        for start in range(0, len(prompt) - self._chunk + 1, self._chunk):
            key = tuple(prompt[start : start + self._chunk])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Pending(node, key)
            held = child.holders.get(instance, 0)
            if not held:
                self._steps[instance] = self._steps.get(instance, 0) + 1
            child.holders[instance] = held + 1
            path.append(child)
            node = child
        ticket, self._next = self._next, self._next + 1
        self._entries[ticket] = _Entry(instance, tuple(prompt), path)
        return ticket

    def entry(self, ticket: int) -> tuple[str, tuple[int, ...]]:
        """The instance and prompt of ``ticket`` (an unknown ticket, one dropped or expired: ``("", ())``)."""
        e = self._entries.get(ticket)
        return ("", ()) if e is None else (e.instance, e.prompt)

    def finish(self, ticket: int, now: float) -> None:
        """``ticket``'s request ended: its prompt expires ``grace_s`` from ``now``."""
        self._expire(now)
        e = self._entries.get(ticket)
        if e is not None and e.expires is None:
            e.expires = now + self._grace_s
            self._finished[ticket] = e.expires

    def finished(self, instance: str) -> list[tuple[int, tuple[int, ...]]]:
        """The tickets and prompts of ``instance``'s ended requests still pending."""
        return [(t, self._entries[t].prompt) for t in self._finished if self._entries[t].instance == instance]

    def remove(self, ticket: int) -> None:
        e = self._entries.pop(ticket, None)
        if e is None:
            return
        self._finished.pop(ticket, None)
        for node in reversed(e.path):
            n = node.holders[e.instance] - 1
            if n:
                node.holders[e.instance] = n
            else:
                del node.holders[e.instance]
                self._steps[e.instance] -= 1
                if not self._steps[e.instance]:
                    del self._steps[e.instance]
            if not node.holders and not node.children and node.parent is not None:
                del node.parent.children[node.chunk]

    def cleared(self, instance: str) -> None:
        """``instance`` is gone: none of its prompts count any more."""
        for ticket in [t for t, e in self._entries.items() if e.instance == instance]:
            self.remove(ticket)

    def match(self, prompt: Sequence[int]) -> dict[str, int]:
        """Tokens of ``prompt``'s longest pending prefix on each instance with one."""
        out: dict[str, int] = {}
        node = self._root
        depth = 0
        while depth + self._chunk <= len(prompt):
            child = node.children.get(tuple(prompt[depth : depth + self._chunk]))
            if child is None:
                break
            depth += self._chunk
            for name in child.holders:
                out[name] = depth
            node = child
        return out

    def leader(self, instance: str, prompt: Sequence[int], beyond: int) -> int | None:
        """The running (not finished) entry on ``instance`` sharing the longest prefix of
        ``prompt``, when that prefix is longer than ``beyond`` tokens."""
        node = self._root
        depth = 0
        deepest: _Pending | None = None
        steps = 0
        while depth + self._chunk <= len(prompt):
            child = node.children.get(tuple(prompt[depth : depth + self._chunk]))
            if child is None or instance not in child.holders:
                break
            depth += self._chunk
            node = deepest = child
            steps += 1
        if deepest is None or depth <= beyond:
            return None
        for ticket, e in self._entries.items():
            if e.instance == instance and e.expires is None and len(e.path) >= steps and e.path[steps - 1] is deepest:
                return ticket
        return None  # only finished requests computed it: their stored events are on the way

    def _expire(self, now: float) -> None:
        while self._finished:
            ticket, expires = next(iter(self._finished.items()))
            if expires > now:
                return
            self.remove(ticket)


class Batch(enum.Enum):
    """What to do with a batch of events, by its sequence number (:meth:`SequenceCursor.accept`)."""

    APPLY = "apply"
    SKIP = "skip"  # a heartbeat, or a batch already applied
    GAP = "gap"  # batches were missed, or the publisher restarted: drop the instance and subscribe afresh


class SequenceCursor:
    """One subscription's position in an instance's stream of numbered batches.

    The first batch of a subscription sets the cursor (a fresh subscription starts with a
    snapshot whose first chunk clears the instance, so nothing earlier is needed); each
    later batch must carry the next number. A repeat of the last number is skipped; a
    number further back means the publisher restarted, and one further on that batches
    were lost: either is a :attr:`Batch.GAP`."""

    def __init__(self) -> None:
        self.last: int | None = None

    def accept(self, sequence_number: int) -> Batch:
        if self.last is None or sequence_number == self.last + 1:
            self.last = sequence_number
            return Batch.APPLY
        if sequence_number == self.last:
            return Batch.SKIP
        return Batch.GAP
