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
    """Counts broadcast_object_list calls; carries nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def broadcast_object_list(self, box: list[Any], src: int) -> None:
        self.calls += 1


def group(rank: int, dist: FakeDist) -> TpGroup:
    return TpGroup(rank, 2, dist)


def test_rank0_without_a_command_raises_before_the_collective() -> None:
    dist = FakeDist()
    with pytest.raises(ConfigError, match="needs a command"):
        group(0, dist).broadcast()
    assert dist.calls == 0
