"""Memory regions and write ops: what a backend registers (:class:`MemoryRegion`), what a
peer learns about them (:class:`RegionInfo`), and the byte copies a sender asks for
(:class:`WriteOp`, :class:`WriteOps`)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple, Sequence

from pdgrpc.errors import BadDescriptor, ConfigError
from pdgrpc.transport.memkind import memory_kind

if TYPE_CHECKING:  # torch is a runtime dependency, but keep this module cheap to import
    import torch

__all__ = ["BadDescriptor", "MemoryRegion", "RegionInfo", "RegionKind", "WriteOp", "WriteOps", "check_source_ops"]

_MAX_REGION_ID = 0xFFFF  # region ids fit 16 bits so backends can use fixed headers


class RegionKind(str, enum.Enum):
    """What a region holds, which decides how a :class:`RoomGrant` applies to it."""

    KV = "kv"  # first dimension = page index; a grant's ``pages`` apply
    METADATA = "metadata"  # first dimension = slot index; a grant's ``slot`` applies


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """What a peer learns about one registered region (from the descriptor).

    ``item_bytes`` is the size of one page (KV) or one row (metadata): the byte stride
    of the region's first dimension. ``backend_data`` is backend-specific (e.g. a remote
    key); empty for backends that need nothing. ``memory`` is the memory kind of the
    tensor (``"host"`` or ``"cuda"``, see :mod:`pdgrpc.transport.memkind`).
    """

    region_id: int
    name: str
    kind: RegionKind
    nbytes: int
    item_bytes: int
    backend_data: bytes = b""
    memory: str = "host"

    def __post_init__(self) -> None:
        if not 0 <= self.region_id <= _MAX_REGION_ID:
            raise BadDescriptor(f"region_id must be in [0, {_MAX_REGION_ID}], got {self.region_id}")
        if self.item_bytes <= 0 or self.nbytes < 0 or self.nbytes % self.item_bytes:
            raise BadDescriptor(
                f"region {self.name!r}: nbytes ({self.nbytes}) must be a non-negative multiple "
                f"of item_bytes ({self.item_bytes} > 0)"
            )

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryRegion:
    """A local tensor handed to :meth:`Transport.register`.

    The tensor must be contiguous; its first dimension indexes pages (KV) or slots
    (metadata). ``region_id`` is chosen by the caller and must agree between sender and
    receiver for the same logical region (e.g. ``2 * layer + (0 for K, 1 for V)``; see
    :mod:`pdgrpc.transport.pages`). ``name`` is for error messages.
    """

    region_id: int
    tensor: "torch.Tensor"
    kind: RegionKind = RegionKind.KV
    name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.region_id <= _MAX_REGION_ID:
            raise ConfigError(f"MemoryRegion.region_id must be in [0, {_MAX_REGION_ID}], got {self.region_id}")
        if self.tensor.dim() < 1 or self.tensor.shape[0] < 1:
            raise ConfigError(f"MemoryRegion.tensor ({self.label}) needs a non-empty first dimension")
        if not self.tensor.is_contiguous():
            raise ConfigError(f"MemoryRegion.tensor ({self.label}) must be contiguous")
        if not self.name:
            object.__setattr__(self, "name", f"{self.kind.value}{self.region_id}")

    @property
    def label(self) -> str:
        return self.name or f"region {self.region_id}"

    # Cached: a registered tensor keeps its shape, and ``page_ops`` asks for every
    # region pair on every write (torch calls per pair would add up per write).
    @functools.cached_property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @functools.cached_property
    def item_bytes(self) -> int:
        return self.nbytes // self.tensor.shape[0]

    @functools.cached_property
    def memory(self) -> str:
        """``"host"`` or ``"cuda"`` (:func:`pdgrpc.transport.memkind.memory_kind`)."""

        return memory_kind(self.tensor).value

    def info(self, backend_data: bytes = b"") -> RegionInfo:
        return RegionInfo(self.region_id, self.name, self.kind, self.nbytes, self.item_bytes, backend_data, self.memory)


class WriteOp(NamedTuple):
    """Copy ``length`` bytes from ``src_offset`` of local region ``src_region`` to
    ``dst_offset`` of the peer's region ``dst_region`` (offsets in bytes).

    A ``NamedTuple`` (immutable, attribute access, cheap to build): a scattered 32k-token
    transfer is ~100k ops, so construction does not validate. Senders validate their
    side with :func:`check_source_ops`; receivers authorize the destination side against
    the room's grant (:meth:`pdgrpc.transport.receiver.RegionTable.authorize`), the check that matters.
    """

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int


class WriteOps(Sequence[WriteOp]):
    """Many write ops as one ``(N, 5)`` int64 array, columns in :class:`WriteOp` field
    order. It *is* a ``Sequence[WriteOp]`` (indexing and iteration yield ``WriteOp``),
    so every backend accepts it unchanged; backends that want speed read
    :attr:`array` directly instead of touching ~100k Python objects.
    :func:`pdgrpc.transport.pages.page_ops` returns this type."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        import numpy as np

        arr = np.ascontiguousarray(array, dtype=np.int64).reshape(-1, 5)
        arr.flags.writeable = False
        self.array = arr

    @classmethod
    def of(cls, ops: Iterable[WriteOp]) -> "WriteOps":
        if isinstance(ops, WriteOps):
            return ops
        import numpy as np

        return cls(np.array([tuple(op) for op in ops], dtype=np.int64).reshape(-1, 5))

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return WriteOps(self.array[i])
        return WriteOp(*(int(x) for x in self.array[i]))

    def __iter__(self) -> Any:
        return (WriteOp(*row) for row in self.array.tolist())

    def __repr__(self) -> str:
        return f"WriteOps({len(self)} ops, {int(self.array[:, 4].sum()) if len(self) else 0} bytes)"

    @property
    def nbytes(self) -> int:
        return int(self.array[:, 4].sum()) if len(self) else 0


def check_source_ops(ops: Iterable[WriteOp], regions: "Mapping[int, MemoryRegion | RegionInfo]") -> None:
    """Raise :class:`~pdgrpc.errors.ConfigError` naming the field if an op's source
    side is not inside a registered local region (a caller bug, not a peer's fault)."""
    if isinstance(ops, WriteOps):  # vectorised: one pass over a size table, first offender reported
        import numpy as np

        a = ops.array
        if not len(a):
            return
        sizes = np.full(max(regions, default=0) + 1, -1, dtype=np.int64)
        for region_id, r in regions.items():
            sizes[region_id] = r.nbytes
        src = a[:, 0]
        known = (src >= 0) & (src < len(sizes))
        size = np.where(known, sizes[np.where(known, src, 0)], -1)
        bad = (size < 0) | (a[:, 1] < 0) | (a[:, 3] < 0) | (a[:, 4] <= 0) | (a[:, 1] + a[:, 4] > size)
        if not bad.any():
            return
        ops = [ops[int(bad.argmax())]]
    for op in ops:
        region = regions.get(op.src_region)
        if region is None:
            raise ConfigError(f"WriteOp.src_region {op.src_region} is not registered locally")
        if op.src_offset < 0 or op.length <= 0 or op.dst_offset < 0:
            raise ConfigError(
                f"WriteOp needs src_offset >= 0, dst_offset >= 0, length > 0; got {op.src_offset}, "
                f"{op.dst_offset}, {op.length}"
            )
        if op.src_offset + op.length > region.nbytes:
            raise ConfigError(
                f"WriteOp source bytes [{op.src_offset}, {op.src_offset + op.length}) outside "
                f"local region {region.name!r} of {region.nbytes} bytes"
            )
