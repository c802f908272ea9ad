"""The memory planner (fxbackend/memory.py) on hand-built buffers and graphs: no device needed.

Contracts under test (memory.py docstring):
- two buffers whose step ranges intersect never overlap in memory; a buffer freed at step t is
  reused from step t+1 on, so a step's output never overlaps its inputs;
- best fit: the smallest free block that fits, else the end of the arena; offsets aligned;
- a buffer lives from the step that defines it through the last step that reads it or any
  view of it; owners whose storage is (or is viewed by) a graph output are allocated per call.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxbackend.ir import Graph, Node, ScalarMeta, TensorMeta, storage_root
from fxbackend.memory import ALIGNMENT, Buffer, assign_offsets, buffers_of, plan_memory

CPU = torch.device("cpu")


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def tm(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device = CPU) -> TensorMeta:
    """Contiguous concrete metadata."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return TensorMeta(tuple(shape), tuple(reversed(stride)), dtype, device)


def _intersect(a: Buffer, b: Buffer) -> bool:
    return a.start <= b.end and b.start <= a.end


def assert_no_overlap(buffers: list[Buffer], offsets: dict, aligned: bool = True) -> None:
    for a, b in itertools.combinations(buffers, 2):
        if not _intersect(a, b):
            continue
        sa = _align(a.nbytes) if aligned else a.nbytes
        sb = _align(b.nbytes) if aligned else b.nbytes
        oa, ob = offsets[a.key], offsets[b.key]
        assert oa + sa <= ob or ob + sb <= oa, (
            f"{a} at {oa} and {b} at {ob} are live together and overlap")


# -- assign_offsets on hand-built buffer lists ----------------------------------------------------

def test_reuse_after_buffer_dies():
    bufs = [Buffer("a", 1000, 0, 1), Buffer("b", 1000, 1, 2), Buffer("c", 1000, 2, 3)]
    offsets, arena = assign_offsets(bufs)
    assert_no_overlap(bufs, offsets)
    assert offsets["c"] == offsets["a"]  # a died at step 1, c starts at step 2
    assert arena == 2 * _align(1000) < sum(b.nbytes for b in bufs)


def test_freed_at_t_not_reused_by_buffer_defined_at_t():
    # a is last read at step 1; b is written at step 1: b must not overlap a
    bufs = [Buffer("a", 256, 0, 1), Buffer("b", 256, 1, 2)]
    offsets, arena = assign_offsets(bufs)
    assert offsets["a"] != offsets["b"]
    assert_no_overlap(bufs, offsets)
    assert arena == 512
    # ... but from step t+1 on it is
    bufs.append(Buffer("c", 256, 2, 2))
    offsets, arena = assign_offsets(bufs)
    assert offsets["c"] == offsets["a"] and arena == 512


def test_best_fit_picks_smallest_block():
    bufs = [
        Buffer("big", 256, 0, 3),     # -> [0, 256)
        Buffer("sep1", 64, 1, 10),    # -> [256, 320), keeps the two holes apart
        Buffer("small", 128, 2, 3),   # -> [320, 448)
        Buffer("sep2", 64, 3, 10),    # -> [448, 512); after step 3: holes of 256 and 128
        Buffer("x", 100, 4, 5),       # 128 aligned: fits both holes, the 128 one is tighter
    ]
    offsets, arena = assign_offsets(bufs)
    assert offsets["big"] == 0 and offsets["small"] == 320
    assert offsets["x"] == 320, "best fit takes the smallest free block, not the first"
    assert arena == 512
    assert_no_overlap(bufs, offsets)


def test_best_fit_grows_from_last_free_block():
    # the free block at the end of the arena is too small: the arena grows from it
    bufs = [Buffer("a", 64, 0, 10), Buffer("b", 64, 0, 0), Buffer("c", 192, 1, 1)]
    offsets, arena = assign_offsets(bufs)
    assert offsets["c"] == offsets["b"] == 64
    assert arena == 64 + 192


def test_alignment():
    sizes = [1, 3, 63, 64, 65, 100, 127, 129, 1000, 7]
    bufs = [Buffer(i, n, i % 3, i % 3 + 2) for i, n in enumerate(sizes)]
    offsets, arena = assign_offsets(bufs)
    assert all(o % ALIGNMENT == 0 for o in offsets.values())
    assert arena % ALIGNMENT == 0
    assert_no_overlap(bufs, offsets)
    offsets, arena = assign_offsets(bufs, alignment=256)
    assert all(o % 256 == 0 for o in offsets.values())
    assert_no_overlap([Buffer(b.key, (b.nbytes + 255) // 256 * 256, b.start, b.end)
                       for b in bufs], offsets, aligned=False)


def test_empty_buffers():
    bufs = [Buffer("e0", 0, 0, 2), Buffer("x", 128, 1, 3), Buffer("e1", 0, 1, 1),
            Buffer("y", 64, 2, 4)]
    offsets, arena = assign_offsets(bufs)
    assert set(offsets) == {"e0", "x", "e1", "y"}
    assert all(o % ALIGNMENT == 0 for o in offsets.values())
    assert_no_overlap(bufs, offsets)
    assert assign_offsets([]) == ({}, 0)


def test_end_before_start_is_an_error():
    with pytest.raises(ValueError, match="'bad'.*before it starts"):
        assign_offsets([Buffer("ok", 64, 0, 1), Buffer("bad", 64, 3, 2)])


buffer_lists = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(0, 30), st.integers(0, 10)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(buffer_lists)
def test_property_random_buffers(spec):
    bufs = [Buffer(i, n, s, s + d) for i, (n, s, d) in enumerate(spec)]
    offsets, arena = assign_offsets(bufs)
    assert set(offsets) == {b.key for b in bufs}
    assert all(o % ALIGNMENT == 0 for o in offsets.values())
    assert all(offsets[b.key] + b.nbytes <= arena for b in bufs)
    assert_no_overlap(bufs, offsets)
    steps = {t for b in bufs for t in (b.start, b.end)}
    max_live = max((sum(b.nbytes for b in bufs if b.start <= t <= b.end) for t in steps),
                   default=0)
    assert arena >= max_live
    # never worse than no reuse (an empty buffer may still take one aligned slot)
    assert arena <= sum(_align(max(b.nbytes, 1)) for b in bufs)


# -- plan_memory on hand-built graphs -------------------------------------------------------------

def _input(g: Graph, meta: TensorMeta) -> Node:
    return g.append(g.new_node("input", meta=meta, is_input=True))


def _op(g: Graph, op: str, srcs, meta, **fields) -> Node:
    return g.append(g.new_node(op, srcs, meta=meta, **fields))


def _buffer(plan, node: Node, index=None) -> Buffer:
    (b,) = [b for b in plan.buffers if b.key == (node.id, index)]
    return b


def test_view_read_late_keeps_owner_alive():
    g = Graph()
    x = _input(g, tm(4, 8))                                  # step 0
    a = _op(g, "aten.exp.default", [x], tm(4, 8))            # 1: owner
    v = _op(g, "aten.t.default", [a], TensorMeta((8, 4), (1, 8), torch.float32, CPU),
            view_of=a)                                       # 2: view of a
    b = _op(g, "aten.neg.default", [x], tm(4, 8))            # 3
    c = _op(g, "aten.neg.default", [b], tm(4, 8))            # 4
    d = _op(g, "aten.neg.default", [c], tm(4, 8))            # 5
    e = _op(g, "aten.mm.default", [v, d], tm(8, 8))          # 6: reads the view late
    g.outputs = [e]
    plan = plan_memory(g)
    assert (_buffer(plan, a).start, _buffer(plan, a).end) == (1, 6)
    assert (_buffer(plan, b).start, _buffer(plan, b).end) == (3, 4)
    assert plan.per_call == [(e.id, None)]
    # b, c and d may share memory with each other but never with a
    for n in (b, c, d):
        oa, on = plan.offsets[(a.id, None)], plan.offsets[(n.id, None)]
        assert oa + 128 <= on or on + 128 <= oa
    assert_no_overlap(plan.buffers, plan.offsets)


def test_output_view_makes_owner_per_call():
    g = Graph()
    x = _input(g, tm(16))
    a = _op(g, "aten.exp.default", [x], tm(16))
    v = _op(g, "aten.view.default", [a], tm(4, 4), view_of=a)
    w = _op(g, "aten.neg.default", [a], tm(16))
    g.outputs = [v, w, x]  # a view of a, a fresh tensor and an input
    plan = plan_memory(g)
    assert plan.buffers == [] and plan.total_arena == 0
    assert plan.per_call == [(a.id, None), (w.id, None)]


def test_multi_output_getitem_and_unread_outputs():
    g = Graph()
    x = _input(g, tm(2, 8))
    ln = _op(g, "aten.native_layer_norm.default", [x], (tm(2, 8), tm(2, 1), tm(2, 1)))
    y = _op(g, "getitem", [ln], tm(2, 8))
    y.params["index"] = 0
    mean = _op(g, "getitem", [ln], tm(2, 1))
    mean.params["index"] = 1
    z = _op(g, "aten.sub.Tensor", [y, mean], tm(2, 8))
    g.outputs = [z]
    plan = plan_memory(g)
    assert {b.key for b in plan.buffers} == {(ln.id, 0), (ln.id, 1), (ln.id, 2)}
    assert _buffer(plan, ln, 0).end == _buffer(plan, ln, 1).end == 4  # read by z
    assert _buffer(plan, ln, 2).end == 3  # rstd: only read by the getitems of ln
    # skip_key: an output that needs no storage is not planned
    plan = plan_memory(g, skip_key={(ln.id, 2)}.__contains__)
    assert {b.key for b in plan.buffers} == {(ln.id, 0), (ln.id, 1)}


def test_one_arena_per_device():
    meta_dev = torch.device("meta")
    g = Graph()
    x = _input(g, tm(64))
    a = _op(g, "aten.exp.default", [x], tm(64))
    b = _op(g, "aten._to_copy.default", [a], tm(64, device=meta_dev))
    c = _op(g, "aten.exp.default", [b], tm(64, device=meta_dev))
    d = _op(g, "aten.add.Tensor", [c, c], tm(64, device=meta_dev))
    g.outputs = [d]
    plan = plan_memory(g)
    assert plan.arena_bytes == {"cpu": 256, "meta": 512}
    assert plan.offsets[(a.id, None)] == 0 and plan.offsets[(b.id, None)] == 0


def test_scalar_and_input_nodes_get_no_buffer():
    g = Graph()
    s = g.append(g.new_node("input", meta=ScalarMeta(int), is_input=True))
    x = _input(g, tm(8))
    k = _op(g, "sym.mul", [], ScalarMeta(int))
    k.params["args"] = [s, 2]
    y = _op(g, "aten.mul.Tensor", [x], tm(8))
    y.params["other"] = k
    z = _op(g, "aten.exp.default", [y], tm(8))
    g.outputs = [z, k]
    bufs, per_call = buffers_of(g)
    assert [b.key for b in bufs] == [(y.id, None)] and per_call == [(z.id, None)]


# -- property test: random graphs with views ------------------------------------------------------

_DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]


@st.composite
def graphs(draw):
    """A random node list: inputs, compute nodes (fresh storage, reading 1-3 earlier tensors),
    multi-output compute nodes, views (same or smaller), multi-output views (split-like),
    getitems of multi-output nodes, in-place writes, and some graph outputs."""
    g = Graph()
    tensors: list[Node] = []  # single-tensor values
    multis: list[Node] = []

    def meta():
        n = draw(st.integers(0, 40))
        shape = draw(st.sampled_from([(n,), (1, n), (n, 2), (2, n, 3)]))
        return tm(*shape, dtype=draw(st.sampled_from(_DTYPES)))

    def smaller(m: TensorMeta) -> TensorMeta:
        numel = draw(st.integers(0, m.numel))
        return tm(numel, dtype=m.dtype)

    for _ in range(draw(st.integers(1, 3))):
        tensors.append(_input(g, meta()))
    for _ in range(draw(st.integers(1, 16))):
        kind = draw(st.sampled_from(["compute", "compute", "view", "view", "multi", "multi_view",
                                     "getitem", "getitem", "inplace"]))
        if kind == "getitem" and not multis:
            kind = "compute"
        if kind == "compute":
            srcs = draw(st.lists(st.sampled_from(tensors), min_size=1, max_size=3))
            tensors.append(_op(g, "compute", srcs, meta()))
        elif kind == "view":
            base = draw(st.sampled_from(tensors))
            m = base.meta if draw(st.booleans()) else smaller(base.meta)
            tensors.append(_op(g, "view", [base], m, view_of=base))
        elif kind == "multi":
            srcs = draw(st.lists(st.sampled_from(tensors), min_size=1, max_size=3))
            k = draw(st.integers(2, 3))
            multis.append(_op(g, "multi", srcs, tuple(meta() for _ in range(k))))
        elif kind == "multi_view":
            base = draw(st.sampled_from(tensors))
            k = draw(st.integers(2, 3))
            multis.append(_op(g, "split", [base], tuple(smaller(base.meta) for _ in range(k)),
                              view_of=base))
        elif kind == "getitem":
            parent = draw(st.sampled_from(multis))
            i = draw(st.integers(0, len(parent.meta) - 1))
            node = _op(g, "getitem", [parent], parent.meta[i])
            node.params["index"] = i
            tensors.append(node)
        else:  # in-place write into an earlier value (maybe through a view)
            target = draw(st.sampled_from(tensors))
            srcs = [target] + draw(st.lists(st.sampled_from(tensors), max_size=2))
            tensors.append(_op(g, "inplace", srcs, target.meta, inplace_of=target))
    candidates = [n for n in tensors if not n.is_input] or tensors
    g.outputs = draw(st.lists(st.sampled_from(candidates), max_size=3, unique_by=id))
    for o in g.outputs:
        o.is_output = True
    return g


def _storage_keys(node: Node) -> list:
    """The buffers a value lives in, found by walking views with ir.storage_root."""
    owner, index = storage_root(node)
    if owner.is_input:
        return []
    if index is None and isinstance(owner.meta, tuple):  # the whole tuple of a multi-output node
        return [(owner.id, i) for i in range(len(owner.meta))]
    return [(owner.id, index)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_property_random_graphs(g):
    plan = plan_memory(g)
    step = {n: t for t, n in enumerate(g.nodes)}
    by_key = {b.key: b for b in plan.buffers}

    # every owner buffer is either in the arena or allocated per call, never both
    owners = set()
    for n in g.nodes:
        if not n.is_input and storage_root(n)[0] is n:
            owners.update(_storage_keys(n))
    assert set(by_key) | set(plan.per_call) == owners
    assert not set(by_key) & set(plan.per_call)

    # storage that is (or is viewed by) a graph output is not in the arena
    out_keys = {k for o in g.outputs for k in _storage_keys(o)}
    assert out_keys == set(plan.per_call)

    # lifetimes: from the defining step through the last step reading the owner or a view of it
    want_end = {}
    for n in g.nodes:
        for s in n.srcs:
            for k in _storage_keys(s):
                want_end[k] = max(want_end.get(k, 0), step[n])
    for k, b in by_key.items():
        assert b.start == step[next(n for n in g.nodes if n.id == k[0])]
        assert b.end == max(b.start, want_end.get(k, b.start)), (k, b, g.format())
        assert b.nbytes == TensorMeta.span_bytes.fget(
            g.nodes[b.start].meta if k[1] is None else g.nodes[b.start].meta[k[1]])

    # buffers that overlap in memory have disjoint lifetimes
    for a, b in itertools.combinations(plan.buffers, 2):
        oa, ob = plan.offsets[a.key], plan.offsets[b.key]
        if oa < ob + b.nbytes and ob < oa + a.nbytes:  # empty buffers overlap nothing
            assert not _intersect(a, b), (a, b, oa, ob, g.format())
    assert all(plan.offsets[b.key] % ALIGNMENT == 0 for b in plan.buffers)
    assert all(plan.offsets[b.key] + b.nbytes <= plan.total_arena for b in plan.buffers)
