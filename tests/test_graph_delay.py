"""``fxbackend.graph_delay(graph, start, end, after)`` on hand-built node lists.

Contract (DESIGN.md "Extension API", fusion.py): move the producer range ``start..end-1`` to just
after node ``after`` (an index or a node).  Refuse (return False, graph unchanged) when a node in
between depends on the range, has unknown side effects (a ``py.*`` node, or a mutable op without
``inplace_of``), or writes storage that aliases the range's inputs or outputs.  Independent copies,
known in-place ops that alias nothing of the range, and owning dtype conversions
(``aten._to_copy``) may be crossed.  Edges and metadata are kept.
"""
from __future__ import annotations

import pytest
import torch

import fxbackend
from test_fusion import GraphBuilder

aten = torch.ops.aten


def _snapshot(g) -> dict:
    """Everything about each node that a move must keep (by identity, not position)."""
    return {n: (n.op, list(n.srcs), dict(n.params), n.meta, n.view_of, n.inplace_of,
                n.is_output) for n in g.nodes}


def _run(g, make_args):
    cg = fxbackend.CompiledGraph(g, fxbackend.parse_options({"fusion": False}))
    args = make_args()
    return cg(*args), args


def _assert_refused(g, start, end, after):
    before, nodes, snap = g.format(), list(g.nodes), _snapshot(g)
    assert fxbackend.graph_delay(g, start, end, after) is False
    assert g.format() == before and g.nodes == nodes and _snapshot(g) == snap


def _assert_moved(g, start, end, after, make_args=None):
    """Move, check order/edges/metadata, and (with ``make_args``) that results are unchanged."""
    nodes, snap = list(g.nodes), _snapshot(g)
    a = nodes.index(after) if not isinstance(after, int) else after
    ref = _run(g, make_args) if make_args else None
    assert fxbackend.graph_delay(g, start, end, after) is True
    assert g.nodes == nodes[:start] + nodes[end:a + 1] + nodes[start:end] + nodes[a + 1:]
    assert _snapshot(g) == snap
    if make_args:
        got = _run(g, make_args)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _seeded(*shapes):
    def make():
        torch.manual_seed(0)
        return [torch.randn(*s) for s in shapes]
    return make


def _base():
    """x, w, z -> a = x * w (the range); c = cos(x); d = sin(z); e = a + c; out (e, d)."""
    b = GraphBuilder()
    x, w, z = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    a = b.op(aten.mul.Tensor, x, w)
    c = b.op(aten.cos.default, x)
    d = b.op(aten.sin.default, z)
    e = b.op(aten.add.Tensor, a, c)
    b.output(e, d)
    return b, dict(x=x, w=w, z=z, a=a, c=c, d=d, e=e)


# -- moves ----------------------------------------------------------------------------------------

def test_moves_range_after_an_index():
    b, n = _base()
    i = b.g.nodes.index(n["a"])
    _assert_moved(b.g, i, i + 1, b.g.nodes.index(n["d"]), _seeded((4, 8), (4, 8), (4, 8)))
    assert [x.op for x in b.g.nodes[3:]] == ["aten.cos.default", "aten.sin.default",
                                             "aten.mul.Tensor", "aten.add.Tensor"]


def test_moves_range_after_a_node():
    b, n = _base()
    i = b.g.nodes.index(n["a"])
    _assert_moved(b.g, i, i + 1, n["c"], _seeded((4, 8), (4, 8), (4, 8)))
    assert b.g.nodes.index(n["a"]) == b.g.nodes.index(n["c"]) + 1


def test_moves_a_multi_node_range():
    b = GraphBuilder()
    x, w, z = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    a = b.op(aten.mul.Tensor, x, w)
    a2 = b.op(aten.neg.default, a)
    d = b.op(aten.sin.default, z)
    e = b.op(aten.add.Tensor, a2, d)
    b.output(e)
    i = b.g.nodes.index(a)
    _assert_moved(b.g, i, i + 2, d, _seeded((4, 8), (4, 8), (4, 8)))
    assert b.g.nodes[-3:] == [a, a2, e]


@pytest.mark.parametrize("case", ["empty", "past_end", "after_past_end", "after_before"])
def test_bad_ranges_are_refused(case):
    b, n = _base()
    i = b.g.nodes.index(n["a"])
    start, end, after = {"empty": (i, i, i + 2), "past_end": (i, len(b.g.nodes) + 1, i + 2),
                         "after_past_end": (i, i + 1, len(b.g.nodes)),
                         # a delay only moves a range later
                         "after_before": (i, i + 1, i - 2)}[case]
    _assert_refused(b.g, start, end, after)


def test_a_range_with_an_input_is_refused():
    b = GraphBuilder()
    x = b.input(4)
    z = b.input(4)
    d = b.op(aten.sin.default, z)
    e = b.op(aten.add.Tensor, x, d)
    b.output(e)
    _assert_refused(b.g, 0, 1, d)


# -- refusals -------------------------------------------------------------------------------------

def test_refuses_when_a_node_in_between_reads_the_range():
    b, n = _base()
    c2 = b.op(aten.neg.default, n["a"])
    b.g.nodes.remove(c2)
    b.g.insert(b.g.nodes.index(n["c"]) + 1, c2)  # a, c, c2 = -a, d, e
    b.output(n["e"], n["d"], c2)
    i = b.g.nodes.index(n["a"])
    _assert_refused(b.g, i, i + 1, n["d"])
    # up to the node before the reader, the move is fine
    _assert_moved(b.g, i, i + 1, n["c"], _seeded((4, 8), (4, 8), (4, 8)))


def test_refuses_when_a_node_in_between_reads_through_a_view():
    b = GraphBuilder()
    x, w, z = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    a = b.op(aten.mul.Tensor, x, w)
    v = b.op(aten.view.default, a, [32])       # in between: depends on the range
    d = b.op(aten.sin.default, z)
    e = b.op(aten.add.Tensor, a, d)
    b.output(e, b.op(aten.cos.default, v))
    i = b.g.nodes.index(a)
    _assert_refused(b.g, i, i + 1, d)


def test_refuses_to_cross_a_py_node():
    b, n = _base()
    p = b.py(torch.tanh, n["z"])  # independent, but a Python call: side effects unknown
    b.g.nodes.remove(p)
    b.g.insert(b.g.nodes.index(n["c"]) + 1, p)
    b.output(n["e"], n["d"], p)
    i = b.g.nodes.index(n["a"])
    _assert_refused(b.g, i, i + 1, n["d"])
    # the same independent work as an ATen op is crossed
    b2, n2 = _base()
    i2 = b2.g.nodes.index(n2["a"])
    _assert_moved(b2.g, i2, i2 + 1, n2["d"])


def _with_between(kind: str):
    """_base() with one extra node ``m`` right after ``c``, plus a spare input ``q``."""
    b = GraphBuilder()
    x, w, z, q = b.input(4, 8), b.input(4, 8), b.input(4, 8), b.input(4, 8)
    vx = b.op(aten.view.default, x, [4, 8]) if kind in ("write_view_of_input",
                                                       "range_reads_view") else None
    a = b.op(aten.mul.Tensor, vx if kind == "range_reads_view" else x, w)
    c = b.op(aten.cos.default, z)
    if kind == "mutable_unknown":
        m = b.op(aten.add_.Tensor, q, z)
        m.inplace_of = None  # a mutable schema whose write the graph does not describe
    elif kind == "known_inplace":
        m = b.op(aten.add_.Tensor, q, z)
    elif kind in ("write_input", "range_reads_view"):
        m = b.op(aten.add_.Tensor, x, z)
    elif kind == "write_view_of_input":
        m = b.op(aten.add_.Tensor, vx, z)
    elif kind == "copy_into_input":
        m = b.op(aten.copy_.default, w, z)
    elif kind == "independent_copy":
        m = b.op(aten.copy_.default, q, z)
    elif kind == "clone":
        m = b.op(aten.clone.default, z)
    elif kind == "to_copy":
        m = b.op(aten._to_copy.default, x, dtype=torch.float64)
    else:
        raise AssertionError(kind)
    d = b.op(aten.sin.default, z)
    e = b.op(aten.add.Tensor, a, c)
    b.output(e, d, m)
    return b, a, d


@pytest.mark.parametrize("kind", ["mutable_unknown", "write_input", "write_view_of_input",
                                  "range_reads_view", "copy_into_input"])
def test_refuses_side_effects_and_aliasing_writes(kind):
    b, a, d = _with_between(kind)
    i = b.g.nodes.index(a)
    _assert_refused(b.g, i, i + 1, d)


@pytest.mark.parametrize("kind", ["known_inplace", "independent_copy", "clone", "to_copy"])
def test_crosses_independent_copies_inplace_ops_and_conversions(kind):
    b, a, d = _with_between(kind)
    i = b.g.nodes.index(a)
    _assert_moved(b.g, i, i + 1, d, _seeded((4, 8), (4, 8), (4, 8), (4, 8)))


def _range_writes(kind: str):
    """t = cos(x) (arena); range: r = t.add_(w); between: m (reads or writes t, or not)."""
    b = GraphBuilder()
    x, w, z = b.input(4, 8), b.input(4, 8), b.input(4, 8)
    t = b.op(aten.cos.default, x)
    r = b.op(aten.add_.Tensor, t, w)
    if kind == "reads":
        m = b.op(aten.sin.default, t)
    elif kind == "writes":
        m = b.op(aten.mul_.Tensor, t, z)
    else:
        m = b.op(aten.sin.default, z)
    d = b.op(aten.neg.default, z)
    e = b.op(aten.exp.default, r)
    b.output(e, m, d)
    return b, r, d


@pytest.mark.parametrize("kind", ["reads", "writes"])
def test_refuses_when_the_range_writes_storage_used_in_between(kind):
    b, r, d = _range_writes(kind)
    i = b.g.nodes.index(r)
    _assert_refused(b.g, i, i + 1, d)


def test_an_inplace_range_crosses_unrelated_nodes():
    b, r, d = _range_writes("unrelated")
    i = b.g.nodes.index(r)
    _assert_moved(b.g, i, i + 1, d, _seeded((4, 8), (4, 8), (4, 8)))


def test_refuses_a_write_that_aliases_the_range_output():
    # the range's value is a view of x: a write into x in between would change what it sees
    b = GraphBuilder()
    x, z = b.input(4, 8), b.input(4, 8)
    v = b.op(aten.view.default, x, [32])
    m = b.op(aten.add_.Tensor, x, z)
    d = b.op(aten.sin.default, z)
    e = b.op(aten.neg.default, v)
    b.output(e, d, m)
    i = b.g.nodes.index(v)
    _assert_refused(b.g, i, i + 1, d)


def test_delay_makes_a_chain_consecutive():
    # graph_delay is what makes a chain consecutive for a rule (see tests/ext_example_fusion.py)
    b, n = _base()
    i = b.g.nodes.index(n["a"])
    assert fxbackend.graph_delay(b.g, i, i + 1, n["d"])
    assert b.g.nodes.index(n["e"]) == b.g.nodes.index(n["a"]) + 1


def test_a_range_already_right_after_the_node_is_a_no_op_success():
    from fxbackend import Graph, TensorMeta
    g = Graph()
    meta = TensorMeta((2,), (1,), torch.float32, torch.device("cpu"))
    x = g.append(g.new_node("input", meta=meta, is_input=True))
    a = g.append(g.new_node("aten.sin.default", [x], {}, meta, target=torch.ops.aten.sin.default,
                            tensor_layout=(("self", True),)))
    b = g.append(g.new_node("aten.cos.default", [a], {}, meta, target=torch.ops.aten.cos.default,
                            tensor_layout=(("self", True),)))
    before = g.format()
    assert fxbackend.graph_delay(g, 1, 2, 0)       # range [a] already follows x
    assert fxbackend.graph_delay(g, 1, 2, a)       # ``after`` is the range's last node
    assert g.format() == before
    assert not fxbackend.graph_delay(g, 2, 3, 0)   # b cannot move before a by "delaying"
    assert g.nodes == [x, a, b]
