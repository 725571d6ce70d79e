"""The prefill server over ``--transport rdma`` (UCX; on this host UCX's tcp/shm
transports, see tests/conftest.py): KV and metadata land bit-exact in a fake decode's
rdma receiver, chunked prompts included, and nothing stays held."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.errors import TransportUnavailable
from pdgrpc.transport import registry
from tests.prefill.fake_decode import FakeDecode
from tests.prefill.harness import CONFIG, assert_landed_bit_exact, assert_settles_to_zero, prompt, run_one
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(180)

try:
    registry.load("rdma")
    RDMA_MISSING = ""
except TransportUnavailable as exc:  # ucxx not installed: the backend's own install hint
    RDMA_MISSING = str(exc)


@pytest.fixture(scope="module")
def rdma_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    if RDMA_MISSING:
        pytest.skip(RDMA_MISSING)
    p = PrefillProc([*ENGINE_FLAGS, "--transport", "rdma", "--dp-size", "1", "--chunk-size", "6"], tmp_path_factory.mktemp("rdma"), "rdma")
    try:
        yield p
    finally:
        assert p.stop() == 0, p.log()[-3000:]


@pytest.fixture
async def rdma_decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode(CONFIG, transport="rdma")
    await d.start()
    try:
        yield d
    finally:
        await d.close()


async def test_rdma_kv_lands_bit_exact(rdma_prefill: PrefillProc, rdma_decode: FakeDecode) -> None:
    lens = [3, 8, 23, 17]
    sampling = SamplingParams(temperature=0.5, seed=7, top_logprobs=3)
    results = await asyncio.gather(*(run_one(rdma_prefill, rdma_decode, prompt(n, 50 + n), sampling, query=False, dp_size=1) for n in lens))
    for n, (resp, r) in zip(lens, results):
        assert resp.prompt_tokens == n and resp.dp_rank == 0
        assert_landed_bit_exact(rdma_decode, r, prompt(n, 50 + n), sampling)
        rdma_decode.free(r)
    await assert_settles_to_zero(rdma_prefill, dp_size=1)
