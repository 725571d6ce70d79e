"""GGUF files (llama.cpp, Ollama, LM Studio) as checkpoints: ``--model FILE.gguf``.

One file holds what a checkpoint directory spreads over several: the hyperparameters
(read here into the ``config.json`` form :mod:`pdgrpc.engine.hf.config` parses), the
tokenizer and chat template (built into a ``tokenizer.json`` with ``transformers``' GGUF
tokenizer conversion, so prompts tokenize as ``transformers`` tokenizes them), and the
tensors, quantized or not. Tensors are dequantized to float32 with the ``gguf`` package
(the code ``transformers`` itself dequantizes with), renamed to ``transformers``' names,
and the query/key rows of a ``llama`` file are put back in the order llama.cpp's converter
permuted them from. A tensor in a quantization type ``gguf`` cannot dequantize is refused
by the type's name.

Torch-free: the router reads the tokenizer and the EOS ids. Needs ``pdgrpc[gguf]``.
The header is parsed here (the metadata once per file and process); the file's mapping
lives only while a :class:`GGUFTensors` is open (the weights are copied out of it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from pdgrpc.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ARCHITECTURES", "GGUFMetadata", "GGUFTensors", "is_gguf", "read_metadata", "supported_quant_types"]

# general.architecture -> the transformers class it converts to.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name -> transformers name ("{}" is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# {arch}.* hyperparameters with no default.
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file (by its suffix, as llama.cpp's tools write it)."""
    return Path(path).suffix.lower() == ".gguf"


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ConfigError("--model FILE.gguf needs the 'gguf' package: pip install 'pdgrpc[gguf]'") from None
    return gguf


@functools.cache
def supported_quant_types() -> frozenset[str]:
    """The tensor types the installed ``gguf`` package dequantizes (by their GGUF names)."""
    gguf = _gguf()
    import numpy as np

    names = set()
    for qtype in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES.get(qtype, (0, 0))
        if not size:
            continue
        try:
            gguf.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        except Exception:  # a type with no block layout here is not dequantizable either
            continue
        names.add(qtype.name)
    return frozenset(names)


# GGUF value types -> struct format (8 string, 9 array: read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_MAGIC = b"GGUF"


class _Cursor:
    """Little-endian reads from the file's header (GGUF versions 2 and 3)."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ConfigError(f"{self.path}: not a valid GGUF file (truncated header)")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = bytes(self.data[self.pos : self.pos + n])
        if len(raw) != n:
            raise ConfigError(f"{self.path}: not a valid GGUF file (truncated header)")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("I"), self.take("Q")
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ConfigError(f"{self.path}: not a valid GGUF file (value type {kind})")
        return self.take(_SCALARS[kind])


@dataclasses.dataclass(frozen=True)
class _Tensor:
    gguf_name: str
    kind: int  # ggml type id
    type_name: str
    shape: tuple[int, ...]  # [out, in], as transformers holds it
    offset: int  # from the file's start
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: cached per file
class GGUFMetadata:
    """A GGUF file's key-value metadata and tensor table (names in ``transformers``'
    spelling, shapes ``[out, in]``), read without its tensor data."""

    path: Path
    values: dict[str, Any]
    tensors: dict[str, _Tensor]  # by transformers name
    file_size: int

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.shape for name, t in self.tensors.items()}

    @property
    def architecture(self) -> str:
        arch = self.values.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{self.path}: general.architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        return str(arch)

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.architecture}.{key}", default)

    def config_dict(self) -> dict[str, Any]:
        """The ``config.json`` this file's metadata describes (transformers 5's spelling)."""
        arch = self.architecture
        for key in _REQUIRED:  # named as the file spells them, not as the config.json fields they become
            if self._arch(key) is None:
                raise ConfigError(f"{self.path}: metadata '{arch}.{key}' is missing")
        heads = self._arch("attention.head_count")
        hidden = self._arch("embedding_length")
        head_dim = self._arch("attention.key_length") or self._arch("rope.dimension_count")
        if head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads:
            head_dim = hidden // heads
        rotary = self._arch("rope.dimension_count")
        if rotary is not None and rotary != head_dim:
            raise ConfigError(f"{self.path}: {arch}.rope.dimension_count = {rotary} (partial rotary) is not supported; head_dim = {head_dim}")
        tokens = self.values.get("tokenizer.ggml.tokens")
        if self._arch("vocab_size") is None and not isinstance(tokens, list):
            raise ConfigError(f"{self.path}: metadata '{arch}.vocab_size' (or 'tokenizer.ggml.tokens') is missing")
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": self._arch("vocab_size") or (len(tokens) if isinstance(tokens, list) else None),
            "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_parameters": self._rope(),
            "max_position_embeddings": self._arch("context_length"),
            "tie_word_embeddings": "lm_head.weight" not in self.shapes,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.shapes,
            "hidden_act": "silu",
            "bos_token_id": self.values.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.values.get("tokenizer.ggml.eos_token_id"),
        }
        if "rope_freqs.weight" in self.shapes:
            # Llama 3.1-style frequency factors: transformers' GGUF loader ignores them (it
            # maps only the model's own tensors), so no reference output exists to equal.
            raise ConfigError(
                f"{self.path}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors) is not supported: "
                "transformers' GGUF loader ignores it, so no output could be checked against it; serve the original "
                "checkpoint directory instead (its config.json's llama3 rope_scaling is supported)"
            )
        return {k: v for k, v in cfg.items() if v is not None}  # absent: config.json's defaults apply

    def _rope(self) -> dict[str, Any]:
        theta = self._arch("rope.freq_base", 10000.0)
        kind = self._arch("rope.scaling.type", "none")
        if kind == "none":
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": self._arch("rope.scaling.factor")}
        raise ConfigError(f"{self.path}: {self.architecture}.rope.scaling.type {kind!r} is not supported (supported: none, linear)")

    def check_types(self) -> None:
        """Every tensor in a type the ``gguf`` package dequantizes; ConfigError naming the first other."""
        supported = supported_quant_types()
        for name, t in self.tensors.items():
            kind = t.type_name
            if kind not in supported:
                raise ConfigError(
                    f"{self.path}: tensor {name!r} has quantization type {kind}, which the installed gguf package "
                    f"cannot dequantize (supported: {', '.join(sorted(supported))})"
                )

    def digest(self) -> str:
        """sha256 over every tensor's name, type and shape and the file's size (the model identity)."""
        h = hashlib.sha256(f"{self.path.name}:{self.file_size}\n".encode())
        for name in sorted(self.shapes):
            t = self.tensors[name]
            h.update(f"{name}:{t.type_name}:{list(t.shape)}\n".encode())
        return h.hexdigest()

    def tokenizer_files(self) -> dict[str, bytes]:
        """``tokenizer.json``, ``tokenizer_config.json`` and ``config.json`` as a checkpoint
        directory holds them (what front ends that tokenize themselves load)."""
        tokenizer, tok_cfg = _tokenizer(self)
        return {
            "tokenizer.json": tokenizer.encode(),
            "tokenizer_config.json": json.dumps(tok_cfg, indent=1).encode(),
            "config.json": json.dumps(self.config_dict(), indent=1).encode(),
        }


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ConfigError(f"{path}: tensor {gguf_name!r} is not one this engine knows (supported architectures: "
                          f"{', '.join(sorted(ARCHITECTURES))})")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


@functools.lru_cache(maxsize=4)
def _read_metadata(path: Path, mtime_ns: int) -> GGUFMetadata:
    gguf = _gguf()
    try:
        if path.stat().st_size == 0:  # mmap refuses an empty file with a message naming none
            raise ConfigError(f"{path}: not a GGUF file (empty)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            cur = _Cursor(memoryview(m), path)
            try:
                if bytes(m[:4]) != _MAGIC:
                    raise ConfigError(f"{path}: not a GGUF file (no GGUF magic)")
                version = cur.take("4xI")
                if version not in (2, 3):
                    raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3, little-endian)")
                n_tensors, n_values = cur.take("Q"), cur.take("Q")
                values: dict[str, Any] = {}
                for _ in range(n_values):
                    key = cur.string()
                    values[key] = cur.value(cur.take("I"))
                infos = []
                for _ in range(n_tensors):
                    name = cur.string()
                    dims = [cur.take("Q") for _ in range(cur.take("I"))]
                    infos.append((name, dims, cur.take("I"), cur.take("Q")))
                end = cur.pos
            finally:
                cur.data.release()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    align = values.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0:  # where the tensor data starts
        raise ConfigError(f"{path}: not a valid GGUF file (general.alignment = {align!r}, not a positive integer)")
    start = end + (-end % align)
    size = path.stat().st_size
    tensors: dict[str, _Tensor] = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ConfigError(f"{path}: tensor {name!r} has an unknown type id {kind}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = 1
        for d in dims:
            count *= d
        nbytes = count // block * type_size
        if start + offset + nbytes > size:
            raise ConfigError(f"{path}: not a valid GGUF file (tensor {name!r} ends past the file's end)")
        hf = "rope_freqs.weight" if name == "rope_freqs.weight" else _hf_name(name, path)
        tensors[hf] = _Tensor(name, kind, qtype.name, tuple(reversed(dims)), start + offset, nbytes)
    return GGUFMetadata(path, values, tensors, size)


def read_metadata(path: str | Path) -> GGUFMetadata:
    """The metadata of the GGUF file at ``path`` (read once per file version and process)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--model {p}: a directory, not a GGUF file")
    if not p.is_file():
        raise ConfigError(f"--model {p}: file not found (a GGUF file)")
    return _read_metadata(p.resolve(), p.stat().st_mtime_ns)


_TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


@functools.lru_cache(maxsize=4)
def _tokenizer(meta: GGUFMetadata) -> tuple[str, dict[str, Any]]:
    """(``tokenizer.json`` text, ``tokenizer_config.json`` object), converted as
    ``transformers`` converts them (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)."""
    v = meta.values
    tokens = v.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{meta.path}: no tokenizer in the file (metadata 'tokenizer.ggml.tokens' is missing)")
    try:
        from tokenizers import processors
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        raise ConfigError("--model FILE.gguf needs 'transformers' and 'tokenizers' to build the tokenizer: "
                          "pip install 'pdgrpc[gguf]'") from None
    tok_dict = {key: v[f"tokenizer.ggml.{gkey}"] for gkey, key in _TOKENIZER_KEYS.items() if f"tokenizer.ggml.{gkey}" in v}
    tok_cfg: dict[str, Any] = {}
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in v:
            tok_cfg[key] = bool(v[f"tokenizer.ggml.{key}"])
    if tok_dict.get("tokenizer_type") == "llama":
        tok_cfg.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for name, key in _SPECIALS.items():
        tid = v.get(f"tokenizer.ggml.{key}")
        tok_cfg[name] = tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None
    if isinstance(v.get("tokenizer.chat_template"), str):
        tok_cfg["chat_template"] = v["tokenizer.chat_template"]
    try:
        tok, _ = convert_gguf_tokenizer(meta.architecture, tok_dict)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"{meta.path}: cannot build the tokenizer from tokenizer.ggml.* ({exc!r})") from None
    # transformers' post-processor: BOS/EOS around the text as add_bos_token/add_eos_token say.
    bos, eos = str(tok_cfg.get("bos_token")), str(tok_cfg.get("eos_token"))
    add_bos = bool(tok_cfg.get("add_bos_token")) and tok_cfg.get("bos_token") is not None
    add_eos = bool(tok_cfg.get("add_eos_token")) and tok_cfg.get("eos_token") is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, v["tokenizer.ggml.bos_token_id"])] if add_bos else []) + (
        [(eos, v["tokenizer.ggml.eos_token_id"])] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok.to_str(), tok_cfg


def tokenizer_json(meta: GGUFMetadata) -> tuple[str, dict[str, Any]]:
    """(``tokenizer.json`` text, ``tokenizer_config.json`` object) of the file."""
    return _tokenizer(meta)


def _unpermute(w: "np.ndarray", n_head: int) -> "np.ndarray":
    """Undo llama.cpp's rotary row permutation of a ``llama`` query/key projection."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFTensors:
    """The file's tensors by ``transformers`` name, dequantized to float32 numpy arrays.
    A context manager: the file stays mapped only inside ``with``."""

    def __init__(self, meta: GGUFMetadata) -> None:
        self._meta = meta
        self._file: Any = None

    def __enter__(self) -> "GGUFTensors":
        import numpy as np

        self._meta.check_types()
        try:  # copy-on-write: writable arrays (torch.from_numpy wants them), the file untouched
            self._file = np.memmap(self._meta.path, dtype=np.uint8, mode="c")
        except OSError as exc:
            raise ConfigError(f"{self._meta.path}: cannot read ({exc.strerror or exc})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._file = None  # drops the mapping

    def get(self, name: str) -> "np.ndarray":
        """One tensor, ``[out, in]``, float32: a fresh array, or a copy-on-write view of the mapping for F32."""
        gguf = _gguf()
        t = self._meta.tensors[name]
        qtype = gguf.GGMLQuantizationType(t.kind)
        raw = self._file[t.offset : t.offset + t.nbytes]
        try:
            w = gguf.dequantize(raw.reshape(gguf.quant_shape_to_byte_shape(t.shape, qtype)), qtype)
        except Exception as exc:  # an inconsistent file
            raise ConfigError(f"{self._meta.path}: cannot dequantize tensor {t.gguf_name!r} ({exc})") from None
        w = w.reshape(t.shape)
        if self._meta.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            cfg = self._meta.config_dict()
            w = _unpermute(w, cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"])
        return w
