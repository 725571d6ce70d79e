"""Start-up sizes a checkpoint decides when the flags leave them unset.

- ``--max-seq-len``: the checkpoint's ``max_position_embeddings``, capped (to whole pages)
  so that one sequence's KV fits in the KV budget;
- ``--max-prompt-tokens``: the reference engine's default for that length
  (:func:`~pdgrpc.engine.config.default_max_prompt_tokens`);
- ``--num-pages``: room for two full-length sequences (or many shorter ones), capped by the
  KV budget and never under one full-length sequence.

The KV budget is :data:`KV_MEMORY_FRACTION` of the memory left after this process's
weights: ``MemAvailable`` for ``cpu``, the device's free memory for ``cuda``. Several
engine processes usually share a host (prefill, decode, their TP ranks), so one takes a
fraction, not all. :class:`Sizing` says what each part weighs, for the start-up log.

Torch-free: the prefill controller sizes its workers without loading torch.
"""

from __future__ import annotations

import dataclasses
import math

from pdgrpc.engine.config import check_tp_divides, default_max_prompt_tokens
from pdgrpc.engine.hf.config import HFConfig
from pdgrpc.errors import ConfigError

__all__ = ["DTYPE_BYTES", "KV_MEMORY_FRACTION", "Sizing", "available_memory", "checkpoint_sizing"]

KV_MEMORY_FRACTION = 0.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # --dtype
_GB = 1e9


def available_memory(device: str) -> int | None:
    """Bytes free for a new allocation on ``device`` (None: unknown)."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def weight_bytes(c: HFConfig, dtype_bytes: int, tp_size: int) -> int:
    """This rank's weights in bytes: embedding and LM head whole, the layers' share."""
    h, d, n = c.hidden_size, c.head_dim, c.num_layers
    layer = 2 * h + (c.num_heads + 2 * c.num_kv_heads) * d * h + c.num_heads * d * h + 3 * c.intermediate_size * h
    if c.qkv_bias:
        layer += (c.num_heads + 2 * c.num_kv_heads) * d
    if c.qk_norm:
        layer += 2 * d
    embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    return dtype_bytes * (embed + n * layer // tp_size)


@dataclasses.dataclass(frozen=True)
class Sizing:
    max_seq_len: int
    max_prompt_tokens: int
    num_pages: int
    page_size: int
    weights_bytes: int
    kv_bytes_per_token: int
    available_bytes: int | None
    capped: bool  # max_seq_len is under max_position_embeddings for lack of memory

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    def describe(self) -> str:
        free = "unknown" if self.available_bytes is None else f"{self.available_bytes / _GB:.2f} GB"
        return (
            f"weights {self.weights_bytes / _GB:.2f} GB + KV pool {self.kv_bytes / _GB:.2f} GB "
            f"({self.num_pages} pages of {self.page_size} tokens, {self.kv_bytes_per_token / 1024:.1f} KiB per token) "
            f"= {(self.weights_bytes + self.kv_bytes) / _GB:.2f} GB per process; max-seq-len {self.max_seq_len}"
            f"{' (capped by memory)' if self.capped else ''}, max-prompt-tokens {self.max_prompt_tokens}; "
            f"memory available at start {free}"
        )


def checkpoint_sizing(
    c: HFConfig,
    *,
    dtype_bytes: int,
    page_size: int,
    tp_size: int = 1,
    max_seq_len: int | None = None,
    max_prompt_tokens: int | None = None,
    num_pages: int | None = None,
    available: int | None = None,
) -> Sizing:
    """The sizes for ``c``: the given ones kept, the others derived (see the module doc).
    A ``tp_size`` that does not divide ``c``'s heads and MLP width is refused as the rule of
    :class:`~pdgrpc.engine.hf.engine.HFEngineConfig`, the configuration these sizes are for."""
    if page_size <= 0:
        raise ConfigError(f"--page-size must be a positive int, got {page_size}")
    tp = max(1, tp_size)
    check_tp_divides("HFEngineConfig", tp, c)  # a rank's share of the KV heads sizes its pool
    per_token = 2 * c.num_layers * (c.num_kv_heads // tp) * c.head_dim * dtype_bytes
    weights = weight_bytes(c, dtype_bytes, tp)
    budget = None if available is None else int(KV_MEMORY_FRACTION * max(0, available - weights))
    capped = False
    if max_seq_len is None:
        max_seq_len = c.max_position_embeddings
        if budget is not None and budget // per_token < max_seq_len:
            fits = budget // per_token // page_size * page_size
            if fits < 2 * page_size:
                raise ConfigError(
                    f"{c.config_file}: not enough memory for the KV of one sequence: {budget / _GB:.2f} GB of KV budget "
                    f"({KV_MEMORY_FRACTION:.0%} of {available / _GB if available else 0:.2f} GB available less "
                    f"{weights / _GB:.2f} GB of weights); pass --max-seq-len and --num-pages"
                )
            max_seq_len, capped = fits, True
    if max_prompt_tokens is None:
        max_prompt_tokens = default_max_prompt_tokens(max_seq_len)
    if num_pages is None:
        one = math.ceil(max_seq_len / page_size)
        num_pages = 2 * one
        if budget is not None:
            num_pages = max(one, min(num_pages, budget // (per_token * page_size)))
    return Sizing(max_seq_len, max_prompt_tokens, num_pages, page_size, weights, per_token, available, capped)
