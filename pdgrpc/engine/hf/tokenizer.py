"""A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

Torch-free (the router tokenizes text prompts with it). A GGUF file's tokenizer is the
``tokenizer.json`` its metadata converts to (:mod:`pdgrpc.engine.hf.gguf`). Encoding applies the
tokenizer's own post-processor (a Llama ``tokenizer.json`` prepends BOS there; a Qwen one
adds nothing), as ``transformers`` does with ``add_special_tokens=True``. EOS ids come
from ``generation_config.json`` (else ``config.json``, else ``tokenizer_config.json``'s
``eos_token``). The chat template is the one ``transformers`` loads (:func:`read_chat_template`).
``hf_files()`` is the directory's tokenizer files, for front ends that
tokenize themselves (smg); ``token_bytes`` maps a token to its output bytes through the
vocabulary (byte-level BPE's symbol map, SentencePiece's ``▁`` and ``<0xNN>``).
:class:`HFStreamDecoder` turns generated ids into text pieces that never
split a UTF-8 character (nor a byte-fallback sequence) between two pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from pdgrpc.engine.chat_template import check as check_chat_template
from pdgrpc.engine.errors import check_token_ids
from pdgrpc.engine.hf.config import HFConfig, load_config, read_json
from pdgrpc.engine.hf.gguf import is_gguf, read_metadata, tokenizer_json
from pdgrpc.engine.tokenizer_files import byte_symbols, read_tokenizer_files
from pdgrpc.errors import ConfigError, EngineError

__all__ = ["HFStreamDecoder", "HFTokenizer", "load_tokenizer", "read_chat_template"]


def _special(tok_cfg: dict[str, Any], key: str) -> str | None:
    value = tok_cfg.get(key)
    if isinstance(value, dict):  # transformers 4.x AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """A checkpoint directory's chat template, looked up where ``transformers`` looks:
    ``chat_template.jinja`` (where transformers 5 saves it), then ``chat_template.json``,
    then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
    templates whose ``default`` is taken). None when there is none."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return check_chat_template(jinja.read_text(encoding="utf-8"), jinja)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{jinja}: cannot read the chat template ({exc})") from None
    source = directory / "chat_template.json"
    value = read_json(source).get("chat_template") if source.is_file() else None
    if value is None:
        source, value = directory / "tokenizer_config.json", tokenizer_config.get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return check_chat_template(value, source) if isinstance(value, str) and value else None


class HFStreamDecoder:
    """Incremental detokenizer: decodes a sliding window of ids and emits only text that
    is final (no trailing U+FFFD from an incomplete byte sequence)."""

    def __init__(self, tokenizer: "HFTokenizer") -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # first id of the decoding window
        self._read = 0  # ids before this have been emitted

    def feed(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is left, incomplete sequences as replacement characters."""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]


class HFTokenizer:
    """The :class:`~pdgrpc.engine.base.Tokenizer` of a checkpoint directory."""

    def __init__(self, config: HFConfig) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ConfigError("--model needs the 'tokenizers' package: pip install 'pdgrpc[hf]'") from None
        self.tokenizer_config: dict[str, Any]
        if is_gguf(config.path):
            path = config.path
            text, self.tokenizer_config = tokenizer_json(read_metadata(path))
            self._tok = tokenizers.Tokenizer.from_str(text)
        else:
            path = config.path / "tokenizer.json"
            if not path.is_file():
                raise ConfigError(f"{path}: file not found (the checkpoint's tokenizer)")
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a plain Exception on a bad file
                raise ConfigError(f"{path}: not a valid tokenizer ({exc})") from None
            tc_path = config.path / "tokenizer_config.json"
            self.tokenizer_config = read_json(tc_path) if tc_path.exists() else {}
        self.name = config.name
        self.path = config.path
        self.vocab_size = config.vocab_size
        self.model_type = config.model_type or config.architecture
        self._token_bytes: list[bytes] | None = None  # built on first use
        if self._tok.get_vocab_size(with_added_tokens=True) > config.vocab_size:
            raise ConfigError(
                f"{path}: the tokenizer has {self._tok.get_vocab_size(with_added_tokens=True)} tokens, more than "
                f"config.json's vocab_size = {config.vocab_size}"
            )
        eos = config.eos_token_ids
        if not eos:
            name = _special(self.tokenizer_config, "eos_token")
            tid = self._tok.token_to_id(name) if name else None
            eos = (tid,) if tid is not None else ()
        if not eos:
            raise ConfigError(f"{config.path}: no EOS token id in generation_config.json, config.json or tokenizer_config.json")
        self.eos_token_ids = frozenset(eos)
        self.eos_token_id = eos[0]
        bos = config.bos_token_id
        self.bos_token_id = bos if bos is not None else -1  # -1: this tokenizer has no BOS
        self.chat_template = read_chat_template(config.path, self.tokenizer_config)

    def encode(self, text: str | bytes, add_bos: bool = True) -> list[int]:
        if isinstance(text, (bytes, bytearray, memoryview)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EngineError(f"encode: prompt is not UTF-8 ({exc.reason} at {exc.start})") from None
        if not isinstance(text, str):
            raise EngineError(f"encode: text must be str or bytes, got {type(text).__name__}")
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_bos).ids
        return ids

    def special_token(self, key: str) -> str | None:
        """``bos_token``, ``eos_token``, ... as ``tokenizer_config.json`` names them."""
        return _special(self.tokenizer_config, key)

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=True)
        return text

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)

    def hf_files(self) -> dict[str, bytes]:
        """The checkpoint's tokenizer files (:func:`~pdgrpc.engine.tokenizer_files.read_tokenizer_files`),
        or those a GGUF file's metadata converts to."""
        return read_metadata(self.path).tokenizer_files() if is_gguf(self.path) else read_tokenizer_files(self.path)

    def token_bytes(self, token_id: int) -> bytes:
        """The output bytes of one token: none for special tokens and ids past the tokenizer."""
        if self._token_bytes is None:
            self._token_bytes = self._bytes_table()
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def _bytes_table(self) -> list[bytes]:
        import tokenizers

        unbyte = {sym: b for b, sym in enumerate(byte_symbols())}
        byte_level = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        table: list[bytes] = []
        for i in range(self._tok.get_vocab_size(with_added_tokens=True)):
            piece = self._tok.id_to_token(i)
            if piece is None or i in special:
                table.append(b"")
            elif byte_level and all(c in unbyte for c in piece):
                table.append(bytes(unbyte[c] for c in piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
                table.append(bytes((int(piece[3:5], 16),)))
            else:
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
        return table

    def check_ids(self, token_ids: Sequence[int], field: str) -> None:
        check_token_ids(token_ids, self.vocab_size, field)


def load_tokenizer(model: str | Path) -> HFTokenizer:
    return HFTokenizer(load_config(model))
