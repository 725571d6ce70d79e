"""Command-line flags shared by the servers, and what they build.

Engine flags
------------
Prefill and decode must run the *same* model with the same KV layout, or the
compatibility hash in every handshake differs and every request is refused. Both
servers therefore add :func:`add_engine_arguments` and build their engine config with
:func:`engine_config_from_args`; a router that runs a colocated reference (``bench e2e``)
does the same. Only ``--num-pages`` may differ between instances (it is not part of the
hash).

Transport flags
---------------
``--transport fake|tcp|rdma`` (default ``rdma``) and ``--transport-host`` (the address
the data plane listens on / advertises). :func:`create_transport` instantiates the
backend through :mod:`pdgrpc.transport.registry`, passing only the options that backend
accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pdgrpc.argtypes import whole_number
from pdgrpc.engine.config import DEFAULT_MAX_PROMPT_TOKENS, MODEL_SEED_LIMIT, EngineConfig, ModelConfig, default_max_prompt_tokens
from pdgrpc.engine.malloc import KEEP_MAX_MIB, keep_freed_memory
from pdgrpc.errors import ConfigError
from pdgrpc.serving.logs import add_logging_arguments  # re-exported: it lives with the logging (torch-free)
from pdgrpc.transport import registry
from pdgrpc.transport.base import Transport

__all__ = [
    "MAX_CHUNK_TOKENS",
    "MODEL_SIZES",
    "add_engine_arguments",
    "add_logging_arguments",
    "add_transport_arguments",
    "chunk_tokens",
    "create_transport",
    "engine_config_from_args",
    "fields_named",
    "flag_names",
    "transport_options_from_args",
    "tune_malloc_from_args",
]

log = logging.getLogger("pdgrpc.serving")

# Named model shapes. "default" is ModelConfig's defaults; "tiny" keeps tests and demos on
# small CPUs fast. Every field here is part of the compatibility hash.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "default": {},
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
}

_D = EngineConfig()

# Most prompt tokens one chunk computes (--chunk-size, a decode's --local-prefill-chunk): a
# chunk is one forward pass, whose activations for a million tokens outgrow any host, and a
# chunk longer than a prompt computes it whole, so a larger value is a typing error.
MAX_CHUNK_TOKENS = 1 << 20
# The argparse type of a chunk's size, on every server that computes prompts in chunks.
chunk_tokens = whole_number(1, "tokens", maximum=MAX_CHUNK_TOKENS)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the reference-engine flags (``--model-size``, ``--model-seed``, ``--page-size``,
    ``--num-pages``, ``--kv-huge-pages``, ``--malloc-keep-mib``, ``--compute-nice``,
    ``--kv-dtype``, ``--max-prompt-tokens``, ``--max-seq-len``), and ``--model``, ``--dtype``,
    ``--device`` (a checkpoint instead, see :mod:`pdgrpc.serving.engines`)."""
    g = parser.add_argument_group("engine (prefill and decode must agree, except --num-pages)")
    g.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="default",
        help="shape of the reference transformer: 'default' (4 layers, hidden 256, 8 query / 2 KV heads) "
        "or 'tiny' (2 layers, hidden 128, 4 query / 2 KV heads). Default: %(default)s",
    )
    g.add_argument(
        "--model-seed", type=whole_number(0, maximum=MODEL_SEED_LIMIT - 1), default=0,
        help="seed the weights are drawn from (nothing is downloaded): a whole number in [0, 2**64). Default: %(default)s",
    )
    g.add_argument("--page-size", type=whole_number(1, "tokens"), default=_D.page_size, help="tokens per KV page. Default: %(default)s")
    g.add_argument(
        "--num-pages", type=whole_number(1, "pages"), default=None,
        help=f"KV pool size of each worker, in pages. Default: {_D.num_pages} for the reference engine; with --model, "
        "room for two --max-seq-len sequences, capped by a quarter of the memory available after the weights (the "
        "sizing is logged at start-up)",
    )
    g.add_argument(
        "--kv-huge-pages",
        action="store_true",
        help="allocate the KV pool in transparent huge pages (2 MiB-aligned, MADV_HUGEPAGE): transfers of many "
        "MiB over rdma get up to ~2x faster (UCX pins memory page by page); no difference measured at 512-token "
        "prompts. A prefill worker's pool with --compute-in process is shared memory, which gets huge pages only "
        "where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows. Memory placement only: prefill and decode "
        "need not agree. Default: off",
    )
    g.add_argument(
        "--malloc-keep-mib",
        type=whole_number(0, maximum=KEEP_MAX_MIB),
        default=256,
        help="glibc malloc in this process: serve allocations up to 32 MiB from the heap and keep up to this "
        "many MiB of freed memory instead of returning it to the kernel (the compute's temporaries otherwise "
        "page-fault in anew on every forward pass: measured ~25%% slower prefill). 0 leaves glibc's defaults; "
        "MALLOC_*_ variables or glibc.malloc tunables in the environment take precedence. Process-local: "
        "instances need not agree. Default: %(default)s",
    )
    g.add_argument(
        "--compute-nice",
        type=_nice_value,
        default=10,
        help="nice value added to the engine's compute thread(s), or to a prefill worker's whole compute "
        "process (--compute-in process) (Linux): when the compute and the serving "
        "work (RPCs, KV transfers, sending a token) want the same core, the serving work goes first and the "
        "compute takes the rest; the total CPU is the same (measured on 2 cores: 0.2-0.4 ms less TTFT over "
        "rdma). 0 keeps the compute at the process's priority: use it on a host shared with other programs "
        "that must not get ahead of inference. Process-local: instances need not agree. Default: %(default)s",
    )
    g.add_argument(
        "--kv-dtype",
        choices=["float32", "float16", "bfloat16"],
        default=_D.kv_dtype,
        help="dtype of the KV pool. Default: %(default)s",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=whole_number(1, "tokens"),
        default=None,
        help=f"longest prompt accepted, in tokens; longer ones are refused with INVALID_ARGUMENT. Default: "
        f"{DEFAULT_MAX_PROMPT_TOKENS}, or --max-seq-len - 1 when that is less",
    )
    g.add_argument(
        "--max-seq-len",
        type=whole_number(1, "tokens"),
        default=None,
        help=f"most tokens (prompt + generated) one request may reach. Default: {_D.max_seq_len} for the reference "
        "engine; with --model, the checkpoint's max_position_embeddings, capped so that one sequence's KV fits in "
        "memory",
    )
    g.add_argument(
        "--model", metavar="PATH", default="",
        help="serve a Hugging Face checkpoint from this local directory (config.json, *.safetensors, tokenizer.json; "
        "Llama, Mistral, Qwen2, Qwen3; needs pdgrpc[hf]) or a GGUF file (FILE.gguf: llama, qwen2, qwen3; any "
        "quantization type the gguf package dequantizes, dequantized to --dtype; tokenizer and chat template from "
        "its metadata; needs pdgrpc[gguf]) instead of the reference engine. Default: the reference engine",
    )
    g.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
        help="with --model: dtype of the weights, activations and KV pool (bytes per parameter: 4, 2, 2). "
        "Default: %(default)s",
    )
    g.add_argument(
        "--device", default="cpu",
        help="torch device of the weights, compute and KV pool: cpu, cuda or cuda:N (metadata rows stay in host "
        "memory; see docs/gpu.md). Default: %(default)s",
    )


def engine_config_from_args(ns: argparse.Namespace, *, tp_rank: int = 0, tp_size: int = 1) -> EngineConfig:
    """The :class:`EngineConfig` the engine flags describe; ConfigError naming the flags
    (with the values typed) for sizes the configuration refuses. An unset
    ``--max-prompt-tokens`` stays under ``--max-seq-len``
    (:func:`~pdgrpc.engine.config.default_max_prompt_tokens`), so a refusal names
    ``--max-prompt-tokens`` only where the user typed it."""
    max_seq_len = _D.max_seq_len if ns.max_seq_len is None else ns.max_seq_len
    max_prompt_tokens = default_max_prompt_tokens(max_seq_len) if ns.max_prompt_tokens is None else ns.max_prompt_tokens
    with fields_named(_model_flag):
        model = ModelConfig(seed=ns.model_seed, **MODEL_SIZES[ns.model_size])
    with fields_named(flag_names(_ENGINE_FLAGS, _model_flag)):
        return EngineConfig(
            model=model,
            page_size=ns.page_size,
            num_pages=_D.num_pages if ns.num_pages is None else ns.num_pages,
            kv_dtype=ns.kv_dtype,
            max_seq_len=max_seq_len,
            max_prompt_tokens=max_prompt_tokens,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kv_huge_pages=getattr(ns, "kv_huge_pages", False),
            device=getattr(ns, "device", "cpu"),
        )


# The flag that sets each EngineConfig field: a refusal names what the user typed, not the field.
_ENGINE_FLAGS = {
    "page_size": "--page-size",
    "num_pages": "--num-pages",
    "kv_dtype": "--kv-dtype",
    "max_seq_len": "--max-seq-len",
    "max_prompt_tokens": "--max-prompt-tokens",
    "tp_size": "--tp-size",
    "kv_huge_pages": "--kv-huge-pages",
    "device": "--device",
}
# ModelConfig's: --model-size sets the shape whole, so a shape field is named as the model's.
_MODEL_FLAGS = {"seed": "--model-seed"}


def _model_flag(field: str) -> str:
    return _MODEL_FLAGS.get(field, f"the model's {field}")


def flag_names(flags: Mapping[str, str], model: Callable[[str], str]) -> Callable[[str], str]:
    """How a refusal names an engine configuration's field to a user of the flags: by the
    flag in ``flags`` that sets it, a field of the model it runs (``model.<name>``) as
    ``model(name)``, and a field no flag sets (tp_rank: the server's own) by its name."""

    def name(field: str) -> str:
        if field.startswith("model."):
            return model(field.removeprefix("model."))
        return flags.get(field, field)

    return name


@contextlib.contextmanager
def fields_named(name: Callable[[str], str]) -> Iterator[None]:
    """Within: a configuration's refusal (a ConfigError with ``fields``) is raised again
    with each field called ``name(field)``, the flag the user typed rather than the field;
    any other error passes as it is."""
    try:
        yield
    except ConfigError as exc:
        if not exc.fields:
            raise
        raise ConfigError(exc.worded(name)) from None


def _nice_value(text: str) -> int:
    value = _non_negative_int(text)
    if value > 19:
        raise argparse.ArgumentTypeError(f"must be in [0, 19] (the range of nice values), got {value}")
    return value


_non_negative_int = whole_number(0)


def tune_malloc_from_args(ns: argparse.Namespace) -> None:
    """Apply ``--malloc-keep-mib`` to this process (see :mod:`pdgrpc.engine.malloc`);
    call once, at start-up, in a process that runs an engine."""
    outcome = keep_freed_memory(ns.malloc_keep_mib << 20)
    log.info("malloc: %s (--malloc-keep-mib %d)", outcome, ns.malloc_keep_mib)


def add_transport_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--transport`` and ``--transport-host``."""
    g = parser.add_argument_group("transport (data plane; KV bytes never travel over gRPC)")
    g.add_argument(
        "--transport",
        default="rdma",
        help="KV transport backend: 'rdma' (UCX: RDMA verbs where present, else UCX tcp/shm), 'tcp' "
        "(asyncio sockets), 'fake' (moves no bytes; warm-up and tests), or a third-party name / "
        "'module:Class'. Prefill and decode must use the same one. Default: %(default)s",
    )
    g.add_argument(
        "--transport-host",
        default="127.0.0.1",
        help="address the transport listens on and advertises to peers. Default: %(default)s",
    )


def transport_options_from_args(ns: argparse.Namespace, cls: type[Transport], tp_rank: int = 0) -> dict[str, Any]:
    """Keyword options for backend ``cls``: only those its constructor takes (``host``:
    ``--transport-host``; ``tp_rank``: the TP rank of the process it serves)."""
    params = inspect.signature(cls.__init__).parameters
    opts: dict[str, Any] = {}
    if "host" in params:
        opts["host"] = ns.transport_host
    if "tp_rank" in params:
        opts["tp_rank"] = tp_rank
    return opts


def create_transport(ns: argparse.Namespace, tp_rank: int = 0) -> Transport:
    """Instantiate the backend ``--transport`` names (TransportUnavailable with an install hint if it cannot load)."""
    cls = registry.load(ns.transport)
    return cls(**transport_options_from_args(ns, cls, tp_rank))

