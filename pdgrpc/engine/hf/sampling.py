"""Token choice from float logits, robust to rounding.

The reference engine's sampler (:mod:`pdgrpc.engine.sampling`) relies on exact logits: it
reduces its 64-bit draw modulo an integer total, so a one-ulp change anywhere in a row
picks another token. A float engine's logits differ in the last bits between batch
shapes, chunkings and thread counts, so here the draw is a fraction of the probability
mass instead: ``u = draw / 2**64`` of the mass, and the token whose cumulative interval
holds ``u``. A rounding difference then changes the token only when ``u`` lies within
that difference of an interval boundary.

Same keys and the same meaning of ``temperature``, ``top_k``, ``top_p`` and
``top_logprobs`` as the reference sampler: the draw for the token at ``position`` depends
only on ``(seed, position)``; logprobs are under the model (before temperature and
cuts), rounded to float32; ties go to the lower id.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdgrpc.engine.base import SampledToken, SamplingParams
from pdgrpc.engine.sampling import draw_u64

__all__ = ["sample_float"]


def _choose(row: torch.Tensor, order: torch.Tensor, p: SamplingParams, position: int) -> int:
    z = row[order] / p.temperature  # most likely first
    w = torch.exp(z - z[0])
    if p.top_k:
        w = w[: p.top_k]
    cum = torch.cumsum(w, dim=0)
    if p.top_p < 1.0:  # the shortest prefix whose mass reaches top_p (at least one token)
        keep = int(((cum - w) < p.top_p * float(cum[-1])).sum())
        cum = cum[: max(1, keep)]
    u = draw_u64(p.seed, position) / 2.0**64 * float(cum[-1])
    j = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype), right=True))
    return int(order[min(j, cum.shape[0] - 1)])


def sample_float(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[SampledToken]:
    """One :class:`SampledToken` per row of ``logits`` ``[rows, vocab]``; row ``i`` is
    sampled for the token at ``positions[i]`` with ``params[i]``."""
    best_t = logits.argmax(dim=-1)  # first maximum: the lowest id among ties
    if all(p.temperature == 0.0 and not p.top_logprobs for p in params):
        # Greedy (the common case): no sort, no float64 copy of the vocabulary; the
        # logprob is the logit minus a float32 logsumexp (relative error ~1e-7).
        lp = logits.gather(1, best_t[:, None])[:, 0] - torch.logsumexp(logits.float(), dim=-1)
        return [SampledToken(token_id=t, logprob=v) for t, v in zip(best_t.tolist(), lp.tolist())]
    best = best_t.tolist()
    logits = logits.to(torch.float64)
    logprobs = torch.log_softmax(logits, dim=-1)
    logits, logprobs = logits.cpu(), logprobs.cpu()
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    out = []
    for i, (p, pos) in enumerate(zip(params, positions)):
        token = best[i] if p.temperature == 0.0 else _choose(logits[i], order[i], p, pos)
        top = order[i, : p.top_logprobs].tolist()
        row = logprobs[i].to(torch.float32)
        out.append(SampledToken(token, float(row[token]), tuple(top), tuple(float(row[t]) for t in top)))
    return out
