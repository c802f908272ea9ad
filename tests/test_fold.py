"""Constant folding (fxbackend/fold.py): steps that read no input are computed once, when the
plan is built, with the same ATen kernels (bit-identical); random ops, returned values and
large values are left to run per call."""
from __future__ import annotations

import pytest
import torch

import fxbackend
import fxbackend.fold as fold

from conftest import capture, tiny_model_outputs


def _folded() -> int:
    return fxbackend.stats()["constants_folded"]


def _pos_embed(x):
    """A sin-cos table from sizes alone (PixArt computes its position embedding like this)."""
    n, c = x.shape[-2:]
    pos = torch.arange(n, dtype=torch.float32)
    omega = 1.0 / 10000 ** (torch.arange(c // 2, dtype=torch.float64) / (c / 2))
    out = pos[:, None] * omega[None, :].float()
    return x + torch.cat([out.sin(), out.cos()], dim=1)


def test_table_is_computed_once_bit_for_bit(no_grad):
    x = torch.randn(2, 7, 12)
    c = capture(_pos_embed, x)  # exact against eager
    assert _folded() == 1  # the table (its arange, pow, sin, cos, cat steps read no input)
    plan = c.graph.plan_for([x])
    ops = [n.op for n in plan.graph.nodes if n in plan.kernels]
    assert ops == ["aten.add.Tensor"], ops
    assert "constant steps folded at plan time: 1" in plan.report()
    for _ in range(2):  # the folded value is not written by the calls
        x = torch.randn(2, 7, 12)
        torch.testing.assert_close(c.fn(x), _pos_embed(x), rtol=0, atol=0)


def test_random_ops_run_every_call(no_grad):
    def fn(x):
        return x + torch.rand(4) * 0

    x = torch.zeros(4)
    c = capture(fn, x)
    plan = c.graph.plan_for([x])
    assert any("rand" in n.op for n in plan.graph.nodes if n in plan.kernels)


def test_returned_values_are_fresh_every_call(no_grad):
    def fn(x):
        return x * 2, torch.arange(6.0).cos()

    x = torch.randn(3)
    c = capture(fn, x)
    assert _folded() == 0
    a, b = c.fn(x)[1], c.fn(x)[1]
    assert a.data_ptr() != b.data_ptr()  # the caller owns each result
    a.add_(1)
    torch.testing.assert_close(c.fn(x)[1], torch.arange(6.0).cos(), rtol=0, atol=0)


def test_large_values_are_left_alone(no_grad, monkeypatch):
    monkeypatch.setattr(fold, "MAX_BYTES", 16)  # the table is 7 x 12 float32
    x = torch.randn(2, 7, 12)
    c = capture(_pos_embed, x)
    assert _folded() == 0
    plan = c.graph.plan_for([x])
    assert any(n.op == "aten.sin.default" for n in plan.graph.nodes if n in plan.kernels)


@pytest.mark.parametrize("family,count", [("flux", 5), ("sd3", 1), ("pixart", 2), ("unet", 3)])
def test_models(family, count, no_grad):
    got, want = tiny_model_outputs(family)
    assert _folded() == count
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
