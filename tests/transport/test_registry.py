"""Finding backends: built-ins, entry points, module:Class, and the errors users see."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdgrpc.errors import ConfigError, TransportUnavailable
from pdgrpc.transport import registry
from pdgrpc.transport.base import Transport
from pdgrpc.transport.fake import FakeTransport
from pdgrpc.transport.tcp import TcpTransport


def _fake_distribution(root: Path, dist: str, entry_points: str) -> None:
    """A real installed-distribution record on sys.path, as pip would leave it."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def test_builtins_load_by_name() -> None:
    assert registry.load("fake") is FakeTransport
    assert registry.load("tcp") is TcpTransport
    assert {"fake", "tcp", "rdma"} <= set(registry.available())


def test_module_class_spelling() -> None:
    assert registry.load("pdgrpc.transport.tcp:TcpTransport") is TcpTransport
    with pytest.raises(TransportUnavailable, match="not a pdgrpc Transport subclass"):
        registry.load("pdgrpc.transport.tcp:HEADER")
    with pytest.raises(TransportUnavailable, match="does not exist"):
        registry.load("no_such_package_xyz.mod:Thing")


def test_unknown_name_lists_available() -> None:
    with pytest.raises(TransportUnavailable) as err:
        registry.load("infiniband")
    msg = str(err.value)
    assert "unknown transport 'infiniband'" in msg
    for name in ("fake", "tcp", "rdma"):
        assert name in msg


def test_example_plugin_found_through_entry_point() -> None:
    pytest.importorskip("pdgrpc_unix", reason="examples/pdgrpc-unix is not installed (scripts/setup.sh installs it)")
    cls = registry.load("unix")
    assert issubclass(cls, TcpTransport) and cls.name == "unix"
    assert isinstance(registry.create("unix"), Transport)


def test_third_party_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "acme_transport.py").write_text(
        "from pdgrpc.transport.fake import FakeTransport\n"
        "class AcmeTransport(FakeTransport):\n    name = 'acme'\n"
    )
    _fake_distribution(tmp_path, "acme_transport", """
        [pdgrpc.transports]
        acme = acme_transport:AcmeTransport
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "acme" in registry.available()
    assert registry.load("acme").__name__ == "AcmeTransport"


def test_two_backends_claiming_one_name_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_distribution(tmp_path, "impostor", """
        [pdgrpc.transports]
        tcp = impostor:Tcp
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TransportUnavailable, match="claimed by 2 backends") as err:
        registry.load("tcp")
    assert "pdgrpc.transport.tcp:TcpTransport" in str(err.value) and "impostor:Tcp" in str(err.value)
    with pytest.raises(TransportUnavailable, match="already taken"):
        registry.register("fake", "somewhere:Else")


def test_missing_optional_dependency_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_missing.py").write_text("import definitely_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("needy", "needs_missing:Needy")
    monkeypatch.setitem(registry.INSTALL_HINTS, "needy", "pip install 'pdgrpc[needy]'")
    try:
        with pytest.raises(TransportUnavailable) as err:
            registry.load("needy")
    finally:
        registry.unregister("needy")
    msg = str(err.value)
    assert "definitely_not_installed_xyz" in msg and "pip install 'pdgrpc[needy]'" in msg


def test_rdma_hint_is_the_ucx_extra() -> None:
    assert registry.INSTALL_HINTS["rdma"] == "pip install 'pdgrpc[ucx]'"


def test_backend_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        registry.create("tcp", bogus=1)
    with pytest.raises(ConfigError, match="connections"):
        registry.create("tcp", connections=0)
    with pytest.raises(ConfigError, match="takes no options"):
        registry.create("fake", x=1)
    with pytest.raises(ConfigError, match="module:Class"):
        registry.register("odd", "no_colon_here")


def test_check_refuses_what_load_refuses() -> None:
    with pytest.raises(TransportUnavailable, match="unknown transport 'infiniband'"):
        registry.check("infiniband")
    with pytest.raises(TransportUnavailable, match="module 'no_such_module_xyz' does not exist"):
        registry.check("no_such_module_xyz:Transport")
    with pytest.raises(TransportUnavailable, match="is not 'module:Class'"):
        registry.check("tcp_without_class:")
    for name in ("fake", "tcp", "rdma"):
        registry.check(name)


def test_check_names_a_missing_dependency_and_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # The UCX libraries as on a machine without the extra: off the path and not loaded.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    monkeypatch.delitem(sys.modules, "libucx", raising=False)
    importlib.invalidate_caches()
    with pytest.raises(TransportUnavailable) as err:
        registry.check("rdma")
    assert str(err.value) == "transport 'rdma' needs 'libucx', which is not installed; install it with: pip install 'pdgrpc[ucx]'"


def test_rdma_needs_only_the_ucx_libraries() -> None:
    # The rdma backend loads libucx itself: a machine with the libucx wheel and without
    # ucxx's Python layer (a GPU image with carried wheels) runs it.
    assert _fresh_interpreter(
        "import sys",
        "sys.modules['ucxx'] = None  # not installed: find_spec finds nothing, import fails",
        "from pdgrpc.transport import registry",
        "registry.check('rdma')",
        "print(registry.load('rdma').__name__)",
    ) == "RdmaTransport"


def test_check_imports_no_backend() -> None:
    assert _fresh_interpreter(
        "import sys",
        "from pdgrpc.transport import registry",
        "for name in ('tcp', 'rdma', 'fake'):",
        "    registry.check(name)",
        "print(sorted(m for m in ('torch', 'ucxx', 'pdgrpc.transport.tcp', 'pdgrpc.transport.rdma') if m in sys.modules))",
    ) == "[]"


def _fresh_interpreter(*lines: str) -> str:
    """What ``lines`` print, run in a new Python process (its imports start empty)."""
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
