"""The engine interface: what pdgrpc needs from the LLM engine that embeds it.

An SGLang or vLLM integration implements :class:`Engine`; pdgrpc ships
:class:`~pdgrpc.engine.reference.ReferenceEngine`, a tiny torch transformer. The engine
owns the model, the KV pool tensors and the page allocator; pdgrpc's servers own
requests, scheduling and transfers. The engine keeps **no per-request state**: every call
carries the request's tokens, pages and sampling parameters, so a request can be
prefilled by one process and decoded by another.

Who calls which hook, and when
------------------------------
``kv_layout`` / ``kv_buffers()`` / ``compat_hash()`` -- prefill and decode servers, once at
    start-up: the pool tensors are registered with the transport (one region per layer
    and K/V; pages are the first dimension, see :mod:`pdgrpc.engine.layout` for the byte
    layout), the hash goes into every handshake and a mismatch refuses the request.

``validate_request(token_ids, max_new_tokens)`` -- the prefill server when a request
    arrives (and the decode server, to fail fast): raises
    :class:`~pdgrpc.errors.EngineError` naming what is wrong (e.g. prompt longer than
    ``max_prompt_tokens``). The router maps it to a clear client error.

``alloc_pages(n)`` / ``free_pages(pages)`` / ``num_free_pages`` -- both servers. Prefill:
    pages for the whole prompt before the first chunk, freed once the transfer finished
    (or failed). Decode: pages for prompt + first token before the handshake, one more
    whenever a decode step would cross a page boundary (:meth:`Engine.pages_needed`),
    all freed when the request ends (an aborted request's pages only after the prefill
    can no longer write into them). ``alloc_pages`` returns ``None`` when too few pages
    are free: the caller waits and retries; nothing is taken.

``prefill_chunk(request, start, end)`` -- the prefill server, for consecutive chunks
    ``[0, c1), [c1, c2), ... [ck, len)`` of one prompt. Fills the KV of tokens
    ``[start, end)`` into the request's pages (those before ``start`` must already be
    there). After each chunk the pages it completed (every page whose last token is in
    the chunk, and on the last chunk the final partial page) may be sent, once the
    :meth:`Engine.chunk_ready` signal recorded after the chunk resolved (a GPU may still
    be writing them when the call returns). On the last chunk returns the first
    generated token as a :class:`SampledToken` (it goes into the metadata row);
    otherwise ``None``.

``decode_step(batch)`` -- the decode server (and colocated generation), once per
    scheduler iteration over every running request. Each :class:`DecodeRequest` gives the
    last token (whose KV is not in the cache yet) and its position; the step writes that
    token's KV and samples the next token.

Determinism contract
--------------------
Sampling is keyed by ``(sampling.seed, position of the sampled token)``, never by
process state, and an implementation must give a request the same tokens whatever
else is in the batch, whatever pages it got and however its prompt was chunked. That is
what lets disaggregated output equal colocated output token for token.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, AbstractSet, Iterable, Protocol, Sequence

from pdgrpc.engine.layout import KVLayout, compat_hash, pages_for_tokens
from pdgrpc.engine.errors import InvalidRequest, check_token_ids

if TYPE_CHECKING:
    import torch

    from pdgrpc.device import ChunkReady

__all__ = [
    "MAX_TOP_LOGPROBS",
    "DecodeRequest",
    "Engine",
    "InvalidRequest",
    "KVBuffers",
    "PrefillRequest",
    "SampledToken",
    "SamplingParams",
    "StreamDecoder",
    "Tokenizer",
    "stop_reason",
]

MAX_TOP_LOGPROBS = 20
_SEED_LIMIT = 2**64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (ties: lowest id).

    ``seed`` makes sampling reproducible anywhere: the draw for the token at position
    ``p`` depends only on ``(seed, p)``. ``top_logprobs`` asks for that many most likely
    tokens' logprobs with every sampled token.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int = 0
    top_logprobs: int = 0
    ignore_eos: bool = False  # keep generating after EOS (benchmarks want fixed lengths)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"sampling.temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"sampling.top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < _SEED_LIMIT:
            raise InvalidRequest(f"sampling.seed must be an int in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """A generated token and its log-probability under the model (before temperature,
    top-k and top-p), plus the ``sampling.top_logprobs`` most likely tokens (highest
    first, ties by lower id). Logprobs are float32 values (as Python floats), so they
    survive a float32 metadata row unchanged."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """A prompt to prefill into ``pages`` (which must hold all of it)."""

    token_ids: tuple[int, ...]
    pages: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """One running request in a decode step: ``token_id`` sits at ``position`` (so
    ``position`` tokens are already in the cache); ``pages`` must hold ``position + 1``
    tokens. The step samples the token for ``position + 1``."""

    token_id: int
    position: int
    pages: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class KVBuffers:
    """The KV pool tensors: ``k[layer]`` and ``v[layer]``, each ``KVLayout.pool_shape``,
    contiguous, pages first. Register them with the transport as they are (e.g.
    ``pdgrpc.transport.pages.kv_regions(buffers.k, buffers.v)``)."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]


class StreamDecoder(Protocol):
    """Incremental detokenizer: text pieces that never split a UTF-8 character."""

    def feed(self, token_ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    bos_token_id: int  # -1: none
    eos_token_id: int
    vocab_size: int  # the model's: ids in [0, vocab_size) are valid
    model_type: str  # config.json's model_type (what a gateway reports)

    @property
    def eos_token_ids(self) -> AbstractSet[int]:
        """Every id that ends generation (``eos_token_id`` among them)."""

    def encode(self, text: str | bytes, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def check_ids(self, token_ids: Sequence[int], field: str) -> None:
        """Raise InvalidRequest naming ``field[i]`` unless every id is in the vocabulary."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the output text (none for special tokens); stop
        strings are matched on these."""

    def hf_files(self) -> dict[str, bytes]:
        """This tokenizer as Hugging Face files, name -> content (``tokenizer.json``,
        ``tokenizer_config.json`` with the chat template, ...), for front ends that
        tokenize themselves (smg). Raises
        :class:`~pdgrpc.engine.tokenizer_files.TokenizerFilesError` naming a file that
        is missing or cannot be served."""


def stop_reason(
    token_id: int, num_generated: int, max_new_tokens: int, sampling: SamplingParams, eos_token_id: int | AbstractSet[int]
) -> str | None:
    """Why generation stops after a token, or ``None`` to go on. ``num_generated``
    counts generated tokens including this one. Shared by colocated and disaggregated
    decoding so both stop at the same token: ``"eos"`` (EOS sampled, kept in the output,
    unless ``sampling.ignore_eos``) or ``"length"`` (``max_new_tokens`` reached).
    ``eos_token_id`` is one id or the set of them (a checkpoint may have several)."""
    is_eos = token_id == eos_token_id if isinstance(eos_token_id, int) else token_id in eos_token_id
    if is_eos and not sampling.ignore_eos:
        return "eos"
    if num_generated >= max_new_tokens:
        return "length"
    return None


class Engine(abc.ABC):
    """What pdgrpc needs from an LLM engine. See the module docstring for who calls what."""

    # ---- identity and KV layout (start-up) -------------------------------------------

    @property
    @abc.abstractmethod
    def model_id(self) -> str:
        """Identifies architecture *and* weights; part of the compatibility hash."""

    @property
    @abc.abstractmethod
    def kv_layout(self) -> KVLayout: ...

    @abc.abstractmethod
    def kv_buffers(self) -> KVBuffers: ...

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @property
    @abc.abstractmethod
    def max_prompt_tokens(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """Most tokens (prompt + generated) a request may reach."""

    def compat_hash(self) -> str:
        return compat_hash(self.kv_layout, self.model_id)

    # ---- pages --------------------------------------------------------------------------

    @abc.abstractmethod
    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` free page indices, or ``None`` (nothing taken) when fewer are free."""

    @abc.abstractmethod
    def free_pages(self, pages: Sequence[int]) -> None:
        """Return pages; raises :class:`~pdgrpc.errors.SlotError` on a double free."""

    @property
    @abc.abstractmethod
    def num_free_pages(self) -> int: ...

    @property
    def num_pages(self) -> int:
        return self.kv_layout.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens of one request."""
        return pages_for_tokens(num_tokens, self.kv_layout.page_size)

    # ---- requests -----------------------------------------------------------------------

    def validate_request(self, token_ids: Sequence[int], max_new_tokens: int, field: str = "token_ids") -> None:
        """Raise :class:`InvalidRequest` unless the prompt and length fit this engine;
        ``field``: what the messages call the prompt (a server names its request's field)."""
        if len(token_ids) == 0:
            raise InvalidRequest(f"{field}: the prompt is empty (encode with a BOS token)")
        if len(token_ids) > self.max_prompt_tokens:
            raise InvalidRequest(
                f"{field}: prompt has {len(token_ids)} tokens, over max_prompt_tokens={self.max_prompt_tokens}"
            )
        check_token_ids(token_ids, self.tokenizer.vocab_size, field)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if len(token_ids) + max_new_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"max_new_tokens: prompt ({len(token_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_seq_len={self.max_seq_len}"
            )

    @abc.abstractmethod
    def prefill_chunk(self, request: PrefillRequest, start: int, end: int) -> SampledToken | None:
        """Fill the KV of tokens ``[start, end)``; on the last chunk (``end ==
        len(token_ids)``) return the first generated token, else ``None``."""

    def chunk_ready(self) -> "ChunkReady":
        """Called on the compute thread right after :meth:`prefill_chunk`: a signal that
        resolves once the device finished writing that chunk's pages, which the prefill
        server awaits before it sends them (:mod:`pdgrpc.device`). The default is
        for engines whose ``prefill_chunk`` returns with the pages written (the CPU)."""
        from pdgrpc.device import READY

        return READY

    @abc.abstractmethod
    def decode_step(self, batch: Sequence[DecodeRequest]) -> list[SampledToken]:
        """One token for each request of ``batch``, in order."""
