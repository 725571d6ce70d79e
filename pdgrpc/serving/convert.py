"""Request fields: protobuf (``pdgrpc.v1``) <-> the values the layers below take.

A request's ``bootstrap_room`` becomes a :data:`~pdgrpc.state.room.Room` through
:func:`room_from_proto`, once, in the servicer that receives it.

SamplingParams: protobuf (``pdgrpc.v1.SamplingParams``) -> engine dataclass.

The proto's zero values mean "default" (``top_p == 0`` is read as 1, no cut), as its
comments say. ``max_new_tokens`` is not an engine sampling parameter; the servers read it
from the proto directly. Invalid values raise
:class:`~pdgrpc.engine.base.InvalidRequest` whose message names the field
(``sampling.temperature ...``), which servers map to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math

import grpc

from pdgrpc.engine.base import InvalidRequest, SamplingParams
from pdgrpc.errors import ConfigError, RequestFailed
from pdgrpc.state.room import Room, as_room
from pdgrpc.v1 import common_pb2

__all__ = ["room_from_proto", "sampling_from_proto"]


def room_from_proto(value: int, field: str = "bootstrap_room") -> Room:
    """A request's room, or RequestFailed(INVALID_ARGUMENT) naming ``field``."""
    try:
        return as_room(value, field)
    except ConfigError as exc:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    # NaN / inf would otherwise slip through the range checks with a confusing message.
    for field in ("temperature", "top_p"):
        v = getattr(msg, field)
        if not math.isfinite(v):
            raise InvalidRequest(f"sampling.{field} must be finite, got {v!r}")
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.top_p != 0.0 else 1.0,
        seed=int(msg.seed),
        top_logprobs=int(msg.top_logprobs),
        ignore_eos=bool(msg.ignore_eos),
    )
