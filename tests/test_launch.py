"""Every server entry point sets the environment before grpc loads, as ``python -m`` and as a
console script: gRPC reads GRPC_EXPERIMENTS and GRPC_ENABLE_FORK_SUPPORT once, on import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdgrpc.rpc.tuning import GRPC_EXPERIMENTS

# module run by `python -m`, its console-script function, whether it may import torch
ENTRY_POINTS = [
    ("pdgrpc.bootstrap", "pdgrpc.bootstrap.__main__:main", False),
    ("pdgrpc.router", "pdgrpc.router.__main__:main", False),
    ("pdgrpc.colocated", "pdgrpc.colocated.__main__:main", True),
    ("pdgrpc.prefill", "pdgrpc.prefill.__main__:main", False),
    ("pdgrpc.prefill.worker_main", "pdgrpc.prefill.worker_main:main", False),
    ("pdgrpc.decode", "pdgrpc.decode.__main__:cli", True),
    ("pdgrpc.decode.follower", "pdgrpc.decode.follower:cli", True),
]

# Records the environment at the moment anything first imports grpc, then prints it with
# the torch modules loaded by the end of the run.
_PROBE = """
import importlib.abc, json, os, runpy, sys
seen = {}
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.update({k: os.environ.get(k) for k in ("GRPC_EXPERIMENTS", "GRPC_ENABLE_FORK_SUPPORT")})
        return None
sys.meta_path.insert(0, Probe())
how, target = sys.argv[1], sys.argv[2]
try:
    if how == "module":
        sys.argv = [target, "--help"]
        runpy.run_module(target, run_name="__main__")
    else:
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(["--help"])
except SystemExit:
    pass
print(json.dumps({"at_grpc_import": seen, "torch": "torch" in sys.modules}))
"""


def _run(how: str, target: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "PDGRPC_GRPC_DEFAULTS", "GRPC_ENABLE_FORK_SUPPORT")}
    out = subprocess.run([sys.executable, "-c", _PROBE, how, target], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("module, script, torch", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
@pytest.mark.parametrize("how", ["module", "script"])
def test_the_environment_is_set_before_grpc_is_imported(module: str, script: str, torch: bool, how: str) -> None:
    result = _run(how, module if how == "module" else script)
    assert result["at_grpc_import"] == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    if not torch:
        assert result["torch"] is False


def test_every_server_console_script_is_checked_here() -> None:
    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    servers = {target for name, target in scripts.items() if name not in ("pdgrpc-cluster", "pdgrpc-bench")}
    assert servers <= {script for _, script, _ in ENTRY_POINTS}


def test_no_module_imports_after_code() -> None:
    # Entry points set the environment through launch(), so no module needs an import
    # placed after a statement (and a linter exemption for it).
    root = Path(__file__).resolve().parents[1] / "pdgrpc"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "noqa: E402" in p.read_text()]
    assert offenders == []


# Delivers a real SIGINT to the server process at one point of its start-up: while it
# imports torch, or once its main coroutine runs (as it builds its engine).
_CTRL_C = """
import importlib.abc, signal, sys
where = sys.argv[1]
if where == "import":
    class Interrupt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                signal.raise_signal(signal.SIGINT)
            return None
    sys.meta_path.insert(0, Interrupt())
from pdgrpc.serving.launch import launch, prepare_environment
if where == "engine":
    prepare_environment()
    import pdgrpc.colocated.server as server
    build = server.build_engine
    def interrupted_build(ns):
        signal.raise_signal(signal.SIGINT)
        return build(ns)
    server.build_engine = interrupted_build
sys.exit(launch("pdgrpc.colocated.server", ["--model-size", "tiny", "--port", "0"]))
"""


@pytest.mark.parametrize("where", ["import", "engine"])
def test_ctrl_c_while_a_server_starts_is_one_line_and_exit_130(where: str) -> None:
    out = subprocess.run([sys.executable, "-c", _CTRL_C, where], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr[-3000:]
    assert "pdgrpc.colocated: stopped by Ctrl-C (SIGINT)" in out.stderr
    assert "Traceback" not in out.stderr and "listening on" not in out.stderr
