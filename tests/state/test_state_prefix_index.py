"""The router's prefix index: longest cached prefix per instance, fed by KV events."""

from __future__ import annotations

import random

import pytest

from pdgrpc.state.cache_events import StoredBlock as Block
from pdgrpc.state.kv_event_log import Cleared, Removed, Stored
from pdgrpc.state.prefix_index import MAX_BLOCKS, Batch, PendingPrefixes, PrefixIndex, SequenceCursor

PAGE = 4


def chain(tokens: list[int], salt: int = 0, page: int = PAGE) -> list[Block]:
    """The full pages of ``tokens`` as a publisher reports them (hashes are the publisher's own)."""
    blocks: list[Block] = []
    parent: int | None = None
    for start in range(0, len(tokens) - page + 1, page):
        h = hash((salt, tuple(tokens[: start + page])))
        blocks.append(Block(h, parent, tuple(tokens[start : start + page])))
        parent = h
    return blocks


def test_longest_prefix_per_instance() -> None:
    index = PrefixIndex()
    shared = list(range(100, 112))  # three pages
    index.stored("a", chain(shared + [1, 2, 3, 4]))
    index.stored("b", chain(shared[:8]))
    prompt = shared + [1, 2, 3, 4, 5, 6]
    assert index.match(prompt) == {"a": 16, "b": 8}
    assert index.match([9] * 20) == {"a": 0, "b": 0}
    assert index.match(shared[:7]) == {"a": 4, "b": 4}  # a partial page never matches


def test_content_keys_make_hash_functions_irrelevant() -> None:
    index = PrefixIndex()
    tokens = list(range(12))
    index.stored("a", chain(tokens, salt=1))
    index.stored("b", chain(tokens, salt=2))  # another hash function, same content
    assert index.match(tokens + [0]) == {"a": 12, "b": 12}


def test_removed_block_cuts_the_prefix_there() -> None:
    index = PrefixIndex()
    blocks = chain(list(range(16)))
    index.stored("a", blocks)
    index.removed("a", [blocks[2].block_hash])
    assert index.match(list(range(17))) == {"a": 8}
    index.removed("a", [12345])  # unknown: ignored
    index.removed("nobody", [blocks[0].block_hash])
    assert index.match(list(range(17))) == {"a": 8}


def test_cleared_drops_the_instance_and_frees_its_nodes() -> None:
    index = PrefixIndex()
    index.stored("a", chain(list(range(16))))
    index.stored("b", chain(list(range(8))))
    index.cleared("a")
    assert index.instances() == ["b"]
    assert index.match(list(range(17))) == {"b": 8}
    index.cleared("b")
    assert index.instances() == [] and index.match(list(range(17))) == {}


def test_orphan_and_partial_blocks_are_not_indexed() -> None:
    index = PrefixIndex()
    index.stored("a", [Block(7, 999, (1, 2, 3, 4))])  # parent never stored
    index.stored("a", [Block(8, None, (1, 2))])  # page size is learned from the first block: 4
    assert index.match([1, 2, 3, 4, 5]) == {"a": 0} and index.block_count("a") == 0


def test_page_size_per_instance() -> None:
    index = PrefixIndex()
    tokens = list(range(16))
    index.stored("small", chain(tokens, page=4))
    index.stored("big", chain(tokens, page=8))
    assert index.match(tokens[:14]) == {"small": 12, "big": 8}


def test_restored_hash_with_other_content_moves() -> None:
    index = PrefixIndex()
    index.stored("a", [Block(1, None, (1, 2, 3, 4))])
    index.stored("a", [Block(1, None, (5, 6, 7, 8))])  # the publisher reused the hash
    assert index.match([1, 2, 3, 4, 0]) == {"a": 0}
    assert index.match([5, 6, 7, 8, 0]) == {"a": 4}
    assert index.block_count("a") == 1


def test_one_block_under_two_hashes_of_one_instance_stays_until_both_are_removed() -> None:
    """A publisher may name the same pages under two hashes (vLLM's per-request cache salt,
    a LoRA adapter): the index holds them while either name does, and removing one name,
    then clearing, leaves nothing behind and raises nothing."""
    index = PrefixIndex()
    tokens = list(range(12))
    salted, plain = chain(tokens, salt=1), chain(tokens, salt=2)
    index.stored("a", salted)
    index.stored("a", plain)
    index.stored("b", chain(tokens[:4]))
    index.removed("a", [salted[-1].block_hash])
    assert index.match(tokens + [0]) == {"a": 12, "b": 4}  # still held under the plain names
    index.stored("a", chain(tokens + [20, 21, 22, 23], salt=2)[3:])  # a child under a kept name
    assert index.match(tokens + [20, 21, 22, 23, 0]) == {"a": 16, "b": 4}
    index.removed("a", [plain[-1].block_hash])
    assert index.match(tokens + [0]) == {"a": 8, "b": 4}  # no name of the third page is left
    index.cleared("a")
    assert index.instances() == ["b"] and index.match(tokens + [20, 21, 22, 23, 0]) == {"b": 4}
    index.cleared("b")
    assert index.match(tokens + [0]) == {}
    index.stored("c", chain(tokens))  # the trie holds nothing of a or b: c's chain is fresh
    assert index.match(tokens + [0]) == {"c": 12}


def test_an_instance_has_at_most_max_blocks_indexed_whatever_it_stores() -> None:
    index = PrefixIndex(max_blocks=3)
    blocks = chain(list(range(20)))  # five pages
    assert index.stored("a", blocks) == 1  # the fourth is left out, and the fifth hangs from it
    assert index.block_count("a") == 3 and index.match(list(range(21))) == {"a": 12}
    assert index.stored("a", blocks[:3]) == 0  # blocks already indexed are not new
    assert index.stored("b", blocks) == 1 and index.block_count("b") == 3  # a bound per instance
    index.removed("a", [blocks[2].block_hash])
    assert index.stored("a", blocks[2:4]) == 1  # room for one again
    assert index.match(list(range(21))) == {"a": 12, "b": 12}
    salted = chain(list(range(20)), salt=9)  # new names count too, whatever they name
    assert index.stored("a", salted) == 1 and index.block_count("a") == 3
    assert PrefixIndex().stored("c", blocks) == 0 and MAX_BLOCKS > len(blocks)
    with pytest.raises(ValueError, match="max_blocks must be at least 1, got 0"):
        PrefixIndex(max_blocks=0)


def test_random_events_agree_with_a_model() -> None:
    """Random stores, removals and clears over a few instances and shared prefixes; the
    index answers as a brute force over each instance's set of live chains does."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(6 * PAGE)] for _ in range(4)]
    index = PrefixIndex()
    live: dict[str, dict[int, Block]] = {}
    for _ in range(600):
        inst = rng.choice("abc")
        op = rng.random()
        mine = live.setdefault(inst, {})
        if op < 0.5:
            p = rng.choice(prefixes)[: rng.randrange(1, 7) * PAGE]
            blocks = chain(p)  # parents first, as a cache stores them
            index.stored(inst, blocks)
            for b in blocks:
                mine[b.block_hash] = b
        elif op < 0.9 and mine:
            gone = rng.sample(sorted(mine), k=min(len(mine), rng.randrange(1, 4)))
            index.removed(inst, gone)
            for h in gone:
                del mine[h]
        elif op >= 0.97:
            index.cleared(inst)
            live[inst] = {}
        prompt = rng.choice(prefixes) + [999]
        want = {}
        for name, blocks in live.items():
            if name not in index.instances():
                continue
            n = 0
            for b in chain(prompt):
                if b.block_hash not in blocks:
                    break
                n += PAGE
            want[name] = n
        assert index.match(prompt) == want


def test_cursor_applies_in_order_skips_repeats_and_reports_gaps_and_restarts() -> None:
    c = SequenceCursor()
    assert c.accept(41) is Batch.APPLY  # a fresh subscription starts anywhere (a snapshot)
    assert c.accept(42) is Batch.APPLY
    assert c.accept(42) is Batch.SKIP  # already applied
    assert c.accept(44) is Batch.GAP  # 43 was lost
    assert c.accept(1) is Batch.GAP  # the publisher restarted
    assert c.last == 42


def test_events_apply_in_order() -> None:
    index = PrefixIndex()
    blocks = chain(list(range(12)))
    index.apply("a", [Stored(tuple(blocks)), Removed((blocks[2].block_hash,))])
    assert index.match(list(range(13))) == {"a": 8}
    index.apply("a", [Cleared(), Stored(tuple(blocks[:1]))])  # a snapshot: cleared, then the live blocks
    assert index.match(list(range(13))) == {"a": 4}


# ---- pending: prompts routed but not yet reported stored --------------------------------


def pending_index(grace_s: float = 2.0, limit: int = 8) -> PrefixIndex:
    return PrefixIndex(PendingPrefixes(chunk=PAGE, grace_s=grace_s, limit=limit))


def test_a_routed_prompt_counts_as_cached_before_its_events() -> None:
    index = pending_index()
    prompt = list(range(100, 118))  # four full pages and two tokens
    index.routed("a", prompt, now=0.0)
    # A later request of the same prefix finds it on "a", before "a" reported anything.
    assert index.match(prompt[:12] + [7, 7, 7, 7, 7]) == {"a": 12}
    assert index.match([5] * 20) == {}
    index.stored("b", chain(prompt[:4]))
    assert index.match(prompt) == {"a": 16, "b": 4}


def test_a_failed_request_stops_counting_at_once() -> None:
    index = pending_index()
    prompt = list(range(12))
    ticket = index.routed("a", prompt, now=0.0)
    index.ended(ticket, ok=False, now=0.1)
    assert index.match(prompt) == {}


def test_a_finished_request_counts_until_its_stored_events_cover_it() -> None:
    index = pending_index()
    prompt = list(range(13))  # three full pages; the last token is never cached
    ticket = index.routed("a", prompt, now=0.0)
    index.ended(ticket, ok=True, now=1.0)
    index.stored("a", chain(prompt[:4]))  # only part of it so far: still pending
    assert index.match(prompt) == {"a": 12}
    index.stored("a", chain(prompt[:12]))
    index.removed("a", [chain(prompt[:12])[2].block_hash])  # evicted later: the index says so, pending does not hide it
    assert index.match(prompt) == {"a": 8}


def test_events_that_came_first_end_pending_with_the_request() -> None:
    index = pending_index()
    prompt = list(range(9))
    ticket = index.routed("a", prompt, now=0.0)
    index.stored("a", chain(prompt[:8]))  # the prefill stores before it answers
    index.ended(ticket, ok=True, now=0.5)
    index.removed("a", [b.block_hash for b in chain(prompt[:8])])
    assert index.match(prompt) == {"a": 0}


def test_a_finished_request_never_reported_expires_after_the_grace() -> None:
    index = pending_index(grace_s=2.0)
    prompt = list(range(8))
    ticket = index.routed("a", prompt, now=0.0)
    index.ended(ticket, ok=True, now=1.0)  # evicted before reported, say
    index.routed("b", [9] * 8, now=2.9)
    assert index.match(prompt) == {"a": 8}
    index.routed("b", [9] * 8, now=3.0)
    assert index.match(prompt) == {}


def test_pending_is_bounded_oldest_first_and_dropped_with_its_instance() -> None:
    pending = PendingPrefixes(chunk=PAGE, limit=3)
    index = PrefixIndex(pending)
    tickets = [index.routed("ab"[i % 2], [i] * 8, now=float(i)) for i in range(5)]
    assert len(pending) == 3 and index.match([0] * 8) == {} and index.match([4] * 8) == {"a": 8}
    index.ended(tickets[0], ok=False, now=5.0)  # already dropped: nothing happens
    index.cleared("a")  # its stream broke, or it restarted
    assert len(pending) == 1 and index.match([3] * 8) == {"b": 8}


def test_pending_counts_each_prompt_and_frees_its_nodes() -> None:
    """Two prompts of one prefix on one instance: the prefix counts until both end; when
    every pending prompt is gone, no node is left behind."""
    pending = PendingPrefixes(chunk=PAGE)
    index = PrefixIndex(pending)
    shared = list(range(8))
    t1 = index.routed("a", shared + [1] * 4, now=0.0)
    t2 = index.routed("a", shared + [2] * 4, now=0.0)
    assert index.size("a") == 16  # the shared steps once, each prompt's own step
    index.stored("a", chain(list(range(50, 58))))
    assert index.size("a") == 24
    index.ended(t1, ok=False, now=0.1)
    assert index.match(shared + [3] * 4) == {"a": 8} and index.size("a") == 20
    assert index.match(shared + [2] * 4) == {"a": 12}
    index.ended(t2, ok=False, now=0.2)
    assert index.match(shared + [2] * 4) == {"a": 0} and len(pending) == 0
    assert pending.match(shared) == {}


def test_a_prompt_follows_the_running_request_that_computes_its_prefix() -> None:
    """The leader: a request still running on the instance that computes more of the
    prompt than the instance has stored; none once it ended or the prefix is stored."""
    index = pending_index()
    shared = list(range(8))
    first = index.routed("a", shared + [1] * 5, now=0.0)
    assert index.leader("a", shared + [2] * 5) == first
    assert index.leader("b", shared + [2] * 5) is None  # nothing runs on b
    assert index.leader("a", [7] * 13) is None  # nothing shared
    longer = index.routed("a", shared + [1] * 8 + [3] * 4, now=0.0)
    assert index.leader("a", shared + [1] * 8 + [5]) == longer  # the longest shared prefix
    index.ended(longer, ok=False, now=0.1)
    assert index.leader("a", shared + [1] * 8 + [5]) == first
    index.stored("a", chain(shared))  # the prefix they share is stored: nothing to wait for
    assert index.leader("a", shared + [2] * 5) is None
    assert index.leader("a", shared + [1] * 5) == first
    index.ended(first, ok=True, now=0.2)  # ended: its pages are cached, their events on the way
    assert index.leader("a", shared + [1] * 5) is None


@pytest.mark.parametrize("args", [(0, 1.0, 1), (4, -1.0, 1), (4, 1.0, 0)])
def test_bad_pending_settings_are_refused(args: tuple[int, float, int]) -> None:
    with pytest.raises(ValueError, match="chunk >= 1, limit >= 1, grace_s >= 0"):
        PendingPrefixes(*args)
