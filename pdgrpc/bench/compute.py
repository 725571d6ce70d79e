"""``python -m pdgrpc.bench compute``: a prefill worker's compute on a thread vs in a
compute process, while its event loop works.

A prefill worker's loop does Python work while a prompt computes: it answers the
decode's Handshake, opens the destination, plans the final write, writes log lines.
This bench computes the same ``--prompt-tokens`` prompts (reference engine, tiny
model, ``--chunk-size`` chunks) two ways, interleaved, while the loop runs
``--loop-work-ms`` of pure-Python work per prompt in ``--loop-bursts`` pieces spread over
the compute:

* ``thread`` (the baseline): on a thread of this process, as ``--compute-in thread``
  does;
* ``process``: in a :class:`~pdgrpc.prefill.compute_process.ComputeProcess`, as
  ``--compute-in process`` (the default) does.

It reports each way's compute time (submit to last chunk posted, p50) and the process
way as a ratio of the thread way; ``--loop-work-ms 0`` shows what the process costs when
the loop is idle (a message each way per prompt). On a host with a spare core for the
loop the process way stays at its idle time; the thread way grows by about the loop's
work, which it must wait for.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from pdgrpc.bench.report import Result

DESCRIPTION = (
    "prefill compute time on a thread of the worker (baseline) vs in a compute process, while the worker's loop "
    "runs Python work (the handshake, logs...) during each prompt"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=40, help="prompts per way (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="prompts per way before measuring (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--loop-work-ms", type=float, default=1.5,
                   help="pure-Python work the loop does per prompt, ms (default: %(default)s: what a worker's loop "
                   "measured during a 512-token prompt in the e2e bench)")
    p.add_argument("--loop-bursts", type=int, default=5, help="pieces the loop's work comes in (default: %(default)s)")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x = (x * 31 + 7) % 1000003  # interpreter work, holds the GIL like a handler does


async def _measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from pdgrpc.engine.base import PrefillRequest
    from pdgrpc.engine.malloc import keep_freed_memory
    from pdgrpc.engine.config import EngineConfig, ModelConfig
    from pdgrpc.engine.reference import ReferenceEngine
    from pdgrpc.prefill.compute_process import ComputeProcess
    from pdgrpc.serving.flags import MODEL_SIZES
    from pdgrpc.serving.threads import compute_executor

    keep = 256 << 20  # the servers' default --malloc-keep-mib
    keep_freed_memory(keep)
    n = args.prompt_tokens
    config = EngineConfig(model=ModelConfig(**MODEL_SIZES["tiny"]), page_size=16, max_seq_len=max(2048, 2 * n),
                          max_prompt_tokens=max(1024, n))
    cp = await ComputeProcess.start(config, name="bench", malloc_keep_bytes=keep)
    shared = ReferenceEngine(config, kv_pool=cp.kv)  # pages of the process way's pool
    local = ReferenceEngine(config)
    executor = compute_executor("bench-compute", 0)
    loop = asyncio.get_running_loop()
    rng = random.Random(0)
    chunk = args.chunk_size

    async def on_thread(ids: tuple[int, ...]) -> float:
        pages = local.alloc_pages(local.pages_needed(n))
        assert pages is not None
        req = PrefillRequest(ids, tuple(pages))
        t = time.perf_counter()
        fut = loop.run_in_executor(executor, lambda: [local.prefill_chunk(req, s, min(n, s + chunk)) for s in range(0, n, chunk)])
        await work(fut)
        dt = time.perf_counter() - t
        local.free_pages(pages)
        return dt

    async def in_process(ids: tuple[int, ...]) -> float:
        pages = shared.alloc_pages(shared.pages_needed(n))
        assert pages is not None
        done: asyncio.Future[float] = loop.create_future()
        t = time.perf_counter()

        def post(end: int, token: object, secs: float, err: BaseException | None) -> None:
            if err is not None and not done.done():
                done.set_exception(err)
            elif end == n and not done.done():
                done.set_result(time.perf_counter() - t)

        cp.submit(PrefillRequest(ids, tuple(pages)), chunk, 1 << 30, config.page_size, post, lambda: None)
        await work(done)
        shared.free_pages(pages)
        return done.result()

    async def work(until: "asyncio.Future[Any]") -> None:
        # The loop's work, in bursts spread over a prompt's usual compute time.
        per = args.loop_work_ms / 1e3 / max(1, args.loop_bursts)
        for _ in range(args.loop_bursts if args.loop_work_ms > 0 else 0):
            await asyncio.sleep(0.004)
            if until.done():
                break
            _busy(per)
        await until

    ways = {"thread": on_thread, "process": in_process}
    out: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for i in range(args.warmup + args.prompts):
            ids = tuple([256] + [rng.randrange(32, 127) for _ in range(n - 1)])
            order = list(ways)
            rng.shuffle(order)
            for w in order:
                dt = await ways[w](ids)
                if i >= args.warmup:
                    out[w].append(dt)
    finally:
        executor.shutdown(wait=True)
        await cp.aclose()
    return out


def run(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.rpc.server import run as run_loop

    samples = run_loop(_measure(args))
    base = statistics.median(samples["thread"]) * 1e3
    value = statistics.median(samples["process"]) * 1e3
    case = f"prefill/{args.prompt_tokens}tok/loop-{args.loop_work_ms:g}ms"
    return [
        Result(f"{case}/thread", "compute_p50", base, "ms"),
        Result(f"{case}/process", "compute_p50", value, "ms", base, value / base),
    ]
