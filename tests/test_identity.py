"""The ``identity_arith`` rewrite (patterns/identity.py): multiplications and divisions by the
number 1 are dropped where the input is the same value in the same layout, never for a graph
output, a dtype change or another layout."""
from __future__ import annotations

import pytest
import torch

import fxbackend
import fxbackend.models
from fxbackend.patterns.identity import IDENTITY_OPS

from conftest import assert_same, capture


def _rewrites():
    return fxbackend.stats()["rewrites_by_rule"].get("identity_arith", 0)


@pytest.mark.parametrize("fn", [
    lambda x, y: ((x + y) / 1.0).exp(),          # a ResnetBlock2D's output_scale_factor
    lambda x, y: ((x * y) * 1).exp(),
    lambda x, y: (torch.div(x - y, 1)).exp(),
    lambda x, y: (x.t() / 1).reshape(-1).exp(),  # a transposed input: the same layout out
])
def test_identity_steps_are_dropped_and_results_stay_bitwise(fn, no_grad):
    args = [torch.randn(4, 6), torch.randn(4, 6)]
    args[0][0, :3] = torch.tensor([-0.0, float("inf"), 1e-40])  # signed zero, inf, subnormal
    fxbackend.reset_stats()
    c = capture(fn, *args)  # compares with eager bit for bit
    assert _rewrites() >= 1
    plan = c.graph.plan_for(args)
    assert not [n for n in plan.graph.nodes if n in plan.kernels and n.op in IDENTITY_OPS
                and n.params.get("other") == 1]


def test_a_graph_output_is_not_an_alias_of_the_input(no_grad):
    x = torch.randn(5, 3)
    fxbackend.reset_stats()
    c = capture(lambda x: x / 1.0, x)
    assert _rewrites() == 0
    out = c.fn(x)
    assert out.data_ptr() != x.data_ptr()
    assert_same(out, x)


@pytest.mark.parametrize("fn,args", [
    (lambda x: (x * 1.0).exp(), [torch.arange(6).reshape(2, 3)]),     # int -> float: promotes
    (lambda x: (x[:, ::2] / 1).reshape(-1).exp(), [torch.randn(3, 4)]),  # strided: copies
    (lambda x: (x * 2.0).exp(), [torch.randn(3, 4)]),                 # not one
    (lambda x: (x * x[0]).exp(), [torch.randn(3, 4)]),                # a tensor, not a number
])
def test_left_alone(fn, args, no_grad):
    fxbackend.reset_stats()
    capture(fn, *args)
    assert _rewrites() == 0


def test_small_unet_drops_its_output_scale_divisions(no_grad):
    model = fxbackend.models.build_model("unet", "tiny")
    inputs = fxbackend.models.make_inputs("unet", "tiny")
    fxbackend.reset_stats()
    ref = fxbackend.models.run_eager(model, inputs)[0]
    out = fxbackend.models.run_eager(torch.compile(model, backend="fxbackend"), inputs)[0]
    # every resnet's "/ output_scale_factor" and attention's "/ rescale_output_factor"
    assert _rewrites() > 0
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
