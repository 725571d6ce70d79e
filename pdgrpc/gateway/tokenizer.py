"""The reference engine's byte tokenizer as Hugging Face tokenizer files, for smg.

smg tokenizes prompts and detokenizes outputs itself, so it needs the worker's tokenizer
in Hugging Face form. :func:`tokenizer_files` writes the byte tokenizer
(:mod:`pdgrpc.engine.tokenizer`: ids 0..255 are bytes, 256 BOS, 257 EOS) as:

* ``tokenizer.json``: a BPE model with no merges over the 256 byte-level symbols (GPT-2's
  byte-to-unicode map), so every byte is one token whose id is the byte's value; the
  ``ByteLevel`` decoder turns ids back into the bytes. BOS and EOS are special added
  tokens; a post-processor prepends BOS, as :meth:`ByteTokenizer.encode` does.
* ``tokenizer_config.json``: BOS/EOS names and a trivial chat template
  (``role: content`` lines, then ``assistant: `` when a generation prompt is asked for).
* ``config.json``: the ids smg reads for EOS/BOS and the vocabulary size.

:func:`tokenizer_zip` packs them as the ``GetTokenizer`` stream carries them (a zip and
its sha256).
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from typing import Mapping

from pdgrpc.engine.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE

__all__ = ["BOS_TOKEN", "CHAT_TEMPLATE", "EOS_TOKEN", "byte_symbols", "tokenizer_files", "tokenizer_zip"]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


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


def _tokenizer_json() -> dict[str, object]:
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    special = [
        {"id": BOS_ID, "content": BOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
        {"id": EOS_ID, "content": EOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
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
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [BOS_ID], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }


def tokenizer_files() -> dict[str, bytes]:
    """File name -> content of the byte tokenizer in Hugging Face form (see the module doc)."""
    config = {
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    model_config = {"model_type": "pdgrpc-reference", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "vocab_size": VOCAB_SIZE}
    files: Mapping[str, object] = {"tokenizer.json": _tokenizer_json(), "tokenizer_config.json": config, "config.json": model_config}
    return {name: json.dumps(body, indent=1, ensure_ascii=False).encode("utf-8") for name, body in files.items()}


def tokenizer_zip(files: Mapping[str, bytes] | None = None) -> tuple[bytes, str]:
    """``(zip bytes, sha256 hex of them)`` of ``files`` (default: :func:`tokenizer_files`)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, body in sorted((files or tokenizer_files()).items()):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: same bytes, same sha256
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, body)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
