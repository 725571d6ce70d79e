"""Which instance holds how much of a prompt's prefix in its cache (pure: no I/O).

Fed by the KV events of each instance (a prefill, or a dp rank of one): blocks stored,
blocks removed, everything cleared. It answers, for a prompt, the longest cached prefix
per instance, by walking the prompt's pages from the first.

Blocks are keyed by their content, not by the publisher's hash: a block is the child of
its parent block holding exactly its tokens. Two instances that cached the same prefix
share the same nodes whatever hash function (or salt) they use, and the index never needs
to reproduce a publisher's hashes; a publisher's ``block_hash`` names a block only within
that instance's own events. A block whose parent the instance never stored cannot be
reached from a prompt's first page, so it is not indexed.

:class:`SequenceCursor` follows one event stream's sequence numbers and says when a batch
is applied, skipped or shows a gap (after which the subscriber drops the instance and
subscribes afresh, getting a snapshot).

What a match weighs against load is :func:`pdgrpc.state.routing.cache_aware_choice`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from pdgrpc.state.kv_event_log import Block, KvEvent, Removed, Stored

__all__ = ["Batch", "PrefixIndex", "SequenceCursor"]


@dataclass
class _Node:
    parent: _Node | None
    tokens: tuple[int, ...]
    holders: set[str] = field(default_factory=set)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class PrefixIndex:
    """A trie of pages shared by every instance; each node lists the instances holding it."""

    def __init__(self) -> None:
        self._root = _Node(None, ())
        self._blocks: dict[str, dict[int, _Node]] = {}  # instance -> its block_hash -> node
        self._page: dict[str, int] = {}  # instance -> its page size, from its first stored block

    def instances(self) -> list[str]:
        return sorted(self._blocks)

    def block_count(self, instance: str) -> int:
        return len(self._blocks.get(instance, {}))

    def apply(self, instance: str, events: Iterable[KvEvent]) -> None:
        """``instance``'s events, in order."""
        for e in events:
            if isinstance(e, Stored):
                self.stored(instance, e.blocks)
            elif isinstance(e, Removed):
                self.removed(instance, e.block_hashes)
            else:
                self.cleared(instance)

    def stored(self, instance: str, blocks: Sequence[Block]) -> None:
        """``blocks`` (parents first) became reusable on ``instance``."""
        mine = self._blocks.setdefault(instance, {})
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
            if old is not None:
                if old.parent is parent and old.tokens == b.token_ids:
                    continue
                self._release(instance, old)
            node = parent.children.get(b.token_ids)
            if node is None:
                node = parent.children[b.token_ids] = _Node(parent, b.token_ids)
            node.holders.add(instance)
            mine[b.block_hash] = node

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
        for node in mine.values():
            self._release(instance, node)

    def match(self, prompt: Sequence[int]) -> dict[str, int]:
        """Tokens of ``prompt``'s longest cached prefix on each instance (0 when none)."""
        out = {name: 0 for name in self._blocks}
        for page in sorted(set(self._page.values())):
            users = {name for name, p in self._page.items() if p == page}
            node = self._root
            depth = 0
            while users and depth + page <= len(prompt):
                child = node.children.get(tuple(prompt[depth : depth + page]))
                if child is None:
                    break
                users &= child.holders
                depth += page
                for name in users:
                    out[name] = depth
                node = child
        return out

    def _release(self, instance: str, node: _Node) -> None:
        node.holders.discard(instance)
        while node.parent is not None and not node.holders and not node.children:
            del node.parent.children[node.tokens]
            node = node.parent


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
