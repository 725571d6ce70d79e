"""The forward pass of a Llama-family decoder over pdgrpc's paged KV pool.

Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) share it: embedding
-> layers of [RMSNorm -> attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP ->
residual] -> RMSNorm -> LM head. Numerics follow ``transformers``: RMSNorm in float32 and
cast back, RoPE tables in float32 (``llama3`` and ``linear`` scaling included), attention
through ``scaled_dot_product_attention``, matmuls in the model dtype. On CPU the kernels
differ, not the arithmetic: projections run through oneDNN (:mod:`~pdgrpc.engine.hf.linear`)
and a float32 prompt of 128+ tokens in one chunk attends by oneDNN matmuls in query
blocks (:mod:`~pdgrpc.engine.hf.attention`).

Attention reads K/V back from the pool (HND pages: ``[page, kv_head, row, head_dim]``),
so what a transfer moved is exactly what decode attends to. One call per layer gathers
every page of every request of the batch; a whole prompt in one chunk attends to its own
fresh K/V (causal), skipping the gather.

Tensor parallelism: a rank holds its query heads, KV heads and MLP columns; the
attention-output and MLP-down projections give partial sums that ``all_reduce`` adds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F

from pdgrpc.engine.hf import attention
from pdgrpc.engine.hf.config import HFConfig
from pdgrpc.engine.hf.linear import Linear, make_linear
from pdgrpc.engine.hf.weights import ModelWeights

__all__ = ["AllReduce", "Batch", "HFModel", "rope_inv_freq"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def rope_inv_freq(c: HFConfig) -> torch.Tensor:
    """float32 inverse frequencies ``[head_dim / 2]``, scaled as ``rope_scaling`` says."""
    d = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    s = c.rope_scaling
    if s.rope_type == "linear":
        return inv / s.factor
    if s.rope_type != "llama3":
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A forward pass: either one prefill chunk (``B == 1``, ``T`` tokens from position
    ``start``) or a decode step (``B`` requests, one token each).

    ``page_table`` ``[B, P]`` holds each request's pages (padded with its first page);
    ``positions`` ``[T]``; ``seq_lens`` ``[B]`` (tokens in the cache after the pass).
    """

    page_table: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    start: int  # prefill: first position of the chunk; decode: -1
    write_pages: torch.Tensor  # [T] page of each new token
    write_rows: torch.Tensor  # [T] row in that page


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer's weights as the forward pass uses them: norms as tensors, projections
    as :class:`~pdgrpc.engine.hf.linear.Linear` (laid out for their kernel)."""

    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class HFModel:
    """One TP rank of the model, computing over the pool tensors it is given.

    It keeps the weights it is built from only in the layout its kernels want
    (:func:`~pdgrpc.engine.hf.linear.make_linear`): the caller drops ``w`` after."""

    def __init__(
        self, c: HFConfig, w: ModelWeights, max_positions: int, device: torch.device, tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        self.c = c
        self.embed, self.norm = w.embed, w.norm
        # A tied head shares the embedding's memory: it stays a plain tensor (no second copy).
        self.lm_head = Linear(w.lm_head, None) if w.lm_head is w.embed else make_linear(w.lm_head)
        self.layers = tuple(
            _Layer(
                input_norm=lw.input_norm, qkv=make_linear(lw.qkv, lw.qkv_bias), q_norm=lw.q_norm, k_norm=lw.k_norm,
                o=make_linear(lw.o), post_norm=lw.post_norm, gate_up=make_linear(lw.gate_up), down=make_linear(lw.down),
            )
            for lw in w.layers
        )
        self.hq, self.hkv, self.d = c.num_heads // tp_size, c.num_kv_heads // tp_size, c.head_dim
        self.all_reduce: AllReduce = all_reduce or (lambda t: t)
        self.dtype = w.embed.dtype
        self.device = device
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(c)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=self.dtype)
        self.sin = emb.sin().to(device=device, dtype=self.dtype)
        self.scale = c.head_dim**-0.5
        # One-shot prefill attention by oneDNN in query blocks where it applies (CPU float32).
        self.tri: torch.Tensor | None = None
        if attention.usable(device, self.dtype):
            self.tri = torch.ones(attention.BLOCK, attention.BLOCK, dtype=torch.bool, device=device).triu(1)[:, None, :]
        self.eps = c.rms_norm_eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, tokens: torch.Tensor, batch: Batch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor:
        """Write the KV of ``tokens`` into the pools; float32 logits of ``rows`` (None: all)."""
        hq, hkv, d = self.hq, self.hkv, self.d
        T = tokens.shape[0]
        cos = self.cos[batch.positions][:, None, :]
        sin = self.sin[batch.positions][:, None, :]
        one_shot = batch.start == 0 and self.c.sliding_window is None  # the whole prompt in this chunk
        mask = None if one_shot else self._mask(batch, k_pool[0].shape[2])
        # Pool rows (page * hkv + head) to gather, request by request, head by head, page by page.
        heads = torch.arange(hkv, device=self.device)
        kv_rows = (batch.page_table[:, None, :] * hkv + heads[None, :, None]).reshape(-1)
        x = self.embed[tokens]
        for li, lw in enumerate(self.layers):
            h = self._norm(x, lw.input_norm)
            qkv = lw.qkv(h)
            q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
            q, k, v = q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)
            if lw.q_norm is not None and lw.k_norm is not None:
                q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k_pool[li][batch.write_pages, :, batch.write_rows, :] = k
            v_pool[li][batch.write_pages, :, batch.write_rows, :] = v
            if one_shot and self.tri is not None and T >= attention.MIN_TOKENS:
                attn = attention.causal_attention(q, k, v, self.scale, self.tri)
            elif one_shot:
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    is_causal=True, scale=self.scale, enable_gqa=True,
                )[0].transpose(0, 1).reshape(T, hq * d)
            else:
                attn = self._paged_attention(q, batch, k_pool[li], v_pool[li], mask, kv_rows)
            x = x + self.all_reduce(lw.o(attn))
            h = self._norm(x, lw.post_norm)
            gate, up = lw.gate_up(h).chunk(2, dim=-1)
            x = x + self.all_reduce(lw.down(F.silu(gate) * up))
        if rows is not None:
            x = x[rows]
        return self.lm_head(self._norm(x, self.norm)).float()

    def _mask(self, batch: Batch, page_size: int) -> torch.Tensor:
        """``[B, 1, N, L]`` bool: which cached keys each new token attends to."""
        B, P = batch.page_table.shape
        key_pos = torch.arange(P * page_size, device=self.device)
        qpos = batch.positions.view(B, -1)  # [B, N]
        mask = key_pos[None, None, :] <= qpos[:, :, None]
        if self.c.sliding_window is not None:
            mask &= key_pos[None, None, :] > qpos[:, :, None] - self.c.sliding_window
        return mask[:, None]

    def _paged_attention(self, q: torch.Tensor, batch: Batch, k_pool: torch.Tensor, v_pool: torch.Tensor, mask: torch.Tensor | None, kv_rows: torch.Tensor) -> torch.Tensor:
        B, P = batch.page_table.shape
        T = q.shape[0]
        N = T // B
        hkv, g, d = self.hkv, self.hq // self.hkv, self.d
        # One contiguous gather per pool: (page, head) blocks of S rows, in the order
        # [request, head, page], which is [B, hkv, P * S, d] as it lands (no second copy).
        S = k_pool.shape[2]
        k = k_pool.view(-1, S, d).index_select(0, kv_rows).view(B, hkv, P * S, d)
        v = v_pool.view(-1, S, d).index_select(0, kv_rows).view(B, hkv, P * S, d)
        if N == 1:
            # Decode: a KV group's query heads attend to the same keys under the same mask,
            # so they go in as that group's query rows (no GQA broadcast of K/V).
            qg = q.view(B, hkv, g, d)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
            return out.reshape(T, self.hq * d)
        qb = q.view(B, N, self.hq, d).transpose(1, 2)  # [B, hq, N, d]
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(T, self.hq * d)
