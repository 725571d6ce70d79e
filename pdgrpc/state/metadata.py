"""Metadata slot rows: the fixed-size record prefill writes into decode memory last.

One row per slot. Every field starts on a 64-byte boundary and is padded to a multiple of
64 bytes, so a field never shares a cache line (or an RDMA write granule) with another.
The row is one contiguous byte range, which is how a transport moves it; the byte layout
of the default row (``top_k=16``, no hidden state) is::

    offset  bytes  field                         dtype     count
         0     64  output_id (first token)       int32     1
        64     64  cached_tokens                 int32     1
       128     64  output_token_logprob_value    float32   1
       192     64  output_token_logprob_index    int32     1
       256     64  top_logprobs_values           float32   top_k
       320     64  top_logprobs_indices          int32     top_k
      (hidden_state: hidden_dtype x hidden_size, padded, when hidden_size > 0)
       384     64  bootstrap_room                int64     1   <- always the last field
       448          row size

:meth:`MetadataLayout.describe` prints the table for any configuration. All values are
little-endian (the host order of every supported platform; checked at import).

``bootstrap_room`` is written **last** by the sender, after everything else in the row has
landed (a separate write, see :meth:`MetadataBuffers.write_row`). 0 means "not written":
rooms are never 0. The decode side treats a row as ready only when its room is non-zero,
and as corrupt when the room is non-zero but not the room it expects.

The prefill side allocates the same rows as its send buffer (same layout, same class),
so a row is copied byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from typing import Iterator

import torch

from pdgrpc.errors import ConfigError, SlotError
from pdgrpc.state.room import Room

if sys.byteorder != "little":  # pragma: no cover - no supported platform is big-endian
    raise ImportError("pdgrpc metadata rows assume a little-endian host")

FIELD_ALIGN = 64

__all__ = ["FIELD_ALIGN", "MetadataBuffers", "MetadataField", "MetadataLayout", "MetadataRow", "row_problem"]


def _pad(nbytes: int) -> int:
    return max(FIELD_ALIGN, -(-nbytes // FIELD_ALIGN) * FIELD_ALIGN)


@dataclasses.dataclass(frozen=True)
class MetadataField:
    name: str
    dtype: torch.dtype
    count: int
    offset: int  # bytes from the start of the row
    nbytes: int  # padded size, a multiple of FIELD_ALIGN

    @property
    def used_bytes(self) -> int:
        return self.count * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class MetadataRow:
    """The decoded payload of a row (what decode hands to the engine on commit)."""

    output_id: int
    cached_tokens: int = 0
    output_token_logprob_value: float = 0.0
    output_token_logprob_index: int = 0
    top_logprobs_values: tuple[float, ...] = ()
    top_logprobs_indices: tuple[int, ...] = ()
    hidden_state: torch.Tensor | None = None


def row_problem(row: MetadataRow, vocab_size: int) -> str | None:
    """Why ``row`` cannot be committed (it came from another process: untrusted), or None.

    The first token and every top-logprob index must be a token id in ``[0, vocab_size)``;
    the first token's logprob must be finite; top logprobs must not be NaN or +inf (a
    token the sampler filtered out has logprob -inf). Unused top-k entries are zeros."""
    if not 0 <= row.output_id < vocab_size:
        return f"output_id {row.output_id} is not a token id in [0, {vocab_size})"
    v = row.output_token_logprob_value
    if not math.isfinite(v):
        return f"output_token_logprob_value {v} is not finite"
    bad_idx = next((i for i in row.top_logprobs_indices if not 0 <= i < vocab_size), None)
    if bad_idx is not None:
        return f"top_logprobs_indices holds {bad_idx}, not a token id in [0, {vocab_size})"
    bad_val = next((x for x in row.top_logprobs_values if math.isnan(x) or x == math.inf), None)
    if bad_val is not None:
        return f"top_logprobs_values holds {bad_val}"
    return None


class MetadataLayout:
    """Field offsets of one row. Both sides must build it from the same arguments (they are
    part of the compatibility hash)."""

    def __init__(self, top_k: int = 16, hidden_size: int = 0, hidden_dtype: torch.dtype = torch.float16) -> None:
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {top_k}")
        if hidden_size < 0:
            raise ConfigError(f"hidden_size must be >= 0, got {hidden_size}")
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype
        specs: list[tuple[str, torch.dtype, int]] = [
            ("output_id", torch.int32, 1),
            ("cached_tokens", torch.int32, 1),
            ("output_token_logprob_value", torch.float32, 1),
            ("output_token_logprob_index", torch.int32, 1),
            ("top_logprobs_values", torch.float32, max(top_k, 1)),
            ("top_logprobs_indices", torch.int32, max(top_k, 1)),
        ]
        if hidden_size:
            specs.append(("hidden_state", hidden_dtype, hidden_size))
        specs.append(("bootstrap_room", torch.int64, 1))  # last, in the row and in time
        fields: dict[str, MetadataField] = {}
        off = 0
        for name, dt, count in specs:
            nb = _pad(count * _itemsize(dt))
            fields[name] = MetadataField(name, dt, count, off, nb)
            off += nb
        self.fields = fields
        self.row_bytes = off
        self.room_offset = fields["bootstrap_room"].offset
        # The row's four scalar fields, packed and read in one call (a commit reads them
        # once), and its room: the layout's byte forms, which the row buffers use.
        self.scalars = struct.Struct("<i60xi60xf60xi")
        self.room_struct = struct.Struct("<q")
        self._top_vals = struct.Struct(f"<{top_k}f")
        self._top_idx = struct.Struct(f"<{top_k}i")

    def __iter__(self) -> Iterator[MetadataField]:
        return iter(self.fields.values())

    def describe(self) -> str:
        lines = [f"{'offset':>6}  {'bytes':>5}  {'field':<28}  {'dtype':<14} count"]
        for f in self:
            lines.append(f"{f.offset:>6}  {f.nbytes:>5}  {f.name:<28}  {str(f.dtype):<14} {f.count}")
        lines.append(f"{self.row_bytes:>6}         row size")
        return "\n".join(lines)

    def key(self) -> tuple[int, int, str, int]:
        """What the compatibility hash covers for the metadata rows."""
        return (self.top_k, self.hidden_size, str(self.hidden_dtype), self.row_bytes)


class MetadataBuffers:
    """``num_slots`` rows in one contiguous ``uint8`` CPU tensor of shape
    ``[num_slots, row_bytes]`` (register :attr:`tensor` with a transport; slot ``i`` is the
    byte range ``[i * row_bytes, (i + 1) * row_bytes)``)."""

    def __init__(self, num_slots: int, layout: MetadataLayout | None = None) -> None:
        if num_slots <= 0:
            raise ConfigError(f"num_slots must be > 0, got {num_slots}")
        self.layout = layout if layout is not None else MetadataLayout()
        self.num_slots = num_slots
        self.tensor = torch.zeros((num_slots, self.layout.row_bytes), dtype=torch.uint8)
        # numpy shares the tensor's memory; a flat memoryview lets struct read/write a row
        # without building tensors (commit and write are per-request hot paths).
        self._mv: memoryview = self.tensor.numpy().reshape(-1).data
        self._rooms = self.field("bootstrap_room")[:, 0]

    # -- views ---------------------------------------------------------------------------
    def field(self, name: str) -> torch.Tensor:
        """Typed view ``[num_slots, count]`` of one field in every row (shares memory)."""
        try:
            f = self.layout.fields[name]
        except KeyError:
            raise ConfigError(f"no metadata field {name!r}; fields: {sorted(self.layout.fields)}") from None
        return self.tensor[:, f.offset : f.offset + f.used_bytes].view(f.dtype)

    def row(self, slot: int) -> torch.Tensor:
        """The contiguous ``uint8`` bytes of one row (shares memory)."""
        self._check(slot)
        return self.tensor[slot]

    def room_column(self) -> torch.Tensor:
        """``int64[num_slots]`` view of every row's bootstrap_room (the metadata gate's input)."""
        return self._rooms

    # -- access --------------------------------------------------------------------------
    def room(self, slot: int) -> int:
        self._check(slot)
        v: int = self.layout.room_struct.unpack_from(self._mv, slot * self.layout.row_bytes + self.layout.room_offset)[0]
        return v

    def write_room(self, slot: int, room: int) -> None:
        """Set the row's room: a :data:`~pdgrpc.state.room.Room`, or 0 ("not written")."""
        self._check(slot)
        self.layout.room_struct.pack_into(self._mv, slot * self.layout.row_bytes + self.layout.room_offset, room)

    def clear_room(self, slot: int) -> None:
        """Mark the row "not written" (room 0); done on every free before reuse."""
        self.write_room(slot, 0)

    def write_payload(self, slot: int, row: MetadataRow) -> None:
        """Write every field except the room (the sender's first write)."""
        self._check(slot)
        lay = self.layout
        base = slot * lay.row_bytes
        lay.scalars.pack_into(
            self._mv, base, row.output_id, row.cached_tokens, row.output_token_logprob_value, row.output_token_logprob_index
        )
        for name, values in (("top_logprobs_values", row.top_logprobs_values), ("top_logprobs_indices", row.top_logprobs_indices)):
            if len(values) > lay.top_k:
                raise ConfigError(f"{name} has {len(values)} entries, the row holds top_k={lay.top_k}")
            # Zeroed even when empty: a reused send row must not carry another request's entries.
            col = self.field(name)[slot]
            col.zero_()
            if values:
                col[: len(values)] = torch.tensor(values, dtype=col.dtype)
        if row.hidden_state is not None:
            if not lay.hidden_size:
                raise ConfigError("hidden_state given but the layout has hidden_size=0")
            self.field("hidden_state")[slot].copy_(row.hidden_state.reshape(-1))

    def write_row(self, slot: int, row: MetadataRow, room: Room) -> None:
        """Payload first, ``bootstrap_room`` last (the order a reader relies on)."""
        self.write_payload(slot, row)
        self.write_room(slot, room)

    def read_row(self, slot: int) -> MetadataRow:
        self._check(slot)
        lay = self.layout
        out_id, cached, lp_val, lp_idx = lay.scalars.unpack_from(self._mv, slot * lay.row_bytes)
        top_vals: tuple[float, ...] = ()
        top_idx: tuple[int, ...] = ()
        if lay.top_k:
            base = slot * lay.row_bytes
            top_vals = lay._top_vals.unpack_from(self._mv, base + lay.fields["top_logprobs_values"].offset)
            top_idx = lay._top_idx.unpack_from(self._mv, base + lay.fields["top_logprobs_indices"].offset)
        hidden = self.field("hidden_state")[slot].clone() if lay.hidden_size else None
        return MetadataRow(out_id, cached, lp_val, lp_idx, top_vals, top_idx, hidden)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.num_slots})")
