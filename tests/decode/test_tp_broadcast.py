"""pdgrpc.decode.tp.TpGroup.broadcast over a stand-in for torch.distributed (no gloo
group, no processes): rank 0 sends its command, the others get exactly that back, and
rank 0 refuses to send no command at all (the followers unpack what they receive)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from pdgrpc.decode.tp import TpGroup
from pdgrpc.errors import ConfigError


class FakeDist:
    """broadcast_object_list from rank 0: fills the box of every other rank."""

    def __init__(self, sent: list[Any] | None = None) -> None:
        self.sent = sent
        self.calls = 0

    def broadcast_object_list(self, box: list[Any], src: int) -> None:
        assert src == 0
        self.calls += 1
        if self.sent is None:  # rank 0: remember what it sends
            self.sent = list(box)
        else:
            box[:] = self.sent


def group(rank: int, dist: FakeDist) -> TpGroup:
    g = TpGroup.__new__(TpGroup)  # skip init_process_group
    g.rank, g.size, g._dist = rank, 2, dist
    return g


def test_rank0_sends_and_followers_receive_the_command() -> None:
    lead = FakeDist()
    cmd = ("step", [1, 2, 3])
    assert group(0, lead).broadcast(cmd) == cmd
    assert lead.sent is not None and pickle.loads(lead.sent[0]) == cmd
    follower = FakeDist(lead.sent)
    assert group(1, follower).broadcast() == cmd
    assert follower.calls == 1


def test_rank0_without_a_command_raises_before_the_collective() -> None:
    dist = FakeDist()
    with pytest.raises(ConfigError, match="needs a command"):
        group(0, dist).broadcast()
    assert dist.calls == 0
