"""Logprobs and token choice from exact logits, reproducible in any process.

The logits arrive exact (see :mod:`pdgrpc.engine.exact`), and everything here is
elementwise, an exact integer sum, or scalar Python math, so the same logits and
parameters give the same token and the same logprob bits everywhere.

Seeded sampling draws one 64-bit number per sampled token from a keyed hash of
``(seed, position)`` -- position being the index of the token being sampled in the full
sequence. No generator state travels between processes: the prefill (which samples the
first token at ``position = len(prompt)``) and a decode on another machine (every later
position) draw exactly what a colocated run would.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import torch

from pdgrpc.engine.base import SampledToken, SamplingParams
from pdgrpc.engine.exact import exp_nonpos

__all__ = ["draw_u64", "sample_rows"]

_WEIGHT_FRAC = 40  # probabilities as multiples of 2**-40: sums over <= 2**12 ids stay exact
_WEIGHT_SCALE = float(2**_WEIGHT_FRAC)


def draw_u64(seed: int, position: int) -> int:
    """The uniform 64-bit draw for the token sampled at ``position`` under ``seed``."""
    key = seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"pdgrpc-sample").digest(), "little")


def _f32(x: float) -> float:
    return float(np.float32(x))


def _exp_weights(z: torch.Tensor) -> torch.Tensor:
    """``round(exp(z) * 2**40)`` as int64 for ``z <= 0``."""
    return torch.round(exp_nonpos(z) * _WEIGHT_SCALE).to(torch.int64)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax of float64 logits ``[rows, vocab]``."""
    m = logits.amax(dim=-1, keepdim=True)
    totals = _exp_weights(logits - m).sum(dim=-1).tolist()  # exact integer sums
    # log of the (exact) sum in scalar libm, one value per row.
    lse = torch.tensor([[math.log(t) - _WEIGHT_FRAC * math.log(2.0)] for t in totals], dtype=torch.float64)
    return logits - (m + lse)


def _choose(logits: torch.Tensor, order: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Seeded draw from the temperature/top-k/top-p distribution of one row."""
    m = logits.max()
    weights = _exp_weights((logits - m) / params.temperature)[order]  # most likely first
    if params.top_k:
        weights = weights[: params.top_k]
    cum = torch.cumsum(weights, dim=0)
    if params.top_p < 1.0:
        # Keep the shortest prefix whose mass reaches top_p (at least one token).
        before = cum - weights
        keep = int((before.to(torch.float64) < params.top_p * float(cum[-1])).sum())
        cum = cum[: max(1, keep)]
    total = int(cum[-1])
    if total == 0:  # every weight rounded to 0: only possible at extreme temperatures
        return int(order[0])
    u = draw_u64(params.seed, position) % total
    j = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.int64), right=True))
    return int(order[j])


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[SampledToken]:
    """One :class:`SampledToken` per row of float64 ``logits`` ``[rows, vocab]``; row ``i``
    is sampled for the token at ``positions[i]`` with ``params[i]``."""
    logprobs = _log_softmax(logits)
    # Most likely first; a stable sort keeps equal logits in id order.
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    out = []
    for i, (p, pos) in enumerate(zip(params, positions)):
        token = int(order[i, 0]) if p.temperature == 0.0 else _choose(logits[i], order[i], p, pos)
        top = order[i, : p.top_logprobs].tolist()
        lp = logprobs[i]
        out.append(
            SampledToken(
                token_id=token,
                logprob=_f32(float(lp[token])),
                top_ids=tuple(top),
                top_logprobs=tuple(_f32(float(lp[t])) for t in top),
            )
        )
    return out
