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

__all__ = ["ARCH_NAMES", "build_checkpoint", "train_tokenizer"]

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
) -> Path:
    """Write a random ``arch`` checkpoint (see :data:`ARCH_NAMES`) to ``path``; returns it."""
    import torch
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = train_tokenizer(out, vocab_size, bos=arch in ("llama", "mistral"))
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
