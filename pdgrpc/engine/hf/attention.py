"""Causal self-attention of a whole prompt in one chunk (prefill's one-shot case), by
oneDNN matmuls in query blocks.

``scaled_dot_product_attention``'s CPU kernel multiplies through MKL's sgemm, which on
AMD hosts takes an AVX2 path (see :mod:`pdgrpc.engine.hf.linear`). Here each KV group's
query heads go in as rows of one matrix (``[tokens * group, head_dim]``, token-major),
and the queries go in blocks of :data:`BLOCK` tokens: a block attends to the keys up to
its last token, so the blocks above the diagonal are never computed, and only the
diagonal block is masked. Scores, softmax and output are float32 throughout (the
softmax over a whole row at once, no running rescale), within ~1e-6 of SDPA's output.
Skipping the blocks above the diagonal is why it beats SDPA on CPU for long prompts.

:func:`usable` says where it applies (CPU, float32, oneDNN present); elsewhere the model
calls SDPA with ``is_causal``, as it does for prompts under :data:`MIN_TOKENS`.
"""

from __future__ import annotations

import torch

from pdgrpc.engine.hf.linear import onednn_usable

__all__ = ["BLOCK", "MIN_TOKENS", "causal_attention", "usable"]

BLOCK = 128  # query tokens per block: large enough for oneDNN, small enough to skip most of the upper triangle
MIN_TOKENS = 128  # shorter prompts: SDPA is faster (tiny matmuls)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Float32 on a CPU with oneDNN (bf16 scores would lose what SDPA keeps in float32)."""
    return dtype == torch.float32 and onednn_usable(device, dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tri: torch.Tensor) -> torch.Tensor:
    """``q`` ``[T, hq, d]``, ``k``/``v`` ``[T, hkv, d]`` -> ``[T, hq * d]``; token ``t``
    attends to tokens ``0..t``. ``tri`` is ``[BLOCK, 1, BLOCK]`` bool, True above the diagonal."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    linear = torch.ops.mkldnn._linear_pointwise
    kh = k.transpose(0, 1).contiguous()  # [hkv, T, d]
    vh = v.transpose(0, 1).contiguous()
    qg = q.reshape(T, hkv, g, d)
    out = torch.empty(T, hkv, g, d, dtype=q.dtype, device=q.device)
    for h in range(hkv):
        rows = qg[:, h].reshape(T * g, d)  # row t * g + j: token t, the group's head j
        for s in range(0, T, BLOCK):
            e = min(T, s + BLOCK)
            n = e - s
            scores = linear(rows[s * g : e * g], kh[h, :e], None, "none", [], "").view(n, g, e)
            scores[:, :, s:].masked_fill_(tri[:n, :, :n], float("-inf"))
            p = torch.softmax(scores.mul_(scale), dim=-1).view(n * g, e)
            # V as a plain transpose: oneDNN's fast path (a column slice of a transposed
            # copy, [d, T][:, :e], falls off it).
            out[s:e, h] = linear(p, vh[h, :e].t(), None, "none", [], "").view(n, g, d)
    return out.view(T, hq * d)
