"""The conformance suite (pdgrpc.transport.testing) against every backend we ship,
plus the example third-party plugin. Sender and receiver run in separate processes."""

from __future__ import annotations

import importlib.util

import pytest

from pdgrpc.errors import TransportUnavailable
from pdgrpc.transport import registry
from pdgrpc.transport.testing import MEASURED, TransportConformance


def _skip_unless_loadable(name: str, module: str) -> pytest.MarkDecorator:
    """Skip (with the reason) only when the backend's module is absent or its optional
    dependency is not installed; any other import problem fails the tests."""
    if importlib.util.find_spec(module) is None:
        return pytest.mark.skip(reason=f"{module} does not exist yet (backend {name!r} not written)")
    try:
        registry.load(name)
    except TransportUnavailable as exc:
        if "not installed" in str(exc):
            return pytest.mark.skip(reason=str(exc))
    return pytest.mark.usefixtures()


class TestFakeConformance(TransportConformance):
    backend = "fake"


class TestTcpConformance(TransportConformance):
    backend = "tcp"


class TestTcpTwoConnectionsConformance(TransportConformance):
    """Several sockets per peer: KV bytes and the metadata row take different sockets."""

    backend = "tcp"
    options = {"connections": 3}


@_skip_unless_loadable("rdma", "pdgrpc.transport.rdma")
class TestRdmaConformance(TransportConformance):
    backend = "rdma"


@_skip_unless_loadable("unix", "pdgrpc_unix")
class TestExamplePluginConformance(TransportConformance):
    """examples/pdgrpc-unix, found through the pdgrpc.transports entry point."""

    backend = "unix"


def teardown_module() -> None:
    for backend, what, seconds in MEASURED:
        print(f"measured: {backend}: {what} in {seconds * 1000:.0f} ms")
