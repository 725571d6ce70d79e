"""bench e2e's twin clusters: each changes one flag of one role, and nothing else."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest

from pdgrpc.bench import e2e
from pdgrpc.cluster.topology import load_topology
from pdgrpc.prefill.cli import build_parser
from pdgrpc.router.server import build_parser as router_parser


@pytest.mark.parametrize("arm, twin, role, change", [
    ("no_prefix_cache_arm", e2e.without_prefix_cache, "prefill", {"no-prefix-cache": True}),
    ("first_token_decode_arm", e2e.first_token_from_decode, "router", {"first-token": "decode"}),
])
def test_a_twin_cluster_changes_one_flag_of_one_role(arm, twin, role, change) -> None:
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    flag = "--" + arm.replace("_", "-")
    assert getattr(p.parse_args([flag]), arm) and not getattr(p.parse_args([]), arm)
    t = load_topology("2p2d")
    changed = twin(t)
    for before, after in zip(t.processes, changed.processes):
        assert after == (dataclasses.replace(before, args={**before.args, **change}) if before.role == role else before)
    assert changed.engine == t.engine


def test_the_flags_the_twins_get_exist() -> None:
    assert "--no-prefix-cache" in build_parser().format_help()
    # The router's default is the one the main cluster runs with.
    base = ["--prefill", "a:1", "--decode", "b:2"]
    assert router_parser().parse_args(base).first_token == "prefill"
    assert router_parser().parse_args([*base, "--first-token", "decode"]).first_token == "decode"


async def test_tokens_per_s_rounds_run_every_system_once_each_in_a_new_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # A drift of the host then falls on every system alike, not on whichever ran then.
    runs: list[tuple[str, tuple[int, ...]]] = []

    async def fake(stub, prompts, max_new, concurrency):
        runs.append((stub, tuple(p[0] for p in prompts)))
        return e2e.Load(1.0, len(prompts) * max_new, len(prompts), len(prompts) // 2)

    monkeypatch.setattr(e2e, "run_load", fake)
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(["--throughput-rounds", "4", "--max-new-tokens", "3"])
    prompts = [[i] for i in range(10)]
    out = await e2e.throughput_rounds({"a": "a", "b": "b", "c": "c"}, prompts, args, random.Random(1))
    rounds = [runs[i : i + 3] for i in range(0, 12, 3)]
    assert all(sorted(name for name, _ in r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(name for name, _ in r) for r in rounds}) > 1  # the order changes
    for name in "abc":  # every prompt once per system, over the rounds
        assert sorted(i for n, ids in runs if n == name for i in ids) == list(range(10))
    assert out == {name: e2e.Load(4.0, 30, 10, 4) for name in "abc"}  # rounds of 3, 3, 2, 2 prompts
    with pytest.raises(SystemExit):
        p.parse_args(["--throughput-rounds", "0"])


async def test_at_its_defaults_each_tokens_per_s_round_holds_several_waves(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A round of one wave times a burst draining, where prefill and decode barely overlap.
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args([])
    assert args.throughput_requests // args.throughput_rounds >= 4 * args.concurrency

    async def fake(stub, prompts, max_new, concurrency):
        return e2e.Load(1.0, len(prompts) * max_new)

    monkeypatch.setattr(e2e, "run_load", fake)
    await e2e.throughput_rounds({"a": "a"}, [[i] for i in range(args.throughput_requests)], args, random.Random(1))
    assert "note:" not in capsys.readouterr().out
    short = p.parse_args(["--throughput-requests", "64"])  # 16 a round: one wave of 16
    await e2e.throughput_rounds({"a": "a"}, [[i] for i in range(64)], short, random.Random(1))
    assert "under two waves of --concurrency 16" in capsys.readouterr().out
