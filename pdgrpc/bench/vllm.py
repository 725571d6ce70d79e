"""vLLM colocated against vLLM 1P1D over ``PdgrpcConnector`` (and over vLLM's own
``NixlConnector`` where ``nixl`` is installed), same model, same prompts, one run.

Run it from the vLLM venv (``make vllm-venv``)::

    PYTHONPATH=. .venv-vllm/bin/python -m pdgrpc.bench vllm [--json PATH]

Every server has one compute thread bound to a core: colocated on core 0; prefill on
core 0 (without async scheduling: see PREFILL_ARGS) and decode on core 1, where all of
the decode's processes run, so that its engine core, which steps every millisecond while
a request waits for its KV, stays off the prefill's core. The
comparison is order-fair: colocated and one pdgrpc pair run side by side, the pair
behind two front doors (the prefill's token first, and ``--no-first-token``: the decode
recomputes it), and each prompt goes to every arm in turn, the order alternating (A B
C, then C B A), so no arm always runs first or right after another, and each request
(and block) starts once every server has been idle for :data:`QUIET_S`, past the second
a vLLM worker keeps polling its core after its last step. The concurrency-8
phase runs ``--rounds`` blocks per arm in the same alternating order. Every server runs
without a prefix cache, so the two arms sharing the pair each compute every prompt in
full (prompts are random token ids, seeded).

Reported: TTFT p50/p99 of single requests at 256 and 512 prompt tokens (streamed; the
time to the first token), tokens/s and TTFT p50 with 8 requests in flight, CPU
milliseconds per generated token in that phase (all the arm's processes: servers and
front door), how many greedy outputs equal colocated's, token for token, and the load
average at the start of each phase. The ``NixlConnector`` arm runs afterwards on its own
pair (the same cores), compared with colocated's figures from the interleaved phases.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pdgrpc.bench.report import Result, percentile

DESCRIPTION = "vLLM colocated vs vLLM 1P1D over PdgrpcConnector (and NixlConnector): TTFT, tokens/s, equality"

NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
COLOCATED = "vllm colocated"
FIRST = "vllm 1p1d pdgrpc"
RECOMPUTE = "vllm 1p1d pdgrpc, decode recomputes"
NIXL = "vllm 1p1d nixl"
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
# A prefill schedules its next step after the last one's output: a finished request's
# send then starts with that step, not one whole step later.
PREFILL_ARGS = ("--no-async-scheduling",)
# A vLLM worker polls its message queue on its core for a second after its last message
# (vLLM's SpinCondition), and the arms share core 0: every measurement waits that long
# first, so that no arm runs beside another's idle polling.
QUIET_S = 1.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20, help="single requests per prompt length and arm (TTFT)")
    parser.add_argument("--load-requests", type=int, default=16,
                        help="requests per block of the concurrency-8 phase")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per arm in the concurrency-8 phase")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--lengths", default="256,512", help="prompt lengths (tokens) for the TTFT phase")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a vLLM server may take to start")
    parser.add_argument("--no-nixl", action="store_true", help="skip the NixlConnector arm even where nixl is installed")


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _load() -> float:
    return os.getloadavg()[0]


def group_cpu_ms(pgids: list[int]) -> float:
    """CPU time so far of every process in the process groups ``pgids`` (a server and
    the processes it started), in ms."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) in pgids:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime + stime, in ticks
    return total * 1e3 / tick


async def _stream(session: Any, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the token ids) of one greedy streamed completion."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{url}: the stream ended with an error: {event['error']}")
            choice = event["choices"][0]
            ids = choice.get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - t0
            tokens.extend(ids)
    if first is None:
        raise RuntimeError(f"{url}: no token came back")
    return first, tokens


def arm_order(names: list[str], i: int) -> list[str]:
    """The order the arms take prompt (or block) ``i`` in: forward, then backward, so
    over any two consecutive prompts each arm runs first once and follows each other
    arm once."""
    return list(names) if i % 2 == 0 else names[::-1]


class Arm:
    """One arm: the URL requests go to and the process groups whose CPU it uses."""

    def __init__(self, url: str, pgids: list[int]) -> None:
        self.url = url
        self.pgids = pgids


async def _measure(arms: dict[str, Arm], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import aiohttp

    names = list(arms)
    out: dict[str, dict[str, Any]] = {n: {"outputs": [], "load_ttft": [], "generated": 0, "seconds": 0.0,
                                          "cpu_ms": 0.0} for n in names}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name in names:  # warm every server's paths
            for prompt in _prompts(2, 64, 999):
                await _stream(session, arms[name].url, prompt, 4)
        for length in [int(x) for x in args.lengths.split(",")]:
            for n in names:
                out[n][f"load_avg@{length}"] = _load()
                out[n][f"ttft@{length}"] = []
            for i, prompt in enumerate(_prompts(args.requests, length, length)):
                for name in arm_order(names, i):
                    await asyncio.sleep(QUIET_S)
                    ttft, tokens = await _stream(session, arms[name].url, prompt, args.output_tokens)
                    out[name][f"ttft@{length}"].append(ttft * 1e3)
                    out[name]["outputs"].append(tokens)
        for n in names:
            out[n]["load_avg@8"] = _load()
        for r in range(args.rounds):
            prompts = _prompts(args.load_requests, 256, 8 + r)
            for name in arm_order(names, r):
                await asyncio.sleep(QUIET_S)
                await _block(session, arms[name], prompts, args.output_tokens, out[name])
    for m in out.values():
        m["tokens_per_s"] = m["generated"] / m["seconds"]
        m["cpu_ms_per_token"] = m["cpu_ms"] / m["generated"]
    return out


async def _block(session: Any, arm: Arm, prompts: list[list[int]], max_tokens: int, into: dict[str, Any]) -> None:
    """``prompts`` with 8 in flight."""
    sem = asyncio.Semaphore(8)

    async def one(prompt: list[int]) -> None:
        async with sem:
            ttft, tokens = await _stream(session, arm.url, prompt, max_tokens)
            into["load_ttft"].append(ttft * 1e3)
            into["generated"] += len(tokens)

    cpu0, t0 = group_cpu_ms(arm.pgids), time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    into["seconds"] += time.perf_counter() - t0
    into["cpu_ms"] += group_cpu_ms(arm.pgids) - cpu0


def run(args: argparse.Namespace) -> list[Result]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("python -m pdgrpc.bench vllm needs vLLM: run it from .venv-vllm (make vllm-venv)")
    from pdgrpc.integrations.vllm.launch import Server, free_port, hf_checkpoint, proxy_server, servers, vllm_server

    model = hf_checkpoint()
    logs = Path(tempfile.mkdtemp(prefix="pdgrpc-bench-vllm-"))

    def ready(*procs: Server) -> None:
        for p in procs:
            p.wait_ready("/v1/models", args.startup_timeout)

    def pair(tag: str, kv: dict[str, Any] | None) -> tuple[Server, Server]:
        # NIXL's side channel listens on a fixed port per server (vLLM's environment).
        side = (lambda: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}) if kv else (lambda: {})
        p = vllm_server(f"{tag}prefill", free_port(), 0, model, logs, kv_config=kv, env=side(),
                        args=(*NO_PREFIX_CACHE, *PREFILL_ARGS))
        d = vllm_server(f"{tag}decode", free_port(), 1, model, logs, kv_config=kv, env=side(), args=NO_PREFIX_CACHE,
                        confine=True)
        return p, d

    colocated = vllm_server("colocated", free_port(), 0, model, logs, connector=False, args=NO_PREFIX_CACHE)
    prefill, decode = pair("", None)
    first = proxy_server(free_port(), prefill, decode, logs, name="proxy")
    recompute = proxy_server(free_port(), prefill, decode, logs, name="proxy-recompute", args=("--no-first-token",))
    with servers(first, recompute, colocated, prefill, decode):
        ready(colocated, prefill, decode, first, recompute)
        print(f"bench vllm: measuring {COLOCATED}, {FIRST}, {RECOMPUTE} interleaved", flush=True)
        pair_groups = [prefill.proc.pid, decode.proc.pid]
        measured = asyncio.run(_measure({COLOCATED: Arm(colocated.url, [colocated.proc.pid]),
                                         FIRST: Arm(first.url, [*pair_groups, first.proc.pid]),
                                         RECOMPUTE: Arm(recompute.url, [*pair_groups, recompute.proc.pid])}, args))
    if not args.no_nixl and importlib.util.find_spec("nixl") is not None:
        prefill, decode = pair("nixl-", NIXL_CONFIG)
        proxy = proxy_server(free_port(), prefill, decode, logs, name="nixl-proxy", args=("--no-first-token",))
        try:
            with servers(proxy, prefill, decode):
                ready(prefill, decode, proxy)
                print(f"bench vllm: measuring {NIXL}", flush=True)
                measured.update(asyncio.run(_measure({NIXL: Arm(proxy.url, [prefill.proc.pid, decode.proc.pid,
                                                                              proxy.proc.pid])}, args)))
        except (RuntimeError, AssertionError, OSError) as exc:
            print(f"bench vllm: {NIXL} failed, left out: {exc}", flush=True)
    print(f"bench vllm: server logs in {logs}")
    return _results(measured, args)


def _results(measured: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[Result]:
    base = measured[COLOCATED]
    results: list[Result] = []
    for name, m in measured.items():
        def add(metric: str, value: float, unit: str, base_value: float | None, samples: list[float] | None = None) -> None:
            ratio = value / base_value if base_value else None
            results.append(Result(name, metric, value, unit, base_value if name != COLOCATED else None,
                                  ratio if name != COLOCATED else None, tuple(samples) if samples else None))

        for length in [int(x) for x in args.lengths.split(",")]:
            key = f"ttft@{length}"
            add(f"ttft p50 @{length} tok", percentile(m[key], 0.5), "ms", percentile(base[key], 0.5), m[key])
            add(f"ttft p99 @{length} tok", percentile(m[key], 0.99), "ms", percentile(base[key], 0.99))
            add(f"load average @{length} tok", m[f"load_avg@{length}"], "", None)
        add("tokens/s @8 in flight", m["tokens_per_s"], "tok/s", base["tokens_per_s"])
        add("ttft p50 @8 in flight", statistics.median(m["load_ttft"]), "ms", statistics.median(base["load_ttft"]))
        add("cpu per token @8 in flight", m["cpu_ms_per_token"], "ms", base["cpu_ms_per_token"])
        add("load average @8 in flight", m["load_avg@8"], "", None)
        equal = sum(a == b for a, b in zip(m["outputs"], base["outputs"]))
        add("outputs equal to colocated", equal, f"of {len(base['outputs'])}", None)
    return results
