"""A plain float64 transformer over contiguous K/V, written the textbook way (torch.softmax,
torch.exp, no pages, no fixed point), from the same weights as the reference engine.

The engine's paged, exact fixed-point forward must agree with it up to the fixed-point
rounding: that is what shows the engine is the transformer it claims to be (RoPE, GQA,
causal masking, page addressing), not merely self-consistent.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pdgrpc.engine.config import ModelConfig

from pdgrpc.engine.model import build_weights


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].to(torch.float64) * inv_freq[None, :]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6)


def float_forward(cfg: ModelConfig, token_ids: Sequence[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits ``[T, vocab]`` and, per layer, K and V ``[T, kv_heads, head_dim]`` (K after RoPE)."""
    w = build_weights(cfg)
    ids = torch.tensor(list(token_ids))
    T, d, hq, hkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    x = w.embed[ids]
    kvs = []
    for lw in w.layers:
        h = rmsnorm(x)
        q = rope((h @ lw.wq.T).view(T, hq, d), pos, cfg.rope_theta)
        k = rope((h @ lw.wk.T).view(T, hkv, d), pos, cfg.rope_theta)
        v = (h @ lw.wv.T).view(T, hkv, d)
        kvs.append((k, v))
        kk = k.repeat_interleave(hq // hkv, dim=1)
        vv = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khd->qhd", p, vv).reshape(T, hq * d)
        x = x + attn @ lw.wo.T
        h = rmsnorm(x)
        x = x + (torch.nn.functional.silu(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T
    return rmsnorm(x) @ w.lm_head.T + w.lm_bias, kvs
