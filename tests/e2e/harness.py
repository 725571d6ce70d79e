"""Shared pieces of the end-to-end tests: clusters per (topology, transport), the prompt
set, the colocated reference, the "nothing left allocated" check, and the servers'
metrics read back over HTTP.

Every check here reads the servers themselves (GetStats, the Prometheus endpoints) and
compares with a ReferenceEngine built from the topology's own [engine] table, never with
the test's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any, Sequence

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.topology import Topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.errors import TransportUnavailable
from pdgrpc.router.kv_events import BACKOFF_MAX_S as KV_EVENTS_BACKOFF_MAX_S
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.transport import registry
from pdgrpc.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually_async
from tests.scrape import Scrape, scrape

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


def may_prefill_locally(cases: Sequence[Case], expected: Sequence[tuple[tuple[int, ...], str]], page_size: int) -> set[int]:
    """Indices of the cases a decode may prefill itself (and so move no KV for): those whose
    prompt begins with a full page of another case's prompt and output, which the decode's
    prefix cache keeps once that case ends. Which of them do depends on timing; every
    other case must move its KV over the transport."""
    out = set()
    for i, c in enumerate(cases):
        head = c.input_ids[:page_size]
        if len(head) < page_size:
            continue
        for j, (d, (ids, _)) in enumerate(zip(cases, expected)):
            if j != i and (d.input_ids + tuple(ids))[:page_size] == head:
                out.add(i)
                break
    return out


def reference_outputs(topology_name: str, cases: list[Case]) -> list[tuple[tuple[int, ...], str]]:
    """Token ids and finish reason of each case, generated colocated in this process."""
    return reference_outputs_for(load_topology(topology_name), cases)


# Router flags that send every prompt to a prefill (no local prefill on a decode): for
# tests of the transfer path, which count what the transfers move.
NO_LOCAL_PREFILL = {"local-prefill-tokens": 0, "local-prefill-queue": 0}


def moving_kv(topology_name: str) -> Topology:
    """The topology of that name with its router's ``--local-prefill-queue`` off: a prompt
    goes to its decode only when the decode holds a prefix of it
    (:func:`may_prefill_locally`); every other prompt's KV moves over the transport, however
    many are sent at once."""
    t = load_topology(topology_name)
    off = {"local-prefill-queue": 0}
    procs = tuple(dataclasses.replace(p, args={**p.args, **off}) if p.role == "router" else p for p in t.processes)
    return dataclasses.replace(t, processes=procs)


def reference_outputs_for(topology: Topology, cases: list[Case]) -> list[tuple[tuple[int, ...], str]]:
    """:func:`reference_outputs` for a topology object (e.g. one with ``model`` set)."""
    engine = reference_engine(topology)
    out = []
    for c in cases:
        (g,) = colocated_generate(engine, [c.input_ids], c.max_new_tokens, c.sampling)
        out.append((g.token_ids, g.finish_reason))
    return out


async def wait_published(cluster: Cluster, name: str, pages: int, *, decode: bool) -> None:
    """Until the router follows instance ``name``'s KV events (its ``pdgrpc_kv_event_streams``
    gauge counts the router's stream) and that stream holds at least ``pages`` stored blocks
    (read on a stream of our own, which lasts 0.5 s: the router's stream, open before, got
    them at least as early). Needs a cluster with metrics, no smg and one router."""
    endpoint = cluster.metrics_endpoints()[name]
    role = "decode" if decode else "prefill"
    await eventually_async(
        lambda: asyncio.to_thread(lambda: scrape(endpoint).value("pdgrpc_kv_event_streams", role=role) >= 1),
        KV_EVENTS_BACKOFF_MAX_S + 30.0, 0.05, f"the router does not follow {name}'s KV events",
    )
    channel = cluster.channel(name)
    stub: Any = decode_pb2_grpc.DecodeServiceStub(channel) if decode else prefill_pb2_grpc.PrefillServiceStub(channel)
    for _ in range(50):
        stored = 0
        call = stub.SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest(), timeout=0.5)
        try:
            async for batch in call:
                stored += sum(len(e.stored.blocks) for e in batch.events if e.WhichOneof("event") == "stored")
        except grpc.aio.AioRpcError:
            pass  # the deadline ends the stream
        if stored >= pages:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never reported {pages} stored pages")


async def wait_nothing_held(cluster: Cluster, timeout: float = 20.0, names: Sequence[str] | None = None) -> None:
    """Poll every prefill's and decode's GetStats until nothing is held (bounded); then,
    when the cluster serves metrics, the live gauges scraped over HTTP must say the same.
    ``names``: only these processes, by GetStats alone (the others may be dead)."""
    deadline = time.monotonic() + timeout
    held: dict[str, dict[str, int]] = {}
    everyone = names is None
    polled = [p.name for p in cluster.topology.processes if p.role in ("prefill", "decode")] if names is None else list(names)

    async def nothing_held() -> bool:
        if everyone:
            cluster.check()
        stats = dict(zip(polled, await asyncio.gather(*(cluster.stats(n) for n in polled))))
        held.clear()
        held.update({name: h for name, s in stats.items() if (h := {f: getattr(s, f) for f in HELD_FIELDS if getattr(s, f)})})
        return not held

    await eventually_async(nothing_held, timeout, 0.1, lambda: f"still held after the last request: {held}")
    if everyone and cluster.metrics_endpoints():
        await wait_metrics_idle(cluster, max(1.0, deadline - time.monotonic()))


# Live gauges that must read 0 on an idle server, by the role whose endpoints expose them.
# A prefill controller exposes none (its workers hold the pages); the router only
# pdgrpc_active_requests. A sample that is missing raises KeyError: an endpoint whose
# gauges were never bound fails the check too.
IDLE_GAUGES = {
    "decode": ("pdgrpc_active_requests", "pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined", "pdgrpc_transport_rooms"),
    "prefill worker": ("pdgrpc_active_requests", "pdgrpc_kv_pages_in_use", "pdgrpc_transport_rooms"),
    "router": ("pdgrpc_active_requests",),
}


def _gauge_kind(cluster: Cluster, endpoint: str) -> tuple[str, str] | None:
    name, _, worker = endpoint.partition("/")
    role = cluster.procs[name].spec.role
    if role == "prefill":
        return ("prefill worker", "prefill") if worker else None
    return (role, role) if role in IDLE_GAUGES else None


async def wait_metrics_idle(cluster: Cluster, timeout: float = 10.0) -> dict[str, Scrape]:
    """Scrape every metrics endpoint over HTTP until each live gauge of IDLE_GAUGES reads 0
    (bounded: the router's count drops a moment after its last stream closed). Also
    checks, per endpoint, that the aborts by reason add up to the aborted requests."""
    busy: dict[str, dict[str, float]] = {}

    async def idle() -> dict[str, Scrape] | None:
        scrapes = await read_metrics(cluster)
        busy.clear()
        for endpoint, s in scrapes.items():
            kind = _gauge_kind(cluster, endpoint)
            if kind is None:
                continue
            values = {g: s.value(g, role=kind[1]) for g in IDLE_GAUGES[kind[0]]}
            nonzero = {g: v for g, v in values.items() if v != 0}
            if nonzero:
                busy[endpoint] = nonzero
        return None if busy else scrapes

    scrapes = await eventually_async(idle, timeout, 0.1, lambda: f"metrics still show resources in use after the last request: {busy}")
    for endpoint, s in scrapes.items():
        check_abort_sum(endpoint, s)
    return scrapes


def check_abort_sum(endpoint: str, s: Scrape) -> None:
    """Each aborted request is counted under exactly one reason."""
    for f in s.families.values():
        if f.name != "pdgrpc_aborts":
            continue
        for role in {x.labels["role"] for x in f.samples}:
            by_reason = sum(x.value for x in f.samples if x.name == "pdgrpc_aborts_total" and x.labels["role"] == role)
            aborted = s.value("pdgrpc_requests_total", role=role, state="aborted")
            assert by_reason == aborted, f"{endpoint} role={role}: aborts by reason add up to {by_reason}, aborted requests = {aborted}"


async def read_metrics(cluster: Cluster) -> dict[str, Scrape]:
    """One HTTP scrape of every metrics endpoint of the cluster (in threads: urllib blocks)."""
    endpoints = cluster.metrics_endpoints()
    assert endpoints, "this cluster serves no metrics (start it with metrics=True)"
    got = await asyncio.gather(*(asyncio.to_thread(scrape, addr) for addr in endpoints.values()))
    return dict(zip(endpoints, got))


class Counters:
    """Counter totals per role over every endpoint of a cluster (a prefill's controller and
    dp workers each count the requests that ended there, so their sum is the prefill's),
    and the change since an earlier reading: ``after.delta(before, ...)``."""

    def __init__(self, scrapes: dict[str, Scrape]) -> None:
        self.scrapes = scrapes

    @classmethod
    async def read(cls, cluster: Cluster) -> "Counters":
        return cls(await read_metrics(cluster))

    def total(self, sample: str, role: str, **labels: str) -> float:
        return sum(s.value(sample, role=role, **labels) for s in self.scrapes.values() if s.has(sample, role=role, **labels))

    def delta(self, before: "Counters", sample: str, role: str, **labels: str) -> float:
        return self.total(sample, role, **labels) - before.total(sample, role, **labels)

    def requests(self, before: "Counters", role: str) -> dict[str, float]:
        """Change of pdgrpc_requests_total by state, and of pdgrpc_aborts_total by reason
        (as ``aborted:<reason>``, non-zero ones only)."""
        out = {st: self.delta(before, "pdgrpc_requests_total", role, state=st) for st in ("finished", "aborted", "refused")}
        for s in self.scrapes.values():
            fam = s.families.get("pdgrpc_aborts")
            for x in fam.samples if fam else ():
                key = f"aborted:{x.labels['reason']}"
                if x.labels.get("role") == role and key not in out:
                    d = self.delta(before, "pdgrpc_aborts_total", role, reason=x.labels["reason"])
                    if d:
                        out[key] = d
        return out


async def generate_all(router: Any, cases: list[Case], timeout: float = 180) -> tuple[list[Any], int]:
    """Send every case at once through ``router`` (a GenerateService stub); returns the
    completions in case order and the most requests that were in flight together."""
    in_flight = peak = 0

    async def one(c: Case) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await generate(
                router, input_ids=c.input_ids, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                seed=c.seed, top_k=c.top_k, top_p=c.top_p, timeout=timeout,
            )
        finally:
            in_flight -= 1

    got = await asyncio.gather(*(one(c) for c in cases))
    return list(got), peak
