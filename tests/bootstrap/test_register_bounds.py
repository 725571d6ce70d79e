"""What one RegisterWorker caller can make a real bootstrap hold, log or repeat: every
size it names is bounded, each refusal names the field and its limit, and a legitimate
worker still registers and is found afterwards."""

from __future__ import annotations

import logging

import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import MAX_WORKERS
from pdgrpc.rpc.errors import RpcError
from pdgrpc.rpc.limits import MAX_ADDRESS_CHARS, MAX_NAME_CHARS, MAX_TRANSPORT_ENDPOINT_BYTES

from bootstrap_helpers import parallel_info, worker


async def registers_and_is_found(client: BootstrapClient) -> None:
    for dp in range(2):
        await client.register_worker(worker(dp), parallel_info(dp=2))
    (w,) = (await client.get_workers_response(1)).workers
    assert (w.transfer_address, w.generation) == ("10.0.0.1:7000", 1)


@pytest.mark.parametrize(
    "sizes",
    [dict(dp=MAX_WORKERS + 1), dict(dp=256, tp=64, pp_size=2), dict(dp=2**16, tp=2**16, pp_size=2**16)],
)
async def test_a_topology_over_max_workers_is_invalid_argument(client: BootstrapClient, sizes: dict[str, int]) -> None:
    """dp_size x tp_size x pp_size was unbounded: a caller registered slot after slot of a
    2**20-worker topology, each held for good, and sizes whose product overflows the
    response's uint32 count ended the call UNKNOWN."""
    with pytest.raises(RpcError) as e:
        await client.register_worker(worker(1), parallel_info(**sizes))  # type: ignore[arg-type]
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert "RegisterWorkerRequest.parallel_info: dp_size" in e.value.details
    assert f"workers, over the limit of {MAX_WORKERS}" in e.value.details
    await registers_and_is_found(client)


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("transfer_address", "a" * 9000, f"9000 characters, over the limit of {MAX_ADDRESS_CHARS}"),
        ("transport", "t" * 9000, f"9000 characters, over the limit of {MAX_NAME_CHARS}"),
        ("transport_endpoint", b"e" * (MAX_TRANSPORT_ENDPOINT_BYTES + 1),
         f"{MAX_TRANSPORT_ENDPOINT_BYTES + 1} bytes, over the limit of {MAX_TRANSPORT_ENDPOINT_BYTES}"),
    ],
)
async def test_oversized_worker_fields_are_refused_and_never_logged(
    client: BootstrapClient, caplog: pytest.LogCaptureFixture, field: str, value: object, shown: str
) -> None:
    """Each was held whole, and the address and transport were logged whole."""
    w = worker(0)
    setattr(w, field, value)
    with caplog.at_level(logging.INFO, logger="pdgrpc"):
        with pytest.raises(RpcError) as e:
            await client.register_worker(w, parallel_info(dp=2))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert e.value.details == f"RegisterWorkerRequest.worker.{field}: {shown}"
    assert not [r for r in caplog.records if len(r.getMessage()) > 1000]
    await registers_and_is_found(client)


async def test_a_mismatch_does_not_repeat_an_oversized_field(client: BootstrapClient) -> None:
    """Against a fixed topology, a 9000-character kv_dtype came back whole in the
    FAILED_PRECONDITION message (and a compatibility hash twice its size, in hex)."""
    await registers_and_is_found(client)
    with pytest.raises(RpcError) as e:
        await client.register_worker(worker(0), parallel_info(dp=2, kv_dtype="d" * 9000))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert e.value.details == f"RegisterWorkerRequest.parallel_info.kv_dtype: 9000 characters, over the limit of {MAX_NAME_CHARS}"
    (w,) = (await client.get_workers_response(0)).workers
    assert w.generation == 1
