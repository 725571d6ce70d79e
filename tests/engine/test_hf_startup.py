"""A bad checkpoint stops a server at start-up with a message naming the file or field.

``python -m pdgrpc.prefill`` checks the checkpoint in its controller before any worker
starts (called in-process here: ``main`` exits 2 through argparse); the decode server is
run as a real process once. Also: the tokenizer's incremental decoding never splits a
UTF-8 character, and chat messages render as ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.engine.hf.engine import HFEngineConfig, check_checkpoint
from pdgrpc.engine.hf.tokenizer import load_tokenizer
from pdgrpc.errors import ConfigError
from pdgrpc.prefill.__main__ import main as prefill_main
from pdgrpc.serving.prompts import request_ids
from pdgrpc.v1 import generate_pb2

transformers = pytest.importorskip("transformers", reason="builds the checkpoints (test extra)")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _breakages(src: Path, tmp: Path) -> list[tuple[str, Path, str]]:
    """(what, checkpoint directory, text the refusal must contain)."""
    out = []
    d = _copy(src, tmp / "no-config")
    (d / "config.json").unlink()
    out.append(("missing config.json", d, "config.json: file not found"))
    d = _copy(src, tmp / "bad-config")
    (d / "config.json").write_text("{not json")
    out.append(("corrupt config.json", d, "config.json: not valid JSON"))
    d = _copy(src, tmp / "arch")
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    out.append(("unsupported architecture", d, "'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"))
    d = _copy(src, tmp / "shape")
    _edit_config(d, intermediate_size=96)
    out.append(("weight shape", d, "weight 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], config.json implies [96, 64]"))
    d = _copy(src, tmp / "no-tokenizer")
    (d / "tokenizer.json").unlink()
    out.append(("missing tokenizer", d, "tokenizer.json: file not found"))
    d = _copy(src, tmp / "bad-shard")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\xff" * 64)
    out.append(("corrupt weights file", d, f"{shard.name}: not a safetensors file"))
    d = _copy(src, tmp / "no-shard")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    out.append(("missing weights file", d, f"{shard.name}: file not found"))
    return out


def test_bad_checkpoints_are_refused_naming_the_file_or_field(hf_checkpoint, tmp_path, capsys):
    for what, path, message in _breakages(hf_checkpoint("llama"), tmp_path):
        with pytest.raises(ConfigError) as err:
            check_checkpoint(HFEngineConfig(str(path)))
        assert message in str(err.value), what
        with pytest.raises(SystemExit) as ei:  # the prefill controller, before any worker starts
            prefill_main(["--model", str(path), "--transport", "tcp"])
        assert ei.value.code == 2 and message in capsys.readouterr().err, what


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_naming_the_fields(hf_checkpoint):
    # Fields, not flags: the serving layer names the flags (tests/test_server_flags.py).
    with pytest.raises(ConfigError) as err:
        check_checkpoint(HFEngineConfig(str(hf_checkpoint("qwen2")), tp_size=3))
    assert err.value.fields == {"tp_size": 3, "model.num_heads": 4}
    assert str(err.value) == "HFEngineConfig.tp_size 3 must divide HFEngineConfig.model.num_heads (4)"


def test_decode_process_exits_nonzero_on_an_unsupported_architecture(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("llama"), tmp_path / "arch")
    _edit_config(d, architectures=["FalconForCausalLM"])
    proc = subprocess.run(
        [sys.executable, "-m", "pdgrpc.decode", "--model", str(d), "--transport", "tcp", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "'FalconForCausalLM' is not supported; supported: LlamaForCausalLM" in proc.stderr + proc.stdout


def test_stream_decoding_never_splits_a_character(hf_checkpoint):
    tok = load_tokenizer(hf_checkpoint("qwen2"))
    text = "Grüße aus Köln: naïve café, 東京と大阪, こんにちは世界 🙂🚀 ü."
    ids = tok.encode(text)
    assert len(ids) > 20
    stream = tok.stream_decoder()
    pieces = [stream.feed([t]) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])  # some tokens end mid-character: held back, not split


def test_chat_messages_render_as_transformers_does(hf_checkpoint):
    path = hf_checkpoint("qwen2")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße?"}]
    req = generate_pb2.GenerateRequest(messages=[generate_pb2.ChatMessage(**m) for m in messages])
    expected = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert request_ids(req, load_tokenizer(path)) == list(expected)


def test_the_chat_template_is_found_where_transformers_saves_it(hf_checkpoint, tmp_path):
    """chat_template.jinja (transformers 5) wins over chat_template.json, which wins over
    tokenizer_config.json; a list of named templates gives its ``default``."""
    src = Path(hf_checkpoint("qwen2"))
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    cfg_path.write_text(json.dumps(cfg))
    assert load_tokenizer(path).chat_template == "D"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_tokenizer(path).chat_template == "J"
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(path).chat_template == "{{ messages[0]['content'] }}!"
    req = generate_pb2.GenerateRequest(messages=[generate_pb2.ChatMessage(role="user", content="hi")])
    assert request_ids(req, load_tokenizer(path)) == load_tokenizer(path).encode("hi!", add_bos=False)
    for name in ("chat_template.jinja", "chat_template.json"):
        (path / name).unlink()
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequest, match="no chat template"):
        request_ids(req, load_tokenizer(path))


def _assert_refused(path: Path, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the start-up check and by the prefill controller (exit 2), naming ``message``."""
    with pytest.raises(ConfigError) as err:
        check_checkpoint(HFEngineConfig(str(path)))
    assert message in str(err.value)
    with pytest.raises(SystemExit) as ei:
        prefill_main(["--model", str(path), "--transport", "tcp"])
    assert ei.value.code == 2 and message in capsys.readouterr().err


def test_quantized_checkpoints_are_refused_not_served_as_floats(hf_checkpoint, tmp_path, capsys):
    """An FP8 checkpoint keeps the float names and shapes; cast to --dtype without its
    scales it would start and answer garbage."""
    from safetensors.torch import load_file, save_file
    import torch

    d = _copy(hf_checkpoint("llama"), tmp_path / "fp8")
    name = "model.layers.1.mlp.up_proj.weight"
    shard = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _assert_refused(d, f"{shard.name}: weight {name!r} has dtype F8_E4M3", capsys)
    _edit_config(d, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    _assert_refused(d, "config.json: field 'quantization_config' (quant_method 'fp8') is not supported", capsys)


def test_eos_and_bos_ids_outside_the_vocabulary_are_refused(hf_checkpoint, tmp_path, capsys):
    """An EOS id no logit can pick never ends a generation."""
    d = _copy(hf_checkpoint("llama"), tmp_path / "eos")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [gen["eos_token_id"], 384]}))
    _assert_refused(d, "generation_config.json: field 'eos_token_id' = 384 is not a token id in [0, 384)", capsys)
    d = _copy(hf_checkpoint("llama"), tmp_path / "bos")
    _edit_config(d, bos_token_id=100000)
    _assert_refused(d, "config.json: field 'bos_token_id' = 100000 is not a token id in [0, 384)", capsys)


def test_unreadable_entries_are_refused_by_name(hf_checkpoint, tmp_path, capsys):
    d = _copy(hf_checkpoint("llama"), tmp_path / "shard-dir")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    shard.mkdir()
    _assert_refused(d, f"{shard}: cannot read", capsys)
    d = _copy(hf_checkpoint("llama"), tmp_path / "archs")
    _edit_config(d, architectures=[{"name": "LlamaForCausalLM"}])
    _assert_refused(d, "config.json: field 'architectures' must be a list of class names", capsys)


def test_weights_of_layers_past_num_hidden_layers_are_refused(hf_checkpoint, tmp_path, capsys):
    """A config.json that undercounts the layers would serve a truncated model."""
    d = _copy(hf_checkpoint("llama"), tmp_path / "layers")
    _edit_config(d, num_hidden_layers=1)
    _assert_refused(d, "config.json: num_hidden_layers = 1, but the weights hold 'model.layers.1.", capsys)


def test_a_chat_template_that_is_not_valid_jinja_is_refused_at_start_up(hf_checkpoint, tmp_path, capsys):
    """Served, it would fail every chat request with a status that blames the client."""
    path = _copy(Path(hf_checkpoint("qwen2")), tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    _assert_refused(path, "chat_template.jinja: the chat template is not valid Jinja: ", capsys)
    (path / "chat_template.jinja").unlink()
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    _assert_refused(path, "tokenizer_config.json: the chat template is not valid Jinja: ", capsys)


def test_a_sliding_window_on_some_layers_only_is_refused_and_on_all_or_none_is_honoured(hf_checkpoint, tmp_path, capsys):
    """Qwen2 and Qwen3 slide only layers from max_window_layers on (or as layer_types says),
    as transformers does; this engine applies one window to every layer or to none, so a
    mix would answer other tokens than transformers: it is refused."""
    from pdgrpc.engine.hf.config import load_config

    path = _copy(Path(hf_checkpoint("qwen2")), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg.pop("layer_types", None)  # as a checkpoint saved before transformers wrote them
    (path / "config.json").write_text(json.dumps(cfg))

    def sliding_in_transformers() -> list[bool]:
        return [t == "sliding_attention" for t in transformers.AutoConfig.from_pretrained(str(path)).layer_types]

    _edit_config(path, use_sliding_window=True, sliding_window=8, max_window_layers=layers)
    assert load_config(path).sliding_window is None and not any(sliding_in_transformers())
    _edit_config(path, max_window_layers=0)
    assert load_config(path).sliding_window == 8 and all(sliding_in_transformers())
    _edit_config(path, max_window_layers=1)
    assert sliding_in_transformers() == [False] + [True] * (layers - 1)
    _assert_refused(path, f"config.json: a sliding window on layers 1 to {layers - 1} only", capsys)
    _edit_config(path, layer_types=["full_attention"] * layers)  # layer_types wins, as in transformers
    assert load_config(path).sliding_window is None and not any(sliding_in_transformers())
