"""Hugging Face decoder checkpoints on pdgrpc's paged KV cache (``--model PATH``).

- :mod:`pdgrpc.engine.hf.config` -- ``config.json`` / ``generation_config.json`` ->
  :class:`~pdgrpc.engine.hf.config.HFConfig`; the supported architectures (torch-free).
- :mod:`pdgrpc.engine.hf.tokenizer` -- ``tokenizer.json`` through ``tokenizers``, incremental
  detokenizing (torch-free: the router uses it).
- :mod:`pdgrpc.engine.hf.weights` -- ``*.safetensors``, memory-mapped, checked against the
  config and sliced per TP rank.
- :mod:`pdgrpc.engine.hf.model` -- the forward pass over the paged KV pool.
- :mod:`pdgrpc.engine.hf.engine` -- :class:`HFEngine`, the :class:`~pdgrpc.engine.base.Engine`.
- :mod:`pdgrpc.engine.hf.gguf` -- a GGUF file (``--model FILE.gguf``) as a checkpoint.
- :mod:`pdgrpc.engine.hf.sizing` -- the sizes a checkpoint decides when flags leave them unset.

Only ``safetensors`` and ``tokenizers`` are needed at run time for a checkpoint directory
(``pdgrpc[hf]``), not ``transformers``; a GGUF file needs ``pdgrpc[gguf]``. Submodules
load on first use: importing this package loads no torch.
"""
