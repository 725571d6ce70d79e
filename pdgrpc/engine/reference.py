"""The reference engine: :class:`~pdgrpc.engine.base.Engine` over the tiny model.

Defaults: 4 layers, hidden 256, 8 query heads and 2 KV heads of dim 32, SwiGLU MLP of 512,
byte vocabulary (258), 16-token pages, float32 KV. Float32 because the KV values are
fixed-point numbers with 20-bit integers (see :mod:`pdgrpc.engine.exact`), which float32
holds exactly; float16/bfloat16 pools work too, on a coarser grid that those dtypes hold
exactly (a different model output, and a different compatibility hash).

Compute is float64 on CPU (exact integer arithmetic, see :mod:`pdgrpc.engine.exact`), so
results are bit-identical whatever the batch, the chunking, the page indices, torch's
thread count, or the TP size. The engine is not thread-safe: one scheduler drives it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

import pdgrpc.engine.exact as exact
from pdgrpc.device import ChunkReady, chunk_ready_on, resolve_device
from pdgrpc.engine.base import (
    DecodeRequest,
    Engine,
    InvalidRequest,
    KVBuffers,
    PrefillRequest,
    SampledToken,
)
from pdgrpc.engine.config import EngineConfig
from pdgrpc.engine.model import AllReduce, ModelShard, SegmentBatch
from pdgrpc.engine.pages import FifoPageAllocator
from pdgrpc.engine.pooled import PooledEngine
from pdgrpc.engine.sampling import sample_rows
from pdgrpc.engine.tokenizer import ByteTokenizer
from pdgrpc.errors import ConfigError
from pdgrpc.host_memory import host_zeros

__all__ = ["ReferenceEngine"]


@contextlib.contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads (process-wide), restoring the old count."""
    if n == 0 or n == torch.get_num_threads():
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class ReferenceEngine(PooledEngine):
    """The tiny reference transformer as an :class:`Engine` (one TP rank of it).

    ``all_reduce`` sums partial results across the TP group (see
    :mod:`pdgrpc.engine.tp`); leave it out for TP=1. Every rank of a group must be
    driven with the same calls in the same order.
    """

    config: EngineConfig

    def __init__(
        self, config: EngineConfig = EngineConfig(), all_reduce: AllReduce | None = None, *, kv_pool: KVBuffers | None = None
    ) -> None:
        if config.tp_size > 1 and all_reduce is None:
            raise ConfigError(f"ReferenceEngine: tp_size={config.tp_size} needs an all_reduce")
        self.config = config
        if config.intra_op_threads:  # first: building the weights is the first heavy work
            torch.set_num_threads(config.intra_op_threads)
        self.device = resolve_device(config.device)
        self._shard = ModelShard(config, all_reduce, self.device)
        self._layout = config.kv_layout()
        m = config.model
        self._kv_quant = exact.kv_format(config.kv_dtype)
        # Zero-filled: stale rows are masked anyway, but zeros make dumps readable.
        if kv_pool is not None:  # memory someone else owns (e.g. shared with a compute process)
            for t in kv_pool.k + kv_pool.v:
                if (tuple(t.shape) != self._layout.pool_shape or t.dtype != self._layout.dtype or not t.is_contiguous()
                        or t.device != self.device):
                    raise ConfigError(
                        f"ReferenceEngine: kv_pool tensors must be contiguous {self._layout.pool_shape} "
                        f"{self._layout.dtype} on {self.device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
                    )
            if len(kv_pool.k) != m.num_layers or len(kv_pool.v) != m.num_layers:
                raise ConfigError(f"ReferenceEngine: kv_pool needs {m.num_layers} K and V tensors")
            self._k, self._v = list(kv_pool.k), list(kv_pool.v)
        else:
            dev = self.device
            alloc = host_zeros if config.kv_huge_pages else (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=dev))
            self._k = [alloc(self._layout.pool_shape, self._layout.dtype) for _ in range(m.num_layers)]
            self._v = [alloc(self._layout.pool_shape, self._layout.dtype) for _ in range(m.num_layers)]
        self._pages = FifoPageAllocator(config.num_pages)
        self._tokenizer = ByteTokenizer()

    # ---- identity and layout ----------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.config.model.model_id

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    # ---- compute --------------------------------------------------------------------------

    def _check_pages(self, pages: Sequence[int], num_tokens: int, field: str) -> None:
        need = self.pages_needed(num_tokens)
        if len(pages) < need:
            raise InvalidRequest(f"{field}: {num_tokens} tokens need {need} pages of {self._layout.page_size}, got {len(pages)}")
        for p in pages[:need]:
            if not isinstance(p, int) or not 0 <= p < self._layout.num_pages:
                raise InvalidRequest(f"{field}: page {p!r} outside the pool [0, {self._layout.num_pages})")
        if len(set(pages[:need])) != need:
            raise InvalidRequest(f"{field}: page indices repeat")

    def prefill_chunk(self, request: PrefillRequest, start: int, end: int) -> SampledToken | None:
        ids = request.token_ids
        self.validate_request(ids, 1)  # every chunk: cheap next to the forward pass
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(ids)):
            raise InvalidRequest(f"prefill_chunk: need 0 <= start < end <= {len(ids)}, got start={start!r}, end={end!r}")
        self._check_pages(request.pages, len(ids), "pages")
        last = end == len(ids)
        batch = SegmentBatch.build([(list(request.pages[: self.pages_needed(end)]), start, end - start)])
        logits = self._forward(ids[start:end], batch, rows=[end - start - 1] if last else [])
        if not last:
            return None
        return sample_rows(logits, [request.sampling], [len(ids)])[0]

    def decode_step(self, batch: Sequence[DecodeRequest]) -> list[SampledToken]:
        if not batch:
            return []
        # Requests may share pages they only read (a prefix cache's), never the page one
        # of them writes: the one holding its position.
        seen: set[int] = set()
        written: set[int] = set()
        for i, r in enumerate(batch):
            field = f"batch[{i}]"
            if not isinstance(r.position, int) or not 0 < r.position < self.max_seq_len:
                raise InvalidRequest(f"{field}.position must be in (0, max_seq_len={self.max_seq_len}), got {r.position!r}")
            if not isinstance(r.token_id, int) or not 0 <= r.token_id < self._tokenizer.vocab_size:
                raise InvalidRequest(f"{field}.token_id = {r.token_id!r} is not a token id in [0, {self._tokenizer.vocab_size})")
            self._check_pages(r.pages, r.position + 1, f"{field}.pages")
            used = r.pages[: self.pages_needed(r.position + 1)]
            page = used[r.position // self._layout.page_size]
            if page in seen or written.intersection(used):
                raise InvalidRequest(f"{field}.pages: shared with another request of the batch, which one of them writes")
            seen.update(used)
            written.add(page)
        segments = SegmentBatch.build([(list(r.pages[: self.pages_needed(r.position + 1)]), r.position, 1) for r in batch])
        logits = self._forward([r.token_id for r in batch], segments, rows=list(range(len(batch))))
        return sample_rows(logits, [r.sampling for r in batch], [r.position + 1 for r in batch])

    def compute_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced float64 logits ``[len(token_ids), vocab]`` (row ``i`` predicts
        token ``i + 1``), computed in one chunk on scratch pages that are freed again.
        For evaluation and tests; raises :class:`InvalidRequest` when the pool is short."""
        self.validate_request(token_ids, 1)
        pages = self.alloc_pages(self.pages_needed(len(token_ids)))
        if pages is None:
            raise InvalidRequest(f"compute_logits: {len(token_ids)} tokens need more pages than are free")
        try:
            batch = SegmentBatch.build([(pages, 0, len(token_ids))])
            return self._forward(token_ids, batch, rows=list(range(len(token_ids))))
        finally:
            self.free_pages(pages)

    def chunk_ready(self) -> ChunkReady:
        return chunk_ready_on(self.device)

    def _forward(self, token_ids: Sequence[int], batch: SegmentBatch, rows: list[int]) -> torch.Tensor:
        """Float64 logits of ``rows``, on the CPU (sampling runs there whatever the device)."""
        dev = self.device
        with torch.no_grad(), _intra_op_threads(self.config.intra_op_threads):
            logits = self._shard.forward(
                torch.tensor(list(token_ids), dtype=torch.int64).to(dev, non_blocking=True),
                batch.to(dev),
                self._k,
                self._v,
                self._kv_quant,
                torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True),
            )
        return logits if dev.type == "cpu" or not rows else logits.cpu()
