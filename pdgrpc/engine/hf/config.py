"""A checkpoint's ``config.json`` (and ``generation_config.json``) as one :class:`HFConfig`.

Reads the files ``transformers`` 4.x writes (``rope_theta``, ``rope_scaling``) and those
5.x writes (``rope_parameters``). Torch-free: the router reads a checkpoint's EOS ids
and tokenizer without loading torch.

A GGUF file (``--model FILE.gguf``) gives the same fields from its metadata.

A file that is missing or unreadable, an architecture outside :data:`ARCHITECTURES`, or a
field with a bad value raises :class:`~pdgrpc.errors.ConfigError` naming the file and the
field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from pdgrpc.engine.hf.gguf import is_gguf, read_metadata
from pdgrpc.errors import ConfigError

__all__ = ["ARCHITECTURES", "HFConfig", "RopeScaling", "config_file", "load_config", "read_json"]

# Supported architectures -> (q/k/v bias, per-head q/k RMSNorm).
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
_ROPE_TYPES = ("default", "linear", "llama3")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ConfigError naming the file when it is missing or bad."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``default`` (none), ``linear`` or ``llama3``."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """What the engine needs from a checkpoint directory's config files."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None  # keys older than this many positions are not attended to
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    digest: str  # sha256 of config.json's canonical JSON
    model_type: str = ""  # config.json's model_type ("llama", "qwen2", ...)

    @property
    def name(self) -> str:
        """How logs and errors name the checkpoint: its directory or GGUF file."""
        return str(self.path)

    @property
    def config_file(self) -> Path:
        """Where the hyperparameters come from, for error messages: config.json or the GGUF file."""
        return config_file(self.path)


def config_file(model: str | Path) -> Path:
    """The file a checkpoint's hyperparameters come from: its ``config.json``, or the GGUF file itself."""
    path = Path(model)
    return path if is_gguf(path) else path / "config.json"


def _int(cfg: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _float(value: Any, key: str, where: Path) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _rope(cfg: dict[str, Any], where: Path) -> tuple[float, RopeScaling]:
    params = cfg.get("rope_parameters")  # transformers 5.x
    scaling = cfg.get("rope_scaling")  # transformers 4.x
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params
    if theta is None:
        theta = 10000.0
    theta = _float(theta, "rope_theta", where)
    if scaling is None:
        return theta, RopeScaling()
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: field 'rope_scaling' must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if kind == "default":
        return theta, RopeScaling()
    factor = _float(scaling.get("factor"), "rope_scaling.factor", where)
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        _float(scaling.get("low_freq_factor"), "rope_scaling.low_freq_factor", where),
        _float(scaling.get("high_freq_factor"), "rope_scaling.high_freq_factor", where),
        _int(scaling, "original_max_position_embeddings", where),
    )


def _eos_ids(value: Any, where: Path, vocab_size: int) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{where}: field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    for i in ids:
        _check_id(i, "eos_token_id", where, vocab_size)
    return tuple(ids)


def _check_id(token_id: int, key: str, where: Path, vocab_size: int) -> None:
    """A special token's id is a row of the embedding: an EOS id past it is never sampled,
    so generations would end only at their length limit."""
    if token_id >= vocab_size:
        raise ConfigError(f"{where}: field {key!r} = {token_id} is not a token id in [0, {vocab_size})")


def _layers_window(cfg: dict[str, Any], window: int, where: Path) -> int | None:
    """Qwen2's and Qwen3's window, which slides only the layers ``layer_types`` names
    ``sliding_attention`` (by default those from ``max_window_layers`` on), as transformers
    reads it: ``window`` when it slides every layer, None when none. This engine applies one
    window to every layer or to none, so a mix is refused: it would answer other tokens."""
    n = _int(cfg, "num_hidden_layers", where)
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        sliding = [t == "sliding_attention" for t in types]
    else:
        first = cfg.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ConfigError(f"{where}: field 'max_window_layers' must be an integer, got {first!r}")
        sliding = [i >= first for i in range(n)]
    if all(sliding):
        return window
    if not any(sliding):
        return None
    layers = [i for i, s in enumerate(sliding) if s]
    raise ConfigError(
        f"{where}: a sliding window on layers {layers[0]} to {layers[-1]} only (layer_types or max_window_layers) is "
        "not supported: this engine applies one window to every layer or to none"
    )


def load_config(model: str | Path) -> HFConfig:
    """Read ``config.json`` (and ``generation_config.json`` where present) of a checkpoint
    directory, or the metadata of a GGUF file (:mod:`pdgrpc.engine.hf.gguf`)."""
    path = Path(model)
    if is_gguf(path):
        meta = read_metadata(path)
        meta.check_types()  # a tensor type the gguf package cannot dequantize is refused at once
        return _parse(path, path, meta.config_dict(), None)
    if not path.is_dir():
        raise ConfigError(
            f"--model {path}: not a directory (a checkpoint directory holds config.json, *.safetensors, tokenizer.json) "
            "nor a .gguf file"
        )
    gen_path = path / "generation_config.json"
    return _parse(path, path / "config.json", read_json(path / "config.json"), read_json(gen_path) if gen_path.exists() else None)


def _parse(path: Path, where: Path, cfg: dict[str, Any], gen: dict[str, Any] | None) -> HFConfig:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{where}: field 'architectures' must be a list of class names, got {archs!r}")
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    qkv_bias, qk_norm = ARCHITECTURES[arch]
    quant = cfg.get("quantization_config")
    if quant is not None:  # quantized weights keep their names; read as floats they give garbage
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ConfigError(
            f"{where}: field 'quantization_config' (quant_method {method!r}) is not supported: this engine "
            "reads unquantized float weights; serve the unquantized checkpoint, or a GGUF file"
        )
    if arch == "LlamaForCausalLM" and cfg.get("attention_bias"):
        qkv_bias = True
    if arch == "LlamaForCausalLM" and cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: field 'mlp_bias' = true is not supported")
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", where)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be even, got {head_dim}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' = {act!r} is not supported (only 'silu')")
    theta, scaling = _rope(cfg, where)
    window = cfg.get("sliding_window")
    if arch != "MistralForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen2/Qwen3 write a window but attend fully unless use_sliding_window
    if window is not None:
        window = _int({"sliding_window": window}, "sliding_window", where)
    if window is not None and arch != "MistralForCausalLM":
        window = _layers_window(cfg, window, where)
    vocab = _int(cfg, "vocab_size", where)
    eos = _eos_ids(cfg.get("eos_token_id"), where, vocab)
    if gen is not None and gen.get("eos_token_id") is not None:
        eos = _eos_ids(gen.get("eos_token_id"), path / "generation_config.json", vocab)
    bos = cfg.get("bos_token_id")
    if not isinstance(bos, int) or isinstance(bos, bool) or bos < 0:
        bos = None  # a negative id (some configs write -1): no BOS
    if bos is not None:
        _check_id(bos, "bos_token_id", where, vocab)
    return HFConfig(
        path=path,
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=_int(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=window,
        bos_token_id=bos,
        eos_token_ids=eos,
        digest=hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
        model_type=cfg["model_type"] if isinstance(cfg.get("model_type"), str) else "",
    )
