"""The ``GetTokenizer`` bundle: a tokenizer's Hugging Face files as one zip and its sha256.

smg loads the served model's tokenizer from this stream: the zip's bytes in chunks, the
last one carrying the sha256 (hex) of the whole zip; smg checks it, extracts the zip and
loads ``tokenizer.json`` (and the chat template of ``tokenizer_config.json``). The
files come from the engine's tokenizer (``Tokenizer.hf_files()``: the checkpoint's own
files, or the reference engine's byte tokenizer exported, see
:mod:`pdgrpc.engine.tokenizer_files`). The zip is deterministic: same files, same bytes,
same sha256. smg refuses a bundle over :data:`MAX_BUNDLE_BYTES`; so does
:func:`tokenizer_zip`, naming the size.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from typing import Mapping

from pdgrpc.engine.tokenizer_files import TokenizerFilesError

__all__ = ["MAX_BUNDLE_BYTES", "tokenizer_zip"]

MAX_BUNDLE_BYTES = 200 * 1024 * 1024  # smg 1.13.0's limit on the zip


def tokenizer_zip(files: Mapping[str, bytes], max_bytes: int = MAX_BUNDLE_BYTES) -> tuple[bytes, str]:
    """``(zip bytes, sha256 hex of them)`` of ``files`` (name -> content)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, body in sorted(files.items()):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: same bytes, same sha256
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, body)
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise TokenizerFilesError(f"the tokenizer bundle ({', '.join(sorted(files))}) is {len(data)} bytes zipped, over smg's limit of {max_bytes}")
    return data, hashlib.sha256(data).hexdigest()
