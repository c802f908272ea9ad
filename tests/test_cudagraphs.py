"""Whole-plan CUDA graphs (fxbackend/cudagraphs.py): which plans may be captured (pure logic on
CPU-built plans), the replay bookkeeping (static inputs, weights by address, outputs handed to
the caller) with the CUDA graph API stubbed, and, marked ``cuda``, the real thing.

Contracts under test (cudagraphs.py docstring): capture-safety is declared by kernels (absent:
unsafe) and the report names the first unsafe step; each call copies user inputs into static
buffers and returns copies of the outputs; an in-place weight update is seen by the replay, a
weight at a new address re-captures.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import fxbackend
from fxbackend import registry
from fxbackend.cudagraphs import GraphRunner, capture_blocker, is_capture_safe

from conftest import assert_same, capture


def _plan(cap):
    cg = cap.graph
    return cg.all_plans()[0]


def _blocker(plan, device_type="cuda"):
    return capture_blocker(plan.graph.nodes, plan.kernels,
                           lambda n: n.is_scalar and n not in plan.scalars, device_type)


def test_native_steps_are_capture_safe_and_cpu_plans_are_not_cuda_plans():
    cap = capture(lambda x, w: torch.tanh(x @ w) + 1, torch.randn(4, 8), torch.randn(8, 8))
    plan = _plan(cap)
    assert _blocker(plan) is None
    assert _blocker(plan, "cpu") == "not a CUDA plan (device cpu)"


def test_syncing_ops_and_undeclared_kernels_block_capture():
    cap = capture(lambda x: (x > 0).float().cos(), torch.randn(4, 8))
    plan = _plan(cap)
    n = next(n for n in plan.graph.nodes if n.op == "aten.cos.default")
    n.op = "aten.nonzero.default"  # the check reads the op and the kernel only
    why = _blocker(plan)
    assert why == f"%{n.id} (aten.nonzero.default) reads device values on the host"

    class K:
        name = "undeclared"

    class Rule:
        impl = type("Impl", (), {"capture_safe": True})()

    assert not is_capture_safe(K()) and is_capture_safe(Rule())
    cap = capture(lambda x: x.sin() * 2, torch.randn(4, 8))
    plan = _plan(cap)
    n = next(n for n in plan.graph.nodes if n.op == "aten.sin.default")
    kernels = dict(plan.kernels)
    kernels[n] = K()
    why = capture_blocker(plan.graph.nodes, kernels, lambda n: False, "cuda")
    assert why == f"%{n.id} (aten.sin.default): kernel 'undeclared' is not declared capture_safe"
    n.annotations["placed"] = "cpu"
    assert "runs on the CPU" in capture_blocker(plan.graph.nodes, plan.kernels,
                                                lambda n: False, "cuda")


def test_every_registered_cuda_kernel_of_the_project_declares_capture_safety():
    # the project's Triton kernels launch only: each says so (so CUDA graphs can take them)
    from fxbackend.fusion import fusions_for
    ours = [r for r in fusions_for("cuda")
            if getattr(getattr(r, "impl", None), "__module__", "").startswith(
                "fxbackend.cuda_kernels")]
    assert len(ours) >= 7
    for r in ours:
        assert hasattr(r.impl, "capture_safe"), f"{r.impl.name}: no capture_safe declaration"
        if not r.impl.__module__.endswith("int8_fusions"):
            assert is_capture_safe(r), r
    # the integer-GEMM rules re-quantize a float weight after a host-side version check
    assert [r.impl.name for r in ours if not is_capture_safe(r)] == \
        [r.impl.name for r in ours if r.impl.__module__.endswith("int8_fusions")
         and getattr(r.impl, "capture_safe") is False]
    for name in ("sd.rms_norm.v1", "sd.rope_apply.v1", "sd.group_norm.v1"):
        for k in registry.kernels_for("cuda", name):
            assert is_capture_safe(k), k


def test_the_option_on_a_cpu_plan_is_reported_and_changes_nothing():
    args = (torch.randn(4, 8), torch.randn(8, 8))
    f = lambda x, w: torch.tanh(x @ w) + 1  # noqa: E731
    cap = capture(f, *args, options={"cuda_graphs": True})
    assert "cuda graph: off: not a CUDA plan (device cpu)" in _plan(cap).report()
    assert_same(cap.fn(*args), f(*args))


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: 'capture' records the function run under it, and
    replay runs it again on the same (static) arguments."""

    current = None

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = {"captures": 0}

    @contextlib.contextmanager
    def graph(g):
        _FakeGraph.current = g
        calls["captures"] += 1
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: type(
        "S", (), {"wait_stream": lambda self, other: None})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"wait_stream": lambda self, other: None})())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return calls


def test_graph_runner_copies_inputs_in_reads_weights_by_address_and_hands_back_copies(fake_cuda):
    runs = []

    def run(args):
        x, w = args
        runs.append((x.data_ptr(), w.data_ptr()))
        out = x @ w
        if _FakeGraph.current is not None and _FakeGraph.current.fn is None:
            g = _FakeGraph.current
            g.fn = lambda: out.copy_(args[0] @ args[1])
        return [out]

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    r = GraphRunner(run, [False, True], torch.device("cpu"))
    o1 = r([x, w])
    assert torch.equal(o1[0], x @ w) and r.captures == 1
    static_x = r._static[0]
    assert static_x is not x and runs[-1] == (static_x.data_ptr(), w.data_ptr())
    x2 = torch.randn(3, 4)
    o2 = r([x2, w])
    assert torch.equal(o2[0], x2 @ w) and torch.equal(o1[0], x @ w)  # o1 is the caller's
    w.mul_(2)  # in place: same address, seen by the replay, no new capture
    assert torch.equal(r([x2, w])[0], x2 @ w) and r.captures == 1
    w_new = torch.randn(4, 5)  # another tensor: captured again
    assert torch.equal(r([x2, w_new])[0], x2 @ w_new) and r.captures == 2


@pytest.mark.cuda
def test_cuda_graph_replays_match_uncaptured_runs_and_follow_weights():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                            torch.nn.Linear(128, 64)).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        want = torch.compile(m, backend="fxbackend")(x)
        torch._dynamo.reset()
        fn = torch.compile(m, backend="fxbackend", options={"cuda_graphs": True})
        outs = [fn(x) for _ in range(5)]
        for o in outs:
            assert torch.equal(o, want)
        m[0].weight.mul_(0.5)  # a LoRA-style in-place update
        want2 = m(x)
        torch.testing.assert_close(fn(x), want2, rtol=1e-5, atol=1e-6)
