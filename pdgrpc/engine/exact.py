"""Exact, order-independent arithmetic for the reference model.

Why
---
Disaggregated decode must produce *exactly* the colocated tokens. Ordinary float
kernels do not promise that: a CPU matmul may pick another blocking (another summation
order) for 1 row than for 7, for 2 threads than for 1; a vectorised ``exp`` may differ by
an ulp from the scalar code that handles a tensor's tail; a TP all-reduce adds partial
sums in another order than one matmul would. Any of these flips a near-tie argmax now and
then, and one flipped token changes everything after it.

How
---
Every value that is ever *summed* is a fixed-point number: an integer times a power of
two, carried in float64. Sums of such numbers are exact as long as the integers stay
below 2**53, and exact sums do not depend on order -- not on the batch, the chunk, the
thread count, the BLAS, or how TP splits a reduction. The bounds are checked where the
formats are chosen (see the constants and :class:`~pdgrpc.engine.model.ModelConfig`).

Everything else is elementwise and built only from IEEE operations that are correctly
rounded wherever they run (``+ - * /``, ``sqrt``, ``round``, ``floor``, comparisons):
those give the same bits for an element whatever its position in the tensor. ``exp``
is therefore computed here (:func:`exp_nonpos`) instead of with ``torch.exp``, and the
attention softmax reads a precomputed table (:func:`softmax_weights`).

Formats (value = integer * 2**-frac, |value| <= limit):

======================  ====  =======  ======================================
what                    frac  limit    integer bound
======================  ====  =======  ======================================
activations (``ACT``)   12    2**8     2**20
weights                 per   127 ulp  2**7 (see ``pdgrpc.engine.model``)
attention weights       16    1        2**16
logit exps              40    1        2**40
======================  ====  =======  ======================================

A matmul of activations by weights over ``k <= 2**12`` terms stays below 2**39; RMSNorm's
sum of squares below 2**52; ``q . k`` below 2**48 for head dims <= 2**8; attention weights
times values below 2**52 for contexts <= 2**16 tokens.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "ACT_FRAC",
    "ACT_LIMIT",
    "ATTN_FRAC",
    "KVFormat",
    "exp_nonpos",
    "kv_format",
    "quantize",
    "rmsnorm",
    "silu",
    "softmax_weights",
]

ACT_FRAC = 12
ACT_LIMIT = 2.0**8
ATTN_FRAC = 16  # attention weights are multiples of 2**-16 in [0, 1]


def quantize(x: torch.Tensor, frac: int = ACT_FRAC, limit: float = ACT_LIMIT) -> torch.Tensor:
    """Round to the nearest multiple of ``2**-frac`` (ties to even) and clamp to ``±limit``.
    Both scalings are by powers of two, so only the rounding changes the value."""
    scale = float(2**frac)
    bound = math.floor(limit * scale)
    return torch.clamp(torch.round(x * scale), -bound, bound) / scale


class KVFormat:
    """The fixed-point grid K and V are stored on, chosen so the KV dtype holds it exactly:
    an integer of at most ``significand bits`` bits times ``2**-frac``."""

    def __init__(self, frac: int, limit: float) -> None:
        self.frac = frac
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantize(x, self.frac, self.limit)


_KV_FORMATS = {
    # float32: 24-bit significand; use the activation grid itself (integers <= 2**20).
    "float32": KVFormat(ACT_FRAC, ACT_LIMIT),
    # float16: 11-bit significand -> integers <= 2**11: step 2**-6, |x| <= 32.
    "float16": KVFormat(6, 32.0),
    # bfloat16: 8-bit significand -> integers <= 2**8: step 2**-4, |x| <= 16.
    "bfloat16": KVFormat(4, 16.0),
}


def kv_format(kv_dtype: str) -> KVFormat:
    return _KV_FORMATS[kv_dtype]


# 2**f for f in [0, 1): Taylor series of exp(f * ln 2), degree 13 (truncation < 1e-13).
_EXP2_COEFFS = [math.log(2.0) ** n / math.factorial(n) for n in range(14)]


def exp_nonpos(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for float64 ``x <= 0`` (larger inputs are clamped to 0; below -700 gives 0),
    from correctly rounded operations only, so each element's result is the same wherever
    and however it is computed. Relative error < 1e-12."""
    underflow = x < -700.0  # exp(-700) ~ 1e-304: below, 2**k would not be a normal double
    x = torch.clamp(x, min=-700.0, max=0.0)
    t = x * (1.0 / math.log(2.0))
    k = torch.floor(t)
    f = t - k  # exact: the fractional part of a double is representable
    acc = torch.full_like(f, _EXP2_COEFFS[-1])
    for c in reversed(_EXP2_COEFFS[:-1]):
        acc = acc * f  # separate ops: no fused multiply-add on any path
        acc = acc + c
    # 2**k built from its bits: biased exponent (k + 1023) in bits 52..62.
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return torch.where(underflow, 0.0, acc * two_k)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` via :func:`exp_nonpos` (float64 in, float64 out)."""
    e = exp_nonpos(-torch.abs(x))
    sig = torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return x * sig


def rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS normalisation over the last dim of an ``ACT``-grid tensor, back onto the grid.
    The sum of squares is exact (integers below 2**52), the rest elementwise."""
    ms = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    return quantize(x / torch.sqrt(ms + eps))


# Attention softmax weights: exp(-(max - score)) on a 1/256 grid of the gap, rounded to
# multiples of 2**-16. Built once with the scalar libm (deterministic), zero past ~11.8.
_GAP_STEPS = 256
_ATTN_TABLE = torch.tensor(
    [round(math.exp(-i / _GAP_STEPS) * 2**ATTN_FRAC) / 2**ATTN_FRAC for i in range(12 * _GAP_STEPS)] + [0.0],
    dtype=torch.float64,
)
assert _ATTN_TABLE[-2] == 0.0, "attention table must end in zeros"


def softmax_weights(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Unnormalised softmax weights of ``scores * scale`` along the last dim: 1.0 at each
    row's max, multiples of 2**-16 elsewhere, 0 where ``mask`` is False. Divide by the
    row sum (exact) to normalise. Rows with no unmasked entry are all zero. Works in
    place on one scratch tensor: for prefill this is the largest tensor of the model."""
    gap = torch.mul(scores, scale * _GAP_STEPS).masked_fill_(~mask, float("-inf"))
    m = gap.amax(dim=-1, keepdim=True)
    m.masked_fill_(~torch.isfinite(m), 0.0)
    # (max - s) in table steps; masked entries become +inf and clamp to the final 0 entry.
    gap.neg_().add_(m).round_().clamp_(max=len(_ATTN_TABLE) - 1)
    return _attn_table(gap.device)[gap.to(torch.int64)]


@functools.lru_cache(maxsize=8)
def _attn_table(device: torch.device) -> torch.Tensor:
    """:data:`_ATTN_TABLE` on ``device`` (the same values: copied, not recomputed)."""
    return _ATTN_TABLE.to(device)
