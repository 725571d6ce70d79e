"""Tiny random checkpoints, built offline, for tests and ``python -m pdgrpc.bench engine``.

:func:`build_checkpoint` writes what a downloaded checkpoint directory holds --
``config.json``, ``*.safetensors`` (optionally sharded with an index),
``generation_config.json``, ``tokenizer.json`` (a byte-level BPE trained here with
``tokenizers``) and ``tokenizer_config.json`` (with a chat template) -- through
``transformers``' own ``save_pretrained``. Needs ``transformers`` (the ``test`` extra);
serving the result does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ARCH_NAMES", "build_checkpoint", "build_gguf", "train_tokenizer"]

# Short names -> (transformers config class, model class).
ARCH_NAMES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Disaggregated serving moves KV pages.",
    "Prefill computes the prompt; decode generates one token at a time from the cache.",
    "Grüße aus Köln: naïve café, déjà vu, 東京と大阪, こんにちは世界, emoji 🙂🚀 and ü.",
    "def f(x):\n    return x * 2 + 1  # numbers 0123456789 and symbols {}[]()<>=+-*/",
]


def train_tokenizer(path: Path, vocab_size: int, bos: bool) -> dict[str, int]:
    """A byte-level BPE ``tokenizer.json`` of at most ``vocab_size`` tokens; returns the
    special tokens' ids. With ``bos`` the post-processor prepends ``<s>`` (Llama style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    ids: dict[str, int] = {s: tok.token_to_id(s) or 0 for s in specials}  # trained in: never None
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])])
    tok.save(str(path / "tokenizer.json"))
    return ids


def build_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 384,
    max_position_embeddings: int = 4096,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    tokenizer_vocab_size: int | None = None,
) -> Path:
    """Write a random ``arch`` checkpoint (see :data:`ARCH_NAMES`) to ``path``; returns it.
    The tokenizer has at most ``tokenizer_vocab_size`` tokens (default: ``vocab_size``)."""
    import torch
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = train_tokenizer(out, tokenizer_vocab_size or vocab_size, bos=arch in ("llama", "mistral"))
    bos_id = ids["<s>"]
    eos_id = ids["</s>"] if arch in ("llama", "mistral") else ids["<|im_end|>"]
    config_cls, model_cls = (getattr(transformers, n) for n in ARCH_NAMES[arch])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_id, initializer_range=init_std,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    if arch == "qwen2":
        kwargs["use_sliding_window"] = False
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1 so that their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    save: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out), **save)
    transformers.GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(str(out))
    tok_cfg = {"bos_token": "<s>" if arch in ("llama", "mistral") else None, "eos_token": "</s>" if eos_id == ids["</s>"] else "<|im_end|>",
               "chat_template": CHATML, "model_max_length": max_position_embeddings}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    return out


def _llama_cpp_permute(w: Any, n_head: int) -> Any:
    """llama.cpp's converter's rotary row order for a ``llama`` query/key projection."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_gguf(path: str | Path, arch: str = "llama", quant: str = "Q8_0", **kwargs: Any) -> Path:
    """Write a random ``arch`` (llama, qwen2 or qwen3) checkpoint as the GGUF file ``path``,
    as llama.cpp's converter writes one: llama.cpp's tensor names and query/key row order,
    2-D weights in ``quant`` (a type the ``gguf`` package quantizes: F32, F16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0), norms and biases in F32, a byte-level BPE tokenizer with its
    chat template. The ``transformers`` checkpoint it comes from is left beside it
    (``path`` without the suffix, plus ``-hf``); ``kwargs`` go to :func:`build_checkpoint`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    out = Path(path)
    vocab_size = kwargs.pop("vocab_size", 384)  # one row left for GPT-2's <|endoftext|>
    src = build_checkpoint(out.with_name(out.stem + "-hf"), arch, vocab_size=vocab_size, tokenizer_vocab_size=vocab_size - 1, **kwargs)
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    tensors: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qtype = gguf.GGMLQuantizationType[quant]

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    vocab = {t: i for t, i in tok["model"]["vocab"].items()} | {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in tok["added_tokens"] if a.get("special")} | {"<|endoftext|>"}
    # One entry per embedding row, as llama.cpp pads; GPT-2's <|endoftext|> first, which
    # transformers' byte-level tokenizer would add otherwise.
    tokens += ["<|endoftext|>"] + [f"[PAD{i}]" for i in range(len(tokens) + 1, cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(arch == "llama")
    w.add_chat_template(CHATML)

    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight", "model.norm.weight": "output_norm.weight"}
    layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    for name in sorted(tensors):
        t = tensors[name].astype(np.float32)
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{layer[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _llama_cpp_permute(t, heads if module == "self_attn.q_proj" else kv_heads)
        else:
            gname = names[name]
        if t.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, t.astype(np.float16))
        elif t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quantize(t, qtype), raw_shape=gguf.quant_shape_to_byte_shape(t.shape, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
