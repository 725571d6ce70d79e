"""The ``rdma`` backend's registered memory: which tensors it may register, and the
lookup tables a write's checks and plans index (one numpy gather per write, no
per-op Python work)."""

from __future__ import annotations

import os

import numpy as np
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.transport.base import MemoryRegion, RegionInfo
from pdgrpc.transport.memkind import MemoryKind, check_registrable, memory_kind
from pdgrpc.transport.regions import RegionKind

REGION_IDS = 1 << 16  # region ids are u16 on the wire


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def ucx_moves_cuda() -> bool:
    """Whether the ``libucx`` in use ships its CUDA transports (``libuct_cuda``, as the
    ``-cu12`` wheels do) and this process can use CUDA: then UCX detects CUDA pointers in
    a message's iov and moves them (``cuda_ipc`` / ``cuda_copy`` / GPUDirect RDMA)."""
    if not torch.cuda.is_available():
        return False
    try:
        import libucx  # type: ignore[import-untyped]
    except ImportError:
        return False
    lib = os.path.join(os.path.dirname(libucx.__file__), "lib", "ucx")
    return os.path.isdir(lib) and any(n.startswith("libuct_cuda.so") for n in os.listdir(lib))


def check_region_memory(region: MemoryRegion) -> None:
    """Raise :class:`ConfigError` for a region this build cannot register: device memory
    other than CUDA, CUDA memory without a CUDA-enabled UCX, metadata rows off the host."""
    kind = memory_kind(region.tensor)
    if kind is MemoryKind.HOST:
        return
    if region.kind is RegionKind.METADATA:
        raise ConfigError(f"rdma transport: metadata region {region.label} must be host memory "
                          f"(metadata rows stay on the host), got a tensor on {region.tensor.device}")
    moves = {MemoryKind.HOST, MemoryKind.CUDA} if ucx_moves_cuda() else {MemoryKind.HOST}
    check_registrable("rdma", kind, moves, region.label,
                      "needs a CUDA-enabled libucx (pip install 'pdgrpc[ucx]', ucxx-cu12) and a visible CUDA device")


class Region:
    """One registered tensor as flat bytes, and its base address."""

    __slots__ = ("info", "flat", "ptr")

    def __init__(self, region: MemoryRegion) -> None:
        check_region_memory(region)
        self.flat = flat_bytes(region.tensor)
        self.ptr = self.flat.data_ptr()
        self.info = region.info()


class Regions:
    """Every region this instance registered, shared by its sender and receiver. The
    arrays are allocated once and filled in place, so a holder may keep them."""

    def __init__(self) -> None:
        self.by_id: dict[int, Region] = {}
        self.infos: dict[int, RegionInfo] = {}
        self.ptrs = np.zeros(REGION_IDS, dtype=np.uint64)  # region id -> base address
        self.sizes = np.full(REGION_IDS, -1, dtype=np.int64)  # region id -> bytes, -1: not registered
        self.device = np.zeros(REGION_IDS, dtype=bool)  # region id -> lives in GPU memory
        self.any_device = False  # some region lives in GPU memory
        self.flats: dict[int, torch.Tensor] = {}  # region id -> its bytes

    def add(self, region: MemoryRegion) -> RegionInfo:
        """Register ``region``; raises :class:`ConfigError` for a taken id or memory this
        build cannot move."""
        if region.region_id in self.by_id:
            raise ConfigError(f"region_id {region.region_id} ({region.name!r}) is already registered")
        reg = self.by_id[region.region_id] = Region(region)
        self.ptrs[region.region_id] = reg.ptr
        self.sizes[region.region_id] = reg.info.nbytes
        self.infos[region.region_id] = reg.info
        self.device[region.region_id] = reg.info.memory != "host"
        self.any_device = self.any_device or reg.info.memory != "host"
        self.flats[region.region_id] = reg.flat
        return reg.info
