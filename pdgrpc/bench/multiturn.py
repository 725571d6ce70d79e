"""``python -m pdgrpc.bench multiturn``: multi-turn chats, with and without reuse.

The workload: ``--sessions`` chats of ``--turns`` turns each. Turn 1 is a new message of
``--message-tokens`` random tokens; turn t+1 is turn t's prompt, its answer
(``--answer-tokens`` tokens, greedy, EOS ignored) and a new message. A session's turns go
one after the other; ``--concurrency`` requests of different sessions are in flight at a
time.

The model is bench prefix's locally built checkpoint (:func:`pdgrpc.bench.prefix.build_model`,
or ``--model PATH``), served by ``--pairs`` prefills and as many decodes behind pdgrpc's
router.

Arms (:data:`ARMS`), one cluster each, one after another on the same messages:

* ``off``: no reuse: the prefills' prefix cache off and the decodes' off, so every turn
  computes and moves its whole history: the baseline;
* ``delta``: the prefills' prefix cache and the decodes' (``--decode-prefix-cache``), the
  router's local prefill off: a turn computes what the prefill lacks and moves only the
  pages the decode lacks;
* ``local``: the defaults: ``delta`` plus the router's local prefill, so a turn whose
  history the decode holds, lacking at most 256 tokens, is computed on the decode, and so
  is a turn that finds the prefill's queue the longer.

Per turn index and arm: the KV bytes a request moved (``GenerateResponse.bytes_transferred``),
client TTFT p50/p99, output tokens/s per request (tokens over its whole time), and the share
of outputs equal to arm ``off``'s. Per arm: TTFT p50 over all turns, output tokens/s over
the run, failed requests. Targets: from turn 3 on, bytes per request at most 0.2x arm
``off``'s; TTFT p50 over all turns at most 0.5x; throughput at least 1.2x; every output
equal; none failed.

Equality and float ties: the checkpoint engine computes in float32, whose rounding
depends on the matmul's shape (the batch, the chunk), so two runs that batch a request
differently may pick different tokens where the top two logits are within rounding of
each other -- arm ``off`` against itself too. A chat whose output differs is checked where
it first differs (:func:`classify`): the colocated engine computes the logits of the
shared prompt and tokens there, and the difference is a tie when both tokens' logits lie
within :data:`TIE_GAP` of the best; what the chat says after a tie differs as a
consequence. ``outputs_differing_beyond_rounding`` counts every other differing output:
wrong KV moves logits by far more than rounding, so a reuse fault shows there. Its
target is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from pdgrpc.bench.prefix import add_model_arguments, build_model
from pdgrpc.bench.report import Result, percentile
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.topology import Topology, parse_topology
from pdgrpc.errors import PdgrpcError
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

DESCRIPTION = (
    "multi-turn chats (sessions x turns, each turn the whole history + a new message) through prefill/decode pairs: "
    "no reuse vs prefill prefix cache + decode reuse with delta transfers; per turn bytes moved, TTFT p50/p99, "
    "output tokens/s, output equality (targets: turn >= 3 bytes <= 0.2x, TTFT p50 <= 0.5x, throughput >= 1.2x)"
)
PLOT = "bytes moved per request and TTFT p50 by turn index, per arm"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One cluster's settings: extra flags of its prefills, decodes and router."""

    label: str
    prefill: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    decode: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    router: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# The arms, baseline first. A new arm is one more entry (a flag of a role it turns on).
ARMS: dict[str, Arm] = {
    "off": Arm("no reuse", prefill={"no-prefix-cache": True}, decode={"no-decode-prefix-cache": True}),
    # The router's local prefill off: every turn's suffix goes through a prefill.
    "delta": Arm(
        "prefill cache + decode reuse, delta transfer", decode={"decode-prefix-cache": True},
        router={"local-prefill-tokens": 0, "local-prefill-queue": 0},
    ),
    # The defaults: a prompt the decode holds a prefix of and lacks at most 256 tokens of is computed
    # there, and so is one that finds the prefill's queue the longer.
    "local": Arm("delta transfer + local prefill", decode={"decode-prefix-cache": True}, router={"local-prefill-tokens": 256}),
}
BASELINE = "off"
FROM_TURN = 3  # the bytes target counts turns from here on
# Logit gap (float32) within which another matmul shape may pick the other token: the
# engine's rounding moves a logit by ~3e-6 between shapes; wrong KV moves it by far more.
TIE_GAP = 1e-4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=32, help="chats (default: %(default)s)")
    p.add_argument("--turns", type=int, default=8, help="turns per chat (default: %(default)s)")
    p.add_argument("--message-tokens", type=int, default=64, help="tokens of each new message (default: %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=64, help="tokens generated per turn, greedily (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight, each of another chat (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=1, help="prefills, and as many decodes (default: %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms to run, of {', '.join(ARMS)} (default: %(default)s)")
    p.add_argument("--transport", default="tcp", help="KV transport (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the messages (default: %(default)s)")


@dataclasses.dataclass
class Outcome:
    ttft: float | None = None  # seconds; None: failed
    seconds: float = 0.0  # the whole request, as the client saw it
    token_ids: tuple[int, ...] = ()
    bytes_moved: int = 0
    error: str = ""


@dataclasses.dataclass
class ArmResult:
    outcomes: dict[tuple[int, int], Outcome]  # (session, turn) -> outcome; turns from 1
    seconds: float  # the whole run


def messages(args: argparse.Namespace, vocab: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """Each (session, turn)'s new message: the same in every arm. Token ids avoid the
    lowest and highest 16 ids, where a built tokenizer keeps its special tokens."""
    rng = random.Random(args.seed)
    return {
        (s, t): tuple(rng.randrange(16, vocab - 16) for _ in range(args.message_tokens))
        for s in range(args.sessions) for t in range(1, args.turns + 1)
    }


def max_prompt_tokens(args: argparse.Namespace) -> int:
    return args.turns * args.message_tokens + (args.turns - 1) * args.answer_tokens


def topology(args: argparse.Namespace, model: str, name: str) -> Topology:
    arm = ARMS[name]
    max_prompt = max_prompt_tokens(args)
    per_chat = -(-(max_prompt + args.answer_tokens) // args.page_size)
    engine: dict[str, Any] = {
        "model": model, "page-size": args.page_size, "max-prompt-tokens": max_prompt,
        "max-seq-len": max_prompt + args.answer_tokens + args.page_size,
        # Room for every chat's history and the requests in flight: nothing is evicted,
        # so the figures show reuse, not the pool's size.
        "num-pages": (args.sessions + args.concurrency + 2) * per_chat,
    }
    prefills = [f"prefill-{i}" for i in range(args.pairs)]
    decodes = [f"decode-{i}" for i in range(args.pairs)]
    processes: list[dict[str, Any]] = [{"name": n, "role": "prefill", "args": {"chunk-size": 512, **arm.prefill}} for n in prefills]
    processes += [{"name": n, "role": "decode", "args": {"num-slots": 64, **arm.decode}} for n in decodes]
    processes.append({
        "name": "router", "role": "router", "prefill": prefills, "decode": decodes,
        "args": {"max-prompt-tokens": max_prompt, **arm.router},
    })
    data = {"description": f"bench multiturn arm {name}: {arm.label}", "transport": args.transport, "metrics": True,
            "engine": engine, "process": processes}
    return parse_topology(data, f"multiturn-{name}")


async def run_arm(args: argparse.Namespace, name: str, model: str, new: Mapping[tuple[int, int], tuple[int, ...]],
                  warmup: list[tuple[int, ...]]) -> ArmResult:
    cluster = Cluster(topology(args, model, name), start_timeout=300)
    async with contextlib.AsyncExitStack() as stack:
        print(f"arm {name} ({ARMS[name].label}): starting ...", flush=True)
        await stack.enter_async_context(cluster)
        stub = GenerateServiceStub(await stack.enter_async_context(cluster.client_channel()))
        gate = asyncio.Semaphore(args.concurrency)
        out: dict[tuple[int, int], Outcome] = {}

        async def one(prompt: tuple[int, ...]) -> Outcome:
            async with gate:
                start = time.perf_counter()
                c = await generate(stub, input_ids=prompt, max_new_tokens=args.answer_tokens, ignore_eos=True, timeout=600)
                return Outcome(c.client_ttft_seconds, time.perf_counter() - start, tuple(c.token_ids), c.bytes_transferred)

        async def chat(session: int) -> None:
            history: tuple[int, ...] = ()
            for turn in range(1, args.turns + 1):
                prompt = history + new[(session, turn)]
                try:
                    o = out[(session, turn)] = await one(prompt)
                except Exception as exc:  # counted, and the chat ends: its next prompt would need this answer
                    out[(session, turn)] = Outcome(error=f"{type(exc).__name__}: {exc}")
                    return
                history = prompt + o.token_ids

        await asyncio.gather(*(one(p) for p in warmup))
        print(f"arm {name}: {args.sessions} chats x {args.turns} turns, {args.concurrency} in flight ...", flush=True)
        start = time.perf_counter()
        await asyncio.gather(*(chat(s) for s in range(args.sessions)))
        seconds = time.perf_counter() - start
        print(f"arm {name}: done in {seconds:.1f} s", flush=True)
        cluster.check()
    return ArmResult(out, seconds)


def summarize(args: argparse.Namespace, results: Mapping[str, ArmResult], beyond_rounding: Mapping[str, int] | None = None) -> list[Result]:
    """Rows per turn index and arm, then each arm's totals; ratios against :data:`BASELINE`
    where it ran. ``beyond_rounding``: per arm, the outputs that differ from the
    baseline's beyond rounding (:func:`classify`)."""
    base = results.get(BASELINE)
    keys = [(s, t) for s in range(args.sessions) for t in range(1, args.turns + 1)]
    rows: list[Result] = []
    base_value: dict[str, float] = {}

    def row(case: str, metric: str, value: float, unit: str, name: str, samples: tuple[float, ...] | None = None) -> None:
        ref = base_value.get(metric) if name != BASELINE else None
        if name == BASELINE:
            base_value[metric] = value
        rows.append(Result(case, metric, value, unit, ref, value / ref if ref else None, samples))

    for name, res in results.items():
        ok = {k: o for k, o in res.outcomes.items() if o.ttft is not None}
        case = f"arm {name}: {ARMS[name].label}"
        for t in range(1, args.turns + 1):
            turn = [o for (_, tt), o in ok.items() if tt == t]
            if not turn:
                continue
            ttfts = tuple(o.ttft * 1e3 for o in turn if o.ttft is not None)
            row(case, f"turn {t}: bytes/request", sum(o.bytes_moved for o in turn) / len(turn), "bytes", name)
            row(case, f"turn {t}: ttft_p50", percentile(ttfts, 0.5), "ms", name, ttfts)
            row(case, f"turn {t}: ttft_p99", percentile(ttfts, 0.99), "ms", name)
            row(case, f"turn {t}: tokens/s/request", sum(len(o.token_ids) / o.seconds for o in turn) / len(turn), "tokens/s", name)
            if base is not None:
                row(case, f"turn {t}: outputs_equal_to_{BASELINE}", _equal(base, res, [(s, t) for s in range(args.sessions)]), "", name)
        late = [o for (_, t), o in ok.items() if t >= FROM_TURN]
        if late:
            row(case, f"turns {FROM_TURN}+: bytes/request", sum(o.bytes_moved for o in late) / len(late), "bytes", name)
        if ok:
            row(case, "all turns: ttft_p50", percentile([o.ttft * 1e3 for o in ok.values() if o.ttft is not None], 0.5), "ms", name)
        row(case, "throughput", sum(len(o.token_ids) for o in ok.values()) / res.seconds, "tokens/s", name)
        if base is not None:
            row(case, f"outputs_equal_to_{BASELINE}", _equal(base, res, keys), "", name)
        if beyond_rounding is not None and name in beyond_rounding:
            row(case, "outputs_differing_beyond_rounding", beyond_rounding[name], "requests", name)
        failed = [o.error if o is not None else "not sent: an earlier turn failed"
                  for k in keys if (o := res.outcomes.get(k)) is None or o.ttft is None]
        row(case, "failed", len(failed), "requests", name)
        if failed:
            print(f"{case}: {len(failed)} failed or not sent, e.g. {failed[0]}")
    return rows


LogitsOf = Callable[[tuple[int, ...]], Sequence[float]]  # a sequence's last position's logits


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a chat's output first differs from the baseline's."""

    session: int
    turn: int
    position: int  # index of the first differing output token
    tokens: tuple[int, int]  # the baseline's token there, then this arm's
    gap: float  # how far below the best logit the lower of the two lies (inf: no token to compare)

    @property
    def tie(self) -> bool:
        return self.gap <= TIE_GAP


def classify(args: argparse.Namespace, new: Mapping[tuple[int, int], tuple[int, ...]], base: ArmResult, res: ArmResult,
             logits_of: LogitsOf) -> tuple[list[Divergence], int]:
    """Each chat's first output that differs from ``base``'s (both succeeded), judged by
    the colocated logits of the shared prompt and tokens before it; and the outputs that
    differ beyond rounding: every differing one of a chat whose first difference is no tie."""
    found: list[Divergence] = []
    beyond = 0
    for s in range(args.sessions):
        prompt: tuple[int, ...] = ()
        first: Divergence | None = None
        for t in range(1, args.turns + 1):
            a, b = base.outcomes.get((s, t)), res.outcomes.get((s, t))
            if a is None or b is None or a.ttft is None or b.ttft is None:
                break  # counted as failed, not as a difference
            if first is None:
                prompt += new[(s, t)]
                if a.token_ids != b.token_ids:
                    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                    if n is None:  # one answer is a prefix of the other: no tie explains it
                        first = Divergence(s, t, min(len(a.token_ids), len(b.token_ids)), (-1, -1), float("inf"))
                    else:
                        lg = logits_of(prompt + a.token_ids[:n])
                        x, y = a.token_ids[n], b.token_ids[n]
                        first = Divergence(s, t, n, (x, y), max(lg) - min(lg[x], lg[y]))
                    found.append(first)
                prompt += a.token_ids
            if first is not None and not first.tie and a.token_ids != b.token_ids:
                beyond += 1
    return found, beyond


def colocated_logits(args: argparse.Namespace, model: str) -> LogitsOf:
    """The checkpoint engine in this process, as the servers build it (float32, one
    chunk), loaded at the first call: only a run with a differing output needs it."""
    longest = max_prompt_tokens(args) + args.answer_tokens

    @functools.cache
    def engine() -> Any:
        from pdgrpc.engine.hf.engine import load

        return load(model, page_size=args.page_size, num_pages=-(-longest // args.page_size) + 1,
                    max_prompt_tokens=longest, max_seq_len=longest + args.page_size)

    return lambda ids: engine().compute_logits(ids)[-1].tolist()


def _equal(base: ArmResult, res: ArmResult, keys: list[tuple[int, int]]) -> float:
    """The share of ``keys`` whose output equals the baseline's (both succeeded)."""
    same = 0
    for k in keys:
        a, b = base.outcomes.get(k), res.outcomes.get(k)
        same += a is not None and b is not None and a.ttft is not None and b.ttft is not None and a.token_ids == b.token_ids
    return same / len(keys)


def run(args: argparse.Namespace) -> list[Result]:
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in names if a not in ARMS]
    if bad or not names:
        raise PdgrpcError(f"--arms: unknown arm(s) {bad or names}; choose from {', '.join(ARMS)}")
    for flag in ("sessions", "turns", "message_tokens", "answer_tokens", "concurrency", "pairs"):
        if getattr(args, flag) < 1:
            raise PdgrpcError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    names.sort(key=lambda n: n != BASELINE)  # the baseline first: the others' ratios refer to it
    with tempfile.TemporaryDirectory(prefix="pdgrpc-bench-multiturn-") as tmp:
        model, vocab = build_model(args, Path(tmp))
        new = messages(args, vocab)
        wrng = random.Random(args.seed + 1)  # distinct tokens: nothing shared with the chats
        warmup = [tuple(wrng.randrange(16, vocab - 16) for _ in range(args.message_tokens)) for _ in range(2)]
        results = {name: run_loop(run_arm(args, name, model, new, warmup)) for name in names}
        beyond: dict[str, int] = {}
        logits_of = colocated_logits(args, model)
        for name, res in results.items():
            if name == BASELINE or BASELINE not in results:
                continue
            found, beyond[name] = classify(args, new, results[BASELINE], res, logits_of)
            for d in found:
                print(f"arm {name}: chat {d.session} first differs at turn {d.turn}, output token {d.position}: "
                      f"{BASELINE} {d.tokens[0]}, {name} {d.tokens[1]}, {d.gap:.3g} below the best logit "
                      f"({'a tie within rounding' if d.tie else 'BEYOND ROUNDING'})", flush=True)
    rows = summarize(args, results, beyond)
    if getattr(args, "plot", None) is not None:
        from pdgrpc.bench.plot import multiturn_figure

        per_turn: dict[str, dict[str, list[float]]] = {}
        for r in rows:
            turn, _, metric = r.metric.partition(": ")
            if turn.startswith("turn ") and metric in ("bytes/request", "ttft_p50"):
                per_turn.setdefault(r.case, {}).setdefault(metric, []).append(r.value)
        multiturn_figure(args.plot, per_turn)
    return rows
