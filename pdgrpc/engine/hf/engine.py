""":class:`HFEngine`: a Hugging Face decoder checkpoint as an :class:`~pdgrpc.engine.base.Engine`.

The KV pool is pdgrpc's HND paged layout in the model dtype (``--dtype``); prefill is
chunked, decode batched, as with the reference engine. The model identity in the
compatibility hash is the architecture, ``config.json``'s digest and a digest of the
weights' metadata (:func:`~pdgrpc.engine.hf.weights.weights_digest`), with the checkpoint's
directory name for people.

Determinism: sampling draws are keyed by seed and position, as in the reference engine,
but taken as a fraction of the probability mass (:mod:`pdgrpc.engine.hf.sampling`). The
float compute is not bit-identical across batch shapes, chunkings and thread counts (BLAS
picks kernels by shape), so two runs of a request agree token for token unless a choice
lies within rounding of a boundary: two greedy candidates' logits within ~1e-6 of each
other in float32 (~1e-2 in bf16/fp16), or a draw that close to a cumulative boundary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch

from pdgrpc.engine.base import DecodeRequest, Engine, InvalidRequest, KVBuffers, PrefillRequest, SampledToken
from pdgrpc.device import ChunkReady, chunk_ready_on, resolve_device
from pdgrpc.engine.config import DEFAULT_MAX_PROMPT_TOKENS, check_sizes, check_tp_divides
from pdgrpc.engine.hf.config import HFConfig, load_config
from pdgrpc.engine.hf.model import AllReduce, Batch, HFModel
from pdgrpc.engine.hf.tokenizer import HFTokenizer
from pdgrpc.engine.hf.weights import load_weights, weights_digest
from pdgrpc.engine.layout import KVLayout, kv_dtype_from_name
from pdgrpc.engine.pages import FifoPageAllocator
from pdgrpc.engine.pooled import PooledEngine
from pdgrpc.engine.hf.sampling import sample_float
from pdgrpc.errors import ConfigError

__all__ = ["HFEngine", "HFEngineConfig"]


@dataclasses.dataclass(frozen=True)
class HFEngineConfig:
    model: str  # checkpoint directory
    dtype: str = "float32"  # weights, activations and KV pool
    device: str = "cpu"
    page_size: int = 16
    num_pages: int = 1024
    max_seq_len: int = 4096
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    tp_rank: int = 0
    tp_size: int = 1
    # torch intra-op threads, set process-wide at construction (0: leave torch's setting).
    # 1 like the reference engine: several server processes share a host's cores, and
    # OpenMP threads of oversubscribed processes spin-wait each other, and a loaded
    # host's forwards then crawl.
    threads: int = 1

    def __post_init__(self) -> None:
        kv_dtype_from_name(self.dtype)
        check_sizes(self)  # every engine configuration's rules on its sizes, as EngineConfig's
        resolve_device(self.device)


def check_checkpoint(config: HFEngineConfig) -> HFConfig:
    """Everything start-up refuses, without loading the weights: config, tokenizer, the
    weights' names and shapes, TP divisibility, context length. A rule between ``config``
    and the checkpoint is raised as :meth:`ConfigError.broken_rule` of HFEngineConfig's,
    calling the checkpoint's own fields ``model.<field>``."""
    from pdgrpc.engine.hf.weights import check_weights

    c = load_config(config.model)
    check_tp_divides(type(config).__name__, config.tp_size, c)
    HFTokenizer(c)
    check_weights(c)
    if config.max_seq_len > c.max_position_embeddings:
        fields = {"max_seq_len": config.max_seq_len, "model.max_position_embeddings": c.max_position_embeddings}
        raise ConfigError.broken_rule(type(config).__name__, "{0} {0.value} exceeds {1} = {1.value}", fields)
    return c


class HFEngine(PooledEngine):
    """One TP rank of a checkpoint. ``all_reduce`` sums partial results over the TP group."""

    config: HFEngineConfig

    def __init__(self, config: HFEngineConfig, all_reduce: AllReduce | None = None) -> None:
        if config.tp_size > 1 and all_reduce is None:
            raise ConfigError(f"HFEngine: tp_size={config.tp_size} needs an all_reduce")
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        c = check_checkpoint(config)
        self.device = resolve_device(config.device)
        dtype = kv_dtype_from_name(config.dtype)
        self._tokenizer = HFTokenizer(c)
        self._model_id = f"hf:{c.architecture}:{c.path.name}:config={c.digest[:16]}:weights={weights_digest(c)[:16]}"
        weights = load_weights(c, dtype, self.device, config.tp_rank, config.tp_size)
        self._model = HFModel(c, weights, config.max_seq_len, self.device, config.tp_size, all_reduce)
        local_kv = c.num_kv_heads // config.tp_size
        self._layout = KVLayout(
            num_layers=c.num_layers, num_pages=config.num_pages, page_size=config.page_size,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, kv_dtype=config.dtype,
            head_start=config.tp_rank * local_kv, head_end=(config.tp_rank + 1) * local_kv,
        )
        shape = self._layout.pool_shape
        self._k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self._pages = FifoPageAllocator(config.num_pages)

    # ---- identity and layout ----------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    # ---- compute --------------------------------------------------------------------------

    def _check_pages(self, pages: Sequence[int], num_tokens: int, field: str) -> list[int]:
        need = self.pages_needed(num_tokens)
        used = list(pages[:need])
        if len(used) < need:
            raise InvalidRequest(f"{field}: {num_tokens} tokens need {need} pages of {self._layout.page_size}, got {len(pages)}")
        n = self._layout.num_pages
        if not all(isinstance(p, int) and 0 <= p < n for p in used):
            bad = next(p for p in used if not (isinstance(p, int) and 0 <= p < n))
            raise InvalidRequest(f"{field}: page {bad!r} outside the pool [0, {n})")
        if len(set(used)) != need:
            raise InvalidRequest(f"{field}: page indices repeat")
        return used

    def _long(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def prefill_chunk(self, request: PrefillRequest, start: int, end: int) -> SampledToken | None:
        ids = request.token_ids
        self.validate_request(ids, 1)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(ids)):
            raise InvalidRequest(f"prefill_chunk: need 0 <= start < end <= {len(ids)}, got start={start!r}, end={end!r}")
        pages = self._check_pages(request.pages, len(ids), "pages")[: self.pages_needed(end)]
        S = self._layout.page_size
        positions = torch.arange(start, end, dtype=torch.int64, device=self.device)
        table = self._long([pages])
        batch = Batch(table, positions, self._long([end]), start, table[0, positions // S], positions % S)
        last = end == len(ids)
        logits = self._forward(self._long(ids[start:end]), batch, self._long([end - start - 1]))
        if not last:
            return None
        return self._sample(logits, [request], [len(ids)])[0]

    def decode_step(self, batch: Sequence[DecodeRequest]) -> list[SampledToken]:
        if not batch:
            return []
        # Requests may share pages they only read (a prefix cache's), never the page one
        # of them writes: the one holding its position.
        seen: set[int] = set()
        written: set[int] = set()
        tables = []
        vocab = self._tokenizer.vocab_size
        for i, r in enumerate(batch):
            field = f"batch[{i}]"
            if not isinstance(r.position, int) or not 0 < r.position < self.max_seq_len:
                raise InvalidRequest(f"{field}.position must be in (0, max_seq_len={self.max_seq_len}), got {r.position!r}")
            if not isinstance(r.token_id, int) or not 0 <= r.token_id < vocab:
                raise InvalidRequest(f"{field}.token_id = {r.token_id!r} is not a token id in [0, {vocab})")
            used = self._check_pages(r.pages, r.position + 1, f"{field}.pages")
            page = used[r.position // self._layout.page_size]
            if page in seen or written.intersection(used):
                raise InvalidRequest(f"{field}.pages: shared with another request of the batch, which one of them writes")
            seen.update(used)
            written.add(page)
            tables.append(used)
        width = max(len(t) for t in tables)
        table = self._long([t + [t[0]] * (width - len(t)) for t in tables])  # padding is masked
        positions = self._long([r.position for r in batch])
        S = self._layout.page_size
        rows = torch.arange(len(batch), device=self.device)
        segs = Batch(table, positions, positions + 1, -1, table[rows, positions // S], positions % S)
        logits = self._forward(self._long([r.token_id for r in batch]), segs, None)
        return self._sample(logits, list(batch), [r.position + 1 for r in batch])

    def compute_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits ``[len(token_ids), vocab]`` of a prompt in one chunk (row ``i``
        predicts token ``i + 1``), on scratch pages freed again. For tests and evaluation."""
        self.validate_request(token_ids, 1)
        pages = self.alloc_pages(self.pages_needed(len(token_ids)))
        if pages is None:
            raise InvalidRequest(f"compute_logits: {len(token_ids)} tokens need more pages than are free")
        try:
            S = self._layout.page_size
            positions = torch.arange(len(token_ids), dtype=torch.int64, device=self.device)
            table = self._long([pages])
            batch = Batch(table, positions, self._long([len(token_ids)]), 0, table[0, positions // S], positions % S)
            return self._forward(self._long(token_ids), batch, None)
        finally:
            self.free_pages(pages)

    def chunk_ready(self) -> ChunkReady:
        return chunk_ready_on(self.device)

    def _forward(self, tokens: torch.Tensor, batch: Batch, rows: torch.Tensor | None) -> torch.Tensor:
        with torch.inference_mode():
            return self._model.forward(tokens, batch, self._k, self._v, rows)

    @staticmethod
    def _sample(logits: torch.Tensor, requests: Sequence[PrefillRequest | DecodeRequest], positions: list[int]) -> list[SampledToken]:
        return sample_float(logits.cpu(), [r.sampling for r in requests], positions)  # a few rows: sampled on the CPU


def load(model: str | Path, **kwargs: object) -> HFEngine:
    """``HFEngine(HFEngineConfig(str(model), **kwargs))``."""
    return HFEngine(HFEngineConfig(str(model), **kwargs))  # type: ignore[arg-type]
