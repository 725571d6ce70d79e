import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.state.room import ROOM_LIMIT, as_room


@pytest.mark.parametrize("value", [1, 2**62, ROOM_LIMIT - 1])
def test_a_room_in_range_is_itself(value: int) -> None:
    assert as_room(value) == value and type(as_room(value)) is int  # a plain int at run time


@pytest.mark.parametrize("value", [0, -1, ROOM_LIMIT, 2**64 - 1])
def test_a_room_out_of_range_names_the_field_and_the_range(value: int) -> None:
    with pytest.raises(ConfigError) as err:
        as_room(value, "AbortRoomRequest.bootstrap_room")
    assert str(err.value) == f"AbortRoomRequest.bootstrap_room must be in [1, 2**63), got {value}"
