"""Memory kinds in descriptors: what a host peer and a GPU peer say to each other, and
what is refused at the handshake (pure checks; memory kinds forced on CPU tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.transport.base import BadDescriptor, Descriptor, MemoryRegion, RegionKind
from pdgrpc.transport.memkind import HOST_ONLY, MemoryKind, MemoryProfile, check_registrable, memory_kind, negotiate
from pdgrpc.transport.regions import RegionInfo


def _desc(memory: str = "host") -> Descriptor:
    regions = (
        RegionInfo(0, "k0", RegionKind.KV, 4096, 1024, b"", memory),
        RegionInfo(0xFFFF, "meta", RegionKind.METADATA, 512, 64, b"", "host"),  # metadata rows stay in host memory
    )
    return Descriptor("tcp", "peer-1", b"127.0.0.1:1", regions)


def test_host_descriptor_bytes_are_unchanged() -> None:
    """A host-only peer writes what older builds wrote (no memory fields at all)."""
    doc = json.loads(_desc().to_bytes()[4:])
    assert "moves" not in doc and all(len(r) == 6 for r in doc["regions"])


def test_cuda_descriptor_round_trips() -> None:
    d = Descriptor.from_bytes(_desc("cuda").to_bytes())
    assert d.region(0).memory == "cuda" and d.region(0xFFFF).memory == "host"  # type: ignore[union-attr]
    assert d.memory_profile() == MemoryProfile(frozenset({"cuda", "host"}), frozenset({"cuda", "host"}))


@pytest.mark.parametrize(("local", "peer"), [("host", "cuda"), ("cuda", "host"), ("cuda", "cuda"), ("host", "host")])
def test_host_and_gpu_peers_interoperate(local: str, peer: str) -> None:
    """Each side moves its own memory, so every pairing of host and cuda works; the
    data path is named for the logs."""
    mine = _desc(local).memory_profile()
    theirs = Descriptor.from_bytes(_desc(peer).to_bytes()).memory_profile()
    path = negotiate(mine, theirs, "peer-1")
    assert path == f"{'+'.join(sorted({local, 'host'}))} <-> {'+'.join(sorted({peer, 'host'}))}"


def test_unknown_memory_kind_is_refused_at_the_handshake() -> None:
    with pytest.raises(BadDescriptor, match="peer peer-1 registered rocm memory; this pdgrpc moves cuda, host only"):
        Descriptor.from_bytes(_desc("rocm").to_bytes())


def test_memory_the_peer_cannot_move_is_refused() -> None:
    raw = json.loads(_desc("cuda").to_bytes()[4:])
    raw["moves"] = ["host"]  # an inconsistent (hand-made) descriptor
    with pytest.raises(BadDescriptor, match="registered cuda memory but says its backend moves host"):
        Descriptor.from_bytes(b"PDGT" + json.dumps(raw).encode())


def test_malformed_moves_is_refused() -> None:
    raw = json.loads(_desc().to_bytes()[4:])
    raw["moves"] = "cuda"
    with pytest.raises(BadDescriptor, match="'moves' must be a list"):
        Descriptor.from_bytes(b"PDGT" + json.dumps(raw).encode())


def test_region_memory_follows_its_tensor() -> None:
    r = MemoryRegion(3, torch.zeros(4, 8))
    assert r.memory == "host" and r.info().memory == "host"
    assert memory_kind(torch.zeros(1)) is MemoryKind.HOST
    with pytest.raises(ConfigError, match="host or cuda tensors"):
        memory_kind(torch.zeros(1, device="meta"))


def test_backend_that_moves_host_only_refuses_cuda_regions() -> None:
    check_registrable("unix", MemoryKind.HOST, HOST_ONLY, "k0")
    with pytest.raises(ConfigError, match=r"unix transport cannot register k0: it is cuda memory and this backend "
                                          r"moves host \(needs staging\)"):
        check_registrable("unix", MemoryKind.CUDA, HOST_ONLY, "k0", "needs staging")


def test_rdma_registers_cuda_only_with_a_cuda_enabled_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgrpc.transport import rdma_regions

    kv = MemoryRegion(0, torch.zeros(4, 64))
    meta = MemoryRegion(0xFFFF, torch.zeros(4, 64), RegionKind.METADATA)
    rdma_regions.check_region_memory(kv)  # host memory: always
    monkeypatch.setattr(rdma_regions, "memory_kind", lambda t: MemoryKind.CUDA)
    monkeypatch.setattr(rdma_regions, "ucx_moves_cuda", lambda: False)
    with pytest.raises(ConfigError, match=r"rdma transport cannot register kv0: it is cuda memory .*CUDA-enabled libucx"):
        rdma_regions.check_region_memory(kv)
    monkeypatch.setattr(rdma_regions, "ucx_moves_cuda", lambda: True)
    rdma_regions.check_region_memory(kv)
    with pytest.raises(ConfigError, match="metadata rows stay on the host"):
        rdma_regions.check_region_memory(meta)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_ucx_moves_no_cuda_without_cuda() -> None:
    from pdgrpc.transport.rdma_regions import ucx_moves_cuda

    assert ucx_moves_cuda() is False
