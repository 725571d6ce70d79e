"""No code of pdgrpc, its tests, scripts or example plugin reaches into another object's
private members: ``x._name`` is read or written only where ``x`` is ``self``, ``cls`` or
``super()``, or where ``_name`` is defined in the same module (a function, class or name
there, or a class's own state assigned through ``self``: the module owns it; writing
``x._name`` elsewhere defines nothing, it reaches in). In the package a narrow interface
passed in at construction replaces the reach; a test asserts through public behaviour,
or through a small public, documented method of the class that states the invariant it
checks. Dunder names are public protocol, and torch's operator namespace names its ops
with a leading underscore."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# namedtuple's public API, spelled with an underscore so it cannot clash with a field
PUBLIC = {"_asdict", "_fields", "_field_defaults", "_make", "_replace"}


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _defined_private(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)  # a class's own state; a store into another object is a reach
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_")}


def private_reaches(source: str, where: str) -> list[str]:
    """``where:line: expression`` for each reach into another object's private member."""
    tree = ast.parse(source, where)
    own = _defined_private(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name, value = node.attr, node.value
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")) or name in PUBLIC or name in own:
            continue
        if _is_self(value):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        if ast.unparse(value).startswith("torch.ops."):
            continue
        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


# The trees checked; code generated from protos/ is not ours to shape (interop/node is
# JavaScript, its node_modules someone else's).
CHECKED = ("pdgrpc", "tests", "scripts", "examples")
GENERATED = (REPO / "pdgrpc" / "v1",)


@pytest.mark.parametrize("top", CHECKED)
def test_no_module_reaches_into_another_objects_private_members(top: str) -> None:
    found = []
    for f in sorted((REPO / top).rglob("*.py")):
        if not any(f.is_relative_to(g) for g in GENERATED):
            found += private_reaches(f.read_text(), str(f.relative_to(REPO)))
    assert found == [], (
        "pass a narrow interface in at construction instead; in a test, assert through public behaviour "
        "or a public, documented method of the class:\n" + "\n".join(found)
    )


def test_the_check_sees_a_reach_and_lets_a_class_use_its_own_state() -> None:
    source = (
        "class Pool:\n"
        "    def __init__(self):\n        self._free = []\n"
        "    def merge(self, other):\n        self._free += other._free\n"
        "def drain(conn):\n    return conn._buffer, conn.__class__\n"
        "def stub(conn):\n    conn._closed = True\n"
    )
    assert sorted(private_reaches(source, "m.py")) == ["m.py:7: conn._buffer", "m.py:9: conn._closed"]
