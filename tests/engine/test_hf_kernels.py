"""The checkpoint engine's CPU kernels against torch's plain ones: projections through
oneDNN (weights reordered at load) equal ``F.linear``, and blocked one-shot attention
equals causal SDPA, for the shapes the model feeds them (GQA groups, prompts that end
mid-block, strided inputs). Float32 tolerance: summation order only (~1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdgrpc.engine.hf import attention
from pdgrpc.engine.hf.linear import Linear, make_linear

ONEDNN = attention.usable(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g) * 0.1
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 128, generator=g)[:, ::2]  # strided, like a split of a fused output
    want = F.linear(x, w, b)
    got = make_linear(w.clone(), None if b is None else b.clone())(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_float16_and_other_devices_keep_the_plain_weight():
    w = torch.randn(8, 4, dtype=torch.float16)
    lin = make_linear(w)
    assert type(lin) is Linear and lin.weight is w
    assert not attention.usable(torch.device("meta"), torch.float32)
    assert not attention.usable(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN on CPU: the model uses SDPA")
@pytest.mark.parametrize("tokens", [attention.MIN_TOKENS, attention.BLOCK + 1, 3 * attention.BLOCK - 5])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
def test_blocked_attention_equals_causal_sdpa(tokens, heads):
    hq, hkv = heads
    g = torch.Generator().manual_seed(tokens + hq)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * 16, generator=g)
    q, k, v = qkv.split((hq * 16, hkv * 16, hkv * 16), dim=-1)
    q, k, v = q.view(tokens, hq, 16), k.view(tokens, hkv, 16), v.view(tokens, hkv, 16)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=0.25, enable_gqa=True
    )[0].transpose(0, 1).reshape(tokens, hq * 16)
    tri = torch.ones(attention.BLOCK, attention.BLOCK, dtype=torch.bool).triu(1)[:, None, :]
    got = attention.causal_attention(q, k, v, 0.25, tri)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
