"""The engine's configuration, torch-free: :class:`ModelConfig` (the reference model's
shape and seed) and :class:`EngineConfig` (pool, limits, placement). The rules on the sizes
every engine's configuration has (:func:`check_sizes`, :func:`check_tp_divides`) and the
prompt limit it takes when none is given (:func:`default_max_prompt_tokens`) are here once,
for the checkpoint engine's configuration too.

Torch-free: servers that run no engine (the prefill controller) parse and check the engine
flags with these classes, and start sooner without torch. The engine modules import these;
nothing here imports them.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Protocol

from pdgrpc.engine.layout import KVLayout, check_kv_dtype
from pdgrpc.engine.tokenizer import VOCAB_SIZE
from pdgrpc.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS", "MAX_CONTEXT", "MAX_HEAD_DIM", "MAX_REDUCTION", "MODEL_SEED_LIMIT", "EngineConfig", "ModelConfig", "ModelShape",
    "Sizes", "check_sizes", "check_tp_divides", "default_max_prompt_tokens", "device_type",
]

# The largest sizes whose sums stay exact in the reference model's fixed-point arithmetic
# (pdgrpc.engine.exact): ModelConfig and EngineConfig refuse anything larger.
MAX_REDUCTION = 2**12  # hidden size, intermediate size
MAX_HEAD_DIM = 2**8
MAX_CONTEXT = 2**16

# Model seeds are below this (ModelConfig.seed, --model-seed): a 64-bit value, as every
# seed pdgrpc takes; the seed is part of the model's identity, which logs and handshake
# refusals repeat, so it stays short.
MODEL_SEED_LIMIT = 2**64

# The longest prompt an engine takes when its configuration names no limit, and so the
# longest the router forwards unless told otherwise.
DEFAULT_MAX_PROMPT_TOKENS = 2048


def device_type(spec: str) -> str:
    """The kind of device ``spec`` names, checked against this machine
    (:func:`pdgrpc.device.resolve_device`). ``cpu`` is answered without importing torch."""
    if spec == "cpu":
        return "cpu"
    from pdgrpc.device import resolve_device

    return resolve_device(spec).type


def _broken(config: object, template: str, *fields: str, **terms: object) -> ConfigError:
    """The error for ``fields`` of ``config`` (dotted paths: ``model.num_heads``) breaking
    a rule (:meth:`ConfigError.broken_rule`), each named ``ClassName.path``."""
    values = {field: operator.attrgetter(field)(config) for field in fields}
    return ConfigError.broken_rule(type(config).__name__, template, values, **terms)


class Sizes(Protocol):
    """The sizes every engine's configuration has: :class:`EngineConfig`'s and the
    checkpoint engine's (:class:`~pdgrpc.engine.hf.engine.HFEngineConfig`)."""

    @property
    def page_size(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_prompt_tokens(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...


class ModelShape(Protocol):
    """The widths a TP rank takes a share of: :class:`ModelConfig`'s and a checkpoint's."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


def check_sizes(config: Sizes) -> None:
    """Raise :meth:`ConfigError.broken_rule`, naming ``config``'s fields, unless its sizes
    are positive, leave room for a prompt and a generated token, and place its TP rank."""
    for field in ("page_size", "num_pages", "max_seq_len", "max_prompt_tokens", "tp_size"):
        v = getattr(config, field)
        if not isinstance(v, int) or v <= 0:
            raise _broken(config, "{0} must be a positive int, got {0.value!r}", field)
    # Before the prompt limit's rule: a length under 2 leaves room for no prompt at
    # all, so the refusal is about the length alone, whatever the limit is.
    if config.max_seq_len < 2:
        raise _broken(config, "{0} {0.value}: must be at least 2 (one prompt token and one generated token)", "max_seq_len")
    if config.max_prompt_tokens >= config.max_seq_len:
        raise _broken(config, "{0} ({0.value}) must be < {1} ({1.value})", "max_prompt_tokens", "max_seq_len")
    if not 0 <= config.tp_rank < config.tp_size:
        raise _broken(config, "{0} must be in [0, {1}={1.value}), got {0.value}", "tp_rank", "tp_size")


def default_max_prompt_tokens(max_seq_len: int) -> int:
    """The prompt limit for a length ``max_seq_len`` when none is given:
    :data:`DEFAULT_MAX_PROMPT_TOKENS`, or ``max_seq_len - 1`` when that is less, and at
    least 1, so that a length under 2 is refused for itself (:func:`check_sizes`), not as
    a prompt limit of 0."""
    return max(1, min(DEFAULT_MAX_PROMPT_TOKENS, max_seq_len - 1))


def check_tp_divides(owner: str, tp_size: int, model: ModelShape) -> None:
    """Raise :meth:`ConfigError.broken_rule` unless ``tp_size`` divides ``model``'s query
    heads, KV heads and MLP width: every TP rank holds an equal share of each. The error
    names the fields of ``owner``, the configuration of a model: ``tp_size`` and
    ``model.<field>``."""
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        width = getattr(model, field)
        if width % tp_size:
            fields = {"tp_size": tp_size, f"model.{field}": width}
            raise ConfigError.broken_rule(owner, "{0} {0.value} must divide {1} ({1.value})", fields)


_MODEL_FAMILY = "pdgrpc-reference-v1"  # bump when the forward computation changes


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, field)
            if not isinstance(v, int) or v <= 0:
                raise _broken(self, "{0} must be a positive int, got {0.value!r}", field)
        if self.num_heads % self.num_kv_heads:
            raise _broken(self, "{0} ({0.value}) must be a multiple of {1} ({1.value})", "num_heads", "num_kv_heads")
        if self.head_dim % 2 or self.head_dim > MAX_HEAD_DIM:
            raise _broken(self, "{0} must be even and <= {most}, got {0.value}", "head_dim", most=MAX_HEAD_DIM)
        # Exact sums need bounded reduction lengths (see pdgrpc.engine.exact).
        for field in ("hidden_size", "intermediate_size", "vocab_size"):
            if getattr(self, field) > MAX_REDUCTION:
                raise _broken(self, "{0} must be <= {most}, got {0.value}", field, most=MAX_REDUCTION)
        if self.num_heads * self.head_dim > MAX_REDUCTION:
            raise _broken(
                self, "{0} * {1} must be <= {most}, got {0.value} * {1.value}", "num_heads", "head_dim", most=MAX_REDUCTION
            )
        if self.vocab_size < VOCAB_SIZE:
            raise _broken(self, "{0} must be >= {least} (the byte tokenizer), got {0.value}", "vocab_size", least=VOCAB_SIZE)
        if not self.rope_theta > 1.0:
            raise _broken(self, "{0} must be > 1, got {0.value}", "rope_theta")
        if not isinstance(self.seed, int) or not 0 <= self.seed < MODEL_SEED_LIMIT:
            raise _broken(self, "{0} must be an int in [0, 2**64), got {0.value!r}", "seed")

    @property
    def model_id(self) -> str:
        """Names architecture and weights (the seed fixes them)."""
        f = dataclasses.asdict(self)
        return _MODEL_FAMILY + ":" + ",".join(f"{k}={f[k]}" for k in sorted(f))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    page_size: int = 16  # tokens per KV page
    num_pages: int = 1024  # KV pool size per instance (pages)
    kv_dtype: str = "float32"
    max_seq_len: int = 4096  # prompt + generated tokens, per request
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    tp_rank: int = 0
    tp_size: int = 1
    # torch intra-op threads for the engine's compute (0: leave torch's setting alone).
    # Results are identical at any count; 1 is fastest for this tiny model and avoids
    # OpenMP spin-waiting when several server processes share the cores. Construction
    # sets it process-wide (one engine per server process); if something changes it
    # later, each engine call switches for its duration and restores it.
    intra_op_threads: int = 1
    # KV pool in transparent huge pages (pdgrpc.host_memory.host_zeros). Off by
    # default: transfers of large page runs over rdma are faster from and into huge
    # pages, but neither this model's compute nor e2e TTFT at 512 tokens changes with
    # them (see pdgrpc.host_memory). Memory placement only: peers need not agree on it.
    kv_huge_pages: bool = False
    # Where the weights, the KV pool and the compute live: "cpu" or "cuda[:N]"
    # (pdgrpc.device). Placement only: the fixed-point arithmetic gives the same
    # tokens on either, and peers need not agree on it.
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.intra_op_threads, int) or self.intra_op_threads < 0:
            raise _broken(self, "{0} must be an int >= 0, got {0.value!r}", "intra_op_threads")
        check_sizes(self)
        check_kv_dtype(self.kv_dtype)
        if device_type(self.device) != "cpu" and self.kv_huge_pages:
            raise _broken(self, "{0} applies to a host KV pool; it cannot be combined with {1} {1.value}", "kv_huge_pages", "device")
        if self.max_seq_len > MAX_CONTEXT:
            raise _broken(self, "{0} {0.value}: the reference engine takes at most {most} tokens", "max_seq_len", most=MAX_CONTEXT)
        check_tp_divides(type(self).__name__, self.tp_size, self.model)

    def kv_layout(self) -> KVLayout:
        """The KV pool of this TP rank: its share of the KV heads, every page."""
        m = self.model
        local = m.num_kv_heads // self.tp_size
        return KVLayout(
            num_layers=m.num_layers, num_pages=self.num_pages, page_size=self.page_size, num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim, kv_dtype=self.kv_dtype, head_start=self.tp_rank * local, head_end=(self.tp_rank + 1) * local,
        )
