"""bench e2e's --model: every system serves the checkpoint, the colocated baseline too,
so outputs stay comparable (no process starts here)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdgrpc.bench import e2e
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.topology import load_topology


def test_every_server_of_every_system_gets_the_model(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    assert p.parse_args([]).model == "" and p.parse_args(["--model", "m.gguf"]).model == "m.gguf"
    for name in ("1p1d", "colocated"):
        cluster = Cluster(e2e.on_device(load_topology(name), "cpu", "m.gguf"), transport="tcp", log_dir=tmp_path / name)
        for proc in cluster.procs.values():
            argv = proc.argv
            assert argv[argv.index("--model") + 1] == "m.gguf", (name, proc.spec.name)
    assert "model" not in e2e.on_device(load_topology("1p1d"), "cpu").engine
