"""Golden step functions: what fxbackend/codegen.py writes for each kind of step.

Each case builds one small CPU plan whose steps are of the kind it is named after
(``StepWriter.kind``, listed in codegen's docstring) and compares, as one text, the kind of
every node, the generated source (``Plan.source``) and what each constant of it holds (arena
views by offset, callables by name).  A change in code generation shows up as a readable diff;
regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/test_codegen.py`` and review it.  Every
case also runs the plan against eager, and checks that generating again from the planned
state gives the same source (``codegen.generate`` changes nothing of the state).

The goldens hold nothing of the host: float32 graphs, whose plans no CPU profile decision
changes (and the conftest pins ``FXB_CPU_PROFILE=amx``); the thread count appears nowhere.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import fxbackend
from fxbackend import TensorMeta
from fxbackend import codegen
from fxbackend.codegen import ExecContext, StepWriter, generate
from fxbackend.step_guards import _AddressWatch, _Computed
from fxbackend.native import out_overload
from fxbackend.planning import FAST_OUT
from fxbackend.services import CancelToken
from conftest import assert_same
from test_fusion import GraphBuilder, Rule

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("no_grad")


# -- building and showing a plan --------------------------------------------------------------

def _compiled_plan(fn: Callable, *args: Any, dynamic: bool = False) -> fxbackend.Plan:
    """The one plan ``torch.compile(fn, backend="fxbackend")`` builds for ``args`` (checked
    against eager, written inputs too)."""
    torch._dynamo.reset()
    eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with fxbackend.record_graphs() as graphs:
        out = torch.compile(fn, backend="fxbackend", dynamic=dynamic, fullgraph=True)(*args)
    assert_same(out, fn(*eager_args))
    assert_same(list(args), eager_args)
    (cg,) = graphs
    (plan,) = cg.all_plans()
    return plan


def _hand_plan(g: fxbackend.Graph, args: list, want: list,
               options: dict | None = None) -> fxbackend.Plan:
    """The plan of hand-built graph ``g`` for ``args``, whose outputs must be ``want``."""
    cg = fxbackend.CompiledGraph(g, fxbackend.parse_options(options))
    assert_same(cg(*args), want)
    (plan,) = cg.all_plans()
    return plan


def _names(plan: fxbackend.Plan) -> dict[int, str]:
    """Names of the plan's ATen callables by object id: each node's op, the ``.out`` overload
    it may call, and the ``torch.*`` bindings of FAST_OUT."""
    names = {id(fn): f"torch.{fn.__name__}" if fn.__module__ == "torch" else
             f"{fn.__module__}.{fn.__name__}"
             for v in FAST_OUT.values() for fn in [v[0] if isinstance(v, tuple) else v]}
    for n in plan.graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload):
            names[id(n.target._op)] = str(n.target)
            out = out_overload(n.target)
            if out is not None:
                names[id(out[0]._op)] = str(out[0])
    return names


def _describe(v: Any, plan: fxbackend.Plan, names: dict) -> str:
    """A constant of the step function, in words that hold on any host."""
    if isinstance(v, torch.Tensor):
        for dev, arena in plan.arenas.items():
            if v.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr():
                off = v.data_ptr() - arena.data_ptr()
                return f"arena[{dev}] +{off} {TensorMeta.of(v).short()}"
        if v.numel() <= 8:
            return f"tensor {TensorMeta.of(v).short()} {v.tolist()}"
        return f"tensor {TensorMeta.of(v).short()}"
    if id(v) in names:
        return names[id(v)]
    if isinstance(v, fxbackend.Node):
        return f"node %{v.id} ({v.op})"
    if hasattr(v, "__self__") and hasattr(v, "__func__"):  # a kernel's bound method
        return f"{type(v.__self__).__name__}.{v.__func__.__name__}"
    if isinstance(v, _AddressWatch):
        return f"_AddressWatch(%{v.node.id})"
    if isinstance(v, _Computed):
        return f"_Computed({type(v.kernel).__name__}.compute, %{v.node.id})"
    if isinstance(v, types.FunctionType):
        return v.__qualname__
    if isinstance(v, (float, str, torch.dtype, torch.device, ExecContext)) or v is None:
        return repr(v)
    return type(v).__name__


def _kinds(plan: fxbackend.Plan) -> str:
    w = StepWriter(plan.state, plan.arenas, {}, [], plan.cancel_token)
    return " ".join(f"%{n.id}:{w.kind(n)}" for n in plan.graph.nodes)


def _golden(plan: fxbackend.Plan) -> str:
    """The node kinds, the step function's source and its constants (see the docstring)."""
    workspaces = {"_ws": plan.workspace}
    if plan.state.regions:
        workspaces["_ws_aux"] = plan.aux_workspace
    again = generate(plan.state, plan.arenas, workspaces, {}, [0.0] * len(plan.graph.nodes),
                     CancelToken())
    assert again.source == plan.source, "generating again gave another source"
    names = _names(plan)
    # a derivation's id is a process-wide counter (weights.what_id): it depends on the tests
    # run before
    source = re.sub(r"(_wcell\(\(.*\), )\d+(, _held\))", r"\1<what>\2", plan.source)
    legend = [f"# {k} = {_describe(plan._ns[k], plan, names)}"
              for k in again.names if re.fullmatch(r"c\d+", k)]
    return "\n".join([f"# kinds: {_kinds(plan)}", source.rstrip("\n"), *legend])


# -- one case per kind ------------------------------------------------------------------------

def test_owned_native_steps():
    # the first product goes to the arena through the .out overload's torch.* binding; the
    # returned exp is allocated per call (the caller keeps it)
    x = torch.randn(2, 3)
    assert_expected_inline(_golden(_compiled_plan(lambda x: (x * 2).exp(), x)), """\
# kinds: %0:input %1:owned %2:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, _ws):
    def run(args):
        a0, = args
        c2(a0, c1, out=c0)
        v2 = empty_strided((2, 3), (3, 1), dtype=c3, device=c4)
        c5(c0, out=v2)
        return [v2]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = tensor f32[] 2.0
# c2 = torch.mul
# c3 = torch.float32
# c4 = device(type='cpu')
# c5 = torch.exp""")


def test_input_view_and_planned_view():
    # a view of planned storage is taken once, at plan time (a constant); a view of an input
    # is taken per call
    x = torch.randn(2, 3)
    assert_expected_inline(_golden(_compiled_plan(lambda x: (x * 2).t() * x.t(), x)), """\
# kinds: %0:input %1:owned %2:view %3:view %4:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, _ws):
    def run(args):
        a0, = args
        c2(a0, c1, out=c0)
        v3 = c4(a0)
        v4 = empty_strided((3, 2), (1, 3), dtype=c5, device=c6)
        c2(c3, v3, out=v4)
        return [v4]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = tensor f32[] 2.0
# c2 = torch.mul
# c3 = arena[cpu] +0 f32[3,2]{1,3}
# c4 = aten.t.default
# c5 = torch.float32
# c6 = device(type='cpu')""")


def test_getitem_of_a_per_call_split():
    x = torch.randn(4, 3)
    plan = _compiled_plan(lambda x: [a * 2 for a in x.chunk(2)], x)
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:view %2:getitem %3:getitem %4:owned %5:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, _ws):
    def run(args):
        a0, = args
        v1 = c0(a0, 2)
        v2 = v1[0]
        v3 = v1[1]
        v4 = empty_strided((2, 3), (3, 1), dtype=c1, device=c2)
        c4(v2, c3, out=v4)
        v5 = empty_strided((2, 3), (3, 1), dtype=c1, device=c5)
        c4(v3, c6, out=v5)
        return [v4, v5]
    return run
# c0 = aten.split.Tensor
# c1 = torch.float32
# c2 = device(type='cpu')
# c3 = tensor f32[] 2.0
# c4 = torch.mul
# c5 = device(type='cpu')
# c6 = tensor f32[] 2.0""")


def test_bound_multi_output_and_its_getitem():
    # native_layer_norm's .out only copies: its own result is used, the unread outputs
    # dropped at once and the read one after its last reader
    x = torch.randn(2, 3)
    plan = _compiled_plan(lambda x: F.layer_norm(x, (3,)) * 2, x)
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:bound %2:getitem %3:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, _ws):
    def run(args):
        a0, = args
        _r = c1(a0, [3], None, None, c0)
        v1_0 = _r[0]
        del _r
        v3 = empty_strided((2, 3), (3, 1), dtype=c2, device=c3)
        c5(v1_0, c4, out=v3)
        del v1_0
        return [v3]
    return run
# c0 = 1e-05
# c1 = aten.native_layer_norm.default
# c2 = torch.float32
# c3 = device(type='cpu')
# c4 = tensor f32[] 2.0
# c5 = torch.mul""")


def test_inplace_write_into_an_input():
    def fn(x):
        x.mul_(2)
        return x + 1

    assert_expected_inline(_golden(_compiled_plan(fn, torch.randn(2, 3))), """\
# kinds: %0:input %1:owned %2:owned %3:inplace
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, _ws):
    def run(args):
        a0, = args
        c2(a0, c1, out=c0)
        v2 = empty_strided((2, 3), (3, 1), dtype=c3, device=c4)
        c6(c0, c5, out=v2)
        c7(a0, c0)
        return [v2]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = tensor f32[] 2.0
# c2 = torch.mul
# c3 = torch.float32
# c4 = device(type='cpu')
# c5 = tensor f32[] 1.0
# c6 = torch.add
# c7 = aten.copy_.default""")


def test_concat_with_a_part_written_in_place():
    # x * 2 writes its slice of the cat's buffer; only the input y is copied
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    plan = _compiled_plan(lambda x, y: torch.cat([x * 2, y]) + 1, x, y)
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:input %2:owned %3:concat %4:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, c8, _ws):
    def run(args):
        a0, a1 = args
        c2(a0, c1, out=c0)
        c4.copy_(a1)
        v4 = empty_strided((4, 3), (3, 1), dtype=c5, device=c6)
        c8(c3, c7, out=v4)
        return [v4]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = tensor f32[] 2.0
# c2 = torch.mul
# c3 = arena[cpu] +0 f32[4,3]
# c4 = arena[cpu] +24 f32[2,3]
# c5 = torch.float32
# c6 = device(type='cpu')
# c7 = tensor f32[] 1.0
# c8 = torch.add""")


def test_constant_folded_at_plan_time():
    x = torch.randn(2, 3)
    plan = _compiled_plan(lambda x: x + torch.arange(3.0), x)
    assert_expected_inline(_golden(plan), """\
# kinds: %3:constant %0:input %2:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, _ws):
    def run(args):
        a0, = args
        v2 = empty_strided((2, 3), (3, 1), dtype=c1, device=c2)
        c3(a0, c0, out=v2)
        return [v2]
    return run
# c0 = tensor f32[3] [0.0, 1.0, 2.0]
# c1 = torch.float32
# c2 = device(type='cpu')
# c3 = torch.add""")


def test_scalar_sizes_known_at_plan_time():
    # the sizes and their arithmetic are numbers of this plan (a symbolic graph's)
    x = torch.randn(2, 3)
    plan = _compiled_plan(lambda x: x * (x.shape[0] * x.shape[1] + 1), x, dynamic=True)
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:input %2:input %3:scalar %4:scalar %5:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, _ws):
    def run(args):
        a0, a1, a2 = args
        v5 = empty_strided((2, 3), (3, 1), dtype=c0, device=c1)
        c3(a2, c2, out=v5)
        return [v5]
    return run
# c0 = torch.float32
# c1 = device(type='cpu')
# c2 = tensor f32[] 7.0
# c3 = torch.mul""")


def test_bind_of_a_number_known_per_call_only():
    # item() is a number of each call (%3: the op's own result); the tensor Dynamo returns
    # for it is made by an op the plan hands over as it comes (%4: returned, allocated by
    # the op anyway)
    x = torch.randn(2, 3)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        plan = _compiled_plan(lambda x: (x * 2, x.sum().item()), x)
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:owned %2:bound %3:bind %4:bind
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, c8, _ws):
    def run(args):
        a0, = args
        v1 = empty_strided((2, 3), (3, 1), dtype=c0, device=c1)
        c3(a0, c2, out=v1)
        v2 = c4(a0)
        v3 = c5(v2)
        del v2
        v4 = c8(v3, dtype=c6, device=c7, pin_memory=False)
        return [v1, v4]
    return run
# c0 = torch.float32
# c1 = device(type='cpu')
# c2 = tensor f32[] 2.0
# c3 = torch.mul
# c4 = aten.sum.default
# c5 = aten._local_scalar_dense.default
# c6 = torch.float64
# c7 = device(type='cpu')
# c8 = aten.scalar_tensor.default""")


class _WeightTimesTwo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(9.0).view(3, 3))

    def forward(self, x):
        return x @ (self.w * 2).t()


def test_cached_weight_derived_step():
    # w * 2 reads the weight alone: recomputed only when the weight's key changes
    plan = _compiled_plan(_WeightTimesTwo(), torch.randn(2, 3))
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:input %2:cached %3:view %4:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, _ws):
    def run(args):
        a0, a1 = args
        _wk0 = _wkey(a0)
        _c = _wcell((a0, ), <what>, _held)
        _k = (_wk0, )
        _p = _c._pair
        if _p[0] != _k:
            _p = (_k, c0(a0, 2))
            _c.set(*_p)
            _wmark(_p[1], (a0, ))
        v2 = _p[1]
        v3 = c1(v2)
        v4 = empty_strided((2, 3), (3, 1), dtype=c2, device=c3)
        c4(a1, v3, out=v4)
        del v2
        return [v4]
    return run
# c0 = aten.mul.Tensor
# c1 = aten.t.default
# c2 = torch.float32
# c3 = device(type='cpu')
# c4 = torch.mm""")


# -- hand-built graphs: custom ops, kernels, placement, fusion --------------------------------

class _Twice:
    """``codegen.twice.v1(x) = 2 x``, with a reference ``execute`` (the native kernel's)."""

    name = "codegen.twice.v1"

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        return TensorMeta.contiguous(srcs[0].shape, srcs[0].dtype, srcs[0].device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        torch.mul(inputs[0], 2, out=out)


class _Negate(_Twice):
    """``codegen.negate.v1(x) = -x``: no reference, only a CPU kernel runs it."""

    name = "codegen.negate.v1"
    execute = None


class _NegateCPU:
    """The CPU kernel of ``codegen.negate.v1``: asks for workspace, watches its input's
    address (``update_args``)."""

    name = "codegen_negate_cpu"
    op = "codegen.negate.v1"

    def supports(self, node) -> bool:
        return True

    def prepare(self, node) -> tuple:
        return "negate state", 64

    def update_args(self, node, state, inputs) -> None:
        pass

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        torch.neg(inputs[0], out=out)


@pytest.fixture
def custom_ops():
    ops = [fxbackend.register_op(_Twice), fxbackend.register_op(_Negate)]
    kernel = fxbackend.register_kernel("cpu", _NegateCPU)
    yield
    fxbackend.unregister_kernel("cpu", kernel)
    for op in reversed(ops):
        fxbackend.unregister_op(op.name)


def _twice_negate(neg_only: bool = False) -> fxbackend.Graph:
    b = GraphBuilder()
    x = b.input(2, 3)
    y = x if neg_only else fxbackend.op_create(b.g, "codegen.twice.v1", [x])
    return b.output(fxbackend.op_create(b.g, "codegen.negate.v1", [y]))


def test_owned_extension_steps(custom_ops):
    # a custom op's reference execute (%1, into the arena) and a registered kernel (%2, with
    # its state, its update_args watch and the workspace)
    x = torch.randn(2, 3)
    plan = _hand_plan(_twice_negate(), [x], [-2 * x])
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %1:owned %2:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, _ws):
    def run(args):
        a0, = args
        c1(c2, c3, None, [a0], c0, _ws)
        v2 = empty_strided((2, 3), (3, 1), dtype=c4, device=c5)
        c9([c0]); c6(c7, c8, 'negate state', [c0], v2, _ws)
        return [v2]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = _Twice.execute
# c2 = ExecContext(device=cpu)
# c3 = node %1 (codegen.twice.v1)
# c4 = torch.float32
# c5 = device(type='cpu')
# c6 = _NegateCPU.execute
# c7 = ExecContext(device=cpu)
# c8 = node %2 (codegen.negate.v1)
# c9 = _AddressWatch(%2)""")


class _NegateCompute(_NegateCPU):
    """A CPU kernel of ``codegen.negate.v1`` returning its result (``compute``): the step is
    bound, with no storage; ``execute`` is never called."""

    name = "codegen_negate_compute"
    priority = 1
    calls = 0

    def compute(self, ctx, node, state, inputs, workspace) -> torch.Tensor:
        type(self).calls += 1
        return torch.neg(inputs[0])

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        raise AssertionError("a kernel with compute is not given storage")


def test_bound_extension_kernel_computes_its_result(custom_ops):
    # the kernel's compute result is the step's value (no arena view, no copy), behind its
    # update_args watch: %1's is read by %2 and dropped after it, %3's returned as it comes back
    kernel = fxbackend.register_kernel("cpu", _NegateCompute)
    try:
        b = GraphBuilder()
        x = b.input(2, 3)
        y = fxbackend.op_create(b.g, "codegen.negate.v1", [x])
        z = b.op(aten.add.Tensor, y, x)
        g = b.output(z, fxbackend.op_create(b.g, "codegen.negate.v1", [z]))
        x_ = torch.randn(2, 3)
        _NegateCompute.calls = 0
        plan = _hand_plan(g, [x_], [torch.zeros(2, 3), torch.zeros(2, 3)])
        assert _NegateCompute.calls == 2
        golden = _golden(plan)
        assert plan.memory.total_arena == 0 and {n.id for n in plan.state.bound} == {1, 3}
    finally:
        fxbackend.unregister_kernel("cpu", kernel)
    assert_expected_inline(golden, """\
# kinds: %0:input %1:bound %2:owned %3:bound
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, _ws):
    def run(args):
        a0, = args
        c3([a0]); v1 = c0(c1, c2, 'negate state', [a0], _ws)
        v2 = empty_strided((2, 3), (3, 1), dtype=c4, device=c5)
        c6(v1, a0, out=v2)
        del v1
        c10([v2]); v3 = c7(c8, c9, 'negate state', [v2], _ws)
        return [v2, v3]
    return run
# c0 = _Computed(_NegateCompute.compute, %1)
# c1 = ExecContext(device=cpu)
# c2 = node %1 (codegen.negate.v1)
# c3 = _AddressWatch(%1)
# c4 = torch.float32
# c5 = device(type='cpu')
# c6 = torch.add
# c7 = _Computed(_NegateCompute.compute, %3)
# c8 = ExecContext(device=cpu)
# c9 = node %3 (codegen.negate.v1)
# c10 = _AddressWatch(%3)""")


class _NegateComputeTransposed(_NegateCompute):
    """Breaks the ``compute`` contract: returns the result in another layout."""

    name = "codegen_negate_compute_transposed"

    def compute(self, ctx, node, state, inputs, workspace) -> torch.Tensor:
        return torch.neg(inputs[0]).t().contiguous().t()


def test_a_compute_result_of_other_metadata_is_an_error(custom_ops):
    kernel = fxbackend.register_kernel("cpu", _NegateComputeTransposed)
    try:
        cg = fxbackend.CompiledGraph(_twice_negate(neg_only=True), fxbackend.parse_options(None))
        with pytest.raises(RuntimeError, match=r"'codegen_negate_compute_transposed': compute\(\) "
                           r"for node %1 \(codegen.negate.v1\) returned .* strides \(1, 2\); "
                           r"expected .* strides \(3, 1\)"):
            cg(torch.randn(2, 3))
    finally:
        fxbackend.unregister_kernel("cpu", kernel)


def test_owned_device_copies_of_a_step_placed_on_the_cpu(custom_ops):
    # with the CPU renamed (options device_type), the kernel-only op has no kernel on the
    # plan's device: it runs on the CPU between two placement copies
    x = torch.randn(2, 3)
    plan = _hand_plan(_twice_negate(neg_only=True), [x], [-x],
                      options={"device_type": "codegen_device"})
    assert_expected_inline(_golden(plan), """\
# kinds: %0:input %2:owned %1:owned %3:owned
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, c3, c4, c5, c6, c7, _ws):
    def run(args):
        a0, = args
        c0.copy_(a0)
        c5([c0]); c2(c3, c4, 'negate state', [c0], c1, _ws)
        v3 = empty_strided((2, 3), (3, 1), dtype=c6, device=c7)
        v3.copy_(c1)
        return [v3]
    return run
# c0 = arena[cpu] +0 f32[2,3]
# c1 = arena[cpu] +64 f32[2,3]
# c2 = _NegateCPU.execute
# c3 = ExecContext(device=cpu)
# c4 = node %1 (codegen.negate.v1)
# c5 = _AddressWatch(%1)
# c6 = torch.float32
# c7 = device(type='cpu')""")


def test_fused_copy_writes_the_destination():
    # x * w + b -> copy_ into the input d: one fused step writing d itself
    b = GraphBuilder()
    x, w, bias, dest = b.input(2, 3), b.input(2, 3), b.input(2, 3), b.input(2, 3)
    b.op(aten.copy_.default, dest, b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x, w), bias))
    g = b.output()
    rule = fxbackend.register_fusion("cpu", Rule("codegen_mul_add_copy", [
        "aten.mul.Tensor", "aten.add.Tensor", "aten.copy_.default"]))
    try:
        X, W, B, D = (torch.randn(2, 3) for _ in range(4))
        want = X * W + B
        plan = _hand_plan(g, [X, W, B, D], [])
        assert_same(D, want)
        golden = _golden(plan)
    finally:
        fxbackend.unregister_fusion("cpu", rule)
    assert_expected_inline(golden, """\
# kinds: %0:input %1:input %2:input %3:input %7:fused_copy
def _make(empty_strided, _wkey, _wcell, _wmark, _held, c0, c1, c2, _ws):
    def run(args):
        a0, a1, a2, a3 = args
        c0(c1, c2, None, [a0, a1, a2, a3], a3, _ws)
        return []
    return run
# c0 = Rule.execute
# c1 = ExecContext(device=cpu)
# c2 = node %7 (fused.codegen_mul_add_copy)""")


def test_docstring_lists_exactly_the_kinds():
    """codegen's docstring names, at the head of its bullets, every kind ``kind()`` returns
    and no other; each kind has its emitter."""
    returned = {node.value.value for node in ast.walk(ast.parse(textwrap.dedent(
                    inspect.getsource(StepWriter.kind))))
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)}
    listed = set()
    for line in codegen.__doc__.splitlines():
        if line.startswith("- "):
            listed.update(re.findall(r"``([a-z_]+)``", line.partition(": ")[0]))
    assert listed == returned
    assert all(callable(getattr(StepWriter, "_emit_" + k, None)) for k in returned)
