"""vLLM colocated against vLLM 1P1D over ``PdgrpcConnector`` (and over vLLM's own
``NixlConnector`` where ``nixl`` is installed), same model, same prompts, one run.

Run it from the vLLM venv (``make vllm-venv``)::

    PYTHONPATH=. .venv-vllm/bin/python -m pdgrpc.bench vllm [--json PATH]

Every server has one compute thread bound to a core: colocated on core 0; prefill on
core 0 and decode on core 1. Arms run one after another, each on its own servers.
Reported: TTFT p50/p99 of single requests at 256 and 512 prompt tokens (streamed; the
time to the first text chunk), tokens/s and TTFT p50 with 8 requests in flight, and how
many greedy outputs equal colocated's, token for token. The pdgrpc arm's front door
answers with the prefill's token first; ``--recompute-arm`` adds one whose decode
recomputes it (the NixlConnector arm runs that way too, as vLLM's own proxy does). Prompts are random token ids
(seeded), distinct per request, so no prefix cache helps any arm.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pdgrpc.bench.report import Result, percentile

DESCRIPTION = "vLLM colocated vs vLLM 1P1D over PdgrpcConnector (and NixlConnector): TTFT, tokens/s, equality"

NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20, help="single requests per prompt length (TTFT)")
    parser.add_argument("--load-requests", type=int, default=32, help="requests in the concurrency-8 phase")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--lengths", default="256,512", help="prompt lengths (tokens) for the TTFT phase")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a vLLM server may take to start")
    parser.add_argument("--no-nixl", action="store_true", help="skip the NixlConnector arm even where nixl is installed")
    parser.add_argument("--recompute-arm", action="store_true",
                        help="add a PdgrpcConnector arm whose front door sends every request to the decode unchanged "
                             "(the decode recomputes the prompt's last position; the proxy's --no-first-token)")


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


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


async def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    out: dict[str, Any] = {"outputs": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _stream(session, url, _prompts(1, 64, 999)[0], 2)  # warm both servers' paths
        for length in [int(x) for x in args.lengths.split(",")]:
            ttfts = []
            for prompt in _prompts(args.requests, length, length):
                ttft, tokens = await _stream(session, url, prompt, args.output_tokens)
                ttfts.append(ttft * 1e3)
                out["outputs"].append(tokens)
            out[f"ttft@{length}"] = ttfts
        sem = asyncio.Semaphore(8)
        load_ttfts: list[float] = []
        generated = 0

        async def one(prompt: list[int]) -> None:
            nonlocal generated
            async with sem:
                ttft, tokens = await _stream(session, url, prompt, args.output_tokens)
                load_ttfts.append(ttft * 1e3)
                generated += len(tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in _prompts(args.load_requests, 256, 8)))
        out["tokens_per_s"] = generated / (time.perf_counter() - t0)
        out["load_ttft"] = load_ttfts
    return out


def _arm(name: str, start: Callable[[Path], tuple[str, list[Any]]], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from pdgrpc.integrations.vllm.launch import servers

    url, procs = start(logs)
    with servers(*procs):
        for p in procs:
            p.wait_ready("/v1/models", args.startup_timeout)
        print(f"bench vllm: measuring {name}", flush=True)
        return asyncio.run(_measure(url, args))


def run(args: argparse.Namespace) -> list[Result]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("python -m pdgrpc.bench vllm needs vLLM: run it from .venv-vllm (make vllm-venv)")
    from pdgrpc.integrations.vllm.launch import free_port, hf_checkpoint, proxy_server, vllm_server

    model = hf_checkpoint()
    logs = Path(tempfile.mkdtemp(prefix="pdgrpc-bench-vllm-"))

    def colocated(logs: Path) -> tuple[str, list[Any]]:
        s = vllm_server("colocated", free_port(), 0, model, logs, connector=False)
        return s.url, [s]

    def pair(kv: dict[str, Any] | None, *proxy_args: str) -> Callable[[Path], tuple[str, list[Any]]]:
        def start(logs: Path) -> tuple[str, list[Any]]:
            # NIXL's side channel listens on a fixed port per server (vLLM's environment).
            side = (lambda: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}) if kv else (lambda: {})
            p = vllm_server("prefill", free_port(), 0, model, logs, kv_config=kv, env=side())
            d = vllm_server("decode", free_port(), 1, model, logs, kv_config=kv, env=side())
            x = proxy_server(free_port(), p, d, logs, args=proxy_args)
            return x.url, [x, p, d]
        return start

    arms: dict[str, Callable[[Path], tuple[str, list[Any]]]] = {"vllm colocated": colocated,
                                                                 "vllm 1p1d pdgrpc": pair(None)}
    if args.recompute_arm:
        arms["vllm 1p1d pdgrpc, decode recomputes"] = pair(None, "--no-first-token")
    if not args.no_nixl and importlib.util.find_spec("nixl") is not None:
        arms["vllm 1p1d nixl"] = pair(NIXL_CONFIG, "--no-first-token")
    measured: dict[str, dict[str, Any]] = {}
    for name, start in arms.items():
        try:
            measured[name] = _arm(name, start, args, logs)
        except (RuntimeError, AssertionError, OSError) as exc:
            if name == "vllm colocated":
                raise
            print(f"bench vllm: {name} failed, left out: {exc}", flush=True)
    base = measured["vllm colocated"]
    results: list[Result] = []
    for name, m in measured.items():
        def add(metric: str, value: float, unit: str, base_value: float | None, samples: list[float] | None = None) -> None:
            ratio = value / base_value if base_value else None
            results.append(Result(name, metric, value, unit, base_value if name != "vllm colocated" else None,
                                  ratio if name != "vllm colocated" else None, tuple(samples) if samples else None))

        for length in [int(x) for x in args.lengths.split(",")]:
            key = f"ttft@{length}"
            add(f"ttft p50 @{length} tok", percentile(m[key], 0.5), "ms", percentile(base[key], 0.5), m[key])
            add(f"ttft p99 @{length} tok", percentile(m[key], 0.99), "ms", percentile(base[key], 0.99))
        add("tokens/s @8 in flight", m["tokens_per_s"], "tok/s", base["tokens_per_s"])
        add("ttft p50 @8 in flight", statistics.median(m["load_ttft"]), "ms", statistics.median(base["load_ttft"]))
        equal = sum(a == b for a, b in zip(m["outputs"], base["outputs"]))
        add("outputs equal to colocated", equal, f"of {len(base['outputs'])}", None)
    print(f"bench vllm: server logs in {logs}")
    return results
