"""Shared pieces of the end-to-end tests: clusters per (topology, transport), the prompt
set, the colocated reference, and the "nothing left allocated" check.

Every check here reads the servers themselves (GetStats) and compares with a
ReferenceEngine built from the topology's own [engine] table, never with the test's
own bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.errors import TransportUnavailable
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.transport import registry
from pdgrpc.v1 import common_pb2

TOPOLOGIES = ("1p1d", "prefill-dp2-round-robin", "prefill-dp2-follow-room")
TRANSPORTS = ("tcp", "rdma")

# What GetStats must read once every request is over: nothing held on either side.
HELD_FIELDS = ("active_requests", "slots_in_use", "pages_in_use", "pages_quarantined", "transport_rooms")


def skip_unless_transport(name: str) -> None:
    """Skip only when the backend cannot be imported here, saying why."""
    try:
        registry.load(name)
    except TransportUnavailable as exc:
        pytest.skip(f"transport {name!r} is not importable on this machine: {exc}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt and how to sample it."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def sampling(self) -> SamplingParams:
        # Through the proto, as the servers get it (temperature and top_p are doubles on the
        # wire, so this is exact; it also applies the proto's defaults, e.g. top_p 0 -> 1).
        return sampling_from_proto(
            common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
        )


def prompt_cases(page_size: int, chunk_size: int, n: int = 54, rng_seed: int = 7) -> list[Case]:
    """``n`` prompts covering the lengths that matter: below one page, exact multiples
    of a page, longer than a prefill chunk (and so sent chunk by chunk); half greedy, half
    seeded sampling (some with top-k / top-p cuts); a few with max_new_tokens=1 (the
    prefill's token only)."""
    rng = random.Random(rng_seed)
    lengths = (
        [1, 2, 5, page_size - 1]  # below one page (1 = the BOS token alone)
        + [page_size, 2 * page_size, 4 * page_size]  # exact multiples of a page
        + [chunk_size + 1, 2 * chunk_size + 3, 3 * chunk_size + page_size]  # longer than a chunk
    )
    text = b"The quick brown fox jumps over the lazy dog. Disaggregated serving moves KV pages. "
    cases = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        start = rng.randrange(len(text))
        body = bytes((text * (length // len(text) + 2))[start : start + length - 1])
        ids = (256, *body)  # BOS + bytes: the byte tokenizer's encoding
        assert len(ids) == length
        sampled = i % 2 == 1
        cases.append(
            Case(
                input_ids=ids,
                max_new_tokens=1 if i % 17 == 0 else rng.randint(2, 24),
                temperature=rng.choice([0.7, 1.0, 1.3]) if sampled else 0.0,
                seed=rng.getrandbits(64) if sampled else 0,
                top_k=rng.choice([0, 0, 20]) if sampled else 0,
                top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
            )
        )
    return cases


def reference_outputs(topology_name: str, cases: list[Case]) -> list[tuple[tuple[int, ...], str]]:
    """Token ids and finish reason of each case, generated colocated in this process."""
    engine = reference_engine(load_topology(topology_name))
    out = []
    for c in cases:
        (g,) = colocated_generate(engine, [c.input_ids], c.max_new_tokens, c.sampling)
        out.append((g.token_ids, g.finish_reason))
    return out


async def wait_nothing_held(cluster: Cluster, timeout: float = 20.0) -> None:
    """Poll every prefill's and decode's GetStats until nothing is held (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        cluster.check()
        stats = await cluster.all_stats()
        held = {
            name: {f: getattr(s, f) for f in HELD_FIELDS if getattr(s, f)} for name, s in stats.items()
        }
        held = {k: v for k, v in held.items() if v}
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held {timeout:.0f} s after the last request: {held}")
        await asyncio.sleep(0.1)
