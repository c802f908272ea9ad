"""Steps computed from weights alone (a weight cast, a weight's channels-last copy) run once and
again only when a weight changes (``Plan.cached``, executor ``_weight_derived``)."""
from __future__ import annotations

import pytest
import torch

import fxbackend


class _CastWeight(torch.nn.Module):
    """``x @ w.to(x.dtype).t()``: the cast of the float32 weight is weight-derived."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 16, generator=g))

    def forward(self, x):
        return x @ self.w.to(x.dtype).t().contiguous()


def _compile(model, x, options=None):
    torch._dynamo.reset()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(model, backend="fxbackend", options=options or {})
        out = c(x)
    (g,) = graphs
    (plan,) = [g._static] if g._static is not None else list(g.plans.values())
    return c, plan, out


def _values(plan):
    return {n: cell[1] for n, cell in plan._cache_cells.items()}


@pytest.mark.usefixtures("no_grad")
def test_weight_steps_run_once_until_the_weight_changes():
    model = _CastWeight()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    fxbackend.reset_stats()
    c, plan, out = _compile(model, x)
    assert torch.equal(out, model(x))
    cached_ops = sorted(n.op for n in plan.cached)
    assert cached_ops == ["aten._to_copy.default", "aten.clone.default"]
    assert fxbackend.stats()["weight_steps_cached"] == 2
    assert "kept between calls: 2" in plan.report()
    first = _values(plan)
    assert all(isinstance(v, torch.Tensor) for v in first.values())
    # an unchanged weight: the same values, not recomputed
    assert torch.equal(c(x), model(x))
    assert all(v is first[n] for n, v in _values(plan).items())
    # an in-place update (a LoRA fuse) bumps the version: recomputed, the result follows
    model.w.mul_(-0.5)
    assert torch.equal(c(x), model(x))
    second = _values(plan)
    assert all(v is not first[n] for n, v in second.items())
    # new storage behind the same parameter (another address)
    model.w.data = torch.randn(8, 16)
    assert torch.equal(c(x), model(x))
    assert all(v is not second[n] for n, v in _values(plan).items())


def test_inference_mode_weights_are_derived_every_call():
    """A tensor created in inference mode has no version counter: no staleness check is
    possible, so its steps run on every call (still correct after an in-place update)."""
    with torch.inference_mode():
        model = _CastWeight()
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        c, plan, out = _compile(model, x)
        assert torch.equal(out, model(x))
        before = _values(plan)
        model.w.mul_(3.0)
        assert torch.equal(c(x), model(x))
        assert all(v is not before[n] for n, v in _values(plan).items())


@pytest.mark.usefixtures("no_grad")
def test_user_inputs_and_cuda_graph_plans_are_not_cached():
    # a step reading a user input is per call
    def fn(x, w):
        return x @ w.to(x.dtype).t().contiguous()
    torch._dynamo.reset()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(fn, backend="fxbackend")
        w = torch.randn(8, 16)
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        c(x, w)
    (plan,) = [graphs[0]._static] if graphs[0]._static is not None \
        else list(graphs[0].plans.values())
    assert not plan.cached
    w.mul_(2)
    assert torch.equal(c(x, w), fn(x, w))
    # under cuda_graphs a replay could neither skip nor redo the step: nothing is cached
    _, plan, _ = _compile(_CastWeight(), x, {"cuda_graphs": True})
    assert not plan.cached
