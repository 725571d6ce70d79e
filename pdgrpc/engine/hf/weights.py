"""A checkpoint's weights from ``*.safetensors``, checked against ``config.json`` and sliced
for one TP rank.

The files are memory-mapped (``safetensors.safe_open``) and each tensor is read as the
slice this rank keeps (``get_slice``) and copied out of the mapping, so loading holds one
copy of this rank's weights and no full copy of the checkpoint; the layers are read as
they are consumed, and the mappings close after the last. Q/K/V and gate/up are concatenated into one matrix each
(one matmul instead of three or two per layer).

A GGUF file's tensors are dequantized with the ``gguf`` package
(:mod:`pdgrpc.engine.hf.gguf`) and copied out of the file's mapping, which is closed when
the load ends.

The model identity (:func:`weights_digest`) is a digest of every tensor's name, dtype and
shape and of each file's size -- the metadata, not every byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from pdgrpc.engine.hf.config import HFConfig, read_json
from pdgrpc.engine.hf.gguf import GGUFTensors, is_gguf, read_metadata
from pdgrpc.errors import ConfigError

__all__ = [
    "LayerWeights", "ModelWeights", "check_weights", "expected_shapes", "load_weights", "weight_files", "weights_digest",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtypes read as plain floats: cast to --dtype they keep their values. Any
# other (FP8, int8, packed 4-bit) needs scales this engine does not apply.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer of one TP rank, ``[out, in]`` like ``nn.Linear``."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(local_q + 2 * local_kv) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [hidden, local_q * head_dim]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * local_intermediate, hidden]
    down: torch.Tensor  # [hidden, local_intermediate]


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    # Read one at a time as iterated (once): a consumer that repacks each layer holds one
    # plain layer at a time, not the whole model twice.
    layers: Iterator[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding when tied)


def weight_files(config: HFConfig) -> dict[str, Path]:
    """Tensor name -> file, from the index (sharded) or the single file's header."""
    index = config.path / INDEX
    if index.exists():
        data = read_json(index)
        wmap = data.get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ConfigError(f"{index}: field 'weight_map' must map tensor names to file names")
        return {name: config.path / fname for name, fname in wmap.items()}
    single = config.path / SINGLE
    if not single.exists():
        raise ConfigError(f"{config.path}: neither {INDEX} nor {SINGLE} found (the checkpoint's weights)")
    return {name: single for name in _header(single)}


def _header(path: Path) -> dict[str, Any]:
    """The safetensors header of ``path`` (names -> dtype, shape, offsets)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ConfigError(f"{path}: not a safetensors file (shorter than its header)")
            n = int.from_bytes(raw, "little")
            if n > 100 << 20:
                raise ConfigError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found (named by {INDEX})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header


def expected_shapes(c: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, with its full (unsharded) shape."""
    h, d = c.hidden_size, c.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_heads * d, h),
            p + "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, c.num_heads * d),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        }
        if c.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": (c.num_heads * d,),
                p + "self_attn.k_proj.bias": (c.num_kv_heads * d,),
                p + "self_attn.v_proj.bias": (c.num_kv_heads * d,),
            }
        if c.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_layers(config: HFConfig, names: Iterable[str]) -> None:
    """No weight of a layer past the configured count: a config that undercounts the layers
    would serve a truncated model."""
    field = f"{config.model_type}.block_count" if is_gguf(config.path) else "num_hidden_layers"
    for name in sorted(names):
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= config.num_layers:
            raise ConfigError(f"{config.config_file}: {field} = {config.num_layers}, but the weights hold {name!r}")


def _check_shapes(config: HFConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every needed tensor of a GGUF file present, with the shape its metadata implies."""
    for name, shape in expected_shapes(config).items():
        if name not in shapes:
            raise ConfigError(f"{config.path}: weight {name!r} is missing from the file")
        if shapes[name] != shape:
            raise ConfigError(f"{config.path}: weight {name!r} has shape {list(shapes[name])}, the metadata implies {list(shape)}")


def check_weights(config: HFConfig) -> None:
    """Every needed tensor present, with the shape the config implies, in a type this engine
    reads (reads headers only)."""
    if is_gguf(config.path):
        meta = read_metadata(config.path)
        _check_layers(config, meta.shapes)
        _check_shapes(config, meta.shapes)
        meta.check_types()
    else:
        check_files(config)


def check_files(config: HFConfig) -> dict[str, Path]:
    """Every needed tensor present, with the shape ``config.json`` implies (reads headers only)."""
    files = weight_files(config)
    _check_layers(config, files)
    headers: dict[Path, dict[str, Any]] = {}
    for name, shape in expected_shapes(config).items():
        if name not in files:
            raise ConfigError(f"{config.path}: weight {name!r} is missing from the checkpoint")
        path = files[name]
        if path not in headers:
            headers[path] = _header(path)
        meta = headers[path].get(name)
        if not isinstance(meta, dict):
            raise ConfigError(f"{path}: weight {name!r} is missing (named by {INDEX})")
        got = tuple(meta.get("shape", ()))
        if got != shape:
            raise ConfigError(
                f"{path}: weight {name!r} has shape {list(got)}, config.json implies {list(shape)}"
            )
        if meta.get("dtype") not in FLOAT_DTYPES:
            raise ConfigError(
                f"{path}: weight {name!r} has dtype {meta.get('dtype')}, which is not supported "
                f"(supported: {', '.join(FLOAT_DTYPES)}; a quantized checkpoint needs its unquantized original)"
            )
    return files


def weights_digest(config: HFConfig) -> str:
    """sha256 over every tensor's name, dtype, shape and file size (the model identity)."""
    if is_gguf(config.path):
        return read_metadata(config.path).digest()
    files = weight_files(config)
    h = hashlib.sha256()
    for path in sorted(set(files.values())):
        header = _header(path)
        h.update(f"{path.name}:{path.stat().st_size}\n".encode())
        for name in sorted(header):
            h.update(f"{name}:{header[name].get('dtype')}:{header[name].get('shape')}\n".encode())
    return h.hexdigest()


class _Reader:
    """Opens each file once; reads tensors (or row/column slices) as ``dtype`` on ``device``."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: torch.device) -> None:
        from safetensors import safe_open

        self._files = files
        self._open: dict[Path, Any] = {}
        self._safe_open = safe_open
        self.dtype, self.device = dtype, device

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        path = self._files[name]
        try:
            if path not in self._open:
                self._open[path] = self._safe_open(str(path), framework="pt")
            part = self._open[path].get_slice(name)
            if rows is None and cols is None:
                t = part[:]
            elif cols is None:
                t = part[rows]
            else:
                t = part[:, cols]
        except ConfigError:
            raise
        except Exception as exc:  # safetensors' errors are not one class
            raise ConfigError(f"{path}: cannot read weight {name!r} ({exc})") from None
        return t.to(device=self.device, dtype=self.dtype, copy=True).contiguous()  # no view keeps the file mapped

    def close(self) -> None:
        self._open.clear()  # safe_open handles: their mappings go with them


class _GGUFReader:
    """A GGUF file's tensors, dequantized, as ``dtype`` on ``device`` (each a copy: the
    file's mapping is released when the load ends)."""

    def __init__(self, tensors: GGUFTensors, dtype: torch.dtype, device: torch.device) -> None:
        self._tensors = tensors
        self.dtype, self.device = dtype, device

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        t = torch.from_numpy(self._tensors.get(name))
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t.to(device=self.device, dtype=self.dtype, copy=True).contiguous()


def load_weights(c: HFConfig, dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> ModelWeights:
    """This rank's weights: query/KV heads and MLP columns ``[r * n / tp, (r + 1) * n / tp)``.
    The layers are read as :attr:`ModelWeights.layers` is iterated; the files close after
    the last one. ``tp_size`` divides the heads and the MLP width (checked by
    :func:`~pdgrpc.engine.hf.engine.check_checkpoint`)."""
    files = contextlib.ExitStack()
    r: _Reader | _GGUFReader
    if is_gguf(c.path):
        check_weights(c)
        r = _GGUFReader(files.enter_context(GGUFTensors(read_metadata(c.path))), dtype, device)
    else:
        r = _Reader(check_files(c), dtype, device)
        files.callback(r.close)
    with files:
        embed = r.get("model.embed_tokens.weight")
        lm_head = embed if c.tie_word_embeddings else r.get("lm_head.weight")
        norm = r.get("model.norm.weight")
        return ModelWeights(embed=embed, layers=_layers(c, r, tp_rank, tp_size, files.pop_all()), norm=norm, lm_head=lm_head)


def _layers(c: HFConfig, r: "_Reader | _GGUFReader", tp_rank: int, tp_size: int, files: contextlib.ExitStack) -> Iterator[LayerWeights]:
    d = c.head_dim
    nq, nkv, ni = c.num_heads // tp_size, c.num_kv_heads // tp_size, c.intermediate_size // tp_size
    qs = slice(tp_rank * nq * d, (tp_rank + 1) * nq * d)
    ks = slice(tp_rank * nkv * d, (tp_rank + 1) * nkv * d)
    ms = slice(tp_rank * ni, (tp_rank + 1) * ni)
    with files:
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if c.qkv_bias:
                bias = torch.cat([r.get(a + "q_proj.bias", qs), r.get(a + "k_proj.bias", ks), r.get(a + "v_proj.bias", ks)])
            yield LayerWeights(
                input_norm=r.get(p + "input_layernorm.weight"),
                qkv=torch.cat([r.get(a + "q_proj.weight", qs), r.get(a + "k_proj.weight", ks), r.get(a + "v_proj.weight", ks)]),
                qkv_bias=bias,
                q_norm=r.get(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=r.get(a + "k_norm.weight") if c.qk_norm else None,
                o=r.get(a + "o_proj.weight", cols=qs),
                post_norm=r.get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([r.get(p + "mlp.gate_proj.weight", ms), r.get(p + "mlp.up_proj.weight", ms)]),
                down=r.get(p + "mlp.down_proj.weight", cols=ms),
            )
