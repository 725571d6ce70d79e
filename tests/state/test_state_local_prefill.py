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


@pytest.mark.parametrize("args, flag", [((-1, 0), "--local-prefill-tokens"), ((0, -2), "--local-prefill-queue")])
def test_bad_settings_name_the_flag(args: tuple[int, int], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        LocalPrefillRule(*args)
