"""Custom ops (fxbackend/ops.py) on hand-built graphs: registration (versioned names, schema,
uniqueness, the generation counter that rebuilds plans), the node builder ``op_create``
(attribute checking and copying, the one-output contract, placement) and the op capabilities
found by presence (infer_meta, a reference execute as native kernel, compile, one instance).
"""
from __future__ import annotations

import threading

import pytest
import torch
from expecttest import assert_expected_inline

import fxbackend
from fxbackend import TensorMeta, registry

from ext_util import (LikeFirst, compiled, contiguous_meta, graph_of, reg,  # noqa: F401
                      registry_guard, set_outputs)

pytestmark = pytest.mark.usefixtures("registry_guard")


class Scale(LikeFirst):
    """x * alpha, with a reference execute (so the native kernel runs it)."""

    name = "test.co_scale.v1"
    attrs = {"alpha": float}

    def execute(self, ctx, node, state, inputs, out, workspace):
        torch.mul(inputs[0], node.params["alpha"], out=out)


class NoExecute(LikeFirst):
    """No reference execute: only an extension kernel can run it."""

    name = "test.co_noexec.v1"


def _scale_graph(n_nodes: int = 1, shape=(4, 3)):
    g, (x,) = graph_of(shape)
    y = x
    for i in range(n_nodes):
        y = fxbackend.op_create(g, Scale.name, [y], {"alpha": float(i + 2)})
    set_outputs(g, y)
    return g


def _scale_expected(t: torch.Tensor, n_nodes: int) -> torch.Tensor:
    for i in range(n_nodes):
        t = t * float(i + 2)
    return t


# -- register_op ----------------------------------------------------------------------------------

def test_register_op_with_a_class_keeps_one_live_instance(reg):
    inst = reg.op(Scale)
    assert isinstance(inst, Scale)
    assert fxbackend.get_op(Scale.name) is inst
    assert Scale.name in fxbackend.ops.registered_ops()


def test_register_op_with_an_instance_keeps_that_instance(reg):
    op = Scale()
    assert reg.op(op) is op and fxbackend.get_op(Scale.name) is op


@pytest.mark.parametrize("name", ["scale", "test.scale", "test.scale.v", "test.scale.1",
                                  "Test.scale.v1", "test.scale.v1.x", "test..v1", None])
def test_register_op_rejects_unversioned_names(reg, name):
    class Bad(LikeFirst):
        pass
    Bad.name = name
    with pytest.raises(ValueError, match=r"namespace\.name\.vN"):
        reg.op(Bad)
    assert name not in fxbackend.ops.registered_ops()


def test_register_op_needs_infer_meta(reg):
    class NoMeta:
        name = "test.co_nometa.v1"

    with pytest.raises(TypeError, match="infer_meta"):
        reg.op(NoMeta)
    assert fxbackend.get_op(NoMeta.name) is None


@pytest.mark.parametrize("schema", [{"w": torch.Tensor}, {"w": list}, {"w": (dict, {})}])
def test_register_op_rejects_non_plain_attribute_types(reg, schema):
    class BadSchema(LikeFirst):
        name = "test.co_badschema.v1"
        attrs = schema

    with pytest.raises(TypeError, match="'w'"):
        reg.op(BadSchema)
    assert fxbackend.get_op(BadSchema.name) is None


def test_registering_a_name_twice_raises_and_keeps_the_live_op(reg):
    live = reg.op(Scale)

    class Impostor(LikeFirst):
        name = Scale.name

        def infer_meta(self, srcs, attrs):
            raise AssertionError("the replaced op must not be used")

    gen = registry.generation()
    with pytest.raises(ValueError, match="test.co_scale.v1 is already registered"):
        fxbackend.register_op(Impostor)
    assert fxbackend.get_op(Scale.name) is live
    g, (x,) = graph_of((2, 2))
    fxbackend.op_create(g, Scale.name, [x], {"alpha": 1.0})  # the live op's infer_meta
    assert registry.generation() == gen, "a rejected registration invalidates no plan"


def test_registration_after_planning_rebuilds_the_plan_with_the_new_kernel(reg):
    """Register before planning; a later registration bumps the generation and every plan built
    before it is rebuilt on its next call, selecting kernels again."""
    reg.op(Scale)

    class Low:
        name, op, priority = "co_low", Scale.name, 1

        def supports(self, node):
            return True

        def execute(self, ctx, node, state, inputs, out, workspace):
            torch.mul(inputs[0], node.params["alpha"], out=out)

    class High(Low):
        name, priority = "co_high", 5

    reg.kernel("cpu", Low())
    cg = compiled(_scale_graph(2))
    x = torch.randn(4, 3)
    want = _scale_expected(x, 2)
    torch.testing.assert_close(cg(x)[0], want)
    torch.testing.assert_close(cg.run([x])[0], want)
    s = fxbackend.stats()
    assert s["plans_built"] == 1 and s["steps_by_kernel"] == {"co_low": 4}

    gen = registry.generation()
    reg.kernel("cpu", High())
    assert registry.generation() > gen
    fxbackend.reset_stats()
    torch.testing.assert_close(cg.run([x])[0], want)  # the fast path checks the generation too
    torch.testing.assert_close(cg(x)[0], want)
    s = fxbackend.stats()
    assert s["plans_built"] == 1, "rebuilt once, then reused"
    assert s["steps_by_kernel"] == {"co_high": 4}

    fxbackend.reset_stats()
    reg.op(NoExecute)  # any registration counts, also of an op the graph does not use
    cg(x)
    assert fxbackend.stats()["plans_built"] == 1


def test_plans_are_reused_without_a_registration(reg):
    reg.op(Scale)
    cg = compiled(_scale_graph(1))
    for _ in range(3):
        cg(torch.randn(4, 3))
    s = fxbackend.stats()
    assert s["plans_built"] == 1 and s["calls"] == 3


# -- op_create ------------------------------------------------------------------------------------

def test_op_create_makes_an_ordinary_node_with_explicit_inputs(reg):
    reg.op(Scale)
    g, (x,) = graph_of((4, 3))
    y = fxbackend.op_create(g, Scale.name, [x], {"alpha": 2.0})
    assert g.nodes[-1] is y
    assert y.op == Scale.name and y.srcs == [x] and y.params == {"alpha": 2.0}
    assert y.meta == contiguous_meta((4, 3))
    assert y.view_of is None and y.inplace_of is None and y.target is None


def test_op_create_copies_attributes(reg):
    class Perm(LikeFirst):
        name = "test.co_perm.v1"
        attrs = {"alpha": float, "dims": tuple, "mode": (str, "fast"), "axes": (tuple, (0,))}

    reg.op(Perm)
    g, (x,) = graph_of((4, 3))
    attrs = {"alpha": 2.0, "dims": [0, 1]}
    y = fxbackend.op_create(g, Perm.name, [x], attrs)
    z = fxbackend.op_create(g, Perm.name, [x], attrs)
    attrs["alpha"] = 5.0
    attrs["dims"].append(2)
    attrs["extra"] = 1
    assert y.params == {"alpha": 2.0, "dims": (0, 1), "mode": "fast", "axes": (0,)}
    assert y.params is not z.params
    y.params["mode"] = "slow"
    assert z.params["mode"] == "fast", "each node has its own copy"


def test_op_create_converts_an_int_for_a_float_attribute(reg):
    reg.op(Scale)
    g, (x,) = graph_of((4, 3))
    y = fxbackend.op_create(g, Scale.name, [x], {"alpha": 3})
    assert y.params["alpha"] == 3.0 and type(y.params["alpha"]) is float


def test_a_tensor_the_op_needs_is_a_source_never_an_attribute(reg):
    class Mul(LikeFirst):
        name = "test.co_mul.v1"
        attrs = {"scale": float}

    reg.op(Mul)
    g, (x, w) = graph_of((4, 3), (4, 3))
    with pytest.raises(TypeError, match="'scale' is a tensor.*source"):
        fxbackend.op_create(g, Mul.name, [x], {"scale": torch.tensor(2.0)})
    node = fxbackend.op_create(g, Mul.name, [x, w], {"scale": 2.0})
    assert node.srcs == [x, w]


@pytest.mark.parametrize("attrs, exc, match", [
    ({"alpha": 1.0, "beta": 2}, ValueError, r"unknown attribute.*'beta'"),
    ({}, ValueError, r"missing attribute 'alpha'"),
    (None, ValueError, r"missing attribute 'alpha'"),
    ({"alpha": "2"}, TypeError, r"'alpha' must be float"),
    ({"alpha": [2.0]}, TypeError, r"'alpha' must be float"),
    ({"alpha": 1.0, "count": True}, TypeError, r"'count' must be int"),
    ({"alpha": 1.0, "count": 2.5}, TypeError, r"'count' must be int"),
    ({"alpha": 1.0, "dims": (1, [2])}, TypeError, r"'dims' must be a tuple of plain values"),
    ({"alpha": 1.0, "dims": (torch.zeros(1),)}, TypeError, r"'dims'"),
    ({"alpha": 1.0, "flag": 1}, TypeError, r"'flag' must be bool"),
])
def test_bad_attributes_are_errors_naming_the_attribute(reg, attrs, exc, match):
    class Typed(LikeFirst):
        name = "test.co_typed.v1"
        attrs = {"alpha": float, "count": (int, 1), "dims": (tuple, ()), "flag": (bool, False)}

    reg.op(Typed)
    g, (x,) = graph_of((4, 3))
    with pytest.raises(exc, match=match):
        fxbackend.op_create(g, Typed.name, [x], attrs)
    assert g.nodes == [x], "a failed op_create adds no node"


def test_op_create_rejects_unknown_ops_and_non_node_sources(reg):
    reg.op(Scale)
    g, (x,) = graph_of((4, 3))
    with pytest.raises(KeyError, match="test.co_missing.v1"):
        fxbackend.op_create(g, "test.co_missing.v1", [x], {})
    with pytest.raises(TypeError, match="source 0"):
        fxbackend.op_create(g, Scale.name, [torch.randn(4, 3)], {"alpha": 1.0})
    assert g.nodes == [x]


def test_infer_meta_reads_source_metadata_and_a_copy_of_the_attributes(reg):
    seen = []

    class Spy(LikeFirst):
        name = "test.co_spy.v1"
        attrs = {"alpha": float}

        def infer_meta(self, srcs, attrs):
            seen.append((srcs, dict(attrs)))
            attrs["alpha"] = -1.0  # must not reach the node
            return super().infer_meta(srcs, attrs)

    reg.op(Spy)
    g, (x,) = graph_of((4, 3))
    y = fxbackend.op_create(g, Spy.name, [x], {"alpha": 2.0})
    (srcs, attrs), = seen
    assert srcs == [x.meta] and all(isinstance(m, TensorMeta) for m in srcs)
    assert attrs == {"alpha": 2.0} and y.params == {"alpha": 2.0}


@pytest.mark.parametrize("meta, exc, match", [
    (TensorMeta((4, 3), (1, 4), torch.float32, torch.device("cpu")), ValueError, "contiguous"),
    (TensorMeta((4, 3), (3, 1), torch.float32, torch.device("cpu"), 2), ValueError,
     "storage offset"),
    (TensorMeta((4, 3), (3, 1), "float32", torch.device("cpu")), TypeError, "torch.dtype"),
    (TensorMeta((4, 3), (3, 1), float, torch.device("cpu")), TypeError, "torch.dtype"),
    ((contiguous_meta((4, 3)), contiguous_meta((4, 3))), TypeError, "must return a TensorMeta"),
    (torch.empty(4, 3), TypeError, "must return a TensorMeta"),
])
def test_the_output_is_one_contiguous_tensor_of_a_real_dtype(reg, meta, exc, match):
    class Out(LikeFirst):
        name = "test.co_out.v1"

        def infer_meta(self, srcs, attrs):
            return meta

    reg.op(Out)
    g, (x,) = graph_of((4, 3))
    with pytest.raises(exc, match=match):
        fxbackend.op_create(g, Out.name, [x], {})
    assert g.nodes == [x]


def test_infer_meta_with_strides_of_the_wrong_rank_is_an_error(reg):
    class Short(LikeFirst):
        name = "test.co_short.v1"

        def infer_meta(self, srcs, attrs):
            return TensorMeta((4, 3), (1,), torch.float32, torch.device("cpu"))

    reg.op(Short)
    g, (x,) = graph_of((4, 3))
    with pytest.raises(ValueError, match="contiguous"):
        fxbackend.op_create(g, Short.name, [x], {})


def test_the_output_may_have_another_existing_dtype(reg):
    class Half(LikeFirst):
        name = "test.co_half.v1"

        def infer_meta(self, srcs, attrs):
            return contiguous_meta(srcs[0].shape, torch.float16)

        def execute(self, ctx, node, state, inputs, out, workspace):
            out.copy_(inputs[0])

    reg.op(Half)
    g, (x,) = graph_of((4, 3))
    set_outputs(g, fxbackend.op_create(g, Half.name, [x], {}))
    t = torch.randn(4, 3)
    (r,) = compiled(g)(t)
    assert r.dtype == torch.float16 and torch.equal(r, t.half())


def test_after_places_the_node_right_after_that_node(reg):
    reg.op(Scale)
    g, (x, w) = graph_of((4, 3), (4, 3))
    a = fxbackend.op_create(g, Scale.name, [x], {"alpha": 2.0})
    b = fxbackend.op_create(g, Scale.name, [a], {"alpha": 3.0})
    c = fxbackend.op_create(g, Scale.name, [x], {"alpha": 4.0}, after=x)
    d = fxbackend.op_create(g, Scale.name, [a], {"alpha": 5.0}, after=a)
    assert g.nodes == [x, c, w, a, d, b]
    assert_expected_inline(g.format(), """\
%0 = input : f32[4,3]
%4 = test.co_scale.v1(%0) {alpha=4.0} : f32[4,3]
%1 = input : f32[4,3]
%2 = test.co_scale.v1(%0) {alpha=2.0} : f32[4,3]
%5 = test.co_scale.v1(%2) {alpha=5.0} : f32[4,3]
%3 = test.co_scale.v1(%2) {alpha=3.0} : f32[4,3]
return ()""")


def test_the_output_is_out_of_place(reg):
    """A custom node's output never overlaps its inputs, even when the planner reuses the
    storage of intermediates that die at that node."""
    overlaps = []

    def span(t):
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    class Checked(Scale):
        name = "test.co_checked.v1"

        def execute(self, ctx, node, state, inputs, out, workspace):
            o0, o1 = span(out)
            overlaps.extend(node.id for i in inputs if span(i)[0] < o1 and o0 < span(i)[1])
            super().execute(ctx, node, state, inputs, out, workspace)

    reg.op(Checked)
    g, (x,) = graph_of((64,))
    y = x
    for alpha in (2.0, 3.0, 0.5, 4.0, 0.25):
        y = fxbackend.op_create(g, Checked.name, [y], {"alpha": alpha})
    set_outputs(g, y)
    cg = compiled(g)
    t = torch.randn(64)
    (r,) = cg(t)
    assert torch.equal(r, t * 2 * 3 * 0.5 * 4 * 0.25)
    assert overlaps == []
    assert cg.all_plans()[0].memory.offsets, "the chain has planned intermediates to check"


# -- capabilities ---------------------------------------------------------------------------------

def test_a_reference_execute_is_the_ops_native_kernel(reg):
    reg.op(Scale)
    cg = compiled(_scale_graph(3))
    x = torch.randn(4, 3)
    torch.testing.assert_close(cg(x)[0], _scale_expected(x, 3))
    assert fxbackend.stats()["steps_by_kernel"] == {"native": 3}
    assert all(k is registry.NATIVE for k in cg.all_plans()[0].kernels.values())


def test_an_op_without_execute_or_kernel_cannot_be_planned(reg):
    reg.op(NoExecute)
    g, (x,) = graph_of((4, 3))
    set_outputs(g, fxbackend.op_create(g, NoExecute.name, [x], {}))
    with pytest.raises(NotImplementedError, match=r"no kernel on 'cpu' can run test.co_noexec.v1"):
        compiled(g)(torch.randn(4, 3))


def test_compile_runs_once_per_node_at_plan_build_not_per_call(reg):
    lock = threading.Lock()
    compiled_nodes: list = []
    threads: set = set()

    class Compiled(Scale):
        name = "test.co_compiled.v1"

        def compile(self, node):
            assert isinstance(node.meta, TensorMeta)
            with lock:  # compile may run in parallel across nodes
                compiled_nodes.append(node.id)
                threads.add(threading.get_ident())

    reg.op(Compiled)
    g, (x,) = graph_of((4, 3))
    y = x
    for alpha in (2.0, 3.0, 4.0, 5.0):
        y = fxbackend.op_create(g, Compiled.name, [y], {"alpha": alpha})
    set_outputs(g, y)
    ids = sorted(n.id for n in g.nodes if n.op == Compiled.name)
    cg = compiled(g)
    assert compiled_nodes == [], "nothing is compiled before the first plan"
    t = torch.randn(4, 3)
    for _ in range(3):
        assert torch.equal(cg(t)[0], t * 2 * 3 * 4 * 5)
    assert sorted(compiled_nodes) == ids
    assert threads, "compile ran"

    reg.op(NoExecute)  # a new generation: the rebuilt plan compiles its nodes again
    cg(t)
    assert sorted(compiled_nodes) == sorted(ids * 2)


def _chain(op: str, alphas) -> object:
    """A graph of one ``op`` node per alpha, each reading the one before."""
    g, (x,) = graph_of((4, 3))
    y = x
    for alpha in alphas:
        y = fxbackend.op_create(g, op, [y], {"alpha": alpha})
    set_outputs(g, y)
    return g


def test_compile_threads_do_not_outlive_the_plan_build(reg):
    """Compile jobs run on threads that exit with the pass: a kept pool thread that once ran a
    kernel keeps an OpenMP team, and with more OpenMP workers than cores every later parallel
    launch of the process waits for its workers to wake (``planning.run_on_passing_threads``)."""
    ran: list = []

    class Compiled(Scale):
        name = "test.co_compile_threads.v1"

        def compile(self, node):
            ran.append(threading.current_thread())

    reg.op(Compiled)
    g = _chain(Compiled.name, (2.0, 3.0, 4.0))
    t = torch.randn(4, 3)
    assert torch.equal(compiled(g)(t)[0], t * 2 * 3 * 4)
    assert len(ran) == 3
    assert all(th is not threading.main_thread() for th in ran) or torch.get_num_threads() == 1
    assert not any(th.is_alive() for th in ran), [th.name for th in ran if th.is_alive()]


def test_a_failing_compile_job_fails_the_plan_build(reg):
    class Failing(Scale):
        name = "test.co_compile_fails.v1"

        def compile(self, node):
            if node.params["alpha"] == 3.0:
                raise RuntimeError(f"cannot compile %{node.id}")

    reg.op(Failing)
    g = _chain(Failing.name, (2.0, 3.0, 4.0))
    with pytest.raises(RuntimeError, match=r"cannot compile %\d+"):
        compiled(g)(torch.randn(4, 3))


def test_one_op_instance_is_shared_by_every_node(reg):
    selves = set()

    class Shared(Scale):
        name = "test.co_shared.v1"

        def infer_meta(self, srcs, attrs):
            selves.add(id(self))
            return super().infer_meta(srcs, attrs)

        def compile(self, node):
            selves.add(id(self))

        def execute(self, ctx, node, state, inputs, out, workspace):
            selves.add(id(self))
            super().execute(ctx, node, state, inputs, out, workspace)

    live = reg.op(Shared)
    g, (x,) = graph_of((4, 3))
    y = x
    for alpha in (2.0, 3.0, 4.0):
        y = fxbackend.op_create(g, Shared.name, [y], {"alpha": alpha})
    set_outputs(g, y)
    compiled(g)(torch.randn(4, 3))
    assert selves == {id(live)}


def test_update_args_is_called_when_an_input_address_changes(reg):
    calls = []

    class Watched(Scale):
        name = "test.co_watched.v1"

        def prepare(self, node):
            return {"node": node.id}, 0

        def update_args(self, node, state, inputs):
            calls.append((node.id, state["node"], inputs[0].data_ptr()))

    reg.op(Watched)
    g, (x,) = graph_of((4, 3))
    set_outputs(g, fxbackend.op_create(g, Watched.name, [x], {"alpha": 2.0}))
    cg = compiled(g)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    cg(a)
    cg(a)  # same address: not called
    assert calls == []
    torch.testing.assert_close(cg(b)[0], b * 2.0)  # new address: called before the step
    assert len(calls) == 1 and calls[0][2] == b.data_ptr() and calls[0][0] == calls[0][1]
    cg(b)
    assert len(calls) == 1
    cg(a)
    assert len(calls) == 2 and calls[1][2] == a.data_ptr()


def test_steps_without_update_args_pay_no_address_check(reg):
    reg.op(Scale)
    g, (x,) = graph_of((4, 3))
    set_outputs(g, fxbackend.op_create(g, Scale.name, [x], {"alpha": 2.0}))
    cg = compiled(g)
    cg(torch.randn(4, 3))
    assert "data_ptr" not in cg.all_plans()[0].source and "_AddressWatch" not in cg.all_plans()[0].source
