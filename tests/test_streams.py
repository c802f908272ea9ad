"""Concurrent branches (fxbackend/streams.py): fork/join regions found by dataflow, buffers kept
disjoint over each region, and the CPU executor running auxiliary branches on the region
thread with byte-identical results.

Contracts under test (streams.py and memory.py docstrings):
- a region's branches never read each other's values; its nodes are consecutive steps; steps
  that compute nothing and read only pre-fork values belong to no branch;
- in-place writes and Python-level ops are barriers; the largest branch stays on the main thread;
- every buffer a region touches lives over the whole region (no shared storage while branches
  overlap); auxiliary branches get a workspace of their own;
- streams on or off (options or FXB_STREAMS) give byte-identical results, run after run.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxbackend
import fxbackend.models
from fxbackend.ir import node_deps
from fxbackend.memory import Buffer, assign_offsets, buffers_of, plan_memory
from fxbackend.streams import find_regions

from conftest import assert_same, capture


class MoE(nn.Module):
    """An MoE layer with a shared expert: routed experts and the shared expert meet at
    ``routed + shared`` (as in diffusers' HiDream)."""

    def __init__(self, d=32, h=64, experts=3):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, d))
                                     for _ in range(experts))
        self.shared = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

    def forward(self, x):
        w = F.softmax(self.gate(x), dim=-1)
        routed = sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))
        return routed + self.shared(x)


def _two_chains(x, w1, w2):
    a = torch.tanh(x @ w1) * 2
    b = torch.sigmoid(x @ w2) + 1
    return a + b


def _plan(cap):
    cg = cap.graph
    return cg.all_plans()[0]


def _check_independent(plan, region):
    branch_of = {n: i for i, b in enumerate(region.branches) for n in b}
    nodes = plan.graph.nodes
    for n in nodes[region.start:region.end]:
        for d in node_deps(n):
            if n in branch_of and d in branch_of:
                assert branch_of[n] == branch_of[d], f"%{n.id} reads %{d.id} of another branch"
    for n in region.free:  # run before the fork: read nothing computed in the region
        assert not any(d in branch_of for d in node_deps(n))


# -- finding regions ------------------------------------------------------------------------------

def test_two_independent_chains_form_one_region_joined_at_the_add():
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16)
    cap = capture(_two_chains, x, w1, w2, options={"streams": True})
    plan = _plan(cap)
    assert len(plan.regions) == 1
    r = plan.regions[0]
    assert len(r.branches) == 2
    ops = [sorted(n.op for n in b if n.op.startswith("aten.") and "mm" in n.op) for b in r.branches]
    assert ops == [["aten.mm.default"], ["aten.mm.default"]]
    join = plan.graph.nodes[r.end]
    assert join.op == "aten.add.Tensor"
    _check_independent(plan, r)
    assert "concurrent region steps" in plan.report()


def test_a_chain_has_no_region_and_streams_off_or_default_cpu_has_none():
    x = torch.randn(8, 16)
    cap = capture(lambda x: torch.tanh(x * 2).sin() + 1, x, options={"streams": True})
    assert _plan(cap).regions == []
    assert "no fork/join region" in _plan(cap).report()
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    for opts in ({"streams": False}, {}):  # default: never on the CPU
        plan = _plan(capture(_two_chains, *args, options=opts))
        assert plan.regions == []


def test_moe_shared_expert_runs_beside_the_routed_experts():
    torch.manual_seed(0)
    m = MoE().eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        cap = capture(m, x, options={"streams": True}, exact=False, rtol=1e-5, atol=1e-6)
    plan = _plan(cap)
    assert len(plan.regions) == 1
    r = plan.regions[0]
    _check_independent(plan, r)
    main, aux = r.branches[r.main], r.aux
    # the shared expert (one GELU) is the auxiliary branch; the routed experts stay on main
    assert [n.op for n in aux if "gelu" in n.op] == ["aten.gelu.default"]
    assert not any("gelu" in n.op for n in main)
    assert plan.graph.nodes[r.end].op == "aten.add.Tensor"  # routed + shared


def test_in_place_writes_are_barriers():
    def f(x, y, w):
        a = torch.tanh(x @ w)
        y.add_(1)  # an input mutation: a step writing storage it does not own
        b = torch.sigmoid(x @ w)
        return a + b + y

    args = (torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 16))
    plan = _plan(capture(f, *args, options={"streams": True}))
    for r in plan.regions:
        for n in plan.graph.nodes[r.start:r.end]:
            assert n.inplace_of is None


# -- memory: what a region touches is disjoint ----------------------------------------------------

def _touched(bufs_plain, first, last):
    return [b for b in bufs_plain if b.start <= last and b.end >= first]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8), st.integers(1, 5000)),
                min_size=2, max_size=25),
       st.lists(st.tuples(st.integers(0, 35), st.integers(1, 8)), max_size=3))
def test_buffers_a_region_touches_never_share_storage(spec, regions):
    bufs = [Buffer(i, n, s, s + d) for i, (s, d, n) in enumerate(spec)]
    ranges = [(a, a + length) for a, length in regions]
    stretched = [Buffer(b.key, b.nbytes, b.start, b.end) for b in bufs]
    for first, last in ranges:
        for b in stretched:
            if b.start <= last and b.end >= first:
                b.start, b.end = min(b.start, first), max(b.end, last)
    offsets, top = assign_offsets(stretched)
    for first, last in ranges:
        touched = _touched(bufs, first, last)
        for a in touched:
            for b in touched:
                if a.key < b.key:
                    oa, ob = offsets[a.key], offsets[b.key]
                    assert oa + a.nbytes <= ob or ob + b.nbytes <= oa, (a, b, first, last)


def test_planner_stretches_lifetimes_over_regions():
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16)
    plan = _plan(capture(_two_chains, x, w1, w2, options={"streams": True}))
    r = plan.regions[0]
    bufs, _ = buffers_of(plan.graph, lambda n: plan.metas[n],
                         regions=[(r.start, r.end - 1)])
    inside = [b for b in bufs if b.start <= r.end - 1 and b.end >= r.start]
    assert len(inside) >= 4  # each branch's matmul and activation results
    assert all(b.start <= r.start and b.end >= r.end - 1 for b in inside)
    mem = plan_memory(plan.graph, lambda n: plan.metas[n], regions=[(r.start, r.end - 1)])
    spans = sorted((mem.offsets[b.key], mem.offsets[b.key] + b.nbytes) for b in inside)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


# -- running: byte-identical, stable, errors, grad mode --------------------------------------------

@pytest.mark.parametrize("family", ["flux", "sd3", "unet"])
def test_models_give_byte_identical_results_with_streams_on_and_off(family):
    model = fxbackend.models.build_model(family, "tiny")
    inputs = fxbackend.models.make_inputs(family, "tiny")
    with torch.no_grad():
        off = fxbackend.models.run_eager(
            torch.compile(model, backend="fxbackend", options={"streams": False}), inputs)
        torch._dynamo.reset()
        fxbackend.reset_stats()
        on = fxbackend.models.run_eager(
            torch.compile(model, backend="fxbackend", options={"streams": True}), inputs)
    assert fxbackend.stats()["concurrent_regions"] >= 1
    assert_same(on, off)


def test_stress_a_region_two_hundred_times():
    torch.manual_seed(1)
    m = MoE(d=64, h=256, experts=4).eval()
    x = torch.randn(16, 64)
    with torch.no_grad():
        want = torch.compile(m, backend="fxbackend", options={"streams": False})(x)
        torch._dynamo.reset()
        fn = torch.compile(m, backend="fxbackend", options={"streams": True})
        outs = [fn(x).clone() for _ in range(200)]
    assert fxbackend.stats()["concurrent_regions"] == 1
    for i, o in enumerate(outs):
        assert torch.equal(o, want), f"run {i} differs"


def test_an_error_in_an_auxiliary_branch_propagates_and_the_plan_stays_usable():
    fail = threading.Event()

    @torch.library.custom_op("fxbtest::maybe_fail", mutates_args=())
    def maybe_fail(x: torch.Tensor) -> torch.Tensor:
        if fail.is_set():
            raise RuntimeError("branch failed on purpose")
        return x * 3

    maybe_fail.register_fake(lambda x: torch.empty_like(x))

    def f(x, w):
        a = torch.tanh(x @ w) * 2
        b = torch.ops.fxbtest.maybe_fail(torch.sigmoid(x @ w @ w))
        return a + b

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    cap = capture(f, x, w, options={"streams": True})
    assert len(_plan(cap).regions) == 1
    fail.set()
    with pytest.raises(RuntimeError, match="branch failed on purpose"):
        cap.fn(x, w)
    fail.clear()
    assert_same(cap.fn(x, w), f(x, w))


def test_branches_run_in_the_callers_grad_mode():
    # grad and inference mode are per thread: arena buffers made under inference mode can be
    # written only under it, so a region thread not in the caller's mode fails
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16)
    with torch.inference_mode():
        cap = capture(_two_chains, x, w1, w2, options={"streams": True})
        assert_same(cap.fn(x, w1, w2), _two_chains(x, w1, w2))


def test_fxb_streams_environment_switch(monkeypatch):
    monkeypatch.setenv("FXB_STREAMS", "1")
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    assert len(_plan(capture(_two_chains, *args)).regions) == 1
    monkeypatch.setenv("FXB_STREAMS", "0")
    torch._dynamo.reset()
    assert _plan(capture(_two_chains, *args)).regions == []


def test_a_runtime_that_forbids_concurrency_turns_cpu_regions_off(monkeypatch):
    from fxbackend import services
    monkeypatch.setattr(services, "_concurrency_checks", {"test": lambda: "not thread-safe"})
    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))
    plan = _plan(capture(_two_chains, *args, options={"streams": True}))
    assert plan.regions == []
    assert "off: test: not thread-safe" in plan.report()


@pytest.mark.cuda
def test_cuda_streams_on_and_off_are_byte_identical():
    torch.manual_seed(0)
    m = MoE(d=64, h=256, experts=4).eval().cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        off = torch.compile(m, backend="fxbackend", options={"streams": False})(x)
        torch._dynamo.reset()
        fn = torch.compile(m, backend="fxbackend", options={"streams": True})
        outs = [fn(x).clone() for _ in range(200)]
    torch.cuda.synchronize()
    assert fxbackend.stats()["concurrent_regions"] >= 1
    for o in outs:
        assert torch.equal(o, off)


def test_find_regions_is_pure_graph_logic():
    # no device: a hand-lowered graph, regions from metadata only
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16)
    plan = _plan(capture(_two_chains, x, w1, w2, options={"streams": True}))
    again = find_regions(plan.graph, plan.kernels, lambda n: plan.metas[n])
    assert [(r.start, r.end, r.main) for r in again] == \
        [(r.start, r.end, r.main) for r in plan.regions]
