"""What one RegisterWorker caller can make a real bootstrap hold: the topology it names
is bounded, the refusal names the sizes and the limit, and a legitimate worker still
registers and is found afterwards."""

from __future__ import annotations

import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import MAX_WORKERS
from pdgrpc.rpc.errors import RpcError

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

