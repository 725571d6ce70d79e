"""Find a transport backend by name.

Three sources, looked up in this order of precedence-free union (a name may come from
only one of them; two claims on one name are an error, never a silent override):

* built-ins, registered lazily as ``"module:Class"`` strings so that importing pdgrpc
  never imports UCX: ``fake``, ``tcp``, ``rdma``;
* third-party packages, through the ``pdgrpc.transports`` entry-point group, e.g. in a
  plugin's ``pyproject.toml``::

      [project.entry-points."pdgrpc.transports"]
      unix = "pdgrpc_unix:UnixTransport"

* anything else by spelling it ``"package.module:Class"`` directly.

A missing optional dependency surfaces as :class:`~pdgrpc.errors.TransportUnavailable`
carrying the install hint (``pip install 'pdgrpc[ucx]'`` for ``rdma``). :func:`check` tells
that much without importing the backend (which imports torch), for a process that only
starts the ones that create it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

from pdgrpc.errors import TransportUnavailable
from pdgrpc.transport.base import Transport

ENTRY_POINT_GROUP = "pdgrpc.transports"

# name -> "module:Class"; imported only when asked for.
BUILTINS: dict[str, str] = {
    "fake": "pdgrpc.transport.fake:FakeTransport",
    "tcp": "pdgrpc.transport.tcp:TcpTransport",
    "rdma": "pdgrpc.transport.rdma:RdmaTransport",
}

# name -> what to install when the backend's optional dependency is missing.
INSTALL_HINTS: dict[str, str] = {
    "rdma": "pip install 'pdgrpc[ucx]'",
}
# name -> the optional modules its backend imports (what INSTALL_HINTS installs); rdma
# loads the UCX libraries from the libucx wheel and needs none of ucxx's Python layer.
_REQUIRES: dict[str, tuple[str, ...]] = {
    "rdma": ("libucx",),
}

# Registered at run time with register(); same namespace as the others.
_RUNTIME: dict[str, str] = {}


def _entry_points() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"{ep.value} (from {dist.name})" if dist is not None else ep.value
        found.setdefault(ep.name, [])
        if ep.value not in [o.split(" (from ")[0] for o in found[ep.name]]:
            found[ep.name].append(origin)
    return found


def _claims() -> dict[str, list[str]]:
    """name -> every ``module:Class`` claiming it, with where the claim comes from."""
    claims: dict[str, list[str]] = {n: [f"{t} (built-in)"] for n, t in BUILTINS.items()}
    for n, t in _RUNTIME.items():
        claims.setdefault(n, []).append(f"{t} (registered at run time)")
    for n, origins in _entry_points().items():
        claims.setdefault(n, []).extend(f"{o} (entry point)" for o in origins)
    return claims


def available() -> list[str]:
    """Every name that can be asked for (whether its dependencies are installed or not)."""
    return sorted(_claims())


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:Class"`` at run time (tests, embedding apps)."""
    if name in _claims():
        raise TransportUnavailable(f"transport name {name!r} is already taken: {_claims()[name]}")
    if ":" not in target:
        from pdgrpc.errors import ConfigError

        raise ConfigError(f"transport target must be 'module:Class', got {target!r}")
    _RUNTIME[name] = target


def unregister(name: str) -> None:
    _RUNTIME.pop(name, None)


def _split(target: str, name: str) -> tuple[str, str]:
    modname, _, clsname = target.partition(":")
    if not modname or not clsname:
        raise TransportUnavailable(f"transport {name!r}: target {target!r} is not 'module:Class'")
    return modname, clsname


def _no_module(name: str, modname: str) -> TransportUnavailable:
    return TransportUnavailable(f"transport {name!r}: module {modname!r} does not exist (available: {', '.join(available())})")


def _not_installed(name: str, missing: str) -> TransportUnavailable:
    hint = INSTALL_HINTS.get(name)
    return TransportUnavailable(
        f"transport {name!r} needs {missing!r}, which is not installed" + (f"; install it with: {hint}" if hint else "")
    )


def _import_target(target: str, name: str) -> type[Transport]:
    modname, clsname = _split(target, name)
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if modname == missing or modname.startswith(missing + "."):
            raise _no_module(name, modname) from None
        raise _not_installed(name, missing) from None
    except ImportError as exc:  # e.g. a shared library of an optional dependency is missing
        hint = INSTALL_HINTS.get(name)
        raise TransportUnavailable(
            f"transport {name!r} failed to import: {exc}" + (f"; install it with: {hint}" if hint else "")
        ) from None
    cls = getattr(module, clsname, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportUnavailable(f"transport {name!r}: {target} is not a pdgrpc Transport subclass")
    return cls


def _target(name: str) -> str:
    """The ``"module:Class"`` that ``name`` (a registered name or a target itself) stands for."""
    if ":" in name:
        return name
    claims = _claims()
    owners = claims.get(name)
    if not owners:
        raise TransportUnavailable(f"unknown transport {name!r}; available: {', '.join(sorted(claims))}")
    if len(owners) > 1:
        raise TransportUnavailable(f"transport name {name!r} is claimed by {len(owners)} backends: {owners}")
    return owners[0].split(" (")[0]


def load(name: str) -> type[Transport]:
    """The backend class for ``name`` (a registered name or ``"module:Class"``)."""
    return _import_target(_target(name), name)


def check(name: str) -> None:
    """Raise what :func:`load` would for an unknown name, a module that does not exist or a
    missing optional dependency, without importing the backend's module. An error inside
    that module surfaces only from :func:`load`."""
    modname, _ = _split(_target(name), name)
    try:
        spec = importlib.util.find_spec(modname)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None:
        raise _no_module(name, modname)
    for dep in _REQUIRES.get(name, ()):
        if importlib.util.find_spec(dep) is None:
            raise _not_installed(name, dep)


def create(name: str, **options: Any) -> Transport:
    """Instantiate the backend ``name`` with backend-specific keyword options."""
    return load(name)(**options)
