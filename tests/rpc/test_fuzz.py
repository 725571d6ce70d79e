"""Fuzzing (issue 16): every request message of BootstrapService and GenerateService,
valid and mutated, against live server processes. No call may end UNKNOWN or INTERNAL
(an uncaught exception), and the servers still serve afterwards. The decode's and the
prefill's services are fuzzed in tests/decode and tests/prefill, against their processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from tests.fuzz_messages import fuzz, serving
from tests.prefill.procs import BootstrapProc, Proc

@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, grpc.Channel]]:
    logs = tmp_path_factory.mktemp("fuzz")
    boot = BootstrapProc(logs)
    router = Proc(
        [sys.executable, "-m", "pdgrpc.router", "--host", "127.0.0.1", "--port", "0",
         "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", "--max-prompt-tokens", "64"],
        logs, "router",
    )
    try:
        router_address = router.wait_for(r"pdgrpc router listening on (\S+:\d+)", source="log").group(1)
        with grpc.insecure_channel(boot.address) as b, grpc.insecure_channel(router_address) as r:
            yield {"pdgrpc.v1.BootstrapService": b, "pdgrpc.v1.GenerateService": r}
            assert serving(b) and serving(r)
    finally:
        for p in (router, boot):
            assert p.stop() == 0, p.log()[-3000:]


@pytest.mark.parametrize("service", ["pdgrpc.v1.BootstrapService", "pdgrpc.v1.GenerateService"])
def test_fuzzed_requests_never_crash_the_server(servers: dict[str, grpc.Channel], service: str) -> None:
    fuzz(servers[service], [service], max_examples=60)
