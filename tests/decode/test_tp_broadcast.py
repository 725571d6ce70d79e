"""pdgrpc.decode.tp.TpGroup.broadcast: rank 0 refuses to send no command at all (the
followers unpack what they receive), before any collective runs. The stand-in for
torch.distributed only counts calls: what a broadcast carries over a real gloo group is
tested by the TP decode in tests/e2e/test_tp.py."""

from __future__ import annotations

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


def test_rank0_without_a_command_raises_before_the_collective() -> None:
    dist = FakeDist()
    with pytest.raises(ConfigError, match="needs a command"):
        group(0, dist).broadcast()
    assert dist.calls == 0
