"""Where a prompt is computed (pdgrpc.state.local_prefill), as a table: no socket."""

from __future__ import annotations

import pytest

from pdgrpc.state.local_prefill import LocalPrefillRule, Where, prefill_where

RULE = LocalPrefillRule(max_tokens=64, queue_bound=3)


@pytest.mark.parametrize(
    "rule, prompt, matched, can, loads, where",
    [
        (RULE, 200, 160, True, [0], Where.SHORT_SUFFIX),  # lacks 40
        (RULE, 200, 136, True, [0], Where.SHORT_SUFFIX),  # lacks exactly 64
        (RULE, 200, 128, True, [0], Where.PREFILL),  # lacks 72
        (RULE, 50, 0, True, [0], Where.PREFILL),  # a short prompt, nothing held: an idle prefill computes it
        (RULE, 50, 0, True, [4, 5], Where.BUSY_PREFILLS),  # ... unless every prefill is busy
        (RULE, 50, 16, True, [0], Where.SHORT_SUFFIX),  # a page held
        (RULE, 64, 64, True, [0], Where.SHORT_SUFFIX),  # held whole: still computes its last token
        (RULE, 200, 160, False, [0], Where.PREFILL),  # this decode cannot compute locally
        (RULE, 500, 0, True, [4, 5], Where.BUSY_PREFILLS),  # every prefill past the bound
        (RULE, 500, 0, True, [4, 3], Where.PREFILL),  # one prefill at the bound
        (RULE, 500, 0, True, [], Where.PREFILL),  # no prefill load known
        (RULE, 500, 0, False, [9, 9], Where.PREFILL),
        (LocalPrefillRule(0, 3), 10, 0, True, [0], Where.PREFILL),  # 0 tokens: the suffix rule is off
        (LocalPrefillRule(0, 0), 500, 0, True, [99], Where.PREFILL),  # 0 bound: the queue rule is off
    ],
)
def test_where_a_prompt_is_computed(rule: LocalPrefillRule, prompt: int, matched: int, can: bool, loads: list[int], where: Where) -> None:
    got = prefill_where(rule, prompt, matched, can, loads)
    assert got is where
    assert got.local == (where is not Where.PREFILL)


@pytest.mark.parametrize(
    "loads, decode_local, where",
    [
        ([4, 5], 3, Where.BUSY_PREFILLS),  # the decode's own queue is the shorter one
        ([4, 5], 4, Where.PREFILL),  # as long as the least busy prefill's: the prefill keeps it
        ([6, 4], 9, Where.PREFILL),
        ([3, 9], 0, Where.PREFILL),  # a prefill at the bound: however idle the decode
    ],
)
def test_a_busy_prefill_gives_a_prompt_to_the_decode_only_while_its_queue_is_shorter(
    loads: list[int], decode_local: int, where: Where
) -> None:
    assert prefill_where(RULE, 500, 0, True, loads, decode_local) is where


def test_by_default_a_third_prefill_call_in_flight_sends_the_next_prompt_to_an_idle_decode() -> None:
    rule = LocalPrefillRule()
    assert prefill_where(rule, 500, 0, True, [2]) is Where.PREFILL
    assert prefill_where(rule, 500, 0, True, [3]) is Where.BUSY_PREFILLS
    assert prefill_where(rule, 500, 0, True, [3], 3) is Where.PREFILL


@pytest.mark.parametrize("args, flag", [((-1, 0), "--local-prefill-tokens"), ((0, -2), "--local-prefill-queue")])
def test_bad_settings_name_the_flag(args: tuple[int, int], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        LocalPrefillRule(*args)
