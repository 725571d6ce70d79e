"""bench e2e's --no-prefix-cache-arm: the twin cluster turns off only the prefills' cache."""

from __future__ import annotations

import argparse

from pdgrpc.bench import e2e
from pdgrpc.cluster.topology import load_topology
from pdgrpc.prefill.cli import build_parser


def test_the_twin_cluster_starts_its_prefills_with_no_prefix_cache() -> None:
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    assert p.parse_args(["--no-prefix-cache-arm"]).no_prefix_cache_arm and not p.parse_args([]).no_prefix_cache_arm
    t = load_topology("2p2d")
    twin = e2e.without_prefix_cache(t)
    for before, after in zip(t.processes, twin.processes):
        if before.role == "prefill":
            assert after.args == {**before.args, "no-prefix-cache": True}
        else:
            assert after == before
    assert twin.engine == t.engine
    assert "--no-prefix-cache" in build_parser().format_help()  # the flag the twin's prefills get
