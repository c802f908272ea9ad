"""Concatenation without copies (fxbackend/concat.py): parts written straight into the result of
``aten.cat``, and cats that re-assemble slices of one tensor elided.

Contracts under test (concat.py docstring):
- a part is placed only when its storage is a whole buffer the plan computes, viewed
  contiguously, and the concatenation is contiguous; a strided slice (a dim before ``dim``
  larger than 1) only for a step's direct result read by the cat alone whose kernel writes any
  strides (its metadata takes the slice's strides); everything else (inputs, outputs, a part used
  twice, in-place writes, other dtypes) is copied as before;
- the memory plan gives a placed part the cat's offset plus its byte offset, and the cat's
  buffer lives over every part's lifetime (no live buffer overlaps it);
- results are bit-identical with ``concat_in_place`` on and off (hypothesis over random graphs).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fxbackend
from fxbackend.dynamo import compile_fx_graph
from fxbackend.options import parse_options
from fxbackend.concat import elide_identity_cats, elide_identity_clones, plan_concat
from fxbackend.ir import Graph, Node, TensorMeta
from fxbackend.memory import plan_memory

from conftest import assert_same, capture
from test_memory import assert_no_overlap, tm

CPU = torch.device("cpu")


def _input(g: Graph, meta: TensorMeta) -> Node:
    return g.append(g.new_node("input", meta=meta, is_input=True))


def _op(g: Graph, op: str, srcs, meta, **fields) -> Node:
    return g.append(g.new_node(op, srcs, meta=meta, **fields))


def _cat(g: Graph, srcs, meta, dim) -> Node:
    return _op(g, "aten.cat.default", srcs, meta, params={"dim": dim})


def _two_parts() -> tuple:
    """A graph with an input ``x [2, 4]`` and two computed parts ``exp(x)``, ``sin(x)``."""
    g = Graph()
    x = _input(g, tm(2, 4))
    return g, x, _op(g, "aten.exp.default", [x], tm(2, 4)), _op(g, "aten.sin.default", [x],
                                                                 tm(2, 4))


def _plan(g: Graph):
    cp = plan_concat(g, lambda n: n.meta, lambda n: True)
    return cp, plan_memory(g, aliases=cp.aliases)


# -- the planner on hand-built graphs -------------------------------------------------------------

def test_parts_placed_at_their_offsets_and_cat_lives_over_them():
    g = Graph()
    x = _input(g, tm(3, 8))                                   # 0
    a = _op(g, "aten.exp.default", [x], tm(3, 8))             # 1: part 0
    t = _op(g, "aten.neg.default", [x], tm(3, 8))             # 2: unrelated, dies at 3
    b = _op(g, "aten.sin.default", [t], tm(5, 8))             # 3: part 1
    c = _cat(g, [a, b], tm(8, 8), 0)                          # 4
    out = _op(g, "aten.neg.default", [c, a], tm(8, 8))        # 5: reads the cat and part 0
    g.outputs = [out]
    cp, mem = _plan(g)
    assert cp.placed == {c: {0, 1}} and cp.parts_in_place == 2
    assert cp.copies_left(c, lambda n: n.meta) == []
    base = mem.offsets[(c.id, None)]
    assert mem.offsets[(a.id, None)] == base
    assert mem.offsets[(b.id, None)] == base + 3 * 8 * 4
    keys = {bf.key for bf in mem.buffers}
    assert (a.id, None) not in keys and (b.id, None) not in keys, "parts are not buffers"
    (cb,) = [bf for bf in mem.buffers if bf.key == (c.id, None)]
    assert (cb.start, cb.end) == (1, 5) and cb.nbytes == 8 * 8 * 4
    assert_no_overlap(mem.buffers, mem.offsets)


def _placed(g: Graph, cat: Node) -> set:
    cp, _ = _plan(g)
    return cp.placed.get(cat, set())


def test_input_and_output_parts_are_copied():
    g = Graph()
    x = _input(g, tm(2, 4))
    a = _op(g, "aten.exp.default", [x], tm(2, 4))
    r = _op(g, "aten.neg.default", [x], tm(2, 4))
    c = _cat(g, [x, a, r], tm(6, 4), 0)
    g.outputs = [_op(g, "aten.neg.default", [c], tm(6, 4)), r]
    assert _placed(g, c) == {1}, "the input and the returned tensor are copied"


def test_cat_returned_to_caller_places_nothing():
    g, x, a, b = _two_parts()
    c = _cat(g, [a, b], tm(4, 4), 0)
    g.outputs = [c]
    assert _placed(g, c) == set()


def test_strided_slices_and_other_dtypes_are_copied():
    g, x, a, b = _two_parts()
    c1 = _cat(g, [a, b], tm(2, 8), 1)       # dim 1 with 2 rows: parts are strided slices
    h = _op(g, "aten.exp.default", [x], tm(2, 4, dtype=torch.float16))
    k = _op(g, "aten.sin.default", [x], tm(2, 4))
    c2 = _cat(g, [h, k], tm(4, 4), 0)       # cat promotes the half part: it is copied
    one = _op(g, "aten.exp.default", [x], tm(1, 2, 4))
    two = _op(g, "aten.sin.default", [x], tm(1, 3, 4))
    c3 = _cat(g, [one, two], tm(1, 5, 4), -2)  # leading dims of size 1: contiguous parts
    g.outputs = [_op(g, "aten.add.Tensor", [c1, c1], tm(2, 8)),
                 _op(g, "aten.add.Tensor", [c2, c2], tm(4, 4)),
                 _op(g, "aten.add.Tensor", [c3, c3], tm(1, 5, 4))]
    cp, mem = _plan(g)
    assert c1 not in cp.placed
    assert cp.placed[c2] == {1}
    assert cp.placed[c3] == {0, 1}
    assert mem.offsets[(two.id, None)] == mem.offsets[(c3.id, None)] + 2 * 4 * 4


def test_strided_slices_for_kernels_that_write_any_strides():
    g, x, a, b = _two_parts()
    c1 = _cat(g, [a, b], tm(2, 8), 1)                  # parts are [2, 4] slices, row stride 8
    y = _op(g, "aten.cos.default", [x], tm(2, 4))
    z = _op(g, "aten.tan.default", [x], tm(2, 4))
    c2 = _cat(g, [y, z], tm(2, 8), 1)
    g.outputs = [_op(g, "aten.add.Tensor", [c1, c1], tm(2, 8)),
                 _op(g, "aten.add.Tensor", [c2, z], tm(2, 8))]  # z is read twice
    strided_ok = {a, b, y}.__contains__                # tan's kernel would not write strides
    cp = plan_concat(g, lambda n: n.meta, lambda n: True, strided_ok=strided_ok)
    assert cp.placed == {c1: {0, 1}, c2: {0}}
    assert cp.relayout[b] == TensorMeta((2, 4), (8, 1), torch.float32, CPU, 0)
    assert set(cp.relayout) == {a, b, y}
    mem = plan_memory(g, aliases=cp.aliases)
    assert mem.offsets[(b.id, None)] == mem.offsets[(c1.id, None)] + 4 * 4  # column 4


def test_cat_with_placed_parts_is_not_relaid_into_a_strided_slice():
    # PixArt's sinusoidal embedding: cat(cat(sin, cos, 1), cat(sin, cos, 1), 1) on [N, .]
    g, x, a, b = _two_parts()
    inner = _cat(g, [a, b], tm(2, 8), 1)
    c, d = _op(g, "aten.cos.default", [x], tm(2, 4)), _op(g, "aten.tan.default", [x], tm(2, 4))
    inner2 = _cat(g, [c, d], tm(2, 8), 1)
    outer = _cat(g, [inner, inner2], tm(2, 16), 1)
    g.outputs = [_op(g, "aten.neg.default", [outer], tm(2, 16))]
    cp = plan_concat(g, lambda n: n.meta, lambda n: True, strided_ok=lambda n: True)
    assert cp.placed == {inner: {0, 1}, inner2: {0, 1}}, "the inner cats keep their layout"
    assert inner not in cp.relayout and inner2 not in cp.relayout


def test_view_with_the_slice_strides_is_placed_in_a_dense_strided_cat():
    # a column-major [2, 6] cat along dim 1: each [2, 3] slice is one contiguous block, which a
    # transposed [3, 2] buffer fills exactly (same strides)
    g = Graph()
    x = _input(g, tm(3, 2))
    a = _op(g, "aten.exp.default", [x], tm(3, 2))
    at = _op(g, "aten.t.default", [a], TensorMeta((2, 3), (1, 2), torch.float32, CPU),
             view_of=a)
    b = _op(g, "aten.sin.default", [x], tm(3, 2))
    bt = _op(g, "aten.t.default", [b], TensorMeta((2, 3), (1, 2), torch.float32, CPU),
             view_of=b)
    c = _cat(g, [at, bt], TensorMeta((2, 6), (1, 2), torch.float32, CPU), 1)
    g.outputs = [_op(g, "aten.neg.default", [c], tm(2, 6))]
    cp, mem = _plan(g)
    assert cp.placed == {c: {0, 1}} and cp.relayout == {}
    assert mem.offsets[(b.id, None)] == mem.offsets[(c.id, None)] + 3 * 2 * 4


def test_part_used_twice_and_partial_views_are_copied():
    g = Graph()
    x = _input(g, tm(4, 4))
    a = _op(g, "aten.exp.default", [x], tm(4, 4))
    s = _op(g, "aten.slice.Tensor", [a], tm(2, 4), view_of=a,
            params={"dim": 0, "start": 0, "end": 2})
    c = _cat(g, [a, a, s], tm(10, 4), 0)
    g.outputs = [_op(g, "aten.neg.default", [c], tm(10, 4))]
    assert _placed(g, c) == {0}, "the second use copies from the first; a slice is not a buffer"


def test_reshaped_whole_buffer_is_placed():
    g = Graph()
    x = _input(g, tm(1, 4, 6))
    a = _op(g, "aten.exp.default", [x], tm(4, 6))
    v = _op(g, "aten.view.default", [a], tm(1, 4, 6), view_of=a)
    b = _op(g, "aten.sin.default", [x], tm(1, 4, 6))
    c = _cat(g, [v, b], tm(1, 8, 6), 1)
    g.outputs = [_op(g, "aten.neg.default", [c, a], tm(1, 8, 6))]
    cp, mem = _plan(g)
    assert cp.placed[c] == {0, 1}
    assert mem.offsets[(a.id, None)] == mem.offsets[(c.id, None)]


def test_inplace_write_into_part_blocks_it():
    g, x, a, b = _two_parts()
    c = _cat(g, [a, b], tm(4, 4), 0)
    w = _op(g, "aten.add_.Tensor", [a, x], tm(2, 4), inplace_of=a)  # a changes after the cat
    g.outputs = [_op(g, "aten.add.Tensor", [c, c], tm(4, 4)), _op(g, "aten.neg.default", [w],
                                                                   tm(2, 4))]
    assert _placed(g, c) == {1}


def test_nested_cats_resolve_to_the_outer_buffer():
    g, x, a, b = _two_parts()
    inner = _cat(g, [a, b], tm(4, 4), 0)
    d = _op(g, "aten.cos.default", [x], tm(2, 4))
    outer = _cat(g, [d, inner], tm(6, 4), 0)
    g.outputs = [_op(g, "aten.neg.default", [outer], tm(6, 4))]
    cp, mem = _plan(g)
    assert cp.placed == {inner: {0, 1}, outer: {0, 1}}
    base = mem.offsets[(outer.id, None)]
    assert mem.offsets[(inner.id, None)] == base + 32
    assert mem.offsets[(a.id, None)] == base + 32
    assert mem.offsets[(b.id, None)] == base + 64
    assert [bf.key for bf in mem.buffers] == [(outer.id, None)]


def test_alias_into_unplanned_buffer_is_an_error():
    g = Graph()
    x = _input(g, tm(4))
    a = _op(g, "aten.exp.default", [x], tm(4))
    g.outputs = [a]
    with pytest.raises(ValueError, match="no arena storage"):
        plan_memory(g, aliases={(a.id, None): ((999, None), 0)})


def test_identity_cat_of_slices_reads_the_tensor():
    g = Graph()
    x = _input(g, tm(1, 7, 4))
    y = _op(g, "aten.exp.default", [x], tm(1, 7, 4))
    s1 = _op(g, "aten.slice.Tensor", [y], tm(1, 3, 4), view_of=y,
             params={"dim": 1, "start": 0, "end": 3})
    s2 = _op(g, "aten.slice.Tensor", [y], tm(1, 4, 4), view_of=y,
             params={"dim": 1, "start": 3, "end": 2**63 - 1})
    c = _cat(g, [s1, s2], tm(1, 7, 4), 1)
    swapped = _cat(g, [s2, s1], tm(1, 7, 4), 1)
    out = _op(g, "aten.add.Tensor", [c, swapped], tm(1, 7, 4))
    g.outputs = [out]
    assert elide_identity_cats(g, lambda n: n.meta) == 1
    assert out.srcs == [y, swapped], "readers of the identity cat read the sliced tensor"


def test_identity_clones_elided_only_where_nothing_can_tell():
    g = Graph()
    x = _input(g, tm(4, 6))
    y = _op(g, "aten.exp.default", [x], tm(4, 6))
    same = _op(g, "aten.clone.default", [y], tm(4, 6))
    t = _op(g, "aten.t.default", [y], TensorMeta((6, 4), (1, 6), torch.float32, CPU), view_of=y)
    relaid = _op(g, "aten.clone.default", [t], tm(6, 4))        # a layout change: a real copy
    returned = _op(g, "aten.clone.default", [y], tm(4, 6))      # handed back: stays distinct
    of_input = _op(g, "aten.clone.default", [x], tm(4, 6))
    w = _op(g, "aten.add_.Tensor", [x, y], tm(4, 6), inplace_of=x)  # x changes afterwards
    a = _op(g, "aten.neg.default", [same], tm(4, 6))
    b = _op(g, "aten.neg.default", [relaid], tm(6, 4))
    cc = _op(g, "aten.neg.default", [of_input], tm(4, 6))
    g.outputs = [a, b, cc, returned, w]
    assert elide_identity_clones(g, lambda n: n.meta) == 1
    assert a.srcs == [y] and b.srcs == [relaid] and cc.srcs == [of_input]


def test_clones_that_resolve_a_conjugate_or_negative_view_stay():
    g = Graph()
    c64 = TensorMeta((4, 6), (6, 1), torch.complex64, CPU)
    x = _input(g, c64)
    conj = _op(g, "aten._conj.default", [x], c64, view_of=x)
    row = _op(g, "aten.select.int", [conj], TensorMeta((6,), (1,), torch.complex64, CPU),
              view_of=conj)  # a view of the conjugate view carries the bit too
    resolved = _op(g, "aten.clone.default", [conj], c64)
    resolved_row = _op(g, "aten.clone.default", [row], TensorMeta((6,), (1,), torch.complex64,
                                                                     CPU))
    y = _op(g, "aten.real.default", [x], tm(4, 6))
    neg = _op(g, "aten._neg_view.default", [y], tm(4, 6), view_of=y)
    resolved_neg = _op(g, "aten.clone.default", [neg], tm(4, 6))
    plain = _op(g, "aten.clone.default", [y], tm(4, 6))  # the control: elided
    outs = [_op(g, "aten.mul.Tensor", [n, n], n.meta)
            for n in (resolved, resolved_row, resolved_neg, plain)]
    g.outputs = outs
    assert elide_identity_clones(g, lambda n: n.meta) == 1
    assert [o.srcs[0] for o in outs] == [resolved, resolved_row, resolved_neg, y]


@pytest.mark.parametrize("fn", [
    lambda fr: torch.view_as_real(fr.conj().resolve_conj()) + 0,
    lambda fr: torch.view_as_real(fr.conj().clone()).sum(-1),
    lambda fr: torch._neg_view(fr.real).clone() * 2,
], ids=["resolve_conj", "clone_of_conj", "resolve_neg"])
def test_compiled_clones_of_lazy_bit_views_match_eager(fn, no_grad):
    """A conjugate view's clone (``resolve_conj``) elided left ``view_as_real`` an
    unresolved conjugate: a RuntimeError where eager runs."""
    g = torch.Generator().manual_seed(0)
    fr = torch.polar(torch.ones(7, 8), torch.randn(7, 8, generator=g))
    _both(fn, fr)


def test_complex_rope_with_conjugated_frequencies_matches_eager(no_grad):
    def rope(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.conj()).flatten(-2).type_as(x)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 16, generator=g)
    freqs = torch.polar(torch.ones(7, 8), torch.randn(7, 8, generator=g))
    _both(rope, x, freqs, exact=False)


# -- compiled functions ---------------------------------------------------------------------------

def _both(fn, *args, exact=True):
    """Compiled with the option on and off (each checked against eager)."""
    on = capture(fn, *args, options={"concat_in_place": True}, exact=exact)
    torch._dynamo.reset()
    off = capture(fn, *args, options={"concat_in_place": False}, exact=exact)
    torch._dynamo.reset()
    return on, off


def test_joint_attention_style_concat(no_grad):
    def fn(txt, img, w):
        q_t = torch.nn.functional.rms_norm((txt @ w).view(1, 5, 2, 8), (8,))
        q_i = torch.nn.functional.rms_norm((img @ w).view(1, 9, 2, 8), (8,))
        q = torch.cat([q_t, q_i], dim=1)
        return (q * 2).sum(-1)

    args = (torch.randn(5, 16), torch.randn(9, 16), torch.randn(16, 16))
    fxbackend.reset_stats()
    on, off = _both(fn, *args, exact=False)  # the RMSNorm kernel's sum order is not ATen's
    plan = on.graph.plan_for(list(args))
    assert plan.concat.parts_in_place == 2
    assert "torch.cat" not in plan.source and "aten.cat" not in plan.source
    assert "written in place; no copy" in plan.report()
    assert off.graph.plan_for(list(args)).concat.parts_in_place == 0
    assert fxbackend.stats()["concat_parts_in_place"] == 2
    assert_same(on.out, off.out)


def test_sd3_style_strided_concat_of_rms_norms(no_grad):
    # [B, H, S, D] q of two token streams, normed per head and joined along S (dim 2): the
    # RMSNorm kernel writes each stream's rows straight into the strided slice
    def fn(txt, img, w, nw):
        def heads(t, n):
            return (t @ w).view(1, n, 2, 8).transpose(1, 2)
        q_t = torch.nn.functional.rms_norm(heads(txt, 5), (8,), nw, 1e-6)
        q_i = torch.nn.functional.rms_norm(heads(img, 9), (8,), nw, 1e-6)
        return torch.cat([q_i, q_t], dim=2) * 2

    args = (torch.randn(5, 16), torch.randn(9, 16), torch.randn(16, 16), torch.rand(8) + 0.5)
    fxbackend.reset_stats()
    on, off = _both(fn, *args, exact=False)
    assert fxbackend.stats()["identity_clones"] == 2  # aten.rms_norm's trailing clones
    plan = on.graph.plan_for(list(args))
    norms = [n for n in plan.graph.nodes if n.op == "sd.rms_norm.v1"]
    assert len(norms) == 2 and all(plan.kernels[n].name == "rms_norm_cpu" for n in norms)
    assert plan.concat.parts_in_place == 2 and set(plan.concat.relayout) == set(norms)
    assert plan.metas[norms[0]].stride == (2 * 14 * 8, 14 * 8, 8, 1)
    assert_same(on.out, off.out)
    assert_same(on.fn(*[a + 1 for a in args]), off.fn(*[a + 1 for a in args]))


def test_split_then_cat_is_elided(no_grad):
    def fn(x):
        y = x.exp()
        a, b = y[:, :3], y[:, 3:]
        return torch.cat([a, b], dim=1) * 2, torch.cat([b, a], dim=1)

    x = torch.randn(1, 7, 4)
    fxbackend.reset_stats()
    on, off = _both(fn, x)
    assert fxbackend.stats()["identity_cats"] == 1
    assert "1 concatenation(s) of slices" in on.graph.plan_for([x]).report()
    assert_same(on.out, off.out)


@st.composite
def _programs(draw):
    """Random chains over a [batch, n, 4] value: unary ops, cats of earlier values along dim 1
    (some used twice, some inputs, some nested), slices, and in-place adds."""
    batch = draw(st.sampled_from([2, 1]))  # 2: the parts are strided slices of the cats
    n_steps = draw(st.integers(2, 9))
    prog = []
    for i in range(n_steps):
        kind = draw(st.sampled_from(["unary", "cat", "cat", "nested", "slice", "inplace"]))
        k = i + 1  # values 0 (the input) .. i are defined
        if kind in ("cat", "nested"):
            picks = draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=3))
            prog.append((kind, picks))
        else:
            prog.append((kind, draw(st.integers(0, k - 1))))
    outs = draw(st.lists(st.integers(0, n_steps), min_size=1, max_size=3, unique=True))
    return prog, outs, batch


def _run_program(prog, outs, x):
    vals = [x]
    for kind, arg in prog:
        if kind == "unary":
            vals.append(torch.sin(vals[arg]) * 1.5)
        elif kind == "cat":
            vals.append(torch.cat([vals[j] for j in arg], dim=1))
        elif kind == "nested":  # fresh parts, a cat of them inside another cat
            inner = torch.cat([torch.cos(vals[j]) for j in arg], dim=1)
            vals.append(torch.cat([torch.exp(vals[arg[0]]), inner], dim=1) * 1.5)
        elif kind == "slice":
            v = vals[arg]
            vals.append(v[:, : max(1, v.shape[1] // 2)] + 1)
        else:
            v = vals[arg] * 1.0
            v.add_(1.0)
            vals.append(v)
    return [vals[i] for i in outs]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_programs())
def test_property_on_off_identical(spec):
    prog, outs, batch = spec
    x = torch.randn(batch, 3, 4)
    fn = lambda x: _run_program(prog, outs, x)  # noqa: E731
    gm = make_fx(fn)(x)
    with torch.no_grad():
        want = fn(x)
        for on in (True, False):
            cg = compile_fx_graph(gm, parse_options({"concat_in_place": on}))
            assert_same(cg(x), want)
            assert_same(cg(x + 1), fn(x + 1))  # the arena is reused: nothing stale


def test_clone_of_an_elementwise_result_becomes_its_layout():
    # SD3's patch embedding: conv output viewed as [B, S, C] (transposed strides) + position
    # embedding, then a contiguous clone.  The add writes the contiguous rows itself.
    g = Graph()
    x = _input(g, tm(1, 4, 6))
    t = _op(g, "aten.transpose.int", [x], TensorMeta((1, 6, 4), (24, 1, 6), torch.float32, CPU),
            view_of=x)
    pos = _input(g, tm(1, 6, 4))
    s = _op(g, "aten.add.Tensor", [t, pos], TensorMeta((1, 6, 4), (24, 1, 6), torch.float32, CPU))
    c = _op(g, "aten.clone.default", [s], tm(1, 6, 4))
    out = _op(g, "aten.neg.default", [c], tm(1, 6, 4))
    g.outputs = [out]
    metas = {n: n.meta for n in g.nodes}
    assert elide_identity_clones(g, metas.__getitem__) == 0, "only with set_meta"
    assert elide_identity_clones(g, metas.__getitem__, metas.__setitem__) == 1
    assert out.srcs == [s] and metas[s].stride == (24, 4, 1)

    # not when something else reads the sum, or for an op that is not elementwise
    g = Graph()
    x = _input(g, tm(1, 4, 6))
    t = _op(g, "aten.transpose.int", [x], TensorMeta((1, 6, 4), (24, 1, 6), torch.float32, CPU),
            view_of=x)
    s = _op(g, "aten.exp.default", [t], TensorMeta((1, 6, 4), (24, 1, 6), torch.float32, CPU))
    c = _op(g, "aten.clone.default", [s], tm(1, 6, 4))
    mm = _op(g, "aten.bmm.default", [t, t], TensorMeta((1, 6, 6), (36, 1, 6), torch.float32, CPU))
    c2 = _op(g, "aten.clone.default", [mm], tm(1, 6, 6))
    g.outputs = [c, s, c2]
    metas = {n: n.meta for n in g.nodes}
    assert elide_identity_clones(g, metas.__getitem__, metas.__setitem__) == 0


def test_patch_embedding_sum_writes_contiguous_rows(no_grad):
    def fn(img, w, b, pos):
        y = torch.nn.functional.conv2d(img, w, b, stride=2).flatten(2).transpose(1, 2)
        return (y + pos).contiguous() * 3

    args = (torch.randn(1, 4, 8, 8), torch.randn(16, 4, 2, 2), torch.randn(16),
            torch.randn(1, 16, 16))
    fxbackend.reset_stats()
    on, off = _both(fn, *args)
    plan = on.graph.plan_for(list(args))
    add = [n for n in plan.graph.nodes if n.op == "aten.add.Tensor"]
    assert len(add) == 1 and plan.metas[add[0]].stride == (256, 16, 1)
    assert not any(n.op == "aten.clone.default" for n in plan.graph.nodes)
    assert_same(on.out, off.out)
