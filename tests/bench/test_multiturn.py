"""bench multiturn: the arms' flags, the cluster each arm starts, and how arms are
summarized per turn (no cluster)."""

from __future__ import annotations

import argparse

import pytest

from pdgrpc.bench import multiturn
from pdgrpc.bench.multiturn import ARMS, ArmResult, Outcome, summarize, topology
from pdgrpc.decode.cli import build_parser as decode_parser
from pdgrpc.errors import PdgrpcError
from pdgrpc.prefill.cli import build_parser as prefill_parser
from pdgrpc.router.server import build_parser as router_parser


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    multiturn.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_are_the_issues_workload() -> None:
    a = args()
    assert (a.sessions, a.turns, a.message_tokens, a.answer_tokens, a.pairs) == (32, 8, 64, 64, 1)
    assert multiturn.max_prompt_tokens(a) == 8 * 64 + 7 * 64


@pytest.mark.parametrize("name", list(ARMS))
def test_every_arm_starts_its_roles_with_flags_they_take(name: str) -> None:
    """An arm is data: each flag it adds must be one its role's parser accepts."""
    t = topology(args("--pairs", "2"), "/models/m", name)
    parsers = {"prefill": prefill_parser(), "decode": decode_parser(), "router": router_parser()}
    roles = [p.role for p in t.processes]
    assert roles.count("prefill") == roles.count("decode") == 2
    for role, flags in (("prefill", ARMS[name].prefill), ("decode", ARMS[name].decode), ("router", ARMS[name].router)):
        for flag, value in flags.items():
            argv = [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
            _, unknown = parsers[role].parse_known_args(argv)
            assert unknown == [], (role, flag)
        for p in t.processes:
            if p.role == role:
                assert {k: p.args[k] for k in flags} == dict(flags)


def test_the_baseline_turns_every_reuse_off() -> None:
    off = ARMS[multiturn.BASELINE]
    assert off.prefill.get("no-prefix-cache") and off.decode.get("no-decode-prefix-cache")


def _result(turn_bytes: dict[int, int], ttft: float, tokens: tuple[int, ...], seconds: float, fail: tuple[int, int] | None = None) -> ArmResult:
    out = {}
    for s in range(2):
        for t in (1, 2, 3):
            out[(s, t)] = Outcome(ttft, 1.0, tokens, turn_bytes[t]) if (s, t) != fail else Outcome(error="UNAVAILABLE: gone")
    return ArmResult(out, seconds)


def test_summary_compares_each_turn_with_the_baseline() -> None:
    a = args("--sessions", "2", "--turns", "3")
    results = {
        "off": _result({1: 100, 2: 200, 3: 300}, 0.4, (1, 2, 3, 4), 10.0),
        "delta": _result({1: 100, 2: 50, 3: 30}, 0.1, (1, 2, 3, 4), 5.0, fail=(1, 3)),
    }
    rows = {(r.case.split(":")[0], r.metric): r for r in summarize(a, results)}
    assert rows[("arm delta", "turn 3: bytes/request")].ratio == pytest.approx(0.1)
    assert rows[("arm delta", "turns 3+: bytes/request")].value == 30
    assert rows[("arm delta", "all turns: ttft_p50")].ratio == pytest.approx(0.25)
    # 2 x 3 x 4 tokens in 10 s; 5 answers of 4 tokens in 5 s.
    assert rows[("arm off", "throughput")].value == pytest.approx(2.4)
    assert rows[("arm delta", "throughput")].ratio == pytest.approx(4.0 / 2.4)
    assert rows[("arm delta", "outputs_equal_to_off")].value == pytest.approx(5 / 6)  # the failed one is not equal
    assert rows[("arm delta", "failed")].value == 1 and rows[("arm off", "failed")].value == 0


def test_an_unknown_arm_is_refused_naming_the_flag() -> None:
    with pytest.raises(PdgrpcError, match="--arms"):
        multiturn.run(args("--arms", "off,nope"))
    with pytest.raises(PdgrpcError, match="--turns"):
        multiturn.run(args("--turns", "0"))


def test_a_difference_at_a_float_tie_is_told_from_one_beyond_rounding() -> None:
    """Chat 0 equal; chat 1 first differs at a tie (its later turn differs as a consequence);
    chat 2 first differs where the baseline's token led by far: 2 outputs beyond rounding."""
    a = args("--sessions", "3", "--turns", "2")
    new = {(s, t): (10 * s + t,) for s in range(3) for t in (1, 2)}
    answers = {(s, t): (100 + s, 200 + t, 300) for s in range(3) for t in (1, 2)}
    base = ArmResult({k: Outcome(0.1, 1.0, v, 0) for k, v in answers.items()}, 1.0)
    mine = dict(answers)
    mine[(1, 2)] = (101, 7, 300)  # differs at output 1: a tie
    mine[(2, 1)] = (102, 201, 8)  # differs at output 2: not a tie
    mine[(2, 2)] = (9, 9, 9)
    res = ArmResult({k: Outcome(0.1, 1.0, v, 0) for k, v in mine.items()}, 1.0)
    seen: list[tuple[int, ...]] = []

    def logits_of(ids: tuple[int, ...]) -> list[float]:
        seen.append(ids)
        lg = [0.0] * 400
        lg[200 + 2] = lg[7] = 5.0 - 1e-6 * (ids[0] == 11)  # chat 1: 202 and 7 within rounding
        lg[300], lg[8] = 5.0, 4.0  # chat 2: 300 led 8 by 1.0
        return lg

    found, beyond = multiturn.classify(a, new, base, res, logits_of)
    assert [(d.session, d.turn, d.position, d.tokens, d.tie) for d in found] == [(1, 2, 1, (202, 7), True), (2, 1, 2, (300, 8), False)]
    assert found[1].gap == pytest.approx(1.0)
    assert seen == [(11, 101, 201, 300, 12, 101), (21, 102, 201)]  # the shared prompt and tokens before the difference
    assert beyond == 2
    rows = {r.metric: r.value for r in summarize(a, {"off": base, "delta": res}, {"delta": beyond}) if r.case.startswith("arm delta")}
    assert rows["outputs_differing_beyond_rounding"] == 2
