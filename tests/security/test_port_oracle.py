"""``Decode`` is no port scanner: naming a closed port, a port that speaks something
other than gRPC, or a gRPC server that is no bootstrap as the prefill's bootstrap gets
one answer, which says nothing about which it was (the decode logs the cause)."""

from __future__ import annotations

import dataclasses
import socket

import grpc
import pytest

from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import Prompt
from tests.decode.test_decode_server import (  # noqa: F401  (module-scoped fixtures for this module's decode)
    engine, make_request, metrics_address, stub,
)


@dataclasses.dataclass
class Target:
    """What make_request reads of a prefill: only its bootstrap's address is named."""

    address: str
    engine: ReferenceEngine
    prompts: dict[int, Prompt] = dataclasses.field(default_factory=dict)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_closed_foreign_and_non_bootstrap_ports_read_the_same(
    stub: decode_pb2_grpc.DecodeServiceStub, decode_proc: tuple[str, str], metrics_address: str, engine: ReferenceEngine,
) -> None:
    targets = {
        "closed": f"127.0.0.1:{_closed_port()}",
        "http": metrics_address,  # plain HTTP (the decode's own Prometheus endpoint)
        "grpc, no bootstrap": decode_proc[0],  # the decode's own gRPC port
    }
    answers = {}
    for what, address in targets.items():
        req = make_request(Target(address, engine), "probe", 2)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Decode(req, timeout=60):
                pass
        answers[what] = (err.value.code(), err.value.details().replace(address, "ADDR"))
    assert len(set(answers.values())) == 1, answers
    assert next(iter(answers.values()))[0] == grpc.StatusCode.UNAVAILABLE
