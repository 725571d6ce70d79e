"""``python -m pdgrpc.bench prefix``: prompts that share prefixes, with and without reuse.

The workload is SGLang's generated-shared-prefix shape: ``--groups`` G groups of
``--questions`` Q questions; each group has one random prefix of ``--prefix-tokens``
tokens (a range, drawn per group) and each question ``--question-tokens`` more. The G x Q
requests are shuffled and sent ``--concurrency`` at a time, each generating
``--max-new-tokens`` tokens greedily. G is larger than the number of prefills (2), so
where a group's prefix sits matters, and each prefill's pool (``--pool-pages``) holds the
prefixes of half the groups plus what the requests in flight add to them, at least the
requests in flight whole: the two pools hold every prefix once, so a router that keeps each
group on one prefill keeps its half cached, while round robin brings every group to both
prefills, which must evict.

The model is a random-weights Qwen2 checkpoint built here, Qwen2.5-0.5B's width (hidden
896, 14 query heads, 2 KV heads, MLP 4864) with ``--layers`` layers (24 in the real
model; fewer by default so a run takes minutes on 2 cores), or ``--model PATH``.

Arms, one cluster each (2 prefills + 1 decode), one after another on the same prompts:

* ``a``: prefix cache off (``--no-prefix-cache``), pdgrpc's router round robin: the baseline;
* ``b``: cache on, round robin;
* ``c``: cache on, pdgrpc's router ``--policy cache_aware``;
* ``d``: cache on, smg's ``cache_aware`` with the prefills' events kept from smg
  (``--no-smg-kv-events``): smg routes by its own approximate tree of what it sent where;
* ``e``: cache on, smg's ``cache_aware`` fed by the prefills' KV events.

With ``--vllm-python PATH`` (a Python where ``import vllm`` works, kept out of pdgrpc's
dependencies) arm ``v`` serves the same prompts from one vLLM OpenAI server with its
automatic prefix caching, as a peer: TTFT of the first streamed completion chunk, and
vLLM's own hit rate is not read (its tokens are not compared: other kernels). Without
the flag, or when ``import vllm`` fails there, arm ``v`` prints why it did not run.

Per arm: client TTFT p50/p90 of each group's first request (in sending order) and of the
later ones, the prompt tokens the clients sent, the tokens computed anywhere (the prefills'
``pdgrpc_prefill_computed_tokens_total`` and the decode's
``pdgrpc_local_prefill_computed_tokens_total``: a router may have the decode compute a
prompt itself), the hit rate (the share of sent tokens no one computed), the share of
requests that succeeded and the share whose output equals arm ``a``'s. Where the work
went: the tokens each prefill and the decode computed, each prefill's own hit rate (its
``pdgrpc_prefix_cache_hit_tokens_total`` over its ``pdgrpc_prefill_prompt_tokens_total``),
the cached pages each evicted (``pdgrpc_prefix_cache_evictions_total``), and how many
groups' prefixes (their first page) each prefill holds at the end, by its KV events (a
group both hold was computed on both). An arm that needs
what this build lacks (the cache, KV events, smg) is reported "not available" rather
than run as something else. Targets: arms ``c`` and ``e`` later-request TTFT p50 at most
0.2x arm ``a``'s, hit rate at least 1.5x arm ``b``'s; every output equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdgrpc.bench.gateway import SmgClient
from pdgrpc.bench.report import Result, percentile
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.ports import free_port
from pdgrpc.cluster.topology import Topology, parse_topology
from pdgrpc.engine.layout import pages_for_tokens
from pdgrpc.errors import PdgrpcError
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME, available as gateway_available
from pdgrpc.prefill.cli import build_parser as prefill_parser
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.serving.kv_events import batch_from_proto
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from pdgrpc.v1.prefill_pb2 import SubscribeKvEventsRequest
from pdgrpc.v1.prefill_pb2_grpc import PrefillServiceStub

DESCRIPTION = (
    "shared-prefix workload (G groups x Q questions, shuffled) through 2 prefills + 1 decode: cache off, cache on "
    "round robin, pdgrpc cache_aware, smg cache_aware without and with KV events; TTFT of first and later requests, "
    "tokens computed (prefills and decode), hit rate, output equality (targets: cache_aware later-request TTFT p50 <= 0.2x "
    "cache off, hit rate >= 1.5x cache on round robin)"
)
PLOT = "TTFT p50 and p90 of each group's first request and of the later ones, per arm"

ARMS = {
    "a": "cache off, round robin",
    "b": "cache on, round robin",
    "c": "cache on, pdgrpc cache_aware",
    "d": "smg cache_aware, no KV events",
    "e": "smg cache_aware, KV events",
    "v": "vLLM, automatic prefix caching (peer)",
}
BASELINE = "a"
PREFILLS = ("prefill-a", "prefill-b")
DECODE = "decode"
# What each prefill and the decode count, by key (a role's metrics endpoints are summed).
_COUNTERS = {
    "prefill": {
        "computed_tokens": "pdgrpc_prefill_computed_tokens_total",
        "prompt_tokens": "pdgrpc_prefill_prompt_tokens_total",
        "hit_tokens": "pdgrpc_prefix_cache_hit_tokens_total",
        "evictions": "pdgrpc_prefix_cache_evictions_total",
    },
    "decode": {"computed_tokens": "pdgrpc_local_prefill_computed_tokens_total"},
}


def _span(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return a, b


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=8, help="groups of requests sharing a prefix; more than the 2 prefills (default: %(default)s)")
    p.add_argument("--questions", type=int, default=4, help="requests per group (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=_span, default=(1024, 2048), metavar="LO-HI", help="shared prefix length, drawn per group (default: 1024-2048)")
    p.add_argument("--question-tokens", type=_span, default=(64, 128), metavar="LO-HI", help="question length, drawn per request (default: 64-128)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request, greedily (default: %(default)s)")
    p.add_argument("--arms", default="a,b,c,d,e,v", help="comma-separated arms to run, of a, b, c, d, e, v (default: %(default)s)")
    p.add_argument(
        "--vllm-python", metavar="PATH", default="",
        help="a Python interpreter where `import vllm` works: arm v serves the workload from one vLLM OpenAI server "
        "with prefix caching, beside pdgrpc (default: none, arm v is skipped with its reason)",
    )
    p.add_argument("--transport", default="tcp", help="KV transport (default: %(default)s)")
    add_model_arguments(p)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument(
        "--pool-pages", type=int, default=None, metavar="N",
        help="KV pages of each prefill. Default: the prefixes of half the groups plus, per request in flight "
        "(--concurrency), the most pages a prompt adds to its group's prefix, and at least --concurrency whole prompts "
        "of the longest length: the two pools hold every prefix once, so one prefill holds its half of the groups while "
        "round robin, which brings every group to both prefills, must evict; 0: room for every group's prefix and the "
        "requests in flight (nothing evicted)",
    )
    p.add_argument("--cache-aware-margin", type=int, default=None, metavar="CALLS", help="the router's --cache-aware-margin in arm c (default: the router's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and their order (default: %(default)s)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :func:`build_model` (also bench multiturn's)."""
    p.add_argument("--layers", type=int, default=2, help="layers of the built checkpoint; Qwen2.5-0.5B has 24 (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=2048, help="vocabulary of the built checkpoint (default: %(default)s)")
    p.add_argument("--model", metavar="PATH", default="", help="serve this checkpoint instead of building one")


def build_model(args: argparse.Namespace, tmp: Path) -> tuple[str, int]:
    """The checkpoint to serve and its vocabulary size: ``--model``, else a random Qwen2
    of Qwen2.5-0.5B's width with ``--layers`` layers, built under ``tmp``."""
    if args.model:
        from pdgrpc.engine.hf.tokenizer import load_tokenizer

        return args.model, load_tokenizer(args.model).vocab_size
    from pdgrpc.engine.hf.build import build_checkpoint

    print(f"building a random Qwen2 checkpoint (hidden 896, {args.layers} layers) ...", flush=True)
    model = build_checkpoint(
        tmp / "qwen2-0.5b-shape", "qwen2", hidden_size=896, num_layers=args.layers, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, vocab_size=args.vocab_size, max_position_embeddings=8192, init_std=0.02,
    )
    return str(model), args.vocab_size


@dataclasses.dataclass(frozen=True)
class Request:
    group: int
    question: int
    input_ids: tuple[int, ...]


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    """The G x Q requests, shuffled. Token ids avoid the lowest and highest 16 ids, where
    a built tokenizer keeps its special tokens."""
    rng = random.Random(args.seed)

    def tokens(span: tuple[int, int]) -> list[int]:
        return [rng.randrange(16, vocab - 16) for _ in range(rng.randint(*span))]

    out = []
    for g in range(args.groups):
        prefix = tokens(args.prefix_tokens)
        out += [Request(g, q, tuple(prefix + tokens(args.question_tokens))) for q in range(args.questions)]
    rng.shuffle(out)
    return out


@dataclasses.dataclass
class Outcome:
    ttft: float | None = None  # seconds; None: failed
    token_ids: tuple[int, ...] = ()
    error: str = ""


@dataclasses.dataclass
class ArmResult:
    outcomes: dict[tuple[int, int], Outcome]
    counters: dict[str, float | None]  # computed_tokens (anywhere), prompt_tokens (the clients sent)
    compare: bool = True  # its token ids are compared with arm a's (not a peer's: other kernels)
    where: dict[str, float] = dataclasses.field(default_factory=dict)  # per server: tokens computed, hit rate, groups held


def prefill_has_flag(flag: str) -> bool:
    """Whether this build's prefill takes ``flag`` (``--no-prefix-cache``: it has a cache to
    turn off; ``--no-smg-kv-events``: smg's stream of its events can be turned off)."""
    return flag in prefill_parser().format_help()


def pool_pages(args: argparse.Namespace, requests: list[Request]) -> int:
    """Each prefill's KV pages: ``--pool-pages``, else half the groups' prefixes (their
    full pages) and, for each of ``--concurrency`` requests in flight, the most pages a
    prompt adds to its group's prefix; never fewer than ``--concurrency`` whole prompts of
    the longest length, so a prefill with nothing cached admits every request in flight.
    A prompt in flight shares its prefix's cached pages, so only what it adds is counted
    beside them: the two pools hold every prefix once, not twice."""
    if args.pool_pages is not None:
        if args.pool_pages < 0:
            raise PdgrpcError(f"--pool-pages must be >= 0, got {args.pool_pages}")
        return int(args.pool_pages)
    shared: dict[int, tuple[int, ...]] = {}
    for r in requests:  # a group's prefix: what its prompts share
        p = shared.setdefault(r.group, r.input_ids)
        n = next((i for i, (a, b) in enumerate(zip(p, r.input_ids)) if a != b), min(len(p), len(r.input_ids)))
        shared[r.group] = p[:n]
    prefix_pages = {g: len(p) // args.page_size for g, p in shared.items()}
    pages = [pages_for_tokens(len(r.input_ids), args.page_size) for r in requests]
    added = max(n - prefix_pages[r.group] for n, r in zip(pages, requests))
    half = -(-sum(prefix_pages.values()) // 2)
    return max(half + args.concurrency * added, args.concurrency * max(pages))


def topology(args: argparse.Namespace, model: str, arm: str, max_prompt: int, prefill_pages: int) -> Topology:
    engine: dict[str, Any] = {
        "model": model, "page-size": args.page_size, "max-prompt-tokens": max_prompt,
        "max-seq-len": max_prompt + args.max_new_tokens + args.page_size,
        # Room for every group's prefix and the requests in flight, so nothing is evicted
        # (the decode's pool; a prefill's is prefill_pages).
        "num-pages": (args.groups + args.concurrency + 2) * (max_prompt // args.page_size + 2),
    }
    prefill_args: dict[str, Any] = {"chunk-size": 512, "num-pages": prefill_pages or engine["num-pages"]}
    if arm == "a" and prefill_has_flag("--no-prefix-cache"):
        prefill_args["no-prefix-cache"] = True
    if arm == "d" and prefill_has_flag("--no-smg-kv-events"):
        prefill_args["no-smg-kv-events"] = True
    smg = arm in ("d", "e")
    if smg:  # the name smg's /generate asks for (bench.gateway's client)
        prefill_args["served-model-name"] = DEFAULT_SERVED_MODEL_NAME
    processes: list[dict[str, Any]] = [{"name": n, "role": "prefill", "args": prefill_args} for n in PREFILLS]
    processes.append({"name": DECODE, "role": "decode", "args": {"num-slots": 64, **({"served-model-name": DEFAULT_SERVED_MODEL_NAME} if smg else {})}})
    # A cluster's front door is a router; the smg arms send their requests to smg beside it.
    router: dict[str, Any] = {"max-prompt-tokens": max_prompt, "policy": "cache_aware" if arm == "c" else "round_robin"}
    if arm == "c" and args.cache_aware_margin is not None:
        router["cache-aware-margin"] = args.cache_aware_margin
    processes.append({"name": "router", "role": "router", "prefill": list(PREFILLS), "decode": [DECODE], "args": router})
    if smg:
        processes.append({
            "name": "smg", "role": "smg", "prefill": list(PREFILLS), "decode": [DECODE],
            # A long prompt on 2 busy cores outlasts smg's default silence bounds (seconds),
            # after which it gives up on a healthy prefill.
            "args": {"prefill-policy": "cache_aware", "decode-policy": "round_robin", "worker-wedge-secs": 600, "worker-stall-secs": 60},
        })
    data = {"description": f"bench prefix arm {arm}: {ARMS[arm]}", "transport": args.transport, "metrics": True, "engine": engine, "process": processes}
    return parse_topology(data, f"prefix-{arm}")


async def events_served(cluster: Cluster) -> bool:
    """Whether the prefills stream KV events: ``SubscribeKvEvents`` answers anything but
    UNIMPLEMENTED within a second (a snapshot, or a stream left open)."""
    stub = PrefillServiceStub(cluster.channel(PREFILLS[0]))
    call = stub.SubscribeKvEvents(SubscribeKvEventsRequest(), timeout=1.0)
    try:
        async for _ in call:
            return True
    except grpc.aio.AioRpcError as exc:
        return exc.code() != grpc.StatusCode.UNIMPLEMENTED
    finally:
        call.cancel()
    return True


async def groups_held(cluster: Cluster, requests: list[Request]) -> dict[str, float]:
    """How many groups' prefixes (their first page) only ``prefill-a``, only
    ``prefill-b``, both or neither hold now, from a snapshot of each one's KV events."""
    index = PrefixIndex()
    for name in PREFILLS:
        stub = PrefillServiceStub(cluster.channel(name))
        # A cursor no instance reached: the snapshot, then the stream is left.
        call = stub.SubscribeKvEvents(SubscribeKvEventsRequest(start_sequence_number=1 << 62), timeout=30)
        async for b in call:
            batch = batch_from_proto(b)
            index.apply(name, batch.events)
            if batch.snapshot is None or batch.snapshot.index + 1 == batch.snapshot.count:
                call.cancel()
                break
    firsts = {r.group: r.input_ids for r in requests}
    out = {f"groups_held/{k}": 0.0 for k in ("prefill-a", "prefill-b", "both", "none")}
    for ids in firsts.values():
        holders = [name for name, depth in index.match(ids[:64]).items() if depth]
        out["groups_held/" + (holders[0] if len(holders) == 1 else "both" if holders else "none")] += 1
    return out


def _read_counters(servers: dict[str, tuple[str, list[str]]]) -> dict[str, dict[str, float | None]]:
    """Each of its role's :data:`_COUNTERS` per server (``name: (role, endpoints)``),
    summed over its metrics endpoints (None when no endpoint exports it: this build does
    not count it)."""
    return {name: _read_one(role, endpoints) for name, (role, endpoints) in servers.items()}


def _read_one(role: str, endpoints: list[str]) -> dict[str, float | None]:
    totals: dict[str, float | None] = {key: None for key in _COUNTERS[role]}
    for address in endpoints:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, name in _COUNTERS[role].items():
                    if sample.name == name and sample.labels.get("role") == role:
                        totals[key] = (totals[key] or 0.0) + sample.value
    return totals


async def _send_all(requests: list[Request], concurrency: int, one: Callable[[int, Request], Awaitable[Outcome]]) -> dict[tuple[int, int], Outcome]:
    """Every request, in order, ``concurrency`` at a time; ``one(slot, request)``: slot is
    the sender (0..concurrency-1) running it."""
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    out: dict[tuple[int, int], Outcome] = {}

    async def sender(slot: int) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            try:
                out[(r.group, r.question)] = await one(slot, r)
            except Exception as exc:  # a failed request is counted, not fatal
                out[(r.group, r.question)] = Outcome(error=f"{type(exc).__name__}: {exc}")

    await asyncio.gather(*(sender(s) for s in range(concurrency)))
    return out


def vllm_problem(python: str) -> str | None:
    """Why arm ``v`` cannot run with ``--vllm-python python`` (None: it can)."""
    if not python:
        return "not available: no --vllm-python (a Python where `import vllm` works)"
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not available: --vllm-python {python}: {exc}"
    if done.returncode:
        return f"not available: --vllm-python {python}: `import vllm` failed: {done.stderr.strip().splitlines()[-1:]}"
    return None


class VllmClient:
    """``/v1/completions``, streamed, over one kept-alive HTTP/1.1 connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def ttft(self, ids: list[int], max_new_tokens: int) -> float:
        """Seconds from sending to the first streamed completion chunk (the rest is read)."""
        if self._conn is None:
            self._conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self._conn
        body = json.dumps({
            "model": "bench", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        }).encode()
        start = time.perf_counter()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise PdgrpcError(f"vLLM /v1/completions answered {status.decode().strip()}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        first = 0.0
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return first
            chunk = await reader.readexactly(size + 2)
            if not first and b'"choices"' in chunk:
                first = time.perf_counter() - start


async def run_vllm(args: argparse.Namespace, model: str, requests: list[Request], warmup: list[Request]) -> ArmResult | str:
    """Arm ``v``: one vLLM OpenAI server with prefix caching, the same requests."""
    problem = vllm_problem(args.vllm_python)
    if problem is not None:
        return problem
    port = free_port()
    max_len = max(len(r.input_ids) for r in requests + warmup) + args.max_new_tokens + args.page_size
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len), "--enable-prefix-caching",
            "--dtype", "float32",
            # vLLM's CPU backend reserves this share of the host's memory up front and refuses
            # to start when less is free: a small model needs little.
            "--gpu-memory-utilization", "0.1"]
    print("arm v (vLLM): starting ...", flush=True)
    log = tempfile.TemporaryFile()
    # GiB of KV cache; one compute thread, unbound, as each pdgrpc worker computes on one.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    clients = [VllmClient(port) for _ in range(args.concurrency)]
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                log.seek(0)
                errors = [ln for ln in log.read().decode(errors="replace").splitlines() if "Error" in ln or "Exception" in ln]
                return f"failed: vLLM exited with {proc.returncode}: {' | '.join(errors[-3:])}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    return "failed: vLLM did not answer /health within 900 s"
                await asyncio.sleep(2)

        async def one(slot: int, r: Request) -> Outcome:
            return Outcome(await clients[slot].ttft(list(r.input_ids), args.max_new_tokens))

        await _send_all(warmup, args.concurrency, one)
        print(f"arm v: {len(requests)} requests, {args.concurrency} in flight ...", flush=True)
        outcomes = await _send_all(requests, args.concurrency, one)
    finally:
        await asyncio.gather(*(c.close() for c in clients))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    return ArmResult(outcomes, {"computed_tokens": None, "prompt_tokens": None}, compare=False)


async def run_arm(args: argparse.Namespace, arm: str, model: str, requests: list[Request], warmup: list[Request]) -> ArmResult | str:
    """One arm's outcomes and the servers' counters over the measured requests, or why
    it is not available."""
    if arm == "v":
        return await run_vllm(args, model, requests, warmup)
    if arm != "a" and not prefill_has_flag("--no-prefix-cache"):
        return "not available: this build's prefill has no prefix cache (--no-prefix-cache)"
    if arm in ("d", "e") and not gateway_available():
        return "not available: smg is not installed (pdgrpc[gateway])"
    max_prompt = max(len(r.input_ids) for r in requests + warmup)
    cluster = Cluster(topology(args, model, arm, max_prompt, pool_pages(args, requests)), start_timeout=300)
    async with contextlib.AsyncExitStack() as stack:
        print(f"arm {arm} ({ARMS[arm]}): starting ...", flush=True)
        await stack.enter_async_context(cluster)
        if arm in ("c", "d", "e"):
            served = await events_served(cluster)
            if arm == "c" and not served:
                return "not available: the prefills serve no KV events (SubscribeKvEvents), which cache_aware reads"
            if arm == "d" and served and not prefill_has_flag("--no-smg-kv-events"):
                return "not available: the prefills serve KV events, and smg reads them whenever they do (arm e)"
            if arm == "e" and not served:
                return "not available: the prefills serve no KV events (SubscribeKvEvents)"
        # Each prefill's controller and workers, and the decode.
        endpoints = {name: ("prefill", [a for n, a in cluster.metrics_endpoints("prefill").items() if n.split("/")[0] == name])
                     for name in PREFILLS}
        endpoints[DECODE] = ("decode", list(cluster.metrics_endpoints("decode").values()))
        if arm in ("d", "e"):
            host, _, port = cluster.openai_base_url.removeprefix("http://").removesuffix("/v1").rpartition(":")
            clients = [SmgClient(host, int(port)) for _ in range(args.concurrency)]
            stack.push_async_callback(lambda: asyncio.gather(*(c.close() for c in clients)))

            async def one(slot: int, r: Request) -> Outcome:
                ids, ttft = await clients[slot].generate(list(r.input_ids), args.max_new_tokens, ignore_eos=True)
                return Outcome(ttft, tuple(ids))
        else:
            stub = GenerateServiceStub(await stack.enter_async_context(cluster.client_channel()))

            async def one(slot: int, r: Request) -> Outcome:
                c = await generate(stub, input_ids=r.input_ids, max_new_tokens=args.max_new_tokens, ignore_eos=True, timeout=600)
                return Outcome(c.client_ttft_seconds, tuple(c.token_ids))

        await _send_all(warmup, args.concurrency, one)
        before = await asyncio.to_thread(_read_counters, endpoints)
        print(f"arm {arm}: {len(requests)} requests, {args.concurrency} in flight ...", flush=True)
        start = time.perf_counter()
        outcomes = await _send_all(requests, args.concurrency, one)
        print(f"arm {arm}: done in {time.perf_counter() - start:.1f} s", flush=True)
        await asyncio.sleep(0.5)  # a prefill counts a request once its KV is sent
        after = await asyncio.to_thread(_read_counters, endpoints)
        where = await groups_held(cluster, requests) if arm != "a" else {}
        cluster.check()
    counters, spread = arm_counters({name: _delta(after[name], before[name]) for name in after}, sum(len(r.input_ids) for r in requests))
    return ArmResult(outcomes, counters, where={**spread, **where})


def arm_counters(servers: dict[str, dict[str, float | None]], sent: int) -> tuple[dict[str, float | None], dict[str, float]]:
    """An arm's totals from each server's counters over the measured requests: the tokens
    computed anywhere (every prefill and the decode; None when one does not count them)
    and the ``sent`` prompt tokens, so that arms whose router has the decode compute some
    prompts compare with those that do not; and where the work went: each server's
    computed tokens, each prefill's own hit rate and the cached pages it evicted."""
    where: dict[str, float] = {}
    for name, c in servers.items():
        if c["computed_tokens"] is not None:
            where[f"computed_tokens/{name}"] = c["computed_tokens"]
        hit, asked = c.get("hit_tokens"), c.get("prompt_tokens")
        if hit is not None and asked:
            where[f"hit_rate/{name}"] = hit / asked
        if (evicted := c.get("evictions")) is not None:
            where[f"evictions/{name}"] = evicted
    parts = [c["computed_tokens"] for c in servers.values()]
    computed = None if any(p is None for p in parts) else sum(p or 0.0 for p in parts)
    return {"computed_tokens": computed, "prompt_tokens": float(sent)}, where


def _delta(after: dict[str, float | None], before: dict[str, float | None]) -> dict[str, float | None]:
    return {key: None if (now := after[key]) is None else now - (before[key] or 0.0) for key in after}


def summarize(requests: list[Request], results: dict[str, ArmResult | str]) -> list[Result]:
    firsts: set[tuple[int, int]] = set()
    seen: set[int] = set()
    for r in requests:  # sending order
        if r.group not in seen:
            seen.add(r.group)
            firsts.add((r.group, r.question))
    base = results.get(BASELINE)
    out: list[Result] = []
    base_p50: dict[str, float] = {}
    base_hit: float | None = None
    for arm, res in results.items():
        case = f"arm {arm}: {ARMS[arm]}"
        if isinstance(res, str):
            print(f"{case}: {res}")
            continue
        n = len(requests)
        ok = {k: o for k, o in res.outcomes.items() if o.ttft is not None}
        for label, keys in (("first", firsts), ("later", set(res.outcomes) - firsts)):
            ttfts = [t * 1e3 for k in keys if k in ok and (t := ok[k].ttft) is not None]
            if not ttfts:
                continue
            p50, p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
            if arm == BASELINE:
                base_p50[label] = p50
            ref = base_p50.get(label) if arm != BASELINE else None
            out.append(Result(case, f"ttft_p50/{label}", p50, "ms", ref, p50 / ref if ref else None, tuple(ttfts)))
            out.append(Result(case, f"ttft_p90/{label}", p90, "ms"))
        for key, value in res.counters.items():
            if value is not None:
                out.append(Result(case, key, value, "tokens"))
        computed, sent = res.counters["computed_tokens"], res.counters["prompt_tokens"]
        if computed is not None and sent:
            rate = 1.0 - computed / sent
            if arm == "b":
                base_hit = rate
            ref = base_hit if arm in ("c", "d", "e") else None
            out.append(Result(case, "hit_rate", rate, "", ref, rate / ref if ref else None))
        for key, value in res.where.items():
            unit = {"groups": "groups", "computed": "tokens", "evictions": "pages"}.get(key.split("/")[0].split("_")[0], "")
            out.append(Result(case, key, value, unit))
        out.append(Result(case, "success_rate", len(ok) / n, ""))
        if isinstance(base, ArmResult) and res.compare:
            equal = sum(1 for k, o in ok.items() if base.outcomes.get(k) is not None and base.outcomes[k].ttft is not None
                        and base.outcomes[k].token_ids == o.token_ids)
            out.append(Result(case, "outputs_equal_to_a", equal / n, ""))
        failed = [o.error for o in res.outcomes.values() if o.ttft is None]
        if failed:
            print(f"{case}: {len(failed)} failed, e.g. {failed[0]}")
    return out


def run(args: argparse.Namespace) -> list[Result]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise PdgrpcError(f"--arms: unknown arm(s) {bad or arms}; choose from {', '.join(ARMS)}")
    if args.groups < 1 or args.questions < 1 or args.concurrency < 1 or args.max_new_tokens < 1:
        raise PdgrpcError("--groups, --questions, --concurrency and --max-new-tokens must be at least 1")
    with tempfile.TemporaryDirectory(prefix="pdgrpc-bench-prefix-") as tmp:
        model, vocab = build_model(args, Path(tmp))
        requests = workload(args, vocab)
        wrng = random.Random(args.seed + 1)  # distinct tokens: nothing shared with the workload
        warmup = [Request(-1, i, tuple(wrng.randrange(16, vocab - 16) for _ in range(64))) for i in range(2)]
        results: dict[str, ArmResult | str] = {}
        for arm in arms:
            results[arm] = run_loop(run_arm(args, arm, model, requests, warmup))
    rows = summarize(requests, results)
    if getattr(args, "plot", None) is not None:
        from pdgrpc.bench.plot import prefix_figure

        ttfts: dict[str, dict[str, float]] = {}
        for r in rows:
            if r.metric.startswith("ttft_"):
                ttfts.setdefault(r.case, {})[r.metric] = r.value
        prefix_figure(args.plot, ttfts)
    return rows
