"""Shared pieces of the conformance suite: the local side of a check, seeded region
contents, and the helpers every check uses. The module is private to
:mod:`pdgrpc.transport.testing` (its leading underscore); its names are that package's to use."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any, ClassVar, Sequence

import pytest
import torch

from pdgrpc.transport import registry
from pdgrpc.transport.base import Transport
from pdgrpc.transport.pages import METADATA_REGION_ID
from pdgrpc.transport.testing.peer import ROOM_FIELD_BYTES, Layout, PeerProcess

FAIL_DEADLINE_S = 2.0  # a dead peer's in-flight rooms must be FAILED this soon
WAIT_S = 60.0  # bound on any wait for something that should happen (not a speed target)
MEASURED: list[tuple[str, str, float]] = []  # (backend, what, seconds)


class Local:
    """This process's side: a transport over a freshly built layout."""

    def __init__(self, backend: str, options: dict[str, Any], layout: Layout, seed: int | None) -> None:
        self.layout = layout
        self.seed = seed
        self.regions, self.flats = layout.build(seed)
        self.t: Transport = registry.create(backend, **options)
        self.descriptor = b""

    async def start(self) -> "Local":
        self.descriptor = await self.t.register(self.regions)
        return self

    def page_bytes(self, region_id: int, page: int) -> torch.Tensor:
        """A page's (or row's) bytes, as a host tensor whatever memory the region is in."""
        ib = self.layout.item_bytes(region_id)
        return self.flats[region_id][page * ib : (page + 1) * ib].cpu()

    def row(self, slot: int) -> torch.Tensor:
        return self.page_bytes(METADATA_REGION_ID, slot)

    def snapshot(self) -> dict[int, torch.Tensor]:
        return {r: f.clone() for r, f in self.flats.items()}


@functools.lru_cache(maxsize=64)
def cached_source(layout: Layout, region_id: int, seed: int) -> torch.Tensor:
    """A seeded region's content (cached: checks compare many pages of few regions)."""
    return layout.source_bytes(region_id, seed)


def expected_row(layout: Layout, seed: int, src_slot: int, room: int) -> torch.Tensor:
    """The metadata row a receiver holds after ``room`` arrived from seeded slot ``src_slot``."""
    rb = layout.row_bytes
    row = layout.source_bytes(METADATA_REGION_ID, seed)[src_slot * rb : (src_slot + 1) * rb].clone()
    row[-ROOM_FIELD_BYTES:] = torch.tensor([room], dtype=torch.int64).view(torch.uint8)
    return row


def row_room(row: torch.Tensor) -> int:
    """The room a metadata row names."""
    return int(row[-ROOM_FIELD_BYTES:].clone().view(torch.int64)[0])


class ConformanceBase:
    """Settings and helpers of :class:`~pdgrpc.transport.testing.TransportConformance`."""

    backend: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    seed: ClassVar[int] = 1234
    # Where both sides' KV regions live: "cpu", or "cuda" for the CUDA variant of the
    # data checks (metadata rows stay in host memory either way).
    device: ClassVar[str] = "cpu"
    peer_device: ClassVar[str] = ""  # the other process's KV regions ("": same as device)
    # Checks a variant does not collect (method names), because its settings cannot
    # change their outcome: the plain run covers them.
    leave_out: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.leave_out:
            if not name.startswith("test_") or not hasattr(cls, name):
                raise TypeError(f"{cls.__name__}.leave_out names {name!r}, which is no check of the suite")
            setattr(cls, name, None)

    # ------------------------------------------------------------------ helpers
    def _backend(self) -> str:
        if not self.backend:
            pytest.skip("TransportConformance subclass did not set `backend`")
        return self.backend

    def _moves_bytes(self) -> bool:
        return registry.load(self._backend()).moves_bytes

    def _require_bytes(self) -> None:
        if not self._moves_bytes():
            pytest.skip(f"backend {self.backend!r} moves no bytes (moves_bytes = False); data checks do not apply")

    @staticmethod
    def _placed(layout: Layout, device: str) -> Layout:
        return layout if device == "cpu" else dataclasses.replace(layout, device=device, huge_pages=False)

    async def _local(self, layout: Layout, seed: int | None) -> Local:
        return await Local(self._backend(), dict(self.options), self._placed(layout, self.device), seed).start()

    def _peer(self, layout: Layout, seed: int | None) -> PeerProcess:
        placed = self._placed(layout, self.peer_device or self.device)
        return PeerProcess(self._backend(), layout=placed, seed=seed, options=dict(self.options))

    def _check_pages(self, local: Local, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        lay = local.layout
        for rid in lay.kv_region_ids():
            src = cached_source(lay, rid, self.seed)
            ib = lay.item_bytes(rid)
            for s, d in zip(src_pages, dst_pages):
                got = local.page_bytes(rid, d)
                assert torch.equal(got, src[s * ib : (s + 1) * ib]), (
                    f"region {rid}: destination page {d} does not hold source page {s}"
                )

    @staticmethod
    async def _wait_local(t: Transport, rooms: Sequence[int], timeout: float = WAIT_S) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        out = {}
        for r in rooms:
            out[r] = await t.wait(r, max(0.0, deadline - time.monotonic()))
        return out


def sender_peer(recv: Local) -> str:
    """The instance id a sender process uses to address ``recv`` (after connect)."""
    return recv.t.instance_id


async def close_transport(t: Transport, timeout: float = 30.0) -> None:
    """Close a transport, bounded: a backend whose close hangs fails the test."""
    try:
        await asyncio.wait_for(t.close(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"{type(t).__name__}.close() did not finish within {timeout} s") from None


async def until(cond: Any, timeout: float = WAIT_S, step: float = 0.002) -> None:
    """Wait for ``cond()`` to hold; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(step)
