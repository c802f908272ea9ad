"""Fusion rules (fxbackend/fusion.py, Plan in fxbackend/executor.py) on hand-built node lists.

Contracts under test (DESIGN.md "Extension API", fusion.py docstring):
- ``register_fusion(device, rule)``; ``match(graph, i) -> n`` claims nodes ``i..i+n-1``; the
  selection is frozen before memory planning (fused intermediates get no arena storage, external
  inputs stay allocated through the final node);
- the engine checks every claim and declines illegal ones, with the reason in
  ``plan.fusion_report.declined`` and in ``Plan.report()``;
- optional ``optimize(graph)`` runs before matching, legality is checked after it;
- fusion is on by default, off with ``FXB_DISABLE_FUSION=1``, ``options={"fusion": False}`` or an
  ``eval_callback``;
- ``fxbackend.explain`` and ``stats()["fusions_by_rule"]`` report what fired.

``GraphBuilder`` (also used by tests/test_graph_delay.py) builds ATen nodes the way lowering
does: ``srcs`` in schema order, other arguments as params, metadata from the meta device,
``view_of``/``inplace_of`` from the schema's alias annotations.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

import fxbackend
from fxbackend import Graph, Node, TensorMeta
from fxbackend.native import call_args

aten = torch.ops.aten
CPU = torch.device("cpu")
DEV = "cpu"


# -- hand-built graphs ----------------------------------------------------------------------------

def tm(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    """Contiguous concrete CPU metadata."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return TensorMeta(tuple(shape), tuple(reversed(stride)), dtype, CPU)


def _on_meta(m: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


class GraphBuilder:
    """Builds an :class:`fxbackend.Graph` node by node, as lowering would."""

    def __init__(self) -> None:
        self.g = Graph()

    def input(self, *shape: int, dtype: torch.dtype = torch.float32) -> Node:
        return self.g.append(self.g.new_node("input", meta=tm(*shape, dtype=dtype), is_input=True))

    def const(self, value: torch.Tensor) -> Node:
        n = self.g.new_node("constant", meta=TensorMeta.of(value), is_weight=True)
        n.annotations["value"] = value
        return self.g.append(n)

    def op(self, overload: Any, *args: Any, **kwargs: Any) -> Node:
        """An ATen node; tensor arguments are nodes, the rest plain values."""
        schema = overload._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        bound = {a.name: v for a, v in zip(positional, args)}
        bound.update(kwargs)
        srcs, params, layout = [], {}, []
        for a in schema.arguments:
            if a.name not in bound:
                continue
            v = bound[a.name]
            if isinstance(v, Node):
                srcs.append(v)
                layout.append((a.name, True))
            else:
                params[a.name] = v
        val = overload(**{k: _on_meta(v.meta) if isinstance(v, Node) else v
                          for k, v in bound.items()})
        meta = dataclasses.replace(TensorMeta.of(val), device=CPU)
        n = self.g.new_node(str(overload), srcs, params, meta, target=overload,
                            tensor_layout=tuple(layout))
        if schema.returns and schema.returns[0].alias_info is not None:
            for a in schema.arguments:
                if a.alias_info is not None and isinstance(bound.get(a.name), Node):
                    if a.alias_info.is_write:
                        n.inplace_of = bound[a.name]
                    else:
                        n.view_of = bound[a.name]
                    break
        return self.g.append(n)

    def py(self, fn: Callable, *srcs: Node) -> Node:
        """A ``py.*`` node (a callable without an ATen schema): unknown side effects."""
        meta = dataclasses.replace(TensorMeta.of(fn(*[_on_meta(s.meta) for s in srcs])),
                                   device=CPU)
        return self.g.append(self.g.new_node(f"py.{fn.__name__}", list(srcs),
                                             {"args": list(srcs), "kwargs": {}}, meta,
                                             target=fn))

    def output(self, *nodes: Node) -> Graph:
        for n in nodes:
            n.is_output = True
        self.g.outputs = list(nodes)
        return self.g


def replay(node: Node, inputs: list, env: dict | None = None) -> dict:
    """Evaluate a fused node's original nodes with their ATen targets; ``{node: value}``."""
    env = dict(env or {})
    env.update(zip(node.srcs, inputs))
    for n in node.annotations["fused"]:
        if n.op == "getitem":
            env[n] = env[n.srcs[0]][n.params["index"]]
            continue
        a, kw = call_args(n, lambda s: env[s], lambda v: v)
        env[n] = n.target(*a, **kw)
    return env


class Rule:
    """A fusion rule that claims every run of nodes whose ops are ``ops`` and runs them by
    replaying their ATen targets.  Records its calls."""

    def __init__(self, name: str, ops: list[str], priority: int = 0,
                 optimize: Callable | None = None, workspace: int | None = None,
                 clobber_out_first: bool = False) -> None:
        self.name = name
        self.ops = ops
        self.priority = priority
        if optimize is not None:
            self.optimize = lambda g: (self.log.append(("optimize", g)), optimize(g))
        if workspace is not None:
            self.prepare = lambda node: (("state", node.id), workspace)
            self.destroyed = []
            self.destroy = self.destroyed.append
        self.clobber = clobber_out_first
        self.log: list = []
        self.calls: list = []

    def match(self, graph: Graph, i: int) -> int:
        self.log.append(("match", graph))
        got = [n.op for n in graph.nodes[i:i + len(self.ops)]]
        return len(self.ops) if got == self.ops else 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        self.calls.append(dict(node=node, state=state, inputs=list(inputs), out=out,
                               workspace=workspace))
        if self.clobber:
            out.fill_(float("nan"))  # a kernel that writes its output before reading inputs
        result = replay(node, inputs)[node.annotations["fused"][-1]]
        if result is not out:
            out.copy_(result)


@pytest.fixture
def rules():
    """Register rules with ``rules.add(device, rule)``; all are unregistered afterwards."""
    added: list = []

    class Reg:
        @staticmethod
        def add(rule, device: str = DEV):
            fxbackend.register_fusion(device, rule)
            added.append((device, rule))
            return rule

    yield Reg
    for device, rule in reversed(added):
        fxbackend.unregister_fusion(device, rule)


def run(g: Graph, *args: torch.Tensor, options: dict | None = None):
    """Compile ``g`` directly, call it once; ``(outputs, plan)``."""
    cg = fxbackend.CompiledGraph(g, fxbackend.parse_options(options))
    outs = cg(*args)
    return outs, cg.plan_for(args)


def fused_nodes(plan) -> list[Node]:
    return [n for n in plan.graph.nodes if n.op.startswith("fused.")]


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


MUL, ADD, NEG, SIN, COS = ("aten.mul.Tensor", "aten.add.Tensor", "aten.neg.default",
                           "aten.sin.default", "aten.cos.default")


def chain3():
    """x, w, b -> t = sin(x); u = t * w; v = u + b; y = -v; out = cos(y)."""
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    t = b.op(aten.sin.default, x)
    u = b.op(aten.mul.Tensor, t, w)
    v = b.op(aten.add.Tensor, u, bias)
    y = b.op(aten.neg.default, v)
    out = b.op(aten.cos.default, y)
    b.output(out)
    return b, dict(x=x, w=w, b=bias, t=t, u=u, v=v, y=y, out=out)


def chain3_ref(x, w, bias):
    return torch.cos(-(torch.sin(x) * w + bias))


# -- registration ---------------------------------------------------------------------------------

def test_register_returns_rule_and_unregister_removes():
    rule = Rule("r_reg", [MUL, ADD])
    assert fxbackend.register_fusion(DEV, rule) is rule
    try:
        from fxbackend.fusion import fusions_for
        assert rule in fusions_for(DEV)
    finally:
        fxbackend.unregister_fusion(DEV, rule)
    assert rule not in fusions_for(DEV)


@pytest.mark.parametrize("missing", ["name", "match", "execute"])
def test_register_rejects_incomplete_rule(missing):
    attrs = {"name": "r_bad", "match": lambda g, i: 0, "execute": lambda *a: None}
    del attrs[missing]
    with pytest.raises(TypeError, match=missing):
        fxbackend.register_fusion(DEV, type("Bad", (), attrs)())


def test_register_duplicate_name_raises(rules):
    rules.add(Rule("r_dup", [MUL, ADD]))
    with pytest.raises(ValueError, match="already registered"):
        fxbackend.register_fusion(DEV, Rule("r_dup", [NEG]))


def test_registering_a_rule_rebuilds_existing_plans(rules):
    b, n = chain3()
    cg = fxbackend.CompiledGraph(b.g, fxbackend.parse_options())
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    cg(*args)
    assert fused_nodes(cg.plan_for(args)) == []
    rules.add(Rule("r_late", [MUL, ADD, NEG]))
    (out,) = cg(*args)
    torch.testing.assert_close(out, chain3_ref(*args))
    assert len(fused_nodes(cg.plan_for(args))) == 1


# -- match claims i..i+n-1 ------------------------------------------------------------------------

def test_match_claims_exactly_n_nodes(rules):
    rule = rules.add(Rule("r3", [MUL, ADD, NEG]))
    b, n = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args))
    assert [x.op for x in plan.graph.nodes if not x.is_input] == [SIN, "fused.r3", COS]
    (f,) = fused_nodes(plan)
    assert [x.id for x in f.annotations["fused"]] == [n["u"].id, n["v"].id, n["y"].id]
    assert plan.fusion_report.fired == [("r3", [n["u"].id, n["v"].id, n["y"].id])]
    assert plan.fusion_report.declined == []
    assert plan.kernels[f] is rule
    # execute: the external inputs in order of first use, out with the final node's metadata
    (call,) = rule.calls
    assert [s.id for s in call["node"].srcs] == [n["t"].id, n["w"].id, n["b"].id]
    assert call["inputs"][1] is args[1] and call["inputs"][2] is args[2]
    torch.testing.assert_close(call["inputs"][0], torch.sin(args[0]))
    assert call["out"].shape == (4, 8) and call["out"].dtype == torch.float32
    assert f.meta == n["y"].meta


def test_match_zero_claims_nothing(rules):
    rule = rules.add(Rule("r_none", [MUL, NEG]))  # never consecutive in chain3
    b, _ = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args), rtol=0, atol=0)
    assert fused_nodes(plan) == [] and rule.calls == []
    assert plan.fusion_report.fired == [] and plan.fusion_report.declined == []
    assert plan.fusion_report.format() == "no fusion rule matched"
    assert any(kind == "match" for kind, _ in rule.log)


def test_match_may_decline_a_recognised_chain_with_a_reason(rules):
    class Declining(Rule):
        def match(self, graph, i):
            n = super().match(graph, i)
            return (0, "no kernel for this layout") if n else 0

    rule = rules.add(Declining("r_why", [MUL, ADD]))
    b, n = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args), rtol=0, atol=0)
    assert rule.calls == [] and fused_nodes(plan) == []
    assert plan.fusion_report.declined == [("r_why", [n["u"].id], "no kernel for this layout")]
    assert "declined r_why on %" in plan.fusion_report.format()


def test_match_returning_a_malformed_tuple_is_an_error(rules):
    class Bad(Rule):
        def match(self, graph, i):
            return (2, "claims and declines") if super().match(graph, i) else 0

    rules.add(Bad("r_bad", [MUL, ADD]))
    b, _ = chain3()
    with pytest.raises(TypeError, match="r_bad.*expected an int, or \\(0, reason\\)"):
        run(b.g, rand(4, 8), rand(4, 8), rand(4, 8))


def test_rules_of_another_device_are_not_consulted(rules):
    other = rules.add(Rule("r_other_dev", [MUL, ADD]), device="fxb_test_device")
    b, _ = chain3()
    _, plan = run(b.g, rand(4, 8), rand(4, 8), rand(4, 8))
    assert other.log == [] and fused_nodes(plan) == []


def test_higher_priority_rule_first_then_fall_through_on_decline(rules):
    b, n = chain3()
    extra = b.op(aten.exp.default, n["v"])  # v read outside [mul, add, neg]
    b.output(n["out"], extra)
    hi = rules.add(Rule("r_hi", [MUL, ADD, NEG], priority=5))
    lo = rules.add(Rule("r_lo", [MUL, ADD], priority=1))
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out, e), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args))
    torch.testing.assert_close(e, torch.exp(torch.sin(args[0]) * args[1] + args[2]))
    assert [d[0] for d in plan.fusion_report.declined] == ["r_hi"]
    assert plan.fusion_report.fired == [("r_lo", [n["u"].id, n["v"].id])]
    assert hi.calls == [] and len(lo.calls) == 1


# -- the selection is frozen before memory planning -----------------------------------------------

def _diamond():
    """t = sin(x); u = t * w; v = u + t; y = cos(v) (output): t is read by the whole range."""
    b = GraphBuilder()
    x, w = b.input(64, 64), b.input(64, 64)
    t = b.op(aten.sin.default, x)
    u = b.op(aten.mul.Tensor, t, w)
    v = b.op(aten.add.Tensor, u, t)
    y = b.op(aten.cos.default, v)
    b.output(y)
    return b.g, dict(t=t, u=u, v=v, y=y)


@pytest.mark.parametrize("fusion", [True, False])
def test_fused_intermediates_get_no_arena_storage(rules, fusion):
    rules.add(Rule("r_dia", [MUL, ADD]))
    g, n = _diamond()
    x, w = rand(64, 64), rand(64, 64)
    (out,), plan = run(g, x, w, options={"fusion": fusion})
    torch.testing.assert_close(out, torch.cos(torch.sin(x) * w + torch.sin(x)))
    keys = {buf.key for buf in plan.memory.buffers}
    if fusion:
        (f,) = fused_nodes(plan)
        assert keys == {(n["t"].id, None), (f.id, None)}
        assert (n["u"].id, None) not in plan.memory.offsets
        assert (n["v"].id, None) not in plan.memory.offsets
    else:
        assert keys == {(n["t"].id, None), (n["u"].id, None), (n["v"].id, None)}


def test_fusion_makes_the_arena_smaller(rules):
    rules.add(Rule("r_dia", [MUL, ADD]))
    g, _ = _diamond()
    args = (rand(64, 64), rand(64, 64))
    _, fused = run(g, *args)
    _, unfused = run(g, *args, options={"fusion": False})
    assert len(fused_nodes(fused)) == 1 and fused_nodes(unfused) == []
    assert fused.memory.total_arena < unfused.memory.total_arena
    assert fused.memory.sum_intermediates < unfused.memory.sum_intermediates


def _live_at(plan, step: int):
    return [buf for buf in plan.memory.buffers if buf.start <= step <= buf.end]


def _overlap(plan, a, b) -> bool:
    from fxbackend.memory import ALIGNMENT
    oa, ob = plan.memory.offsets[a.key], plan.memory.offsets[b.key]
    sa = -(-a.nbytes // ALIGNMENT) * ALIGNMENT
    sb = -(-b.nbytes // ALIGNMENT) * ALIGNMENT
    return oa < ob + sb and ob < oa + sa


def test_external_input_stays_allocated_through_the_final_node(rules):
    # t is read only by the first node (mul) of the fused range [mul, add, neg]
    rule = rules.add(Rule("r_keep", [MUL, ADD, NEG], clobber_out_first=True))
    b, n = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    # the kernel wrote NaN into its output before reading t: a shared buffer would show
    torch.testing.assert_close(out, chain3_ref(*args))
    (f,) = fused_nodes(plan)
    step = plan.graph.nodes.index(f)
    (t_buf,) = [buf for buf in plan.memory.buffers if buf.key == (n["t"].id, None)]
    assert t_buf.end == step
    others = [buf for buf in _live_at(plan, step) if buf is not t_buf]
    assert [buf.key for buf in others] == [(f.id, None)]
    assert not any(_overlap(plan, t_buf, o) for o in others)
    assert len(rule.calls) == 1


def test_without_fusion_a_first_use_input_dies_early():
    # contrast: unfused, t dies at the mul step and its storage is reused by a later step
    b, n = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args), rtol=0, atol=0)
    (t_buf,) = [buf for buf in plan.memory.buffers if buf.key == (n["t"].id, None)]
    assert t_buf.end == next(i for i, x in enumerate(plan.graph.nodes) if x.id == n["u"].id)
    assert t_buf.end < max(buf.end for buf in plan.memory.buffers)
    later = [buf for buf in plan.memory.buffers if buf.start > t_buf.end]
    assert any(plan.memory.offsets[buf.key] == plan.memory.offsets[t_buf.key] for buf in later)


def test_rule_can_request_workspace_through_prepare(rules):
    # input/output overlap is the rule's to handle; it asks for scratch with prepare()
    rule = rules.add(Rule("r_ws", [MUL, ADD, NEG], workspace=1000))
    b, n = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args)
    torch.testing.assert_close(out, chain3_ref(*args))
    (f,) = fused_nodes(plan)
    assert plan.workspace_bytes == 1000
    (call,) = rule.calls
    assert call["state"] == ("state", f.id)
    assert call["workspace"] is not None and call["workspace"].numel() >= 1000
    assert rule.destroyed == []
    del plan, call
    import gc
    gc.collect()
    assert rule.destroyed == [("state", f.id)]  # destroy(state) when the plan is dropped


def test_no_workspace_without_prepare(rules):
    rules.add(Rule("r_nows", [MUL, ADD, NEG]))
    b, _ = chain3()
    _, plan = run(b.g, rand(4, 8), rand(4, 8), rand(4, 8))
    assert len(fused_nodes(plan)) == 1 and plan.workspace_bytes == 0


# -- legality: the engine declines illegal claims, with the reason in the report ------------------

def _expect_declined(plan, name: str, ids: list, why: str):
    assert fused_nodes(plan) == [], plan.report()
    assert plan.fusion_report.fired == []
    matches = [d for d in plan.fusion_report.declined if d[0] == name]
    assert matches, plan.fusion_report.declined
    rname, rids, reason = matches[0]
    assert rids == ids and why in reason, reason
    text = plan.report()
    assert f"declined {name} on " + ", ".join(f"%{i}" for i in ids) + f": {reason}" in text


def _expect_fired(plan, name: str, ids: list):
    assert plan.fusion_report.declined == []
    assert plan.fusion_report.fired == [(name, ids)]
    assert f"fused {name}: " + ", ".join(f"%{i}" for i in ids) in plan.report()


@pytest.mark.parametrize("kind", ["py", "constant"])
def test_declines_a_claim_of_a_non_compute_node(rules, kind):
    b = GraphBuilder()
    x, w = b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    if kind == "py":
        mid = b.py(torch.neg, u)
        y = b.op(aten.sin.default, mid)
        ops = [MUL, "py.neg", SIN]
    else:
        mid = b.const(torch.full((4, 8), 2.0))
        y = b.op(aten.add.Tensor, u, mid)
        ops = [MUL, "constant", ADD]
    b.output(y)
    rules.add(Rule("r_nc", ops))
    X, W = rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W)
    want = torch.sin(-(X * W)) if kind == "py" else X * W + 2.0
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    _expect_declined(plan, "r_nc", [u.id, mid.id, y.id], "is not a compute node")


def test_accepts_a_claim_of_compute_nodes(rules):
    b = GraphBuilder()
    x, w = b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    mid = b.op(aten.neg.default, u)
    y = b.op(aten.sin.default, mid)
    b.output(y)
    rules.add(Rule("r_c", [MUL, NEG, SIN]))
    X, W = rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W)
    torch.testing.assert_close(out, torch.sin(-(X * W)))
    _expect_fired(plan, "r_c", [u.id, mid.id, y.id])


@pytest.mark.parametrize("read_outside", [False, True])
def test_intermediate_read_outside_the_match(rules, read_outside):
    b, n = chain3()
    outs = [n["out"]]
    if read_outside:
        outs.append(b.op(aten.exp.default, n["u"]))
    b.output(*outs)
    rules.add(Rule("r_out", [MUL, ADD, NEG]))
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    res, plan = run(b.g, *args)
    torch.testing.assert_close(res[0], chain3_ref(*args))
    ids = [n["u"].id, n["v"].id, n["y"].id]
    if read_outside:
        torch.testing.assert_close(res[1], torch.exp(torch.sin(args[0]) * args[1]))
        _expect_declined(plan, "r_out", ids,
                         f"intermediate %{n['u'].id} (aten.mul.Tensor) is read by "
                         f"%{outs[1].id} outside the match")
    else:
        _expect_fired(plan, "r_out", ids)


@pytest.mark.parametrize("is_output", [False, True])
def test_intermediate_that_is_a_graph_output(rules, is_output):
    b, n = chain3()
    b.output(n["out"], *([n["v"]] if is_output else []))
    rules.add(Rule("r_go", [MUL, ADD, NEG]))
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    res, plan = run(b.g, *args)
    torch.testing.assert_close(res[0], chain3_ref(*args))
    ids = [n["u"].id, n["v"].id, n["y"].id]
    if is_output:
        torch.testing.assert_close(res[1], torch.sin(args[0]) * args[1] + args[2])
        _expect_declined(plan, "r_go", ids,
                         f"intermediate %{n['v'].id} (aten.add.Tensor) is a graph output")
    else:
        _expect_fired(plan, "r_go", ids)


def test_final_node_may_be_a_graph_output(rules):
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.add.Tensor, u, bias)
    b.output(v)
    rules.add(Rule("r_fo", [MUL, ADD]))
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W, B)
    torch.testing.assert_close(out, X * W + B)
    _expect_fired(plan, "r_fo", [u.id, v.id])
    (out2,) = plan(X, W, B)
    assert out2 is not out  # outputs stay fresh per call
    torch.testing.assert_close(out2, out)


def test_view_of_storage_inside_the_match_is_accepted(rules):
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(8, 4)
    u = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.view.default, u, [8, 4])
    y = b.op(aten.add.Tensor, v, bias)
    z = b.op(aten.cos.default, y)
    b.output(z)
    assert v.view_of is u
    rules.add(Rule("r_view_in", [MUL, "aten.view.default", ADD]))
    X, W, B = rand(4, 8), rand(4, 8), rand(8, 4)
    (out,), plan = run(b.g, X, W, B)
    torch.testing.assert_close(out, torch.cos((X * W).view(8, 4) + B))
    _expect_fired(plan, "r_view_in", [u.id, v.id, y.id])
    assert not any(key[0] in (u.id, v.id, y.id) for key in plan.memory.offsets)


@pytest.mark.parametrize("owner", ["input", "intermediate"])
def test_view_of_storage_outside_the_match_is_declined(rules, owner):
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(8, 4), b.input(8, 4)
    src = x if owner == "input" else b.op(aten.sin.default, x)
    v = b.op(aten.view.default, src, [8, 4])
    u = b.op(aten.mul.Tensor, v, w)
    y = b.op(aten.add.Tensor, u, bias)
    b.output(y)
    rules.add(Rule("r_view_out", ["aten.view.default", MUL, ADD]))
    X, W, B = rand(4, 8), rand(8, 4), rand(8, 4)
    (out,), plan = run(b.g, X, W, B)
    base = X if owner == "input" else torch.sin(X)
    torch.testing.assert_close(out, base.view(8, 4) * W + B, rtol=0, atol=0)
    _expect_declined(plan, "r_view_out", [v.id, u.id, y.id],
                     f"view %{v.id} (aten.view.default) aliases storage of %{src.id} outside "
                     f"the match")


def _var_mean(b: GraphBuilder, x: Node):
    """A multi-output node and its two getitem reads."""
    ov = aten.var_mean.correction
    vals = ov(_on_meta(x.meta), [1], correction=0, keepdim=True)
    meta = tuple(dataclasses.replace(TensorMeta.of(v), device=CPU) for v in vals)
    vm = b.g.append(b.g.new_node(str(ov), [x], {"dim": [1], "correction": 0, "keepdim": True},
                                 meta, target=ov, tensor_layout=(("self", True),)))
    g0 = b.g.append(b.g.new_node("getitem", [vm], {"index": 0}, meta[0]))
    g1 = b.g.append(b.g.new_node("getitem", [vm], {"index": 1}, meta[1]))
    return vm, g0, g1


@pytest.mark.parametrize("claim_parent", [True, False])
def test_getitem_views_of_a_multi_output_node(rules, claim_parent):
    # getitem is a view of one output: accepted when the multi-output node is in the match
    b = GraphBuilder()
    x = b.input(4, 8)
    vm, g0, g1 = _var_mean(b, x)
    s = b.op(aten.add.Tensor, g0, g1)
    y = b.op(aten.sub.Tensor, x, s)
    b.output(y)
    ops = ([vm.op] if claim_parent else []) + ["getitem", "getitem", ADD]
    rules.add(Rule("r_vm", ops))
    X = rand(4, 8)
    (out,), plan = run(b.g, X)
    v, m = torch.var_mean(X, 1, correction=0, keepdim=True)
    torch.testing.assert_close(out, X - (v + m))
    ids = ([vm.id] if claim_parent else []) + [g0.id, g1.id, s.id]
    if claim_parent:
        _expect_fired(plan, "r_vm", ids)
        assert not any(key[0] == vm.id for key in plan.memory.offsets)
    else:
        _expect_declined(plan, "r_vm", ids, f"view %{g0.id} (getitem) aliases storage of "
                                            f"%{vm.id} outside the match")


def test_inplace_intermediate_on_earlier_match_node_is_accepted(rules):
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    u2 = b.op(aten.add_.Tensor, u, bias)
    y = b.op(aten.neg.default, u2)
    b.output(y)
    assert u2.inplace_of is u
    rules.add(Rule("r_ip_in", [MUL, "aten.add_.Tensor", NEG]))
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W, B)
    torch.testing.assert_close(out, -(X * W + B))
    _expect_fired(plan, "r_ip_in", [u.id, u2.id, y.id])


@pytest.mark.parametrize("owner", ["input", "intermediate"])
def test_inplace_intermediate_on_outside_storage_is_declined(rules, owner):
    b = GraphBuilder()
    x, w = b.input(4, 8), b.input(4, 8)
    dst = x if owner == "input" else b.op(aten.sin.default, x)
    u = b.op(aten.mul.Tensor, x, w)
    u2 = b.op(aten.add_.Tensor, dst, u)  # writes storage outside the match
    y = b.op(aten.neg.default, u2)
    z = b.op(aten.cos.default, dst)
    b.output(y, z)
    rules.add(Rule("r_ip_out", [MUL, "aten.add_.Tensor", NEG]))
    X, W = rand(4, 8), rand(4, 8)
    X0 = X.clone()
    base = X0.clone() if owner == "input" else torch.sin(X0)
    want = base + X0 * W
    (out, zz), plan = run(b.g, X, W)
    torch.testing.assert_close(out, -want)
    torch.testing.assert_close(zz, torch.cos(want))
    _expect_declined(plan, "r_ip_out", [u.id, u2.id, y.id],
                     f"in-place %{u2.id} (aten.add_.Tensor) writes storage of %{dst.id}, "
                     f"which is not an earlier node of the match")


@pytest.mark.parametrize("kind", ["view", "inplace"])
def test_final_node_that_does_not_own_its_storage_is_declined(rules, kind):
    b = GraphBuilder()
    x, w = b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    if kind == "view":
        last = b.op(aten.view.default, u, [32])
        ops = [MUL, "aten.view.default"]
        b.output(b.op(aten.cos.default, last))
    else:
        last = b.op(aten.add_.Tensor, w, u)  # a non-copy in-place write into an input
        ops = [MUL, "aten.add_.Tensor"]
        b.output(b.op(aten.cos.default, last))
    rules.add(Rule("r_last", ops))
    X, W = rand(4, 8), rand(4, 8)
    W0 = W.clone()
    (out,), plan = run(b.g, X, W)
    want = torch.cos((X * W0).view(32)) if kind == "view" else torch.cos(W0 + X * W0)
    torch.testing.assert_close(out, want)
    _expect_declined(plan, "r_last", [u.id, last.id],
                     f"final node %{last.id} ({last.op}) does not own its storage")


def test_terminal_copy_keeps_its_destination(rules):
    b = GraphBuilder()
    x, w, bias, dest = b.input(4, 8), b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.add.Tensor, u, bias)
    c = b.op(aten.copy_.default, dest, v)
    b.output()
    assert c.inplace_of is dest
    rule = rules.add(Rule("r_copy", [MUL, ADD, "aten.copy_.default"]))
    X, W, B, D = rand(4, 8), rand(4, 8), rand(4, 8), torch.zeros(4, 8)
    outs, plan = run(b.g, X, W, B, D)
    assert outs == []
    torch.testing.assert_close(D, X * W + B)  # write semantics: the destination holds it
    _expect_fired(plan, "r_copy", [u.id, v.id, c.id])
    (f,) = fused_nodes(plan)
    assert f.inplace_of.id == dest.id  # the plan graph is a copy: compare ids
    (call,) = rule.calls
    assert call["out"].data_ptr() == D.data_ptr()
    assert plan.memory.buffers == []
    # every call writes the destination again
    D2 = torch.zeros(4, 8)
    plan(X, W, B, D2)
    torch.testing.assert_close(D2, X * W + B)


def test_terminal_copy_from_torch_compile(rules):
    # functionalisation writes a mutated input back with copy(dest, v) then copy_(dest, .)
    rules.add(Rule("r_copy_tc", [MUL, ADD, "aten.copy.default", "aten.copy_.default"]))

    def fn(x, w, b, dest):
        dest.copy_(x * w + b)

    X, W, B, D = rand(4, 8), rand(4, 8), rand(4, 8), torch.zeros(4, 8)
    with torch.no_grad():
        torch.compile(fn, backend="fxbackend")(X, W, B, D)
    torch.testing.assert_close(D, X * W + B)
    assert fxbackend.stats()["fusions_by_rule"] == {"r_copy_tc": 1}


@pytest.mark.parametrize("dest_kind", ["slice_of_input", "intermediate"])
def test_terminal_copy_into_a_view_or_an_intermediate(rules, dest_kind):
    b = GraphBuilder()
    x, w, bias, d = b.input(4, 8), b.input(4, 8), b.input(4, 8), b.input(8, 8)
    dest = (b.op(aten.slice.Tensor, d, 0, 0, 4) if dest_kind == "slice_of_input"
            else b.op(aten.sin.default, x))
    u = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.add.Tensor, u, bias)
    c = b.op(aten.copy_.default, dest, v)
    b.output(b.op(aten.cos.default, c))
    rule = rules.add(Rule("r_copy_v", [MUL, ADD, "aten.copy_.default"]))
    X, W, B, D = rand(4, 8), rand(4, 8), rand(4, 8), torch.zeros(8, 8)
    (out,), plan = run(b.g, X, W, B, D)
    torch.testing.assert_close(out, torch.cos(X * W + B))
    _expect_fired(plan, "r_copy_v", [u.id, v.id, c.id])
    (call,) = rule.calls
    if dest_kind == "slice_of_input":
        torch.testing.assert_close(D[:4], X * W + B)
        assert (D[4:] == 0).all()
        assert call["out"].data_ptr() == D.data_ptr() and call["out"].shape == (4, 8)
    else:
        # the destination's buffer is the fused step's output, kept through the cos
        (f,) = fused_nodes(plan)
        (buf,) = plan.memory.buffers
        assert buf.key == (dest.id, None)
        assert buf.end > plan.graph.nodes.index(f)


def test_copy_into_outside_storage_that_is_not_terminal_is_declined(rules):
    b = GraphBuilder()
    x, w, dest = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    c = b.op(aten.copy_.default, dest, u)
    y = b.op(aten.neg.default, c)
    b.output(y)
    rules.add(Rule("r_copy_mid", [MUL, "aten.copy_.default", NEG]))
    X, W, D = rand(4, 8), rand(4, 8), torch.zeros(4, 8)
    (out,), plan = run(b.g, X, W, D)
    torch.testing.assert_close(D, X * W)
    torch.testing.assert_close(out, -(X * W))
    _expect_declined(plan, "r_copy_mid", [u.id, c.id, y.id],
                     f"in-place %{c.id} (aten.copy_.default) writes storage of %{dest.id}")


def test_terminal_copy_into_a_node_of_the_match_is_declined(rules):
    b = GraphBuilder()
    x, w = b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    s = b.op(aten.sin.default, u)
    c = b.op(aten.copy_.default, u, s)  # destination u is inside the match
    y = b.op(aten.cos.default, c)
    b.output(y)
    rules.add(Rule("r_copy_in", [MUL, SIN, "aten.copy_.default"]))
    X, W = rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W)
    torch.testing.assert_close(out, torch.cos(torch.sin(X * W)))
    _expect_declined(plan, "r_copy_in", [u.id, s.id, c.id], "")


# -- optimize runs before matching; legality is checked after it ----------------------------------

def _interleaved(extra_reader: bool):
    """u = x * w; c = cos(x) (independent); v = u + b; [e = exp(u)]."""
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    c = b.op(aten.cos.default, x)
    v = b.op(aten.add.Tensor, u, bias)
    outs = [v, c]
    if extra_reader:
        outs.append(b.op(aten.exp.default, u))
    b.output(*outs)
    return b.g, dict(u=u, c=c, v=v)


def _delay_mul(g: Graph) -> None:
    i = next(k for k, n in enumerate(g.nodes) if n.op == MUL)
    j = next(k for k, n in enumerate(g.nodes) if n.op == ADD)
    assert fxbackend.graph_delay(g, i, i + 1, j - 1)


def test_optimize_runs_before_matching_on_the_plan_graph(rules):
    rule = rules.add(Rule("r_opt", [MUL, ADD], optimize=_delay_mul))
    g, n = _interleaved(False)
    before = g.format()
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (v, c), plan = run(g, X, W, B)
    torch.testing.assert_close(v, X * W + B)
    torch.testing.assert_close(c, torch.cos(X))
    kinds = [k for k, _ in rule.log]
    assert kinds[0] == "optimize" and "match" in kinds and kinds.count("optimize") == 1
    assert all(graph is rule.log[0][1] for _, graph in rule.log)  # one graph: the plan's
    assert rule.log[0][1] is plan.graph
    assert g.format() == before  # the compiled graph itself is not reordered
    _expect_fired(plan, "r_opt", [n["u"].id, n["v"].id])
    assert [x.op for x in plan.graph.nodes if not x.is_input] == [COS, "fused.r_opt"]


def test_without_optimize_the_interleaved_chain_does_not_fire(rules):
    rule = rules.add(Rule("r_noopt", [MUL, ADD]))
    g, _ = _interleaved(False)
    _, plan = run(g, rand(4, 8), rand(4, 8), rand(4, 8))
    assert fused_nodes(plan) == [] and not hasattr(rule, "optimize")


def test_legality_is_checked_after_optimize(rules):
    rules.add(Rule("r_opt_bad", [MUL, ADD], optimize=_delay_mul))
    g, n = _interleaved(True)
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (v, c, e), plan = run(g, X, W, B)
    torch.testing.assert_close(v, X * W + B)
    torch.testing.assert_close(e, torch.exp(X * W))
    # the reorder happened (the claim is on the reordered graph) but the claim is illegal
    ops = [x.op for x in plan.graph.nodes if not x.is_input]
    assert ops[:3] == [COS, MUL, ADD]
    _expect_declined(plan, "r_opt_bad", [n["u"].id, n["v"].id], "outside the match")


def test_legality_is_checked_after_a_hand_made_reorder(rules):
    # an optimize that bypasses graph_delay and puts a read of the product into the range
    def reorder(g: Graph) -> None:
        k = next(k for k, x in enumerate(g.nodes) if x.op == "aten.exp.default")
        e = g.nodes.pop(k)
        g.nodes.insert(next(k for k, x in enumerate(g.nodes) if x.op == ADD), e)

    rules.add(Rule("r_opt_hand", [MUL, "aten.exp.default", ADD], optimize=reorder))
    b = GraphBuilder()
    x, w, bias = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    u = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.add.Tensor, u, bias)
    e = b.op(aten.exp.default, u)
    b.output(v, e)  # e is an output: claiming [mul, exp, add] makes it an intermediate output
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (vv, ee), plan = run(b.g, X, W, B)
    torch.testing.assert_close(vv, X * W + B)
    torch.testing.assert_close(ee, torch.exp(X * W))
    _expect_declined(plan, "r_opt_hand", [u.id, e.id, v.id], "is a graph output")


# -- on by default; off by env, option, or an evaluation callback ---------------------------------

def test_fusion_runs_by_default(rules, monkeypatch):
    monkeypatch.delenv("FXB_DISABLE_FUSION", raising=False)
    rules.add(Rule("r_def", [MUL, ADD, NEG]))
    b, n = chain3()
    _, plan = run(b.g, rand(4, 8), rand(4, 8), rand(4, 8))
    assert plan.fusion_report.disabled is None
    _expect_fired(plan, "r_def", [n["u"].id, n["v"].id, n["y"].id])


@pytest.mark.parametrize("env, options, fires", [
    ("1", None, False), ("0", None, True), (None, {"fusion": False}, False),
    (None, {"fusion": True}, True), ("1", {"fusion": True}, True),
])
def test_fusion_switches(rules, monkeypatch, env, options, fires):
    if env is None:
        monkeypatch.delenv("FXB_DISABLE_FUSION", raising=False)
    else:
        monkeypatch.setenv("FXB_DISABLE_FUSION", env)
    rule = rules.add(Rule("r_sw", [MUL, ADD, NEG]))
    b, _ = chain3()
    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    (out,), plan = run(b.g, *args, options=options)
    torch.testing.assert_close(out, chain3_ref(*args))
    assert (len(fused_nodes(plan)) == 1) == fires
    if not fires:
        assert rule.log == [] and plan.fusion_report.fired == []
        assert plan.fusion_report.disabled
        assert "fusion disabled" in plan.report()
        assert fxbackend.stats()["fusions_by_rule"].get("r_sw", 0) == 0


def test_fusion_switch_through_torch_compile(rules, monkeypatch):
    rules.add(Rule("r_sw_tc", [MUL, ADD]))

    def fn(x, w, b):
        return (x * w + b).sin()

    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    with torch.no_grad():
        monkeypatch.setenv("FXB_DISABLE_FUSION", "1")
        torch.compile(fn, backend="fxbackend")(*args)
        assert fxbackend.stats()["fusions_by_rule"] == {}
        torch._dynamo.reset()
        torch.compile(fn, backend="fxbackend", options={"fusion": True})(*args)
        assert fxbackend.stats()["fusions_by_rule"] == {"r_sw_tc": 1}
        monkeypatch.delenv("FXB_DISABLE_FUSION")
        torch._dynamo.reset()
        torch.compile(fn, backend="fxbackend", options={"fusion": False})(*args)
        assert fxbackend.stats()["fusions_by_rule"] == {"r_sw_tc": 1}


@pytest.mark.parametrize("callback", [False, True])
def test_eval_callback_sees_every_step_and_disables_fusion(rules, callback):
    rule = rules.add(Rule("r_cb", [MUL, ADD, NEG]))
    b, n = chain3()
    seen: list = []
    # the value is valid during the call (arena storage is reused later): keep a copy
    options = {"eval_callback": lambda node, value: seen.append((node, value.clone()))} \
        if callback else None
    X, W, B = rand(4, 8), rand(4, 8), rand(4, 8)
    (out,), plan = run(b.g, X, W, B, options=options)
    torch.testing.assert_close(out, chain3_ref(X, W, B))
    if not callback:
        assert len(fused_nodes(plan)) == 1 and seen == []
        return
    assert fused_nodes(plan) == [] and rule.log == []
    assert plan.fusion_report.disabled and "evaluation callback" in plan.fusion_report.disabled
    assert "fusion disabled" in plan.report()
    steps = [x for x in plan.graph.nodes if not x.is_input]
    assert [x.id for x, _ in seen] == [x.id for x in steps]
    want = {n["t"].id: torch.sin(X), n["u"].id: torch.sin(X) * W,
            n["v"].id: torch.sin(X) * W + B, n["y"].id: -(torch.sin(X) * W + B),
            n["out"].id: chain3_ref(X, W, B)}
    for node, value in seen:
        torch.testing.assert_close(value, want[node.id])
    seen.clear()
    plan(X, W, B)
    assert len(seen) == len(steps)  # every call


# -- explain and stats ----------------------------------------------------------------------------

def test_explain_reports_kernels_fusions_and_declines_per_graph(rules, capsys):
    rules.add(Rule("r_ex", [MUL, ADD]))

    def fn(x, w, b):
        y = (x * w + b).sin()           # graph 1: fires
        torch._dynamo.graph_break()
        u = y * w
        return u + b, u.exp()           # graph 2: declined (u is read by exp)

    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    text = fxbackend.explain(fn, *args)
    assert text in capsys.readouterr().out
    parts = text.split("\n\n")
    assert len(parts) == 2 and all(p.startswith("plan ") for p in parts)
    first, second = parts
    assert "fused r_ex: %" in first and "[r_ex]" in first and "declined" not in first
    assert any(ln.startswith("%") and "aten.sin.default" in ln and ln.endswith("[native]")
               for ln in first.splitlines())
    assert "fused r_ex" not in second
    decl = [ln for ln in second.splitlines() if ln.startswith("declined r_ex on ")]
    assert len(decl) == 1 and "is read by" in decl[0] and "outside the match" in decl[0]
    # every compute step names its kernel
    for part in parts:
        for ln in part.splitlines():
            if ln.startswith("%") and " = input " not in ln:
                assert ln.endswith("]"), ln


def test_explain_without_rules():
    def fn(x):
        return x.sin() + 1

    text = fxbackend.explain(fn, rand(3))
    assert "no fusion rule matched" in text and "[native]" in text


def test_stats_count_fusions_by_rule(rules):
    rules.add(Rule("r_st", [MUL, ADD]))
    rules.add(Rule("r_st_never", ["aten.tanh.default", NEG]))

    def fn(x, w, b):
        return (x * w + b).sin() * w + b  # two chains

    args = (rand(4, 8), rand(4, 8), rand(4, 8))
    with torch.no_grad():
        out = torch.compile(fn, backend="fxbackend")(*args)
    torch.testing.assert_close(out, fn(*args))
    fb = fxbackend.stats()["fusions_by_rule"]
    assert fb["r_st"] == 2 and fb.get("r_st_never", 0) == 0
