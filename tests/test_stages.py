"""Plans with data-dependent steps (fxbackend.stages): ``nonzero``, boolean indexing and
``unique`` give results whose sizes depend on tensor values; an exported plan runs them natively
between stages planned as any graph, and saves, loads and replays like any plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxbackend
from fxbackend.executor import CompiledGraph
from fxbackend.options import parse_options
from fxbackend.stages import Stages


class _MaskedTokens(torch.nn.Module):
    """Mochi's attention, reduced: per batch row the tokens its mask keeps (``nonzero``), a
    linear over them, padded back to the row's length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        rows = []
        for i in range(x.shape[0]):
            keep = torch.nonzero(mask[i], as_tuple=False).flatten()
            y = self.proj(x[i, keep])
            rows.append(F.pad(y, (0, 0, 0, x.shape[1] - y.shape[0])))
        return torch.stack(rows) + x


class _Nested(torch.nn.Module):
    """A data-dependent step reading the result of another: three stages."""

    def forward(self, x, mask):
        y = x[mask]
        z = y[y.sum(-1) > 0]
        return z * 2, y.sum()


class _Unique(torch.nn.Module):
    """A data-dependent step with several results (``_unique2``), read through getitems."""

    def forward(self, labels, x):
        values, counts = torch.unique(labels, return_counts=True)
        return values * 2, counts, x + 1


class _WritesAfter(torch.nn.Module):
    """Writes its input with a value computed after a data-dependent step."""

    def forward(self, x, mask):
        keep = torch.nonzero(mask[0]).flatten()
        x.add_(x[:, keep].sum())
        return x * 2


class _ReadsThenWrites(torch.nn.Module):
    """Reads its input through a data-dependent step whose result it returns, then writes
    it: the write (a copy into the input at the end of the exported graph, reading no
    data-dependent result) runs after that step, not in the stage before it."""

    def forward(self, x):
        positive = x[x > 0]
        x.mul_(2)
        return positive


def _mask(lengths, n=5):
    m = torch.zeros(len(lengths), n, dtype=torch.bool)
    for i, k in enumerate(lengths):
        m[i, :k] = True
    return m


def _round_trip(model, args, tmp_path):
    plan = fxbackend.export(model, tuple(a.clone() for a in args))
    plan.save(tmp_path / "plan.fxb")
    return plan, fxbackend.load(tmp_path / "plan.fxb")


def _same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6)


def test_masked_tokens_export_save_load_replay(tmp_path):
    """Exported with every token kept, saved and loaded, the plan gives eager's results for
    masks keeping any number of tokens per row (none too), and the loaded plan the plan's
    bits; one plan of the second stage per set of kept counts."""
    model = _MaskedTokens().eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    plan, loaded = _round_trip(model, (x, _mask([5, 5])), tmp_path)
    assert isinstance(loaded.compiled, Stages)
    # both nonzero read the mask alone: they run after stage 0, everything else is stage 1
    assert loaded.compiled.summary().startswith(
        "2 data-dependent step(s) run natively between 2 stages")
    assert sorted(r.hint for r in loaded.symbols.values()) == [5, 5]  # the example's counts
    for lengths in ([5, 5], [2, 4], [0, 5], [1, 1], [2, 4]):
        m = _mask(lengths)
        with torch.no_grad():
            want = model(x, m)
        got = loaded(x, m)
        _same(got, want)
        assert torch.equal(got, plan(x, m))
    assert len(loaded.plans) == 1 + 4  # stage 0 once, stage 1 per distinct kept counts
    assert "data-dependent step(s)" in loaded.report()


@pytest.mark.parametrize("case", ["nested", "unique"])
def test_data_dependent_steps_reading_each_other_or_with_several_results(case, tmp_path):
    g = torch.Generator().manual_seed(2)
    if case == "nested":
        model = _Nested().eval()
        x = torch.randn(2, 5, 8, generator=g)
        calls = [(x, torch.rand(2, 5, generator=g) > p) for p in (0.3, 0.0, 0.7, 1.0)]
        stages = 3
    else:
        model = _Unique().eval()
        calls = [(torch.tensor(v), torch.randn(3, generator=g))
                 for v in ([3, 1, 3, 2], [0, 0, 0, 0], [5, 4, 3, 2], [1, 2, 1, 2])]
        stages = 2
    _, loaded = _round_trip(model, calls[0], tmp_path)
    assert f"between {stages} stages" in loaded.compiled.summary()
    for args in calls:
        with torch.no_grad():
            want = model(*args)
        _same(loaded(*args), want)


@pytest.mark.parametrize("model", [_WritesAfter(), _ReadsThenWrites()],
                         ids=["write_after", "read_then_write"])
def test_a_model_writing_its_input_around_a_data_dependent_step(model, tmp_path):
    """The caller's tensor is written as eager writes it, and read before the write where
    the model reads it before (the export's example inputs are left as they were)."""
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))
    calls = [(_mask(k),) for k in ([3], [0], [5])] if isinstance(model, _WritesAfter) \
        else [()] * 2
    example = x.clone()
    plan, loaded = _round_trip(model.eval(), (example, *calls[0]), tmp_path)
    assert torch.equal(example, x)
    for p in (plan, loaded):
        for rest in calls:
            mine, theirs = x.clone(), x.clone()
            with torch.no_grad():
                want = model(theirs, *rest)
            _same(p(mine, *rest), want)
            assert torch.equal(mine, theirs)


def test_planning_a_data_dependent_step_ahead_says_so():
    """A CompiledGraph (one plan per signature, planned before the call) refuses the graph
    with an error naming the step and why, not the meta device's missing kernel."""
    model = _MaskedTokens().eval()
    x, m = torch.randn(1, 5, 8), _mask([3])
    plan = fxbackend.export(model, (x, m))
    cg = CompiledGraph(plan.graph, parse_options(None), "whole")
    args = [plan.weights[plan.names[n]] if n.is_weight else {"x": x, "mask": m}[plan.names[n]]
            for n in plan.graph.inputs]
    with pytest.raises(NotImplementedError, match=r"%\d+ \(aten\.nonzero\.default\) is "
                                                  r"data-dependent: the sizes of its result "
                                                  r"\(i64\[u0,1\]\) depend on the values"):
        cg.run(args)
