"""``python -m pdgrpc.bench engine``: the checkpoint engine (``--model``) vs ``transformers``.

Builds a random Llama checkpoint (``--hidden-size`` 512, ``--layers`` 8 by default;
``--model PATH`` uses one on disk) and measures, with the same dtype and torch threads,
side by side in one run:

* ``prefill``: tokens/s of a ``--prompt-tokens`` prompt (1,024) -- pdgrpc's prefill of the
  whole prompt (one chunk, first token sampled) vs ``generate(max_new_tokens=1)``;
* ``decode bN``: generated tokens/s at batch 1 and batch 16 (``--batches``) -- pdgrpc's
  colocated generation (paged KV, continuous batching) vs ``generate()`` on a batch of
  equal-length prompts; each side's time for ``--new-tokens`` tokens minus its time for
  one token, so the prompts' prefill cancels out.

Each time is the best of ``--repeats`` runs, the two sides interleaved run by run: on a
shared host the least disturbed run is the one that measures the code, and both sides
get the same chance at it. The ratio is pdgrpc / transformers (> 1: pdgrpc is faster).
Needs ``transformers`` (the test extra).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from typing import Any, Callable

from pdgrpc.bench.report import Result

DESCRIPTION = "checkpoint engine (--model) vs transformers generate(): prefill and decode tokens/s, same dtype and threads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", metavar="PATH", help="checkpoint directory (default: build a random Llama)")
    p.add_argument("--hidden-size", type=int, default=512, help="random checkpoint: hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="random checkpoint: layers (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=8192, help="random checkpoint: vocabulary (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both (default: torch's)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prefill case: prompt length (default: %(default)s)")
    p.add_argument("--decode-prompt-tokens", type=int, default=128, help="decode cases: prompt length (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="decode cases: generated tokens (default: %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="runs per case and side; the median counts (default: %(default)s)")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> list[Result]:
    import torch
    import transformers

    from pdgrpc.engine.base import PrefillRequest, SamplingParams
    from pdgrpc.engine.colocated import generate, prefill
    from pdgrpc.engine.hf.build import build_checkpoint
    from pdgrpc.engine.hf.engine import HFEngine, HFEngineConfig
    from pdgrpc.engine.malloc import keep_freed_memory

    if args.threads:
        torch.set_num_threads(args.threads)
    # As the servers do (--malloc-keep-mib): freed temporaries stay in the heap instead of
    # page-faulting in anew every step. Process-wide, so transformers gets it too.
    keep_freed_memory(256 << 20)
    tmp = None
    path = args.model
    if not path:
        tmp = tempfile.TemporaryDirectory(prefix="pdgrpc-bench-engine-")
        h = args.hidden_size
        path = str(build_checkpoint(
            tmp.name, "llama", hidden_size=h, num_layers=args.layers, num_heads=h // 64, num_kv_heads=max(1, h // 256),
            intermediate_size=h * 11 // 4, vocab_size=args.vocab_size, init_std=0.02,
        ))
    dtype = getattr(torch, args.dtype)
    longest = max(args.prompt_tokens, args.decode_prompt_tokens + args.new_tokens) + 16
    max_batch = max(args.batches)
    pages = (max_batch + 1) * (longest // 16 + 2)
    engine = HFEngine(HFEngineConfig(path, dtype=args.dtype, num_pages=pages, max_seq_len=longest + 1, max_prompt_tokens=longest, threads=0))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    vocab = engine.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    results: list[Result] = []
    fixed = SamplingParams(ignore_eos=True)

    def hf_generate(ids: torch.Tensor, new: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)

    # prefill
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=g)
    ids = tuple(prompt[0].tolist())

    def ours_prefill() -> None:
        p = engine.alloc_pages(engine.pages_needed(len(ids)))
        assert p is not None
        try:
            prefill(engine, PrefillRequest(ids, tuple(p), fixed), len(ids))
        finally:
            engine.free_pages(p)

    ours_prefill()  # warm-up
    hf_generate(prompt, 1)
    best = {"ours": math.inf, "hf": math.inf}
    for _ in range(args.repeats):
        best["ours"] = min(best["ours"], _timed(ours_prefill))
        best["hf"] = min(best["hf"], _timed(lambda: hf_generate(prompt, 1)))
    ours_tps, hf_tps = args.prompt_tokens / best["ours"], args.prompt_tokens / best["hf"]
    results.append(Result(f"prefill {args.prompt_tokens} tokens", "tokens/s", ours_tps, "tok/s", hf_tps, ours_tps / hf_tps))

    # decode at each batch size
    for b in args.batches:
        prompts = torch.randint(0, vocab, (b, args.decode_prompt_tokens), generator=g)
        lists = [tuple(r) for r in prompts.tolist()]

        def ours(new: int) -> None:
            out = generate(engine, lists, new, fixed, prefill_chunk_tokens=args.decode_prompt_tokens)
            assert all(len(o.tokens) == new for o in out)

        def theirs(new: int) -> None:
            hf_generate(prompts, new)

        ours(2)  # warm-up
        theirs(2)
        full = {"ours": math.inf, "hf": math.inf}
        first = dict(full)
        for _ in range(args.repeats):
            for side, fn in (("ours", ours), ("hf", theirs)):
                full[side] = min(full[side], _timed(lambda: fn(args.new_tokens)))
                first[side] = min(first[side], _timed(lambda: fn(1)))
        n = b * (args.new_tokens - 1)
        ours_tps = n / max(full["ours"] - first["ours"], 1e-9)
        hf_tps = n / max(full["hf"] - first["hf"], 1e-9)
        results.append(Result(f"decode b{b}", "tokens/s", ours_tps, "tok/s", hf_tps, ours_tps / hf_tps))
    if tmp is not None:
        tmp.cleanup()
    return results
