"""What the scheduler side tells the worker side each step (carried in vLLM's connector
metadata, so plain picklable data): blocks to keep for a decode, blocks to fetch from a
prefill, and rooms to give up."""

from __future__ import annotations

import dataclasses

from pdgrpc.integrations.vllm.params import TransferParams
from pdgrpc.state.room import Room

__all__ = ["Jobs", "LoadJob", "ReleaseJob", "SendJob"]


@dataclasses.dataclass(frozen=True)
class SendJob:
    """Prefill: ``block_ids`` hold the KV of ``room``; keep them for the decode whose
    handshake proves ``room_secret``, at most ``lease_s`` seconds before it comes."""

    req_id: str
    room: Room
    room_secret: bytes
    block_ids: tuple[int, ...]
    lease_s: float


@dataclasses.dataclass(frozen=True)
class LoadJob:
    """Decode: fetch the prefill's KV for ``req_id`` into ``block_ids`` (token order);
    the first ``cached_blocks`` of them already hold it (this decode's prefix cache)."""

    req_id: str
    params: TransferParams
    block_ids: tuple[int, ...]
    cached_blocks: int


@dataclasses.dataclass(frozen=True)
class ReleaseJob:
    """Decode: give up ``params.room`` (request aborted, or nothing left to fetch). With
    ``req_id``, that request's load ends first and is reported finished, failed, once
    the prefill acknowledged the abort (or is known gone): only then may vLLM reuse its
    blocks."""

    req_id: str | None
    params: TransferParams


@dataclasses.dataclass
class Jobs:
    sends: list[SendJob] = dataclasses.field(default_factory=list)
    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    releases: list[ReleaseJob] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.loads or self.releases)
