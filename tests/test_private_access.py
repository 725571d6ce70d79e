"""No code of pdgrpc, its tests, scripts or example plugin reaches into another object's
private members: ``x._name`` is read or written only where ``x`` is ``self``, ``cls`` or
``super()``, or where ``_name`` is defined in the same module (a function, class or name
there, or a class's own state assigned through ``self``: the module owns it; writing
``x._name`` elsewhere defines nothing, it reaches in). In the package a narrow interface
passed in at construction replaces the reach; a test asserts through public behaviour,
or through a small public, documented method of the class that states the invariant it
checks. Dunder names are public protocol, and torch's operator namespace names its ops
with a leading underscore.

Importing another module's private name (``from m import _x``) is the same reach. A
private module (``_m``) is private to the package that holds it: that package's modules,
its subpackages' included, import it and every name in it (the module's underscore marks
them all private, so they are spelled without one); a module outside the package does
not import it (``import pkg._m``, ``from pkg._m import x``, ``from pkg import _m``)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _outside_owner(module: str, package: str) -> bool:
    """Whether ``package`` lies outside the package owning a private module on ``module``'s path."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        owner = ".".join(parts[:i])
        if _private(part) and package != owner and not package.startswith(owner + "."):
            return True
    return False


def _is_repo_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(source: str, where: str, package: str, is_module: Callable[[str], bool] = _is_repo_module) -> list[str]:
    """``where:line: import`` for each import of another module's private name, or of a
    private module from outside the package that holds it. ``package``: the importing
    module's package (for an ``__init__.py``, its own); ``is_module``: whether a dotted
    name is a module (``from pkg import _m`` imports a module, not a name)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if _outside_owner(a.name, package)]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                full = f"{target}.{a.name}"
                submodule = _private(a.name) and is_module(full)
                if _outside_owner(full if submodule else target, package) or (_private(a.name) and not submodule):
                    found.append(f"{where}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}")
    return found


def _package_of(f: Path) -> str:
    parts = f.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1])


@pytest.mark.parametrize("top", CHECKED)
def test_no_module_imports_another_modules_private_name(top: str) -> None:
    found = []
    for f in sorted((REPO / top).rglob("*.py")):
        if not any(f.is_relative_to(g) for g in GENERATED):
            found += private_imports(f.read_text(), str(f.relative_to(REPO)), _package_of(f))
    assert found == [], (
        "what another module needs is public: give it a public name (documented, typed), or assert through "
        "public behaviour; a private module is its own package's:\n" + "\n".join(found)
    )


def test_the_check_sees_a_private_import_and_lets_a_package_use_its_private_module() -> None:
    modules = {"pkg._impl", "pkg.sub._impl"}.__contains__
    source = (
        "from __future__ import annotations\n"
        "from pkg.api import _helper, public\n"
        "import pkg._impl\n"
        "from pkg import _impl\n"
        "from pkg._impl import Worker\n"
        "from pkg.api import __all__\n"
        "from . import _impl\n"
        "from ._impl import _secret\n"
    )
    assert private_imports(source, "tests/t.py", "tests", modules) == [
        "tests/t.py:2: from pkg.api import _helper",
        "tests/t.py:3: import pkg._impl",
        "tests/t.py:4: from pkg import _impl",
        "tests/t.py:5: from pkg._impl import Worker",
        "tests/t.py:7: from . import _impl",  # not a module of tests: a private name of its __init__
        "tests/t.py:8: from ._impl import _secret",
    ]
    assert private_imports(source, "pkg/sub/m.py", "pkg.sub", modules) == [
        "pkg/sub/m.py:2: from pkg.api import _helper",
        "pkg/sub/m.py:8: from ._impl import _secret",
    ]
