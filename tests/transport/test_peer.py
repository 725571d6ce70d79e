"""pdgrpc.transport.testing.peer, the separate-process peer the conformance suite drives: a
command or a reply larger than the pipe's buffer (thousands of ops or rooms) arrives
whole, instead of the peer taking a half-read message for its parent going away."""

from __future__ import annotations

import pytest

from pdgrpc.errors import TransportError
from pdgrpc.transport.testing.peer import Layout, PeerProcess


def test_commands_and_replies_larger_than_the_pipe_buffer_arrive_whole() -> None:
    # Under uvloop, as the servers and benches run it: its add_reader makes the pipe
    # non-blocking, which is what broke large messages.
    uvloop = pytest.importorskip("uvloop", reason="uvloop is a dependency off Windows")
    uvloop.run(_large_messages())


async def _large_messages() -> None:
    layout = Layout(layers=2, pages=64, slots=4)
    async with PeerProcess("tcp", layout=layout) as peer:
        rooms = list(range(1, 200_001))
        for room in rooms[:3000]:  # a few thousand rooms the peer knows
            await peer.call("advertise", room, [room % 64], None)
        got = await peer.call("status", rooms[:3000])  # ~100 KB reply
        assert len(got) == 3000 and all(state == 2 for state, _ in got)  # WAITING_FOR_INPUT
        with pytest.raises(TransportError, match="UnknownRoom"):  # ~1 MB command
            await peer.call("status", rooms)
        assert await peer.call("drain", 1, 1.0) is True  # and it is still serving
