"""A client in another language, built from protos/ alone, against the real server:
interop/node/bootstrap_client.js (grpc-js + proto-loader) registers and queries rooms,
checks error codes and health."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from pdgrpc.bootstrap.service import BootstrapServer

NODE_DIR = Path(__file__).resolve().parents[2] / "interop" / "node"
NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed (the interop client is JavaScript)")
async def test_javascript_client_from_protos_alone(server: BootstrapServer) -> None:
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run scripts/setup.sh (it runs npm ci in interop/node)"
    # The server runs in this event loop: the client must run beside it, not block it.
    proc = await asyncio.create_subprocess_exec(
        NODE, str(NODE_DIR / "bootstrap_client.js"), server.address, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (out.decode(), err.decode())
    seen = json.loads(out.decode().strip().splitlines()[-1])
    assert seen["ok"] and seen["health"] == ["SERVING", "SERVING"]
    assert seen["registered"] == {"added": 101, "unchanged": 0} and (seen["found"], seen["missing"]) == (101, 2)
    assert "0 means not written" in seen["room_zero"]
    assert len(server.table) == 101  # what JavaScript registered is what the server holds
