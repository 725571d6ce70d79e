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

The two sides run interleaved, round by round, ``--repeats`` rounds. Each case's main
row is the best of the rounds on each side: on a shared host the least disturbed run is
the one that measures the code, and both sides get the same chance at it. Three more
rows per case give the ratio round by round (``round ratio p50/min/max``: each round's
two sides ran back to back, so they saw about the same load) -- the spread says how far
the host's load moved the result. The ratio is pdgrpc / transformers (> 1: pdgrpc is
faster). Needs ``transformers`` (the test extra).
"""

from __future__ import annotations

import argparse
import statistics
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
    p.add_argument("--repeats", type=int, default=5, help="rounds per case, the two sides interleaved (default: %(default)s)")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rows(case: str, best: dict[str, float], rounds: dict[str, list[float]], work: float) -> list[Result]:
    """The best-of row and the per-round ratio rows of one case: each side's best seconds
    and its seconds round by round, for ``work`` tokens."""
    best_ours, best_hf = work / best["ours"], work / best["hf"]
    ratios = sorted(h / o for o, h in zip(rounds["ours"], rounds["hf"]))
    return [
        Result(case, "tokens/s", best_ours, "tok/s", best_hf, best_ours / best_hf),
        Result(case, "round ratio p50", statistics.median(ratios), "x"),
        Result(case, "round ratio min", ratios[0], "x"),
        Result(case, "round ratio max", ratios[-1], "x"),
    ]


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
    rounds: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(args.repeats):
        rounds["ours"].append(_timed(ours_prefill))
        rounds["hf"].append(_timed(lambda: hf_generate(prompt, 1)))
    best = {side: min(times) for side, times in rounds.items()}
    results += _rows(f"prefill {args.prompt_tokens} tokens", best, rounds, args.prompt_tokens)

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
        # Decode time: a run of --new-tokens tokens minus a run of one. Best: each side's
        # best full run minus its best one-token run; per round: that round's full run
        # minus the best one-token run (a round's own short run, disturbed, could exceed
        # its full run on a loaded host).
        full: dict[str, list[float]] = {"ours": [], "hf": []}
        first: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.repeats):
            for side, fn in (("ours", ours), ("hf", theirs)):
                full[side].append(_timed(lambda: fn(args.new_tokens)))
                first[side].append(_timed(lambda: fn(1)))
        best = {side: max(min(full[side]) - min(first[side]), 1e-9) for side in full}
        per_round = {side: [max(f - min(first[side]), 1e-9) for f in full[side]] for side in full}
        results += _rows(f"decode b{b}", best, per_round, b * (args.new_tokens - 1))
    if tmp is not None:
        tmp.cleanup()
    return results
