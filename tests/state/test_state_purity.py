"""pdgrpc.state stays pure: no asyncio, grpc, sockets, threads, processes or clocks in its
own source, and the package's mypy run holds it to what ``mypy --strict`` checks.

The scan reads the package's own files (torch itself imports threading, so looking at
sys.modules after import would prove nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pdgrpc.state

PKG = Path(pdgrpc.state.__file__).parent
REPO = PKG.parent.parent
FORBIDDEN = {
    "asyncio", "grpc", "socket", "selectors", "ssl", "threading", "_thread", "concurrent", "multiprocessing",
    "subprocess", "signal", "time", "datetime", "uvloop", "ucxx", "torch.distributed", "pdgrpc.transport",
    "pdgrpc.v1",
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            out.add("<dynamic __import__>")
        elif isinstance(node, ast.Attribute) and node.attr in ("import_module",):
            out.add("<dynamic import_module>")
    return out


def offending(mods: set[str]) -> set[str]:
    return {m for m in mods if m.startswith("<") or any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}


def test_the_scan_catches_forbidden_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\nimport torch.distributed as dist\nfrom concurrent import futures\n")
    assert offending(imported_modules(bad)) >= {"time", "asyncio", "torch.distributed", "concurrent"}


@pytest.mark.parametrize("path", sorted(PKG.glob("*.py")), ids=lambda p: p.name)
def test_no_io_threads_or_clocks(path: Path) -> None:
    assert offending(imported_modules(path)) == set(), f"{path.name} imports something impure"


@pytest.mark.parametrize("module", ["pdgrpc.state", "pdgrpc.state.room", "pdgrpc.metrics", "pdgrpc.metrics.catalog"])
def test_the_package_check_holds_state_and_metrics_to_mypy_strict(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole-package mypy run (tests/test_typing.py) is the one check; this asserts that
    # pyproject.toml gives these modules every flag `--strict` turns on, as mypy reads it.
    from mypy.main import process_options

    monkeypatch.chdir(REPO)
    _, plain = process_options(["--config-file=", "pdgrpc"])
    _, strict = process_options(["--config-file=", "--strict", "pdgrpc"])
    _, ours = process_options(["pdgrpc"])
    names = [n for n in dir(strict) if not n.startswith("_") and not callable(getattr(strict, n))]
    turned_on = {n: getattr(strict, n) for n in names if getattr(strict, n) != getattr(plain, n)}
    assert "disallow_untyped_defs" in turned_on  # what --strict means is read from mypy, not listed here
    effective = ours.clone_for_module(module)
    missing = {n: v for n, v in turned_on.items() if getattr(effective, n) != v}
    assert missing == {}, f"pyproject.toml's [tool.mypy] leaves {module} without these --strict settings: {missing}"
