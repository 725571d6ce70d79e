"""The exact-arithmetic primitives: accurate, on their grids, and position independent."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgrpc.engine import exact


def test_exp_nonpos_is_accurate_and_handles_the_ends() -> None:
    x = torch.linspace(-60.0, 0.0, 5001, dtype=torch.float64)
    got = exact.exp_nonpos(x)
    want = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    assert ((got - want).abs() / want).max() < 1e-12
    ends = exact.exp_nonpos(torch.tensor([float("-inf"), -1e6, 0.0, 3.0], dtype=torch.float64))
    assert ends.tolist() == [0.0, 0.0, 1.0, 1.0]  # positive inputs are clamped to 0


@settings(deadline=None)  # no timing assertions: CI boxes are shared
@given(st.lists(st.floats(-40.0, 40.0), min_size=1, max_size=8), st.integers(0, 70), st.integers(0, 70))
def test_elementwise_results_do_not_depend_on_position_in_the_tensor(values: list[float], before: int, after: int) -> None:
    """The same input bits give the same output bits whether an element sits in the
    vectorised body or the scalar tail of a kernel (the reason exp is not torch.exp)."""
    x = torch.tensor(values, dtype=torch.float64)
    padded = torch.cat([torch.full((before,), 0.5, dtype=torch.float64), x, torch.full((after,), -0.25, dtype=torch.float64)])
    sl = slice(before, before + len(values))
    assert torch.equal(exact.silu(padded)[sl], exact.silu(x))
    assert torch.equal(exact.exp_nonpos(-padded.abs())[sl], exact.exp_nonpos(-x.abs()))
    assert torch.equal(exact.quantize(padded * 3.3)[sl], exact.quantize(x * 3.3))


def test_silu_matches_the_textbook_formula() -> None:
    x = torch.linspace(-30, 30, 2001, dtype=torch.float64)
    assert torch.allclose(exact.silu(x), torch.nn.functional.silu(x), rtol=1e-12, atol=1e-300)


def test_quantize_rounds_to_the_grid_and_clamps() -> None:
    x = torch.tensor([0.1, -0.1, 1e9, -1e9, 2.0**-13], dtype=torch.float64)
    q = exact.quantize(x)
    assert torch.equal(torch.round(q * 2**exact.ACT_FRAC), q * 2**exact.ACT_FRAC)  # on the grid
    assert (q - x)[:2].abs().max() <= 2.0 ** -(exact.ACT_FRAC + 1)
    assert q[2] == exact.ACT_LIMIT and q[3] == -exact.ACT_LIMIT
    assert q[4] == 0.0  # exactly half a step: ties to even


def test_kv_formats_are_exactly_representable_in_their_dtype() -> None:
    x = torch.linspace(-100, 100, 20001, dtype=torch.float64)
    for name, dtype in [("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)]:
        q = exact.kv_format(name)(x)
        assert torch.equal(q.to(dtype).to(torch.float64), q), name
        assert len(q.unique()) > 500, name  # and still a useful resolution


def test_matmul_of_grid_values_is_order_independent() -> None:
    """The property the whole design rests on: sums of grid values are exact."""
    g = torch.Generator().manual_seed(0)
    a = exact.quantize(torch.randn(7, 4096, dtype=torch.float64, generator=g) * 50)
    w = torch.round(torch.randn(4096, 5, dtype=torch.float64, generator=g) * 40).clamp(-127, 127) / 2**9
    full = a @ w
    assert torch.equal(a[3:4] @ w, full[3:4])  # one row alone (a GEMV instead of a GEMM)
    halves = a[:, :2048] @ w[:2048] + a[:, 2048:] @ w[2048:]  # as two TP ranks would
    assert torch.equal(halves, full)
    perm = torch.randperm(4096, generator=g)
    assert torch.equal(a[:, perm] @ w[perm], full)


def test_softmax_weights_approximate_softmax_and_respect_the_mask() -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 40, dtype=torch.float64, generator=g) * 20
    mask = torch.rand(3, 40, generator=g) > 0.3
    mask[2] = False  # a row with nothing to attend to (a padded query)
    w = exact.softmax_weights(scores, mask, 0.25)
    assert (w[~mask] == 0).all() and (w[2] == 0).all()
    p = w[:2] / w[:2].sum(dim=-1, keepdim=True)
    want = torch.softmax((scores[:2] * 0.25).masked_fill(~mask[:2], float("-inf")), dim=-1)
    assert (p - want).abs().max() < 2e-3
    assert torch.equal(w[:2].amax(dim=-1), torch.ones(2, dtype=torch.float64))  # the max gets exactly 1
