"""A decode's handshake, checked against this prefill rank (no I/O).

:func:`check_handshake` turns a ``HandshakeRequest`` into a :class:`Destination` or raises
:class:`~pdgrpc.prefill.errors.RequestFailed` with the status the proto documents
(INVALID_ARGUMENT for a malformed field, FAILED_PRECONDITION for a decode that cannot
pair with this rank) and a message naming the field.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from pdgrpc.errors import PdgrpcError
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.serving.room_proof import verify
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, check_tp_sizes, senders_of
from pdgrpc.transport import peerauth
from pdgrpc.transport.base import BadDescriptor, Descriptor, MemoryRegion, RegionKind
from pdgrpc.transport.pages import METADATA_REGION_ID, region_pairs
from pdgrpc.v1 import handshake_pb2

__all__ = ["Destination", "LocalEnd", "Signed", "check_handshake"]



@dataclasses.dataclass(frozen=True)
class Destination:
    """A validated handshake: where one room's pages and metadata row go."""

    room: int
    dst_pages: tuple[int, ...]
    dst_slot: int
    descriptor: bytes
    parsed: Descriptor
    decode_tp_rank: int = 0
    decode_tp_size: int = 1
    wants_metadata: bool = True
    credential: bytes = b""  # what the decode's transport issued to this worker's (peerauth)
    cached_pages: int = 0  # leading dst_pages the decode holds already: never written


@dataclasses.dataclass(frozen=True)
class Signed:
    """A handshake's outcome (or an abort's tombstone) with what proves its sender.

    ``message`` is what the sender signed (:mod:`pdgrpc.serving.room_proof`), ``proof``
    the HMAC it sent. A room whose Prefill carries a secret takes only the items whose
    proof verifies under it; one without a secret takes every item."""

    item: "Destination | RequestFailed"
    message: bytes
    proof: bytes
    abort: bool = False  # an AbortRoom that came before the Prefill RPC

    def genuine(self, secret: bytes) -> bool:
        return not secret or verify(secret, self.message, self.proof)


@dataclasses.dataclass(frozen=True)
class LocalEnd:
    """What a handshake must match on this prefill rank."""

    transport: str  # the transport's name
    compat_hash: bytes
    tp_rank: int
    tp_size: int
    num_kv_heads: int  # of the whole model
    head_bytes: int  # one KV head of one token page, one layer
    regions: Sequence[MemoryRegion]  # registered: KV regions, then the metadata rows
    row_bytes: int  # one metadata row
    max_pages: int  # most dst_pages one handshake may carry: the pages of the longest prompt
    model_id: str = ""  # the engine's model identity (a checkpoint names its directory), for refusals


def _hex(b: bytes) -> str:
    return "0x" + b.hex() if b else "(empty)"


def _check_pairing(req: handshake_pb2.HandshakeRequest, local: LocalEnd) -> None:
    room = req.bootstrap_room
    if req.transport != local.transport:
        raise ending(
            Refusal.INCOMPATIBLE,
            f"room {room}: transport mismatch: decode uses {req.transport!r}, this prefill worker uses {local.transport!r}",
        )
    if req.compatibility_hash != local.compat_hash:
        raise ending(
            Refusal.INCOMPATIBLE,
            f"room {room}: compatibility_hash mismatch: decode has {_hex(req.compatibility_hash)}, "
            f"prefill has {_hex(local.compat_hash)} serving {local.model_id or '(unnamed)'} "
            "(model, page size, KV dtype/layout or protocol differ)",
        )
    tp_d, d = req.decode_tp_size or 1, req.decode_tp_rank  # size 0: an old client, TP 1
    try:
        check_tp_sizes(local.tp_size, tp_d)
        if d >= tp_d:
            raise PdgrpcError("decode_tp_rank must be < decode_tp_size")
        ok = local.tp_rank in senders_of(d, tp_d, local.tp_size)
        why = "it does not write to that decode rank"
    except PdgrpcError as exc:
        ok, why = False, str(exc)
    if not ok:
        raise ending(
            Refusal.INCOMPATIBLE,
            f"room {room}: decode_tp_rank={d} / decode_tp_size={req.decode_tp_size}: this prefill worker is "
            f"tp_rank {local.tp_rank} of tp_size {local.tp_size}; {why}",
        )


def check_handshake(req: handshake_pb2.HandshakeRequest, local: LocalEnd) -> Destination:
    room = req.bootstrap_room
    n = len(req.dst_pages)  # O(1): nothing below walks an oversized list
    if n > local.max_pages:
        raise ending(
            Refusal.BAD_REQUEST,
            f"room {room}: dst_pages: {n} pages, over the limit of {local.max_pages} per handshake "
            "(the pages of max_prompt_tokens, the longest prompt this prefill accepts)",
        )
    _check_pairing(req, local)
    tp_d, d = req.decode_tp_size or 1, req.decode_tp_rank
    if not n:
        raise ending(Refusal.BAD_REQUEST, f"room {room}: dst_pages is empty")
    pages = tuple(req.dst_pages)
    if len(set(pages)) != n:
        counts = collections.Counter(pages)
        dup = next(p for p in pages if counts[p] > 1)
        raise ending(Refusal.BAD_REQUEST, f"room {room}: dst_pages: page {dup} appears more than once")
    if len(req.transport_credential) not in (0, peerauth.CREDENTIAL_BYTES):
        raise ending(
            Refusal.BAD_REQUEST,
            f"room {room}: transport_credential: {len(req.transport_credential)} bytes (want {peerauth.CREDENTIAL_BYTES} or none)",
        )
    if req.cached_pages > n:
        raise ending(
            Refusal.BAD_REQUEST, f"room {room}: cached_pages: {req.cached_pages}, more than the {n} pages of dst_pages"
        )
    try:
        parsed = Descriptor.from_bytes(req.transport_descriptor)
    except BadDescriptor as exc:
        raise ending(Refusal.BAD_REQUEST, f"room {room}: transport_descriptor: {exc}") from None
    meta = parsed.region_map().get(METADATA_REGION_ID if req.wants_metadata else METADATA_SINK_REGION_ID)
    if meta is None or meta.kind is not RegionKind.METADATA:
        what = "metadata region" if req.wants_metadata else "metadata sink region (wants_metadata is false)"
        raise ending(Refusal.BAD_REQUEST, f"room {room}: transport_descriptor has no {what}")
    if meta.item_bytes != local.row_bytes:
        raise ending(
            Refusal.INCOMPATIBLE,
            f"room {room}: metadata row size mismatch: decode rows are {meta.item_bytes} B, prefill rows are {local.row_bytes} B",
        )
    if req.dst_slot >= meta.num_items:
        raise ending(Refusal.BAD_REQUEST, f"room {room}: dst_slot {req.dst_slot} outside the decode's {meta.num_items} slots")
    try:
        pairs = region_pairs(local.regions, parsed.regions)
    except PdgrpcError as exc:
        raise ending(Refusal.INCOMPATIBLE, f"room {room}: KV regions: {exc}") from None
    heads = local.num_kv_heads // tp_d
    for src, dst in pairs:
        if dst.item_bytes != heads * local.head_bytes:
            raise ending(
                Refusal.INCOMPATIBLE,
                f"room {room}: KV page size mismatch in {src.name!r}: decode {dst.item_bytes} B, expected "
                f"{heads * local.head_bytes} B ({heads} heads of decode tp rank {d} of {tp_d}; prefill pages are {src.item_bytes} B)",
            )
    limit = min((r.num_items for r in parsed.regions if r.kind is RegionKind.KV), default=0)
    if n > limit:
        raise ending(Refusal.BAD_REQUEST, f"room {room}: dst_pages: {n} pages do not fit the decode's pool of {limit} pages")
    bad = next((p for p in pages if p >= limit), None)
    if bad is not None:
        raise ending(Refusal.BAD_REQUEST, f"room {room}: dst_pages: page {bad} outside the decode's pool of {limit} pages")
    return Destination(
        room, pages, req.dst_slot, bytes(req.transport_descriptor), parsed,
        decode_tp_rank=d, decode_tp_size=tp_d, wants_metadata=req.wants_metadata,
        credential=bytes(req.transport_credential), cached_pages=req.cached_pages,
    )
