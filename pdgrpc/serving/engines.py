"""Which engine a server runs: the reference engine, or a checkpoint with ``--model PATH``.

Every server that runs an engine (prefill workers, decode ranks, the colocated server, the
tests' in-process reference) builds it through :func:`build_engine`, so the same flags
give the same engine -- and the same compatibility hash -- everywhere.

``--device`` places either engine (weights, compute, KV pool) on ``cpu`` or ``cuda[:N]``.
``--model`` selects :class:`~pdgrpc.engine.hf.engine.HFEngine` with ``--dtype`` (weights,
activations and KV pool); the reference-engine flags (``--model-size``,
``--model-seed``, ``--kv-dtype``) then do not apply. ``--page-size``, ``--num-pages``,
``--max-prompt-tokens`` and ``--max-seq-len`` apply to both.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import TYPE_CHECKING

from pdgrpc.engine.malloc import release_freed_memory
from pdgrpc.errors import ConfigError
from pdgrpc.serving.flags import engine_config_from_args, fields_named, flag_names

if TYPE_CHECKING:
    from pdgrpc.engine.base import Engine, Tokenizer
    from pdgrpc.engine.hf.engine import HFEngineConfig
    from pdgrpc.engine.model import AllReduce
    from pdgrpc.engine.hf.sizing import Sizing

__all__ = [
    "apply_engine_defaults", "build_engine", "check_engine_args", "engine_limits_argv", "hf_config_from_args",
    "served_tokenizer", "uses_checkpoint",
]

log = logging.getLogger("pdgrpc.serving")


def uses_checkpoint(ns: argparse.Namespace) -> bool:
    return bool(getattr(ns, "model", ""))


def served_tokenizer(ns: argparse.Namespace) -> Tokenizer:
    """The tokenizer of the engine the flags describe, without building the engine
    (torch-free): the checkpoint's with ``--model``, else the byte tokenizer. For servers
    that run no engine in their own process (the prefill controller)."""
    if uses_checkpoint(ns):
        from pdgrpc.engine.hf.tokenizer import load_tokenizer

        return load_tokenizer(ns.model)
    from pdgrpc.engine.tokenizer import ByteTokenizer

    return ByteTokenizer()


def apply_engine_defaults(ns: argparse.Namespace, *, tp_size: int = 1) -> None:
    """Fill ``--max-seq-len``, ``--max-prompt-tokens`` and ``--num-pages`` where the flags
    left them unset: the reference engine's defaults, or what the checkpoint and this
    machine's memory decide (:mod:`pdgrpc.engine.hf.sizing`; :func:`build_engine` logs the
    sizing). Idempotent: a process that starts others resolves them once and passes them
    on (:func:`engine_limits_argv`), so a TP group agrees."""
    if None not in (ns.max_seq_len, ns.max_prompt_tokens, ns.num_pages):
        return
    if not uses_checkpoint(ns):
        cfg = engine_config_from_args(ns, tp_size=tp_size)
        ns.max_seq_len, ns.max_prompt_tokens, ns.num_pages = cfg.max_seq_len, cfg.max_prompt_tokens, cfg.num_pages
        return
    with _checkpoint_fields_named(ns):
        s = _sizing(ns, tp_size)
    ns.max_seq_len, ns.max_prompt_tokens, ns.num_pages = s.max_seq_len, s.max_prompt_tokens, s.num_pages


def _sizing(ns: argparse.Namespace, tp_size: int) -> "Sizing":
    from pdgrpc.engine.hf.config import load_config
    from pdgrpc.engine.hf.sizing import DTYPE_BYTES, available_memory, checkpoint_sizing

    return checkpoint_sizing(
        load_config(ns.model), dtype_bytes=DTYPE_BYTES[ns.dtype], page_size=ns.page_size, tp_size=tp_size,
        max_seq_len=ns.max_seq_len, max_prompt_tokens=ns.max_prompt_tokens, num_pages=ns.num_pages,
        available=available_memory(ns.device),
    )


def engine_limits_argv(ns: argparse.Namespace) -> list[str]:
    """The resolved ``--max-seq-len``, ``--max-prompt-tokens`` and ``--num-pages``, as
    flags for a process started with this one's other flags (a TP rank)."""
    return ["--max-seq-len", str(ns.max_seq_len), "--max-prompt-tokens", str(ns.max_prompt_tokens), "--num-pages", str(ns.num_pages)]


def hf_config_from_args(ns: argparse.Namespace, *, tp_rank: int = 0, tp_size: int = 1, threads: int = 1) -> "HFEngineConfig":
    """The :class:`HFEngineConfig` the flags describe, its unset sizes filled
    (:func:`apply_engine_defaults`); ConfigError naming the flags for sizes it refuses."""
    from pdgrpc.engine.hf.engine import HFEngineConfig

    apply_engine_defaults(ns, tp_size=tp_size)
    with _checkpoint_fields_named(ns):
        return HFEngineConfig(
            model=ns.model, dtype=ns.dtype, device=ns.device, page_size=ns.page_size, num_pages=ns.num_pages,
            max_seq_len=ns.max_seq_len, max_prompt_tokens=ns.max_prompt_tokens, tp_rank=tp_rank, tp_size=tp_size,
            threads=threads,
        )


# The flag that sets each HFEngineConfig field: a refusal names what the user typed, not the field.
_CHECKPOINT_FLAGS = {
    "model": "--model",
    "dtype": "--dtype",
    "device": "--device",
    "page_size": "--page-size",
    "num_pages": "--num-pages",
    "max_seq_len": "--max-seq-len",
    "max_prompt_tokens": "--max-prompt-tokens",
    "tp_size": "--tp-size",
}


def _checkpoint_fields_named(ns: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """Refusals of the checkpoint engine's configuration worded with the flags; a field of
    the checkpoint itself (``model.<name>``) is named after the file it comes from."""
    from pdgrpc.engine.hf.config import config_file

    return fields_named(flag_names(_CHECKPOINT_FLAGS, lambda field: f"{config_file(ns.model)} {field}"))


def check_engine_args(ns: argparse.Namespace, *, tp_size: int = 1) -> None:
    """Raise ConfigError (naming the file or field) for flags no engine can start with;
    reads a checkpoint's config, tokenizer and weight headers, not its weights. Fills the
    sizes the flags left unset first (:func:`apply_engine_defaults`)."""
    apply_engine_defaults(ns, tp_size=tp_size)
    if uses_checkpoint(ns):
        from pdgrpc.engine.hf.engine import check_checkpoint

        config = hf_config_from_args(ns, tp_size=tp_size)
        with _checkpoint_fields_named(ns):
            check_checkpoint(config)
        sizing = _sizing(ns, tp_size)
        kv_bytes, weights_bytes = sizing.kv_bytes, sizing.weights_bytes
    else:
        kv_bytes, weights_bytes = engine_config_from_args(ns, tp_size=tp_size).kv_layout().pool_bytes, 0
    _check_memory(ns, kv_bytes, weights_bytes)


def _check_memory(ns: argparse.Namespace, kv_bytes: int, weights_bytes: int) -> None:
    """Refuse a ``--num-pages`` whose KV pool (with the weights) is more than the device
    has free: allocated, it fails with a traceback, or on a CPU it is faulted in until the
    kernel kills a process."""
    from pdgrpc.engine.hf.sizing import available_memory

    device = getattr(ns, "device", "cpu")
    available = available_memory(device)
    if available is None or kv_bytes + weights_bytes <= available:
        return
    weights = f" besides {weights_bytes / 1e9:.2f} GB of weights" if weights_bytes else ""
    # Both flags are named: the pool is their product, and either may be the one typed.
    raise ConfigError(
        f"--num-pages {ns.num_pages} of --page-size {ns.page_size} tokens: the KV pool needs {kv_bytes / 1e9:.2f} GB"
        f"{weights}, more than the {available / 1e9:.2f} GB available on {device}; pass a smaller --num-pages or --page-size"
    )


def build_engine(ns: argparse.Namespace, *, tp_rank: int = 0, tp_size: int = 1, all_reduce: AllReduce | None = None) -> Engine:
    """The engine the flags describe (this TP rank of it). A checkpoint engine computes on
    ``--compute-threads`` torch threads where the server has that flag (prefill workers),
    else on one, like the reference engine."""
    if uses_checkpoint(ns):
        from pdgrpc.engine.hf.engine import HFEngine

        try:
            threads = int(getattr(ns, "compute_threads", 1))  # at least 1: the flag's type
            config = hf_config_from_args(ns, tp_rank=tp_rank, tp_size=tp_size, threads=threads)
            with _checkpoint_fields_named(ns):
                engine: Engine = HFEngine(config, all_reduce)
        except ImportError as exc:
            raise ConfigError(f"--model needs pdgrpc[hf] (safetensors, tokenizers): {exc}") from None
        release_freed_memory()  # the plain weights, freed once repacked for their kernels
        log.info("engine: %s (%s, %s)", engine.model_id, ns.dtype, ns.device)
        log.info("sizing: %s", _sizing(ns, tp_size).describe())
        return engine
    from pdgrpc.engine.reference import ReferenceEngine

    return ReferenceEngine(engine_config_from_args(ns, tp_rank=tp_rank, tp_size=tp_size), all_reduce)
