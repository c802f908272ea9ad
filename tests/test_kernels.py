"""Extension kernels (fxbackend/registry.py, executor.py) on hand-built graphs: selection
(supports, preferred, priority, the native fallback and its absence), supports_op and
supports_native_op with the recursion guard, the kernel life cycle (prepare at plan time,
execute per call, destroy with the plan), errors, overriding ATen ops through torch.compile,
views and in-place writes never intercepted, and the per-plan workspace.
"""
from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxbackend
from fxbackend import ExecContext, Node, registry
from fxbackend.dynamo import compile_fx_graph

from ext_util import (LikeFirst, compiled, contiguous_meta, graph_of, reg,  # noqa: F401
                      registry_guard, set_outputs)

pytestmark = pytest.mark.usefixtures("registry_guard")


class Scale(LikeFirst):
    """x * alpha, with a reference execute (the op's native kernel) that counts its calls."""

    name = "test.kn_scale.v1"
    attrs = {"alpha": float}

    def __init__(self) -> None:
        self.native_calls: list = []

    def execute(self, ctx, node, state, inputs, out, workspace):
        self.native_calls.append(node.id)
        torch.mul(inputs[0], node.params["alpha"], out=out)


class NoExec(LikeFirst):
    """x * alpha without a reference execute: the native kernel cannot run it."""

    name = "test.kn_noexec.v1"
    attrs = {"alpha": float}


class ScaleKernel:
    """Computes x * alpha for ``op`` (float32 only) and records the nodes it ran."""

    def __init__(self, name: str, op: str = Scale.name, priority: int = 0,
                 dtypes=(torch.float32,)) -> None:
        self.name, self.op, self.priority, self.dtypes = name, op, priority, dtypes
        self.calls: list = []

    def supports(self, node):
        return node.srcs[0].meta.dtype in self.dtypes

    def execute(self, ctx, node, state, inputs, out, workspace):
        self.calls.append(node.id)
        torch.mul(inputs[0], node.params["alpha"], out=out)


class Picky(ScaleKernel):
    """A ScaleKernel with a ``preferred`` answer."""

    def __init__(self, name: str, preferred: bool, **kw) -> None:
        super().__init__(name, **kw)
        self._preferred = preferred

    def preferred(self, node):
        return self._preferred


def _graph(op: str = Scale.name, alphas=(2.0,), dtype=torch.float32):
    g, (x,) = graph_of((4, 3), dtype=dtype)
    y = x
    for a in alphas:
        y = fxbackend.op_create(g, op, [y], {"alpha": a})
    set_outputs(g, y)
    return g


def _node(op: str = Scale.name, dtype=torch.float32) -> Node:
    return _graph(op, dtype=dtype).nodes[-1]


def _run(g, dtype=torch.float32, alphas=(2.0,)):
    x = torch.randn(4, 3, dtype=dtype)
    cg = compiled(g)
    (r,) = cg(x)
    want = x
    for a in alphas:
        want = want * a
    torch.testing.assert_close(r, want)
    return cg


# -- registration and selection -------------------------------------------------------------------

def test_register_kernel_checks_the_kernel(reg):
    class NoSupports:
        name, op = "kn_nosup", Scale.name

        def execute(self, ctx, node, state, inputs, out, workspace):
            pass

    with pytest.raises(TypeError, match="'supports'"):
        fxbackend.register_kernel("cpu", NoSupports())
    reg.kernel("cpu", ScaleKernel("kn_dup"))
    with pytest.raises(ValueError, match="'kn_dup' is already registered"):
        fxbackend.register_kernel("cpu", ScaleKernel("kn_dup"))
    reg.kernel("testdev", ScaleKernel("kn_dup"))  # another device type: a separate entry
    assert [k.name for k in registry.kernels_for("cpu", Scale.name)] == ["kn_dup"]


def test_a_supporting_kernel_without_preferred_overrides_the_native_kernel(reg):
    op = reg.op(Scale)
    k = reg.kernel("cpu", ScaleKernel("kn_plain"))
    assert fxbackend.select_kernel("cpu", _node()) is k
    _run(_graph(alphas=(2.0, 3.0)), alphas=(2.0, 3.0))
    assert len(k.calls) == 2 and op.native_calls == []
    assert fxbackend.stats()["steps_by_kernel"] == {"kn_plain": 2}


@pytest.mark.parametrize("preferred, chosen", [(True, "kn_picky"), (False, "native")])
def test_preferred_says_whether_to_override_an_available_native_kernel(reg, preferred, chosen):
    op = reg.op(Scale)
    k = reg.kernel("cpu", Picky("kn_picky", preferred))
    assert fxbackend.select_kernel("cpu", _node()).name == chosen
    _run(_graph())
    assert fxbackend.stats()["steps_by_kernel"] == {chosen: 1}
    assert (len(k.calls), len(op.native_calls)) == ((1, 0) if preferred else (0, 1))


def test_supports_says_which_nodes_a_kernel_computes(reg):
    op = reg.op(Scale)
    k = reg.kernel("cpu", ScaleKernel("kn_f32", dtypes=(torch.float32,)))
    assert fxbackend.select_kernel("cpu", _node(dtype=torch.float64)) is registry.NATIVE
    _run(_graph(dtype=torch.float64), dtype=torch.float64)
    assert k.calls == [] and len(op.native_calls) == 1
    _run(_graph(dtype=torch.float32))
    assert len(k.calls) == 1


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_higher_priority_is_tried_first(reg, order):
    reg.op(Scale)
    low = ScaleKernel("kn_low", priority=1, dtypes=(torch.float32, torch.float64))
    high = ScaleKernel("kn_high", priority=7, dtypes=(torch.float32,))
    for k in ([low, high] if order == "low_first" else [high, low]):
        reg.kernel("cpu", k)
    assert fxbackend.select_kernel("cpu", _node()) is high
    assert fxbackend.select_kernel("cpu", _node(dtype=torch.float64)) is low, \
        "a kernel that does not support the node is skipped"


def test_a_preferred_lower_priority_kernel_beats_native(reg):
    reg.op(Scale)
    reg.kernel("cpu", Picky("kn_reluctant", False, priority=9))
    eager = reg.kernel("cpu", Picky("kn_eager", True, priority=1))
    assert fxbackend.select_kernel("cpu", _node()) is eager


def test_kernels_apply_to_their_device_type_only(reg):
    reg.op(Scale)
    k = reg.kernel("testdev", ScaleKernel("kn_elsewhere"))
    assert fxbackend.select_kernel("cpu", _node()) is registry.NATIVE
    assert fxbackend.select_kernel("testdev", _node()) is k
    _run(_graph())
    assert k.calls == []


@pytest.mark.parametrize("preferred", [None, True, False])
def test_without_a_native_kernel_a_supporting_extension_runs_whatever_preferred_says(
        reg, preferred):
    reg.op(NoExec)
    k = ScaleKernel("kn_only", op=NoExec.name) if preferred is None else \
        Picky("kn_only", preferred, op=NoExec.name)
    reg.kernel("cpu", k)
    assert fxbackend.select_kernel("cpu", _node(NoExec.name)) is k
    _run(_graph(NoExec.name))
    assert len(k.calls) == 1


def test_without_native_the_highest_priority_supporting_extension_runs(reg):
    reg.op(NoExec)
    reg.kernel("cpu", Picky("kn_a", False, op=NoExec.name, priority=1))
    b = reg.kernel("cpu", Picky("kn_b", False, op=NoExec.name, priority=2))
    assert fxbackend.select_kernel("cpu", _node(NoExec.name)) is b


def test_no_supporting_kernel_is_a_clear_error(reg):
    reg.op(NoExec)
    reg.kernel("cpu", ScaleKernel("kn_f64only", op=NoExec.name, dtypes=(torch.float64,)))
    with pytest.raises(NotImplementedError, match="no kernel on 'cpu' can run test.kn_noexec.v1"):
        fxbackend.select_kernel("cpu", _node(NoExec.name))
    with pytest.raises(NotImplementedError, match="no kernel on 'cpu' can run test.kn_noexec.v1"):
        compiled(_graph(NoExec.name))(torch.randn(4, 3))


def test_a_kernel_class_is_instantiated_once(reg):
    made = []

    class ClassKernel:
        name, op = "kn_class", Scale.name

        def __init__(self):
            made.append(self)

        def supports(self, node):
            return True

        def execute(self, ctx, node, state, inputs, out, workspace):
            torch.mul(inputs[0], node.params["alpha"], out=out)

    reg.op(Scale)
    reg.kernel("cpu", ClassKernel)
    _run(_graph(alphas=(2.0, 3.0)), alphas=(2.0, 3.0))
    assert len(made) == 1
    assert fxbackend.stats()["steps_by_kernel"] == {"kn_class": 2}


# -- supports_op / supports_native_op -------------------------------------------------------------

def test_supports_op_counts_extensions_and_supports_native_op_does_not(reg):
    reg.op(NoExec)
    node = _node(NoExec.name)
    assert (fxbackend.supports_op("cpu", node), fxbackend.supports_native_op("cpu", node)) == \
        (False, False)
    reg.kernel("cpu", ScaleKernel("kn_f64", op=NoExec.name, dtypes=(torch.float64,)))
    assert fxbackend.supports_op("cpu", node) is False, "a kernel that declines does not count"
    reg.kernel("cpu", Picky("kn_f32", False, op=NoExec.name))
    assert fxbackend.supports_op("cpu", node) is True, "preferred plays no part"
    assert fxbackend.supports_native_op("cpu", node) is False
    assert fxbackend.supports_op("testdev", node) is False


def test_supports_native_op_for_reference_executes_and_aten_ops(reg):
    reg.op(Scale)
    node = _node()
    assert fxbackend.supports_native_op("cpu", node) and fxbackend.supports_op("cpu", node)
    g, (x, y) = graph_of((4, 3), (4, 3))
    mul = g.append(g.new_node("aten.mul.Tensor", [x, y], {}, contiguous_meta((4, 3)),
                              target=torch.ops.aten.mul.Tensor))
    assert fxbackend.supports_native_op("cpu", mul) and fxbackend.supports_op("cpu", mul)


def test_a_fusion_only_registration_does_not_claim_single_node_support(reg):
    class Rule:
        name = "kn_rule"

        def match(self, graph, i):
            return 2 if graph.nodes[i].op == NoExec.name else 0

        def execute(self, ctx, node, state, inputs, out, workspace):
            pass

    reg.op(NoExec)
    reg.fusion("cpu", Rule())
    node = _node(NoExec.name)
    assert fxbackend.supports_op("cpu", node) is False
    assert fxbackend.supports_native_op("cpu", node) is False


class AsksAbout(ScaleKernel):
    """A kernel whose ``supports`` (or ``preferred``) asks ``supports_op`` about ``ask(node)``."""

    def __init__(self, name, ask, in_preferred=False, **kw):
        super().__init__(name, **kw)
        self.ask, self.in_preferred, self.answers = ask, in_preferred, []

    def supports(self, node):
        if not self.in_preferred:
            self.answers.append(fxbackend.supports_op(*self.ask(node)))
        return True

    def preferred(self, node):
        if self.in_preferred:
            self.answers.append(fxbackend.supports_op(*self.ask(node)))
        return True


@pytest.mark.parametrize("in_preferred", [False, True])
def test_a_callback_asking_about_its_own_op_gets_a_clear_error(reg, in_preferred):
    reg.op(Scale)
    bad = reg.kernel("cpu", AsksAbout("kn_self", lambda n: ("cpu", n), in_preferred))
    node = _node()
    with pytest.raises(RuntimeError, match="recursively"):
        fxbackend.select_kernel("cpu", node)
    with pytest.raises(RuntimeError, match="recursively"):
        compiled(_graph())(torch.randn(4, 3))
    if not in_preferred:
        with pytest.raises(RuntimeError, match="recursively"):
            fxbackend.supports_op("cpu", node)
    # the guard is released after the error
    fxbackend.unregister_kernel("cpu", bad)
    assert fxbackend.supports_op("cpu", node) and fxbackend.select_kernel("cpu", node) is \
        registry.NATIVE


def test_a_callback_asking_through_select_kernel_gets_the_same_error(reg):
    class Indirect(ScaleKernel):
        def supports(self, node):
            return fxbackend.select_kernel("cpu", node) is not None

    reg.op(Scale)
    reg.kernel("cpu", Indirect("kn_indirect"))
    with pytest.raises(RuntimeError, match="recursively"):
        fxbackend.supports_op("cpu", _node())


def test_a_callback_may_ask_about_other_ops_or_devices(reg):
    reg.op(Scale)
    reg.op(NoExec)
    other = _node(NoExec.name)
    same_op = reg.kernel("cpu", AsksAbout("kn_other_dev", lambda n: ("testdev", n), True,
                                          priority=1))
    other_op = reg.kernel("cpu", AsksAbout("kn_other_op", lambda n: ("cpu", other)))
    assert fxbackend.select_kernel("cpu", _node()) is same_op
    assert same_op.answers == [True], "the reference execute runs on any device"
    assert other_op.answers == [False]
    reg.kernel("cpu", ScaleKernel("kn_noexec_cpu", op=NoExec.name))
    assert fxbackend.supports_op("cpu", _node())
    assert other_op.answers[-1] is True


# -- prepare / execute / destroy ------------------------------------------------------------------

class Lifecycle(ScaleKernel):
    """Records prepare, execute and destroy; each prepared node gets its own state object."""

    def __init__(self, name, op=Scale.name, workspace_bytes=256, **kw):
        super().__init__(name, op=op, **kw)
        self.workspace_bytes = workspace_bytes
        self.prepared, self.states, self.executed, self.destroyed = [], [], [], []

    def prepare(self, node):
        self.prepared.append(node.id)
        state = ("state", node.id, object())
        self.states.append(state)
        self.prepare_view = [(type(s).__name__, type(s.meta).__name__) for s in node.srcs]
        self.prepare_params = dict(node.params)
        return state, self.workspace_bytes

    def execute(self, ctx, node, state, inputs, out, workspace):
        self.executed.append((ctx, node.id, state, list(inputs), out, workspace))
        super().execute(ctx, node, state, inputs, out, workspace)

    def destroy(self, state):
        self.destroyed.append(state)


def test_prepare_runs_once_per_plan_on_metadata(reg):
    reg.op(Scale)
    k = reg.kernel("cpu", Lifecycle("kn_life"))
    cg = compiled(_graph(alphas=(2.0, 3.0)))
    assert k.prepared == []
    x = torch.randn(4, 3)
    for _ in range(5):
        cg(x)
    assert sorted(k.prepared) == sorted(n.id for n in cg.graph.nodes if n.op == Scale.name)
    assert k.prepare_view == [("Node", "TensorMeta")], "sources are nodes with metadata only"
    assert k.prepare_params == {"alpha": 3.0}
    assert len(k.executed) == 10


def test_execute_gets_context_state_workspace_inputs_and_the_output_view(reg):
    reg.op(Scale)
    k = reg.kernel("cpu", Lifecycle("kn_life", workspace_bytes=96))
    cg = compiled(_graph())
    x = torch.randn(4, 3)
    (r,) = cg(x)
    (ctx, node_id, state, inputs, out, ws), = k.executed
    assert isinstance(ctx, ExecContext) and ctx.device == torch.device("cpu")
    assert ctx.stream is None
    assert state is k.states[0]
    assert ws.dtype == torch.uint8 and ws.device.type == "cpu" and ws.numel() >= 96
    assert len(inputs) == 1 and inputs[0].data_ptr() == x.data_ptr(), "inputs are not copied"
    assert out.shape == (4, 3) and out.dtype == torch.float32 and out.is_contiguous()
    assert out.data_ptr() == r.data_ptr(), "what execute writes into out is what the caller sees"
    torch.testing.assert_close(r, x * 2.0)


def test_a_kernel_without_prepare_gets_no_state(reg):
    reg.op(Scale)
    seen = []

    class Bare(ScaleKernel):
        def execute(self, ctx, node, state, inputs, out, workspace):
            seen.append(state)
            super().execute(ctx, node, state, inputs, out, workspace)

    reg.kernel("cpu", Bare("kn_bare"))
    _run(_graph())
    assert seen == [None]


def test_destroy_runs_when_the_plan_is_dropped(reg):
    reg.op(Scale)
    k = reg.kernel("cpu", Lifecycle("kn_life"))
    cg = compiled(_graph(alphas=(2.0, 3.0)))
    x = torch.randn(4, 3)
    cg(x)
    cg(x)
    gc.collect()
    assert k.destroyed == [], "not while the plan lives"
    first = list(k.states)

    reg.op(NoExec)  # a new generation: the old plan is replaced and dropped
    cg(x)
    gc.collect()
    assert sorted(k.destroyed, key=id) == sorted(first, key=id)

    k.executed.clear()  # the records hold the plan's tensors, not the plan
    del cg
    gc.collect()
    assert sorted(k.destroyed, key=id) == sorted(k.states, key=id)
    assert len(k.states) == 4


def test_a_kernels_compile_runs_once_per_node_at_plan_build(reg):
    reg.op(Scale)
    lock = threading.Lock()
    compiled_nodes = []

    class Compiling(ScaleKernel):
        def compile(self, node):
            with lock:  # may run in parallel across nodes
                compiled_nodes.append(node.id)

    reg.kernel("cpu", Compiling("kn_compiling"))
    cg = compiled(_graph(alphas=(2.0, 3.0, 4.0)))
    x = torch.randn(4, 3)
    for _ in range(4):
        cg(x)
    assert sorted(compiled_nodes) == sorted(n.id for n in cg.graph.nodes if n.op == Scale.name)


def test_an_error_in_prepare_reaches_the_caller(reg):
    op = reg.op(Scale)

    class Failing(Lifecycle):
        def prepare(self, node):
            raise RuntimeError("kn_fail: no plan for this node")

    k = reg.kernel("cpu", Failing("kn_fail"))
    with pytest.raises(RuntimeError, match="kn_fail: no plan for this node"):
        compiled(_graph())(torch.randn(4, 3))
    assert k.executed == [] and op.native_calls == []


@pytest.mark.parametrize("op_cls", [Scale, NoExec])
def test_a_launched_extension_is_never_retried_with_native(reg, op_cls):
    op = reg.op(op_cls)
    effects = []

    class Crashing(ScaleKernel):
        def execute(self, ctx, node, state, inputs, out, workspace):
            out.fill_(7.0)
            effects.append(node.id)
            raise ValueError("kn_crash failed half way")

    reg.kernel("cpu", Crashing("kn_crash", op=op_cls.name))
    cg = compiled(_graph(op_cls.name))
    for _ in range(2):
        with pytest.raises(ValueError, match="kn_crash failed half way"):
            cg(torch.randn(4, 3))
    assert len(effects) == 2
    assert getattr(op, "native_calls", []) == []


def test_prepare_must_return_a_byte_count(reg):
    reg.op(Scale)
    reg.kernel("cpu", Lifecycle("kn_bad_ws", workspace_bytes=-1))
    with pytest.raises(ValueError, match="workspace_bytes=-1"):
        compiled(_graph())(torch.randn(4, 3))


# -- ATen ops through torch.compile ---------------------------------------------------------------

class MulKernel:
    """aten.mul.Tensor of two same-shape tensors."""

    name, op = "kn_mul", "aten.mul.Tensor"

    def __init__(self, preferred: bool | None = None) -> None:
        self.calls = 0
        if preferred is not None:
            self.preferred = lambda node: preferred

    def supports(self, node):
        return len(node.srcs) == 2 and node.srcs[0].meta.shape == node.srcs[1].meta.shape

    def execute(self, ctx, node, state, inputs, out, workspace):
        self.calls += 1
        torch.mul(inputs[0], inputs[1], out=out)


@pytest.mark.parametrize("preferred", [None, True, False])
def test_a_kernel_for_an_aten_op_overrides_it_in_torch_compile(reg, preferred):
    k = reg.kernel("cpu", MulKernel(preferred))
    fn = lambda x, y: (x * y).sin()  # noqa: E731
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    with torch.no_grad():
        r = torch.compile(fn, backend="fxbackend")(x, y)
    torch.testing.assert_close(r, fn(x, y))
    steps = fxbackend.stats()["steps_by_kernel"]
    if preferred is False:
        assert k.calls == 0 and "kn_mul" not in steps and steps["native"] == 2
    else:
        assert k.calls == 1 and steps == {"kn_mul": 1, "native": 1}


def test_views_and_in_place_writes_are_never_intercepted(reg):
    calls = []

    class Anything:
        def __init__(self, op):
            self.name, self.op = "kn_any_" + op.split(".")[1], op

        def supports(self, node):
            return True

        def execute(self, ctx, node, state, inputs, out, workspace):
            calls.append(node.op)

    for op in ("aten.view.default", "aten.add_.Tensor"):
        reg.kernel("cpu", Anything(op))

    def fn(x):
        t = x * 2
        t.add_(1)
        return t.view(-1) * 3

    x = torch.randn(2, 3)
    cg = compile_fx_graph(make_fx(fn)(x), fxbackend.Options())
    ops = {n.op for n in cg.graph.nodes}
    assert {"aten.view.default", "aten.add_.Tensor"} <= ops, "the graph has both kinds of node"
    (r,) = cg(x)
    torch.testing.assert_close(r, fn(x))
    assert calls == []
    assert all(k is registry.NATIVE for n, k in cg.all_plans()[0].kernels.items()
               if n.op in ("aten.view.default", "aten.add_.Tensor"))


# -- workspace ------------------------------------------------------------------------------------

class Copy(LikeFirst):
    """A copy whose kernel asks for ``ws`` bytes of workspace."""

    name = "test.kn_copy.v1"
    attrs = {"ws": int}


class WorkspaceKernel:
    name, op = "kn_ws", Copy.name

    def __init__(self) -> None:
        self.workspaces = []

    def supports(self, node):
        return True

    def prepare(self, node):
        return None, node.params["ws"]

    def execute(self, ctx, node, state, inputs, out, workspace):
        assert workspace.numel() >= node.params["ws"]
        workspace[: node.params["ws"]].fill_(node.id)  # scratch: contents are not preserved
        self.workspaces.append(workspace)
        out.copy_(inputs[0])


@pytest.mark.parametrize("requests", [(100, 300), (300, 100), (1 << 20, 3 << 20)])
def test_one_workspace_per_plan_sized_to_the_largest_request(reg, requests):
    reg.op(Copy)
    k = reg.kernel("cpu", WorkspaceKernel())
    g, (x,) = graph_of((4, 3))
    y = x
    for ws in requests:
        y = fxbackend.op_create(g, Copy.name, [y], {"ws": ws})
    set_outputs(g, y)
    cg = compiled(g)
    t = torch.randn(4, 3)
    assert torch.equal(cg(t)[0], t)
    plan = cg.all_plans()[0]
    want = max(requests)
    assert plan.workspace_bytes == want
    assert fxbackend.stats()["workspace_bytes"] == want
    a, b = k.workspaces
    assert a is b and a.dtype == torch.uint8 and a.numel() == want, "one tensor, shared"
    assert f"workspace {want / 2**20:.2f} MB" in plan.report()


def test_a_plan_without_requests_has_no_workspace(reg):
    reg.op(Scale)
    cg = _run(_graph())
    assert cg.all_plans()[0].workspace_bytes == 0 and fxbackend.stats()["workspace_bytes"] == 0


def test_report_names_extension_kernels_that_declined_a_node(reg):
    class Picky:
        name = "picky_sin"
        op = "aten.sin.default"

        def supports(self, node):
            return False

        def why_not(self, node):
            return f"rank {len(node.meta.shape)} is not 3"

        def execute(self, ctx, node, state, inputs, out, workspace):
            raise AssertionError("never selected")

    class Shy(Picky):
        name = "shy_sin"

        def supports(self, node):
            return True

        def preferred(self, node):
            return False

    reg.kernel("cpu", Picky())
    reg.kernel("cpu", Shy())
    text = fxbackend.explain(lambda x: x.sin() + 1, torch.randn(4, 5))
    assert "kernel picky_sin declined %" in text and ": rank 2 is not 3" in text
    assert "kernel shy_sin declined %" in text and ": not preferred for this node" in text
