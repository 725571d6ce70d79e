"""The reference model: a tiny decoder-only transformer over a paged KV cache.

Architecture (Llama-shaped): token embedding -> ``num_layers`` x [RMSNorm -> grouped-query
attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM
head (+ a fixed output bias). Weights are random, drawn from ``ModelConfig.seed`` one
tensor at a time (each from its own name-derived seed, so growing the model does not
change the other tensors); nothing is downloaded.

The output bias is a character-frequency prior (English letters and spaces likely, rare
bytes unlikely). It keeps the random model's text readable in demos without changing
what the tests prove; the random weights still decide which token wins.

All arithmetic is exact fixed-point (:mod:`pdgrpc.engine.exact`): results do not depend on
batching, chunking, page indices, thread count, or how tensor parallelism splits the work.

Tensor parallelism (``tp_size`` ranks): rank ``r`` holds query heads, KV heads and MLP
columns ``[r * n / tp_size, (r + 1) * n / tp_size)`` of each; the attention output and
MLP down projections produce partial sums that an injected ``all_reduce`` adds up (exact,
so any reduction order gives the TP1 result). Embedding and LM head are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Callable

import torch

import pdgrpc.engine.exact as exact
from pdgrpc.engine.config import EngineConfig, ModelConfig
from pdgrpc.engine.tokenizer import EOS_ID

__all__ = ["AllReduce", "ModelShard", "SegmentBatch", "build_weights"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor elementwise over the TP group, returning the sum (identity for
TP=1). Must return the same value on every rank."""

# ---- weights ------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _draw_weight(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Gaussian weights of about ``std`` as 8-bit integers times a power of two, so that
    products with fixed-point activations are exact (see :mod:`pdgrpc.engine.exact`)."""
    w = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float64) * std
    e = round(math.log2(32.0 / std))  # integer std about 32, clipped at +-127 (~4 sigma)
    return torch.clamp(torch.round(w * 2.0**e), -127, 127) / 2.0**e


# Rough English byte frequencies (per mille) for the output prior.
_CHAR_FREQ = {
    " ": 180, "e": 100, "t": 72, "a": 65, "o": 60, "i": 57, "n": 56, "s": 52, "h": 50, "r": 48,
    "d": 35, "l": 33, "c": 23, "u": 23, "m": 20, "w": 19, "f": 18, "g": 16, "y": 16, "p": 15,
    "b": 12, ",": 10, ".": 10, "v": 8, "k": 6, "\n": 4, "T": 3, "A": 2, "I": 2, "S": 2,
    "'": 1, "j": 1, "x": 1, "q": 1, "z": 1,
}
_PRIOR_SHARPNESS = 0.5  # scales log-frequency: the random logits (std ~5) still dominate
_PRIOR_OTHER = -10.0  # bytes not listed: effectively never generated
_PRIOR_EOS = -8.0  # EOS: rare, but random prompts do end early now and then


def _output_prior(vocab_size: int) -> torch.Tensor:
    prior = [_PRIOR_OTHER] * vocab_size
    top = max(_CHAR_FREQ.values())
    for ch, f in _CHAR_FREQ.items():
        prior[ord(ch)] = _PRIOR_SHARPNESS * math.log(f / top)
    prior[EOS_ID] = _PRIOR_EOS
    return exact.quantize(torch.tensor(prior, dtype=torch.float64))


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """Full (unsharded) weights of one layer, ``[out, in]`` like ``nn.Linear``."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    lm_head: torch.Tensor  # [vocab, hidden]
    lm_bias: torch.Tensor  # [vocab]


@functools.lru_cache(maxsize=4)
def build_weights(cfg: ModelConfig) -> ModelWeights:
    """The full weights for ``cfg`` (cached: treat as read-only)."""
    h, d, q, kv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    layers = []
    for i in range(cfg.num_layers):
        w = functools.partial(_draw_weight, cfg.seed)
        layers.append(
            LayerWeights(
                wq=w(f"layers.{i}.wq", (q * d, h), 1 / math.sqrt(h)),
                wk=w(f"layers.{i}.wk", (kv * d, h), 1 / math.sqrt(h)),
                wv=w(f"layers.{i}.wv", (kv * d, h), 1 / math.sqrt(h)),
                wo=w(f"layers.{i}.wo", (h, q * d), 1 / math.sqrt(q * d)),
                w_gate=w(f"layers.{i}.w_gate", (inter, h), 1 / math.sqrt(h)),
                w_up=w(f"layers.{i}.w_up", (inter, h), 1 / math.sqrt(h)),
                w_down=w(f"layers.{i}.w_down", (h, inter), 1 / math.sqrt(inter)),
            )
        )
    return ModelWeights(
        # Embeddings land on the activation grid directly (their grid is coarser). A large
        # std keeps the current token audible over the averaged context, so greedy
        # decoding of this random model cycles through many tokens instead of one.
        embed=_draw_weight(cfg.seed, "embed", (cfg.vocab_size, h), 3.0),
        layers=tuple(layers),
        # Logit std about 5: the context, not the prior, picks the next token.
        lm_head=_draw_weight(cfg.seed, "lm_head", (cfg.vocab_size, h), 5.0 / math.sqrt(h)),
        lm_bias=_output_prior(cfg.vocab_size),
    )


@functools.lru_cache(maxsize=8)
def _rope_table(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_positions, head_dim / 2]`` on a 2**-14 grid, from scalar libm
    (the same bits in every process, whatever the table length)."""
    half = head_dim // 2
    inv_freq = [theta ** (-2.0 * i / head_dim) for i in range(half)]
    cos = [[math.cos(p * f) for f in inv_freq] for p in range(max_positions)]
    sin = [[math.sin(p * f) for f in inv_freq] for p in range(max_positions)]
    grid = functools.partial(exact.quantize, frac=14, limit=1.0)
    return grid(torch.tensor(cos, dtype=torch.float64)), grid(torch.tensor(sin, dtype=torch.float64))


# ---- forward ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SegmentBatch:
    """A forward pass over ``B`` segments, each a run of consecutive new tokens of one
    request (a prefill chunk, or one decode token). Tokens are flattened segment after
    segment.

    - ``page_table`` ``[B, max_pages]`` int64: each request's pages (padded with 0);
    - ``seq_lens`` ``[B]``: tokens in the cache after this pass (last position + 1);
    - ``seg_of`` / ``row_of`` ``[T]``: segment, and row within the segment, of each token;
    - ``positions`` ``[T]``: each token's position in its sequence.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    seg_of: torch.Tensor
    row_of: torch.Tensor
    positions: torch.Tensor
    max_rows: int

    def to(self, device: torch.device) -> "SegmentBatch":
        """This batch with its index tensors on ``device`` (itself on the CPU)."""
        if device.type == "cpu":
            return self
        move = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
        return dataclasses.replace(
            self, page_table=move(self.page_table), seq_lens=move(self.seq_lens), seg_of=move(self.seg_of),
            row_of=move(self.row_of), positions=move(self.positions),
        )

    @staticmethod
    def build(segments: list[tuple[list[int], int, int]]) -> "SegmentBatch":
        """From ``(pages, start_position, num_tokens)`` per segment."""
        max_pages = max(len(p) for p, _, _ in segments)
        table = torch.zeros((len(segments), max_pages), dtype=torch.int64)
        seg_of: list[int] = []
        row_of: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        for b, (pages, start, n) in enumerate(segments):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
            seg_of += [b] * n
            row_of += range(n)
            positions += range(start, start + n)
            seq_lens.append(start + n)
        as_long = functools.partial(torch.tensor, dtype=torch.int64)
        return SegmentBatch(
            table, as_long(seq_lens), as_long(seg_of), as_long(row_of), as_long(positions), max(n for *_, n in segments)
        )


@dataclasses.dataclass(frozen=True)
class _ShardLayer:
    wq_t: torch.Tensor  # [hidden, local_q * d]   (transposed: activations @ w_t)
    wk_t: torch.Tensor
    wv_t: torch.Tensor
    wo_t: torch.Tensor  # [local_q * d, hidden]
    w_gate_t: torch.Tensor
    w_up_t: torch.Tensor
    w_down_t: torch.Tensor


class ModelShard:
    """One TP rank's slice of the model, computing over paged K/V pool tensors.

    Its sizes (the model, ``max_seq_len`` positions, the TP rank) come from an
    :class:`EngineConfig` and nowhere else: that configuration refuses the sizes a shard
    cannot take when it is built, so the shard checks none of them."""

    def __init__(self, config: EngineConfig, all_reduce: AllReduce | None = None, device: torch.device = torch.device("cpu")) -> None:
        cfg, tp_rank, tp_size = config.model, config.tp_rank, config.tp_size
        self.cfg = cfg
        self.all_reduce: AllReduce = all_reduce or (lambda t: t)
        self.local_heads = cfg.num_heads // tp_size
        # This rank computes the KV heads its pool holds (EngineConfig.kv_layout), so the
        # weights' slice and the pool's cannot disagree.
        kv = config.kv_layout()
        self.local_kv_heads = kv.local_kv_heads
        weights = build_weights(cfg)
        d = cfg.head_dim
        qs = slice(tp_rank * self.local_heads * d, (tp_rank + 1) * self.local_heads * d)
        ks = slice(kv.head_start * d, kv.head_end * d)
        n_inter = cfg.intermediate_size // tp_size
        ms = slice(tp_rank * n_inter, (tp_rank + 1) * n_inter)

        self.device = device

        def t(w: torch.Tensor) -> torch.Tensor:  # stored transposed: activations @ w_t
            return w.t().contiguous().to(device)

        self.layers = [
            _ShardLayer(t(lw.wq[qs]), t(lw.wk[ks]), t(lw.wv[ks]), t(lw.wo[:, qs]), t(lw.w_gate[ms]), t(lw.w_up[ms]), t(lw.w_down[:, ms]))
            for lw in weights.layers
        ]
        self.embed = weights.embed.to(device)
        self.lm_head_t = t(weights.lm_head)
        self.lm_bias = weights.lm_bias.to(device)
        cos, sin = _rope_table(d, cfg.rope_theta, config.max_seq_len)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.inv_sqrt_d = 1.0 / math.sqrt(d)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, d]`` by position (halves layout); exact products."""
        c = self.cos[positions][:, None, :]
        s = self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def forward(self, tokens: torch.Tensor, batch: SegmentBatch, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], kv_quant: exact.KVFormat, logits_rows: torch.Tensor) -> torch.Tensor:
        """Write the KV of ``tokens`` (``[T]``, positions per ``batch``) into the pools
        and return float64 logits ``[len(logits_rows), vocab]`` for the chosen rows."""
        cfg = self.cfg
        d, hq, hkv = cfg.head_dim, self.local_heads, self.local_kv_heads
        T = tokens.shape[0]
        page_size = k_pool[0].shape[2]
        write_pages = batch.page_table[batch.seg_of, batch.positions // page_size]
        write_rows = batch.positions % page_size
        x = self.embed[tokens]  # [T, hidden] on the activation grid
        for li, lw in enumerate(self.layers):
            h = exact.rmsnorm(x)
            q = self._rope(exact.quantize(h @ lw.wq_t).view(T, hq, d), batch.positions)
            k = self._rope(exact.quantize(h @ lw.wk_t).view(T, hkv, d), batch.positions)
            v = exact.quantize(h @ lw.wv_t).view(T, hkv, d)
            # Attention reads back exactly what the pool stores (what a transfer moves).
            k_pool[li][write_pages, :, write_rows, :] = kv_quant(k).to(k_pool[li].dtype)
            v_pool[li][write_pages, :, write_rows, :] = kv_quant(v).to(v_pool[li].dtype)
            attn = self._attention(exact.quantize(q), batch, k_pool[li], v_pool[li])
            x = exact.quantize(x + self.all_reduce(attn @ lw.wo_t))
            h = exact.rmsnorm(x)
            act = exact.quantize(exact.silu(h @ lw.w_gate_t) * (h @ lw.w_up_t))
            x = exact.quantize(x + self.all_reduce(act @ lw.w_down_t))
        h = exact.rmsnorm(x[logits_rows])
        logits: torch.Tensor = h @ self.lm_head_t + self.lm_bias
        return logits

    def _attention(self, q: torch.Tensor, batch: SegmentBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """Causal GQA over each segment's pages. ``q`` ``[T, hq, d]`` -> ``[T, hq * d]``."""
        B, N = batch.page_table.shape[0], batch.max_rows
        _, hkv, page_size, d = k_pool.shape
        group = q.shape[1] // hkv
        L = batch.page_table.shape[1] * page_size
        dev = q.device
        key_pos = torch.arange(L, device=dev)
        in_seq = key_pos[None, :] < batch.seq_lens[:, None]  # [B, L]
        stale = ~in_seq[:, None, :, None]

        def gather(pool: torch.Tensor) -> torch.Tensor:
            """Each request's pages as [B, hkv, L, d] float64. Rows past a request's
            length hold stale bytes (maybe NaN from another request): zeroed."""
            g = pool[batch.page_table].permute(0, 2, 1, 3, 4).reshape(B, hkv, L, d)
            return g.masked_fill_(stale, 0.0).to(torch.float64)

        k, v = gather(k_pool), gather(v_pool)
        # Queries padded to [B, N] so every segment is one batched matmul.
        qp = torch.zeros((B, N, q.shape[1], d), dtype=torch.float64, device=dev)
        qp[batch.seg_of, batch.row_of] = q
        qpos = torch.full((B, N), -1, dtype=torch.int64, device=dev)
        qpos[batch.seg_of, batch.row_of] = batch.positions
        # Query heads sharing a KV head become extra rows: [B, hkv, group * N, d], so each
        # matmul is a plain batched one over (request, KV head) with no broadcast copies.
        qg = qp.view(B, N, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, group * N, d)
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, hkv, group * N, L], exact
        mask = (key_pos[None, None, :] <= qpos[:, :, None]) & in_seq[:, None, :]  # [B, N, L]
        mask = mask[:, None].expand(B, group, N, L).reshape(B, 1, group * N, L)
        w = exact.softmax_weights(scores, mask, self.inv_sqrt_d)
        out = torch.matmul(w, v) / w.sum(dim=-1, keepdim=True).clamp(min=1.0)
        out = exact.quantize(out).view(B, hkv, group, N, d)
        out = out.permute(0, 3, 1, 2, 4).reshape(B, N, hkv * group * d)
        return out[batch.seg_of, batch.row_of]
