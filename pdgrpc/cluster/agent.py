"""``python -m pdgrpc.cluster.agent``: a client that runs on one host (network namespace)
and takes its orders as JSON lines on stdin, answering one JSON line each on stdout.

The hosts' addresses exist only inside their namespaces, so whoever drives a multi-host
cluster (the tests, ``bench multihost``) cannot dial it from outside: it starts this agent
on the router's host with ``ip netns exec`` and talks to it over the pipes.

Orders::

    {"op": "health", "address": "10.77.0.2:5000"}            -> {"ok": true, "serving": true}
    {"op": "generate", "address": "10.77.0.1:8000", "input_ids": [...], "max_new_tokens": 8,
     "timeout": 30}                                           -> {"ok": true, "token_ids": [...],
                                                                  "ttft_seconds": ..., "client_ttft_seconds": ...}
    a failed call                                             -> {"ok": false, "code": "UNAVAILABLE", "details": "..."}
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.cluster.client import generate
from pdgrpc.v1 import generate_pb2_grpc

__all__ = ["main"]


class _Agent:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    async def handle(self, order: dict[str, Any]) -> dict[str, Any]:
        op = order.get("op")
        try:
            if op == "health":
                reply = await health_pb2_grpc.HealthStub(self.channel(order["address"])).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=float(order.get("timeout", 1.0))
                )
                return {"ok": True, "serving": reply.status == health_pb2.HealthCheckResponse.SERVING}
            if op == "generate":
                done = await generate(
                    generate_pb2_grpc.GenerateServiceStub(self.channel(order["address"])),
                    input_ids=order.get("input_ids", ()), prompt=order.get("prompt", ""),
                    max_new_tokens=int(order.get("max_new_tokens", 8)), timeout=float(order.get("timeout", 30.0)),
                )
                return {
                    "ok": True, "token_ids": list(done.token_ids), "ttft_seconds": done.ttft_seconds,
                    "client_ttft_seconds": done.client_ttft_seconds, "bytes_transferred": done.bytes_transferred,
                }
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            return {"ok": False, "code": code.name if code else "UNKNOWN", "details": details or ""}
        return {"ok": False, "code": "INVALID_ARGUMENT", "details": f"unknown op {op!r}"}

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


async def _serve() -> None:
    agent = _Agent()
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            try:
                order = json.loads(line)
                if not isinstance(order, dict):
                    raise ValueError("an order is a JSON object")
            except ValueError as exc:
                reply: dict[str, Any] = {"ok": False, "code": "INVALID_ARGUMENT", "details": str(exc)}
            else:
                reply = await agent.handle(order)
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        await agent.close()


def main() -> int:
    asyncio.run(_serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
