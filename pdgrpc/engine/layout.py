"""KV pool layout: the shapes and byte offsets a transport needs, and the compatibility hash.

Byte layout (layout name ``"HND"``)
-----------------------------------
An engine's KV pool is ``2 * num_layers`` tensors: for each layer one K tensor and one V
tensor, each contiguous, of shape::

    [num_pages, local_kv_heads, page_size, head_dim]      dtype = kv dtype

- **pages are the first dimension**; page ``p`` of a pool tensor is the contiguous byte
  range ``[p * page_bytes, (p + 1) * page_bytes)``;
- inside a page the **head dimension comes first** ("HND": heads, tokens, head dim), so
  the bytes of one KV head in one page are contiguous (``head_bytes`` long), and a
  head slice ``[h0, h1)`` of a page is *one* contiguous range, ``(h1 - h0) * head_bytes``
  long at ``(h0 - head_start) * head_bytes`` into the page. Across pages a head-sliced
  transfer is therefore a strided range: one ``(h1 - h0) * head_bytes`` block every
  ``page_bytes``;
- token ``t`` of a request lives in page ``pages[t // page_size]`` at row
  ``t % page_size``; rows past the request's length in its last page hold stale bytes
  that readers must mask (the reference engine does).

With tensor parallelism, rank ``r`` of ``tp_size`` holds KV heads
``[head_start, head_end) = [r * H / tp_size, (r + 1) * H / tp_size)`` of the model's
``H = num_kv_heads`` KV heads; its pool tensors have ``local_kv_heads = head_end -
head_start`` in the head dimension. Head ids in this module's API are *global* (model)
head ids, so a sender and a receiver with different TP sizes can intersect their ranges.

Compatibility hash
------------------
:func:`compat_hash` digests everything both sides must agree on for the bytes to mean the
same thing: protocol version, layout name, model identity, number of layers, *total* KV
heads, head dim, page size and KV dtype. It deliberately leaves out per-instance facts
(pool size, TP rank/size, this rank's head slice): a TP2 prefill and a TP1 decode of the
same model have the same hash, and exchange their head ranges in the handshake instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING

from pdgrpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DELTA_PROTOCOL_VERSION",
    "KV_LAYOUT_HND",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "KVLayout",
    "check_kv_dtype",
    "compat_hash",
    "kv_dtype_from_name",
    "pages_for_tokens",
]

# Version of the KV bytes protocol between prefill and decode (layout semantics, metadata
# meaning). Bump on any incompatible change; it is part of the compatibility hash.
PROTOCOL_VERSION = 2
# Every version a decode serves. Version 1 lacks only HandshakeRequest.cached_pages (delta
# transfer): a prefill of version 1 writes every page, so a decode asks it for no skip.
PROTOCOL_VERSIONS = (1, 2)
DELTA_PROTOCOL_VERSION = 2  # the first whose prefills honour cached_pages

KV_LAYOUT_HND = "HND"

# Bytes per element of each KV dtype a pool may hold. This module imports no torch: servers
# that run no engine (the prefill controller) size pools with it.
_KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def check_kv_dtype(name: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a KV dtype (``float32``, ``float16``, ``bfloat16``)."""
    if name not in _KV_DTYPE_BYTES:
        raise ConfigError(f"kv_dtype must be one of {sorted(_KV_DTYPE_BYTES)}, got {name!r}")


def kv_dtype_from_name(name: str) -> "torch.dtype":
    """The torch dtype for a KV dtype name (``float32``, ``float16``, ``bfloat16``)."""
    check_kv_dtype(name)
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """How many pages hold ``num_tokens`` tokens."""
    if num_tokens < 0 or page_size <= 0:
        raise ConfigError(f"pages_for_tokens: need num_tokens >= 0 and page_size > 0, got {num_tokens}, {page_size}")
    return -(-num_tokens // page_size)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape and byte layout of one engine instance's KV pool (see the module docstring)."""

    num_layers: int
    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int  # KV heads of the whole model (all TP ranks together)
    head_dim: int
    kv_dtype: str  # "float32" | "float16" | "bfloat16"
    head_start: int = 0  # first global KV head held by this instance
    head_end: int = -1  # one past the last; -1 means num_kv_heads
    name: str = KV_LAYOUT_HND

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"KVLayout.{field} must be > 0, got {getattr(self, field)}")
        check_kv_dtype(self.kv_dtype)
        if self.head_end == -1:
            object.__setattr__(self, "head_end", self.num_kv_heads)
        if not 0 <= self.head_start < self.head_end <= self.num_kv_heads:
            raise ConfigError(
                f"KVLayout head range [{self.head_start}, {self.head_end}) must be a non-empty part of "
                f"[0, {self.num_kv_heads})"
            )
        if self.name != KV_LAYOUT_HND:
            raise ConfigError(f"KVLayout.name: only {KV_LAYOUT_HND!r} is defined, got {self.name!r}")

    @property
    def dtype(self) -> "torch.dtype":
        return kv_dtype_from_name(self.kv_dtype)

    @property
    def local_kv_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def element_size(self) -> int:
        return _KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        """Shape of each per-layer K (and V) pool tensor."""
        return (self.num_pages, self.local_kv_heads, self.page_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head within one page (contiguous)."""
        return self.page_size * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one pool tensor (contiguous); also the page stride."""
        return self.local_kv_heads * self.head_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool: every layer's K and V tensors."""
        return 2 * self.num_layers * self.num_pages * self.page_bytes

    def pages_for_tokens(self, num_tokens: int) -> int:
        return pages_for_tokens(num_tokens, self.page_size)

    def compat_fields(self) -> dict[str, object]:
        """The fields that enter the compatibility hash (no per-instance facts)."""
        return {
            "layout": self.name,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "kv_dtype": self.kv_dtype,
        }


def compat_hash(layout: KVLayout, model_id: str, protocol_version: int = PROTOCOL_VERSION) -> str:
    """Hex SHA-256 over the protocol version, the model identity and the layout's shape.

    Two engines may exchange KV pages only when their hashes are equal. ``model_id`` must
    identify the weights (architecture *and* values): the same shapes with other weights
    would produce KV that decodes to garbage.
    """
    if not model_id:
        raise ConfigError("compat_hash: model_id must be a non-empty string")
    doc = {"protocol_version": protocol_version, "model_id": model_id, **layout.compat_fields()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
