"""``kv_transfer_params`` as the prefill writes them and the decode reads them: a round
trip keeps every field, and bad input is refused naming the field."""

from __future__ import annotations

import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.integrations.vllm.params import TransferParams
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.state.room import Room


def _params() -> TransferParams:
    return TransferParams(Room(42), draw_secret(), "127.0.0.1:5000", "writer", (3, 1, 2), 90, "engine")


def test_params_survive_the_round_trip_through_json():
    p = _params()
    assert TransferParams.from_json(p.to_json()) == p


@pytest.mark.parametrize("field,value,words", [
    ("pdgrpc_room", 0, "pdgrpc_room must be in [1, 2**63)"),
    ("pdgrpc_room", "42", "pdgrpc_room must be int"),
    ("pdgrpc_room_secret", "zz", "pdgrpc_room_secret must be hex"),
    ("pdgrpc_room_secret", "00", "pdgrpc_room_secret: room_secret must be 32 bytes"),
    ("pdgrpc_address", "nohost", "pdgrpc_address must be host:port"),
    ("pdgrpc_writer", "", "pdgrpc_writer is empty"),
    ("remote_block_ids", [1, -2], "remote_block_ids must be a list of block ids >= 0"),
    ("remote_num_tokens", True, "remote_num_tokens must be int"),
])
def test_bad_params_are_refused_naming_the_field(field, value, words):
    doc = _params().to_json()
    doc[field] = value
    with pytest.raises(ConfigError, match=f"kv_transfer_params.{words}".replace("[", r"\[").replace("*", r"\*")
                       .replace("(", r"\(").replace(")", r"\)")):
        TransferParams.from_json(doc)


def test_a_missing_field_is_named():
    doc = _params().to_json()
    del doc["pdgrpc_writer"]
    with pytest.raises(ConfigError, match="kv_transfer_params.pdgrpc_writer is missing"):
        TransferParams.from_json(doc)
