"""The model's projections (``y = x W^T + b``, ``W`` ``[out, in]`` as in ``nn.Linear``),
each with its weight laid out once, at load, for the kernel that runs it.

On CPU, float32 and bfloat16 weights are reordered into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by oneDNN
(``torch.ops.mkldnn._linear_pointwise``); the plain ``[out, in]`` copy is dropped, so
this costs no memory. Why: ``F.linear`` on CPU runs MKL's sgemm, which on AMD hosts
takes an AVX2 path even where AVX-512 is there; oneDNN picks its kernels by the
instruction set, and is faster at the bench checkpoint's shapes from 1 row up. Both
are float32 arithmetic (no reduced-precision mode); they differ only in summation
order, ~1e-6 of an output of the bench checkpoint.

Elsewhere (another device, float16, a torch without oneDNN, or a reorder that fails)
the weight stays a plain tensor and ``F.linear`` runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Linear", "make_linear", "onednn_usable"]

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    """``F.linear`` over a plain ``[out, in]`` weight (and optional bias)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _OneDNNLinear(Linear):
    """The weight in oneDNN's blocked layout, multiplied by oneDNN."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's linear for ``dtype`` on ``device``."""
    return (
        device.type == "cpu"
        and dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The projection by ``weight`` ``[out, in]`` in the fastest layout this device offers;
    the result no longer references ``weight`` when its layout changed."""
    if weight.dim() != 2 or not onednn_usable(weight.device, weight.dtype):
        return Linear(weight, bias)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        out = _OneDNNLinear(packed, None if bias is None else bias.contiguous())
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        if tuple(out(probe).shape) != (1, weight.shape[0]):
            return Linear(weight, bias)
    except RuntimeError:  # a torch build whose oneDNN refuses this dtype or shape
        return Linear(weight, bias)
    return out
