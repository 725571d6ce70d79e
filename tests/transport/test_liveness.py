"""The liveness side channel (used by backends whose data path cannot see a dead peer):
a watched peer in another OS process that dies, hangs, or was replaced is reported."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.transport import peerauth
from pdgrpc.transport.liveness import Liveness

CHILD = """
import asyncio, sys
from pdgrpc.transport.liveness import Liveness
async def main():
    live = Liveness(sys.argv[1], lambda peer, why: None, interval=0.1, lease=0.6)
    print(await live.start(), live.key.hex(), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


class _Child:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, instance_id], stdout=subprocess.PIPE, text=True)

    async def address(self) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 60)
        address, key = line.split()
        peerauth.remember_key(self.instance_id, bytes.fromhex(key))  # as the control plane would tell us
        return address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


async def _wait_lost(lost: list, timeout: float) -> float:
    t0 = time.monotonic()
    while not lost:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"peer not reported lost within {timeout} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
def child():
    c = _Child("peer-B")
    yield c
    c.stop()


async def test_killed_peer_is_reported_at_once(child: _Child) -> None:
    lost: list[tuple[str, str]] = []
    live = Liveness("A", lambda p, why: lost.append((p, why)), interval=0.1, lease=0.6)
    try:
        await live.watch("peer-B", await child.address())
        await asyncio.sleep(0.3)  # heartbeats flowing, nothing reported
        assert lost == []
        child.proc.send_signal(signal.SIGKILL)
        took = await _wait_lost(lost, 10)
        assert lost[0][0] == "peer-B" and ("closed" in lost[0][1] or "reset" in lost[0][1]), lost
        print(f"killed peer reported after {took * 1000:.0f} ms")
    finally:
        await live.close()


async def test_hung_peer_is_reported_after_the_lease(child: _Child) -> None:
    lost: list[tuple[str, str]] = []
    live = Liveness("A", lambda p, why: lost.append((p, why)), interval=0.1, lease=0.6)
    try:
        await live.watch("peer-B", await child.address())
        os.kill(child.proc.pid, signal.SIGSTOP)  # alive but silent: socket stays open
        try:
            await _wait_lost(lost, 10)
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)
        assert "no heartbeat" in lost[0][1]
    finally:
        await live.close()


async def test_replaced_peer_is_reported_not_trusted(child: _Child) -> None:
    lost: list[tuple[str, str]] = []
    live = Liveness("A", lambda p, why: lost.append((p, why)))
    try:
        await live.watch("peer-OLD", await child.address())  # port now held by peer-B
        assert lost and lost[0][0] == "peer-OLD" and "restarted" in lost[0][1]
    finally:
        await live.close()


async def test_close_leaves_no_tasks() -> None:
    live = Liveness("A", lambda p, why: None)
    other = Liveness("B", lambda p, why: None)
    await live.watch("B", await other.start())
    await live.close()
    await other.close()
    await asyncio.sleep(0.01)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_a_link_without_the_credential_is_closed_and_reported_to_nobody() -> None:
    lost_b: list[tuple[str, str]] = []
    b = Liveness("B", lambda p, why: lost_b.append((p, why)), interval=0.05, lease=0.3)
    forger = Liveness("A", lambda p, why: None, interval=0.05, lease=0.3,
                      credential_for=lambda peer: peerauth.credential(b"\x00" * 32, "A", peer))  # a wrong key's
    try:
        assert await forger.watch("B", await b.start()) is None  # B closed the link
        await asyncio.sleep(0.6)  # two leases: nothing reported, for a link that proved nothing
        assert lost_b == [] and b.proven_link("A", b"") is None
    finally:
        await forger.close()
        await b.close()


def test_lease_must_exceed_interval() -> None:
    with pytest.raises(ConfigError, match="interval"):
        Liveness("A", lambda p, why: None, interval=1.0, lease=0.5)
