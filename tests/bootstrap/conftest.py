"""Fixtures: a real bootstrap server on 127.0.0.1 (free port) with a clock the test
moves, and a client on its own channel pool."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.service import BootstrapConfig, BootstrapServer, start_bootstrap_server
from pdgrpc.rpc.channels import ChannelPool

from bootstrap_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def config() -> BootstrapConfig:
    """Override in a test module (or parametrize indirectly) for other limits."""
    return BootstrapConfig(ttl=30.0, max_rooms=10_000, max_batch=2048, sweep_interval=0.02)


@pytest.fixture
async def server(config: BootstrapConfig, clock: FakeClock) -> AsyncIterator[BootstrapServer]:
    srv = await start_bootstrap_server("127.0.0.1", 0, config, clock=clock)
    try:
        yield srv
    finally:
        await srv.stop(grace=0.5)


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    p = ChannelPool()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
def client(server: BootstrapServer, pool: ChannelPool) -> BootstrapClient:
    return BootstrapClient(server.address, pool=pool, timeout=5.0, retry_for=2.0)
