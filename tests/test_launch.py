"""Every server entry point sets the environment before grpc loads, as ``python -m`` and as a
console script: gRPC reads GRPC_EXPERIMENTS and GRPC_ENABLE_FORK_SUPPORT once, on import."""

from __future__ import annotations

import json
import os
import signal
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
    ("pdgrpc.decode", "pdgrpc.decode.__main__:cli", False),
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


# Delivers a real signal to a server process at one point of its start-up and prints the
# process's children at that moment (``CHILDREN pid ...``): as it imports torch, as it
# builds its engine, once its gRPC server listens, as a decode TP rank starts to join its
# gloo group, or once a prefill controller started its worker.
_STOP = """
import importlib.abc, logging, os, signal, sys
signum, where, module, argv = getattr(signal, sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
fired = []

def fire():
    if fired:
        return
    fired.append(True)
    kids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids += f.read().split()
    print("CHILDREN", *kids, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signum)

if where == "import":
    class Importing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                fire()
            return None
    sys.meta_path.insert(0, Importing())
if where == "listening":
    class At(logging.Filter):
        def filter(self, record):
            if "listening on" in record.getMessage():
                fire()
            return True
    logging.getLogger("pdgrpc.rpc").addFilter(At())
from pdgrpc.serving.launch import launch, prepare_environment
if where == "join":
    prepare_environment()
    from pdgrpc.decode.tp import TpGroup
    join = TpGroup.join
    async def joining(rank, size, init, timeout):
        fire()
        return await join(rank, size, init, timeout)
    TpGroup.join = joining
if where == "engine":
    # Before the role's server module imports build_engine, so that it imports this one.
    prepare_environment()
    import pdgrpc.serving.engines as engines
    build = engines.build_engine
    def building(*args, **kwargs):
        fire()
        return build(*args, **kwargs)
    engines.build_engine = building
if where == "spawned":
    prepare_environment()
    from pdgrpc.prefill.controller import Controller
    spawn = Controller.spawn
    async def spawned(self, *args):
        worker = await spawn(self, *args)
        fire()
        return worker
    Controller.spawn = spawned
sys.exit(launch(module, argv))
"""

_PREFILL_WORKER = [
    "--dp-rank", "0", "--dp-size", "1", "--bootstrap", "127.0.0.1:1", "--load-balance-method", "round_robin",
    "--transport", "tcp", "--compute-in", "process", "--model-size", "tiny", "--num-pages", "64",
]
_PREFILL = ["--port", "0", "--transport", "tcp", "--model-size", "tiny", "--num-pages", "64"]
_DECODE = ["--transport", "fake", "--model-size", "tiny", "--port", "0"]
# (signal, where, module, flags): every role that has no stop of its own yet at that point
STOPS = [
    ("SIGTERM", "import", "pdgrpc.colocated.server", ["--model-size", "tiny", "--port", "0"]),
    ("SIGTERM", "listening", "pdgrpc.router.server", ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", "0"]),
    ("SIGTERM", "listening", "pdgrpc.colocated.server", ["--model-size", "tiny", "--port", "0"]),
    ("SIGTERM", "listening", "pdgrpc.decode.server", _DECODE),
    ("SIGTERM", "listening", "pdgrpc.prefill.worker_role", _PREFILL_WORKER),
    ("SIGINT", "listening", "pdgrpc.prefill.worker_role", _PREFILL_WORKER),
    ("SIGTERM", "listening", "pdgrpc.prefill.controller_main", _PREFILL),
    ("SIGTERM", "spawned", "pdgrpc.prefill.controller_main", _PREFILL),
    ("SIGINT", "spawned", "pdgrpc.prefill.controller_main", _PREFILL),
    # Rank 0 kills rank 1 as it stops, so its own join can never complete.
    ("SIGTERM", "join", "pdgrpc.decode.server", [*_DECODE, "--tp-size", "2"]),
    ("SIGINT", "join", "pdgrpc.decode.server", [*_DECODE, "--tp-size", "2"]),
    # Rank 1 started before rank 0 imports torch: rank 0 kills it, as no group will form.
    ("SIGTERM", "import", "pdgrpc.decode.server", [*_DECODE, "--tp-size", "2"]),
    # Rank 1 is in the group: rank 0 kills it, as no "stop" command will reach it.
    ("SIGTERM", "engine", "pdgrpc.decode.server", [*_DECODE, "--tp-size", "2"]),
    # No rank 0 listens at --dist-init: the join would wait out --dist-timeout.
    ("SIGTERM", "join", "pdgrpc.decode.follower_server", [*_DECODE, "--tp-size", "2", "--tp-rank", "1", "--dist-init", "tcp://127.0.0.1:1"]),
]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
@pytest.mark.parametrize("signame, where, module, flags", STOPS, ids=[f"{s[0]}-{s[2]}-{s[1]}" for s in STOPS])
def test_a_signal_while_a_server_starts_stops_it_cleanly(signame: str, where: str, module: str, flags: list[str]) -> None:
    # Bounded well below --dist-timeout (120 s): a stop that waits out a join fails here.
    out = subprocess.run([sys.executable, "-c", _STOP, signame, where, module, *flags], capture_output=True, text=True, timeout=60)
    package = module.rsplit(".", 1)[0]
    if signame == "SIGTERM":  # asked to stop: a clean exit
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"{package}: stopped by SIGTERM while starting" in out.stderr, out.stderr[-3000:]
    else:
        assert out.returncode == 130, out.stderr[-3000:]
        assert f"{package}: stopped by Ctrl-C (SIGINT)" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-3000:]
    (children,) = [line.split()[1:] for line in out.stderr.splitlines() if line.startswith("CHILDREN")]
    left = [pid for pid in map(int, children) if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes {left} outlived the server stopped while it started"


# A script's background job (``server &``, ``nohup server &``) starts with SIGINT ignored:
# Ctrl-C at the script's terminal is not for it, but SIGTERM still stops its start-up.
BACKGROUND_STOPS = [
    ("import", "pdgrpc.colocated.server", ["--model-size", "tiny", "--port", "0"]),
    ("join", "pdgrpc.decode.follower_server", [*_DECODE, "--tp-size", "2", "--tp-rank", "1", "--dist-init", "tcp://127.0.0.1:1"]),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
@pytest.mark.parametrize("where, module, flags", BACKGROUND_STOPS, ids=[f"{s[1]}-{s[0]}" for s in BACKGROUND_STOPS])
def test_sigterm_stops_the_start_of_a_server_started_with_sigint_ignored(where: str, module: str, flags: list[str]) -> None:
    # sh ignores SIGINT, and the server it execs inherits that, as a background job does.
    argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable, "-c", _STOP, "SIGTERM", where, module, *flags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    package = module.rsplit(".", 1)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{package}: stopped by SIGTERM while starting" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


# A role whose serve() crashes the interpreter in native code, as a segfault in an
# extension would.
_CRASHING_ROLE = '''
import argparse, ctypes
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.serving.launch import Role

def build_parser():
    p = argparse.ArgumentParser()
    add_security_arguments(p)
    p.add_argument("--log-level", default="info")
    return p

def crash_in_native_code(ns):
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return 0

ROLE = Role(build_parser=build_parser, serve=crash_in_native_code, log_name=lambda ns: "crasher")
'''


def test_a_server_that_crashes_in_native_code_leaves_its_python_stack_in_its_log(tmp_path: Path) -> None:
    (tmp_path / "crashing_role.py").write_text(_CRASHING_ROLE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    env.pop("PYTHONFAULTHANDLER", None)
    code = "import sys; from pdgrpc.serving.launch import launch; sys.exit(launch('crashing_role', []))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert "crash_in_native_code" in out.stderr  # the frame it happened in
