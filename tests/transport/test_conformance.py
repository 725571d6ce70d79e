"""The conformance suite (pdgrpc.transport.testing) against every backend we ship,
plus the example third-party plugin. Sender and receiver run in separate processes."""

from __future__ import annotations

from typing import Callable

import pytest

from pdgrpc.errors import TransportUnavailable
from pdgrpc.transport import registry
from pdgrpc.transport.testing import MEASURED, NON_DATA_CHECKS, CudaTransportConformance, TransportConformance


def _skip_unless_loadable(name: str) -> Callable[[type], type]:
    """Skip (with the reason) only when the backend's optional dependency is not
    installed; any other import problem fails the tests."""
    try:
        registry.load(name)
    except TransportUnavailable as exc:
        if "not installed" in str(exc):
            return pytest.mark.skip(reason=str(exc))
    return lambda cls: cls


class TestFakeConformance(TransportConformance):
    backend = "fake"


class TestTcpConformance(TransportConformance):
    backend = "tcp"


class TestTcpThreeConnectionsConformance(TransportConformance):
    """Several sockets per peer: a room's frames and its metadata row take different
    sockets, so ordering rests on the receiver's byte count, not on one stream. Only the
    data-path checks are repeated here (the rest does not depend on the socket count:
    a lost socket drops the whole peer, which the one-socket run covers)."""

    backend = "tcp"
    options = {"connections": 3}
    # not collected for this variant: identical to the one-connection run
    leave_out = (*NON_DATA_CHECKS, "test_unauthorized_writes_are_rejected", "test_large_transfer_bit_exact")


@_skip_unless_loadable("rdma")
class TestRdmaConformance(TransportConformance):
    backend = "rdma"


@_skip_unless_loadable("rdma")
class TestRdmaPackedConformance(TransportConformance):
    """Every data message of several ops packed, as messages of GPU memory are: gathered
    into one buffer before the send, received into one and scattered into the pages
    (pdgrpc.transport.rdma_pack). The data checks and the lost peers, on host memory."""

    backend = "rdma"
    options = {"pack": "always"}
    # packing changes nothing these check that the checks kept here do not
    leave_out = ("test_registry_and_descriptor", "test_fail_peer_hook_on_sender", "test_large_transfer_bit_exact")


@_skip_unless_loadable("unix")
class TestExamplePluginConformance(TransportConformance):
    """examples/pdgrpc-unix, found through the pdgrpc.transports entry point."""

    backend = "unix"


# -- the data checks with KV regions in GPU memory (skipped without a CUDA device) ------
class TestTcpCudaConformance(CudaTransportConformance):
    backend = "tcp"


class TestTcpCudaToHostConformance(CudaTransportConformance):
    """This process's regions on the GPU, the peer process's on the host."""

    backend = "tcp"
    peer_device = "cpu"


@_skip_unless_loadable("rdma")
class TestRdmaCudaConformance(CudaTransportConformance):
    backend = "rdma"


@_skip_unless_loadable("rdma")
class TestRdmaCudaToHostConformance(CudaTransportConformance):
    backend = "rdma"
    peer_device = "cpu"


def test_leave_out_names_only_checks_of_the_suite() -> None:
    """A misspelt name in ``leave_out`` is an error, not a check silently kept."""
    with pytest.raises(TypeError, match="'test_round_trip_random_pages', which is no check of the suite"):
        type("Variant", (TransportConformance,), {"backend": "tcp", "leave_out": ("test_round_trip_random_pages",)})


def teardown_module() -> None:
    for backend, what, seconds in MEASURED:
        print(f"measured: {backend}: {what} in {seconds * 1000:.0f} ms")
