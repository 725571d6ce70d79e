"""A tokenizer as the Hugging Face files that a front end which tokenizes itself loads.

smg, SGLang's model gateway, tokenizes prompts and detokenizes outputs itself, from the
files a worker streams it (``GetTokenizer``). Every :class:`~pdgrpc.engine.base.Tokenizer`
gives them through ``hf_files()``:

* a checkpoint's tokenizer (:func:`read_tokenizer_files`): the tokenizer files of its
  directory that exist among :data:`TOKENIZER_FILES` and ``*.jinja`` (chat templates),
  as they are on disk. ``tokenizer.json`` must be there; a missing, unreadable or too
  large file raises :class:`TokenizerFilesError` naming it.
* the reference engine's byte tokenizer (:func:`byte_tokenizer_files`, ids 0..255 are
  bytes, 256 BOS, 257 EOS):

  - ``tokenizer.json``: a BPE model with no merges over the 256 byte-level symbols
    (GPT-2's byte-to-unicode map, :func:`byte_symbols`), so every byte is one token whose
    id is the byte's value; the ``ByteLevel`` decoder turns ids back into the bytes. BOS
    and EOS are special added tokens; a post-processor prepends BOS, as
    :meth:`ByteTokenizer.encode` does.
  - ``tokenizer_config.json``: BOS/EOS names and a trivial chat template (``role:
    content`` lines, then ``assistant: `` when a generation prompt is asked for).
  - ``config.json``: the ids smg reads for EOS/BOS and the vocabulary size.

Torch-free: the prefill controller serves them without an engine in its process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from pdgrpc.errors import EngineError

__all__ = [
    "BOS_TOKEN", "CHAT_TEMPLATE", "EOS_TOKEN", "MAX_FILE_BYTES", "TOKENIZER_FILES", "TokenizerFilesError",
    "byte_symbols", "byte_tokenizer_files", "read_tokenizer_files",
]

# What smg (and SGLang's and vLLM's servicers) put in the bundle, where present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json", "chat_template.jinja",
)
REQUIRED_FILE = "tokenizer.json"  # smg loads nothing without it
MAX_FILE_BYTES = 64 << 20  # per file; the largest published tokenizer.json files are ~35 MB

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class TokenizerFilesError(EngineError):
    """A tokenizer file that cannot be served (missing, unreadable, too large); the
    message names the file."""


def read_tokenizer_files(directory: str | Path, max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, bytes]:
    """File name -> content of the tokenizer files in ``directory`` (see the module doc)."""
    root = Path(directory)
    names = [n for n in TOKENIZER_FILES if (root / n).is_file()]
    names += sorted(p.name for p in root.glob("*.jinja") if p.is_file() and p.name not in names)
    if REQUIRED_FILE not in names:
        raise TokenizerFilesError(f"{root / REQUIRED_FILE}: file not found (the tokenizer a front end needs)")
    files: dict[str, bytes] = {}
    for name in names:
        path = root / name
        try:
            size = path.stat().st_size
            if size > max_file_bytes:
                raise TokenizerFilesError(f"{path}: {size} bytes, over the limit of {max_file_bytes} bytes per tokenizer file")
            files[name] = path.read_bytes()
        except OSError as exc:
            raise TokenizerFilesError(f"{path}: cannot read ({exc.strerror})") from None
    return files


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte 0..255 (GPT-2's byte-level map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = 0
    out: list[str] = []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _byte_tokenizer_json(bos_id: int, eos_id: int) -> dict[str, object]:
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    special = [
        {"id": bos_id, "content": BOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
        {"id": eos_id, "content": EOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }


def byte_tokenizer_files(bos_id: int, eos_id: int, vocab_size: int, model_type: str) -> dict[str, bytes]:
    """File name -> content of the byte tokenizer in Hugging Face form (see the module doc)."""
    config = {
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    model_config = {"model_type": model_type, "bos_token_id": bos_id, "eos_token_id": eos_id, "vocab_size": vocab_size}
    files: Mapping[str, object] = {
        "tokenizer.json": _byte_tokenizer_json(bos_id, eos_id), "tokenizer_config.json": config, "config.json": model_config,
    }
    return {name: json.dumps(body, indent=1, ensure_ascii=False).encode("utf-8") for name, body in files.items()}
