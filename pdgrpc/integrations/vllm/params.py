"""``kv_transfer_params``: what a prefill vLLM hands the front door and the front door
hands the decode vLLM, as a plain JSON object.

The prefill's scheduler side fills it when its request finishes
(:meth:`TransferParams.to_json`); the decode's scheduler side reads it from the request
(:meth:`TransferParams.from_json`), which names the first bad field in its error. The
``room_secret`` travels with it: the front door carries it from one server to the other
over its own connections, and only the decode's handshake proves it to the prefill.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pdgrpc.errors import ConfigError
from pdgrpc.serving.room_proof import secret_problem
from pdgrpc.state.room import Room, as_room

__all__ = ["PREFILL_REQUEST", "TransferParams", "wants_remote_decode"]

# What the front door sends the prefill: vLLM's own key, so a stock proxy works too.
PREFILL_REQUEST: dict[str, Any] = {"do_remote_decode": True}


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a prefill request asks for its KV to be kept for a decode."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


@dataclasses.dataclass(frozen=True)
class TransferParams:
    """Where a decode fetches one request's KV: the prefill worker's handshake address,
    its transport instance (the writer the decode admits), the room and its secret, and
    the prefill's block ids in token order."""

    room: Room
    room_secret: bytes
    address: str  # host:port of the prefill worker's HandshakeService
    writer_id: str  # the prefill worker's transport instance id
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens the prefill computed
    engine_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "pdgrpc_room": int(self.room),
            "pdgrpc_room_secret": self.room_secret.hex(),
            "pdgrpc_address": self.address,
            "pdgrpc_writer": self.writer_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_engine_id": self.engine_id,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "TransferParams":
        """Parse what :meth:`to_json` wrote; :class:`~pdgrpc.errors.ConfigError` names
        the first missing or malformed field."""

        def need(key: str, kind: type) -> Any:
            if key not in doc:
                raise ConfigError(f"kv_transfer_params.{key} is missing")
            value = doc[key]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ConfigError(f"kv_transfer_params.{key} must be {kind.__name__}, got {type(value).__name__}")
            return value

        room = as_room(need("pdgrpc_room", int), "kv_transfer_params.pdgrpc_room")
        try:
            secret = bytes.fromhex(need("pdgrpc_room_secret", str))
        except ValueError:
            raise ConfigError("kv_transfer_params.pdgrpc_room_secret must be hex") from None
        problem = secret_problem(secret)
        if problem is not None:
            raise ConfigError(f"kv_transfer_params.pdgrpc_room_secret: {problem}")
        address = need("pdgrpc_address", str)
        if not address.rpartition(":")[2].isdigit():
            raise ConfigError(f"kv_transfer_params.pdgrpc_address must be host:port, got {address!r}")
        writer = need("pdgrpc_writer", str)
        if not writer:
            raise ConfigError("kv_transfer_params.pdgrpc_writer is empty")
        blocks = need("remote_block_ids", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise ConfigError("kv_transfer_params.remote_block_ids must be a list of block ids >= 0")
        num_tokens = need("remote_num_tokens", int)
        if num_tokens < 0:
            raise ConfigError(f"kv_transfer_params.remote_num_tokens must be >= 0, got {num_tokens}")
        engine = doc.get("remote_engine_id", "")
        return cls(room, secret, address, writer, tuple(blocks), num_tokens, str(engine or ""))
