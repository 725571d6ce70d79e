"""Byte-level tokenizer of the reference engine: one token per UTF-8 byte, plus specials.

Ids ``0..255`` are the bytes themselves, ``256`` is BOS (prepended to every prompt by
default, so even an empty prompt has a token to prefill) and ``257`` is EOS (generation
stops when it is sampled). Any byte string round-trips exactly; text is UTF-8. Generated
ids need not form valid UTF-8: :meth:`ByteTokenizer.decode` replaces broken sequences, and
:meth:`ByteTokenizer.stream_decoder` turns a token stream into text pieces without
splitting a multi-byte character between two pieces. Its chat template is the one its
Hugging Face form carries (:data:`~pdgrpc.engine.tokenizer_files.CHAT_TEMPLATE`), so the
router, the colocated server and smg render a conversation alike.
"""

from __future__ import annotations

import codecs
from typing import Iterable, Sequence

from pdgrpc.engine.errors import check_token_ids
from pdgrpc.engine.tokenizer_files import CHAT_TEMPLATE
from pdgrpc.errors import EngineError

__all__ = ["BOS_ID", "EOS_ID", "VOCAB_SIZE", "ByteTokenizer", "StreamDecoder"]

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258


class StreamDecoder:
    """Incremental detokenizer: feed ids as they are generated, get the text they complete."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Iterable[int]) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Text of any incomplete trailing sequence (as replacement characters)."""
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    eos_token_ids = frozenset({EOS_ID})
    vocab_size = VOCAB_SIZE
    model_type = "pdgrpc-reference"
    chat_template = CHAT_TEMPLATE

    def hf_files(self) -> dict[str, bytes]:
        """This tokenizer as Hugging Face files (:mod:`pdgrpc.engine.tokenizer_files`)."""
        from pdgrpc.engine.tokenizer_files import byte_tokenizer_files

        return byte_tokenizer_files(BOS_ID, EOS_ID, VOCAB_SIZE, self.model_type)

    def token_bytes(self, token_id: int) -> bytes:
        """The output bytes of one token (none for BOS and EOS)."""
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def encode(self, text: str | bytes, add_bos: bool = True) -> list[int]:
        if isinstance(text, str):
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates have no UTF-8 form
                raise EngineError(f"encode: text is not encodable as UTF-8 ({e.reason} at {e.start})") from None
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise EngineError(f"encode: text must be str or bytes, got {type(text).__name__}")
        return ([BOS_ID] if add_bos else []) + list(data)

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The bytes of ``token_ids``, specials dropped."""
        self.check_ids(token_ids, "token_ids")
        return bytes(t for t in token_ids if t < 256)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.decode_bytes(token_ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()

    def check_ids(self, token_ids: Sequence[int], field: str) -> None:
        check_token_ids(token_ids, VOCAB_SIZE, field)
