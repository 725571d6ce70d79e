"""bench prefix: the workload's shape and how arms are summarized (no cluster)."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdgrpc.bench import prefix
from pdgrpc.bench.prefix import ArmResult, Outcome, Request, summarize, workload


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    prefix.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_workload_is_groups_of_questions_sharing_a_prefix_shuffled() -> None:
    reqs = workload(args(groups=3, questions=4, prefix_tokens="40-60", question_tokens="5-9"), vocab=512)
    assert len(reqs) == 12 and sorted((r.group, r.question) for r in reqs) == [(g, q) for g in range(3) for q in range(4)]
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled
    heads = set()
    for g in range(3):
        prompts = [r.input_ids for r in reqs if r.group == g]
        assert len({p[:40] for p in prompts}) == 1  # the group's prefix
        heads.add(prompts[0][:40])
        assert all(45 <= len(p) <= 69 and min(p) >= 16 and max(p) < 512 - 16 for p in prompts)
    assert len(heads) == 3  # a prefix per group
    assert workload(args(groups=3, questions=4), 512) == workload(args(groups=3, questions=4), 512)  # seeded


@pytest.mark.parametrize("bad", ["0-5", "9-3", "x"])
def test_a_bad_span_is_refused_naming_the_flag(bad: str, capsys) -> None:
    with pytest.raises(SystemExit):
        args(prefix_tokens=bad)
    assert "--prefix-tokens" in capsys.readouterr().err


def test_summary_splits_first_and_later_and_compares_with_arm_a() -> None:
    reqs = [Request(0, 0, (1,)), Request(1, 0, (2,)), Request(0, 1, (1, 3)), Request(1, 1, (2, 3))]
    a = ArmResult({(0, 0): Outcome(1.0, (5,)), (1, 0): Outcome(1.0, (6,)), (0, 1): Outcome(1.0, (7,)), (1, 1): Outcome(1.0, (8,))},
                  {"computed_tokens": 400.0, "prompt_tokens": 400.0})
    b = ArmResult({(0, 0): Outcome(1.0, (5,)), (1, 0): Outcome(1.0, (6,)), (0, 1): Outcome(0.5, (7,)), (1, 1): Outcome(error="boom")},
                  {"computed_tokens": 300.0, "prompt_tokens": 400.0})
    c = ArmResult({(0, 0): Outcome(1.0, (5,)), (1, 0): Outcome(1.0, (6,)), (0, 1): Outcome(0.1, (7,)), (1, 1): Outcome(0.1, (0,))},
                  {"computed_tokens": 200.0, "prompt_tokens": 400.0},
                  where={"hit_rate/prefill-a": 0.6, "groups_held/both": 1.0, "computed_tokens/decode": 50.0, "evictions/prefill-b": 3.0})
    rows = {(r.case.split(":")[0], r.metric): r for r in summarize(reqs, {"a": a, "b": b, "c": c, "e": "not available: no events"})}
    assert rows[("arm c", "ttft_p50/later")].ratio == pytest.approx(0.1)
    assert rows[("arm c", "ttft_p50/first")].ratio == pytest.approx(1.0)
    assert rows[("arm b", "success_rate")].value == 0.75
    assert rows[("arm c", "outputs_equal_to_a")].value == 0.75  # one output differs
    assert rows[("arm a", "hit_rate")].value == 0.0
    assert rows[("arm c", "hit_rate")].value == 0.5 and rows[("arm c", "hit_rate")].ratio == pytest.approx(2.0)
    assert not any(arm == "arm e" for arm, _ in rows)  # not available: no numbers
    assert rows[("arm c", "hit_rate/prefill-a")].value == 0.6  # where the work went
    assert (rows[("arm c", "computed_tokens/decode")].value, rows[("arm c", "computed_tokens/decode")].unit) == (50.0, "tokens")
    assert (rows[("arm c", "groups_held/both")].value, rows[("arm c", "groups_held/both")].unit) == (1.0, "groups")
    assert (rows[("arm c", "evictions/prefill-b")].value, rows[("arm c", "evictions/prefill-b")].unit) == (3.0, "pages")


def test_an_arms_tokens_computed_count_the_decodes_local_prefills_over_all_it_sent() -> None:
    """A cache-aware router has the decode compute some prompts itself: they count as
    computed, over every prompt token the clients sent, so arms compare."""
    servers: dict[str, dict[str, float | None]] = {
        "prefill-a": {"computed_tokens": 300.0, "prompt_tokens": 1000.0, "hit_tokens": 700.0, "evictions": 12.0},
        "prefill-b": {"computed_tokens": 100.0, "prompt_tokens": 400.0, "hit_tokens": 300.0},
        "decode": {"computed_tokens": 200.0},
    }
    counters, where = prefix.arm_counters(servers, sent=2000)
    assert counters == {"computed_tokens": 600.0, "prompt_tokens": 2000.0}  # hit rate 0.7, not the prefills' 0.71
    assert where == {
        "computed_tokens/prefill-a": 300.0, "computed_tokens/prefill-b": 100.0, "computed_tokens/decode": 200.0,
        "hit_rate/prefill-a": 0.7, "hit_rate/prefill-b": 0.75, "evictions/prefill-a": 12.0,
    }
    # A server that does not count its computed tokens leaves the total unknown, not short.
    assert prefix.arm_counters({**servers, "decode": {"computed_tokens": None}}, sent=2000)[0]["computed_tokens"] is None


def test_each_prefill_holds_half_the_groups_prefixes_and_what_the_requests_in_flight_add() -> None:
    a = args(groups=8, questions=3, prefix_tokens="64", question_tokens="16", concurrency=2, page_size=16)
    reqs = workload(a, vocab=512)
    # Eight groups' four-page prefixes, half of them, and each request in flight adds one
    # page (its 16-token question) to the prefix it shares with the cache.
    assert prefix.pool_pages(a, reqs) == 8 * 4 // 2 + 2 * 1
    t = prefix.topology(a, "model", "b", 80, prefix.pool_pages(a, reqs))
    pools = {p.name: p.args["num-pages"] for p in t.processes if p.role == "prefill"}
    assert pools == {"prefill-a": 18, "prefill-b": 18}
    assert int(t.engine["num-pages"]) > 8 * 4 + 2 * 5  # the decode: room for everything
    # --pool-pages 0: the prefills get the decode's roomy pool, so nothing is evicted.
    roomy = prefix.topology(a, "model", "b", 80, prefix.pool_pages(args(pool_pages=0), reqs))
    assert {p.args["num-pages"] for p in roomy.processes if p.role == "prefill"} == {roomy.engine["num-pages"]}


def test_a_prefill_pool_admits_every_request_in_flight_with_nothing_cached() -> None:
    a = args(groups=2, questions=3, prefix_tokens="64", question_tokens="16", concurrency=4, page_size=16)
    assert prefix.pool_pages(a, workload(a, vocab=512)) == 4 * 5  # four whole 5-page prompts, not 4 + 4 * 1


def test_at_the_defaults_one_prefill_cannot_hold_every_prefix_but_holds_half() -> None:
    """Round robin brings every group to both prefills, which must evict; a router that
    keeps each group on one prefill keeps its half cached with the requests in flight."""
    a = args()
    reqs = workload(a, vocab=a.vocab_size)
    pages = prefix.pool_pages(a, reqs)
    every = sum(len(_shared(reqs, g)) // a.page_size for g in range(a.groups))
    assert every // 2 < pages < every


def _shared(reqs: list[Request], group: int) -> tuple[int, ...]:
    prompts = [r.input_ids for r in reqs if r.group == group]
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return prompts[0][:n]


def test_the_vllm_arm_says_why_it_did_not_run() -> None:
    assert "no --vllm-python" in (prefix.vllm_problem("") or "")
    assert "import vllm" in (prefix.vllm_problem(sys.executable) or "")  # pdgrpc's own Python has no vLLM
    assert "not available" in (prefix.vllm_problem("/nonexistent/python") or "")
