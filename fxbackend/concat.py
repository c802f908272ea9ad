"""Concatenation without copies: producers write straight into the result of ``aten.cat``.

Diffusion transformers concatenate a lot: the text and image halves of q, k and v before
joint attention, the two token streams at the start of every single-stream block, a UNet's skip
connections.  Eager (and a plain plan) computes each part into a buffer of its own and then
copies it into the concatenation.  Two plan-time steps remove those copies; both work on a
plan's concrete graph and never change a result, only where values live.

1. :func:`elide_identity_cats`: ``cat([x[a0:a1], x[a1:a2], ...], d)`` whose slices tile a
   contiguous ``x`` along ``d`` in order *is* ``x``; its readers read ``x`` (Flux splits the
   joint token stream at the end of a single-stream block and concatenates it again at the start
   of the next).  Likewise :func:`elide_identity_clones`: a ``clone`` of a value that already
   has the clone's strides (``aten.rms_norm``'s decomposition ends in one), or of an
   elementwise result read by nothing else, which then takes the clone's strides itself.
2. :func:`plan_concat`: a part whose storage can be a slice of the concatenation's buffer gets
   that slice as its storage (a memory-plan *alias*: ``{part's buffer key: (cat's buffer key,
   byte offset)}``, see :func:`fxbackend.memory.plan_memory`), so its producer writes the
   concatenation directly; the ``cat`` step then copies only the parts that could not be placed
   (inputs, weights, a part used twice), or nothing at all.

A part is placed only when all of these hold (else it is copied, as before):

- the concatenation is dense (contiguous, or any layout without gaps or overlaps), planned in
  the arena (not handed back to the caller) and runs natively;
- the part views its buffer with the slice's own strides (a contiguous part of a contiguous
  concatenation whose dims before ``dim`` have size 1: one contiguous block of it); or else the
  part is contiguous and its slice *strided* (SD3 concatenates q/k/v of ``[B, H, S, D]`` along
  S), and then the part must be the direct result of its step, read by nothing but this cat,
  and its kernel must write correctly through any output strides (``strided_ok(node)``: native
  ops with an ``.out`` overload, extension kernels and fusion rules declaring
  ``strided_out = True``).  Its metadata then takes the slice's strides
  (``ConcatPlan.relayout``), before the kernels' ``compile`` and ``prepare``;
- the part's storage is a buffer the plan computes (not an input, weight or constant; not
  handed back to the caller; a single buffer not claimed by another concatenation, appearing
  once in this one), the part covers that whole buffer from offset 0, and the part, its
  buffer and the concatenation have one dtype and device;
- no step writes in place into the part's storage or the concatenation's.

Lifetimes: the concatenation's buffer lives from the first part's step to the last read of it or
of any part, so nothing else shares those bytes while any part is live.  Two parts are disjoint
slices of one buffer, so a step that reads one part and writes another is still correct.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .ir import Graph, Node, TensorMeta, node_deps, storage_root

__all__ = ["CAT_OP", "POINTWISE_OPS", "ConcatPlan", "elide_identity_cats", "elide_identity_clones",
           "plan_concat"]

CAT_OP = "aten.cat.default"
_SLICE_OP = "aten.slice.Tensor"


@dataclasses.dataclass
class ConcatPlan:
    """What :func:`plan_concat` decided.

    ``aliases``: ``{part buffer key: (cat buffer key, byte offset)}`` for the memory planner;
    ``placed``: ``{cat node: {indices of its sources written in place}}`` (only cats with at
    least one); ``dest``: ``{(cat node, source index): (dim, start, length)}`` of every source,
    the slice of the concatenation it fills; ``relayout``: ``{part node: its new metadata}``
    for parts placed in a strided slice.
    """

    aliases: dict = dataclasses.field(default_factory=dict)
    placed: dict = dataclasses.field(default_factory=dict)
    dest: dict = dataclasses.field(default_factory=dict)
    relayout: dict = dataclasses.field(default_factory=dict)

    @property
    def parts_in_place(self) -> int:
        return sum(len(v) for v in self.placed.values())

    def copies_left(self, cat: Node, metas: Callable[[Node], Any]) -> list[int]:
        """Indices of ``cat``'s non-empty sources that its step must still copy."""
        done = self.placed.get(cat, set())
        return [j for j, s in enumerate(cat.srcs)
                if j not in done and isinstance(metas(s), TensorMeta) and metas(s).numel > 0]


def _cat_dim(cat: Node, m: TensorMeta) -> int | None:
    d = cat.params.get("dim", 0)
    if not isinstance(d, int):
        return None
    nd = len(m.shape)
    if not -nd <= d < nd:
        return None
    return d % nd


def _dense(m: TensorMeta) -> bool:
    """Non-overlapping and without gaps (any dim order)."""
    return m.span_bytes == m.numel * m.itemsize


def _buffer_bytes(m: TensorMeta) -> int:
    return m.span_bytes + m.storage_offset * m.itemsize


def _written_roots(graph: Graph) -> set:
    """(owner, index) of every storage some step writes in place."""
    return {storage_root(n) for n in graph.nodes if n.inplace_of is not None}


def _output_roots(graph: Graph) -> set:
    return {storage_root(o) for o in graph.outputs if isinstance(o, Node)}


def elide_identity_cats(graph: Graph, metas: Callable[[Node], Any]) -> int:
    """Make the readers of every ``cat`` of slices that tile one contiguous tensor, in order,
    read that tensor instead (the ``cat`` and slices become dead).  Returns how many."""
    from .fusion import replace_uses_from
    written = _written_roots(graph)
    outputs = {o for o in graph.outputs if isinstance(o, Node)}
    done = 0
    for i, cat in enumerate(list(graph.nodes)):
        if cat.op != CAT_OP or cat in outputs or not cat.srcs:
            continue
        m = metas(cat)
        if not isinstance(m, TensorMeta) or m.is_symbolic:
            continue
        d = _cat_dim(cat, m)
        base = cat.srcs[0].srcs[0] if cat.srcs[0].op == _SLICE_OP and cat.srcs[0].srcs else None
        if d is None or base is None:
            continue
        bm = metas(base)
        if not isinstance(bm, TensorMeta) or bm.shape != m.shape or bm.dtype != m.dtype \
                or bm.device != m.device or not bm.is_contiguous or storage_root(base) in written:
            continue
        pos = 0
        for s in cat.srcs:
            p = s.params
            if s.op != _SLICE_OP or not s.srcs or s.srcs[0] is not base:
                break
            dim = p.get("dim", 0)
            if not isinstance(dim, int) or dim % len(m.shape) != d or p.get("step", 1) != 1:
                break
            length = metas(s).shape[d]
            start = p.get("start", 0) or 0
            if not isinstance(start, int) or not isinstance(length, int):
                break
            if start < 0:
                start += m.shape[d]
            if start != pos:
                break
            pos += length
        else:
            if pos == m.shape[d]:
                replace_uses_from(graph, cat, base, graph.nodes.index(cat) + 1)
                done += 1
    return done


def _reader_counts(graph: Graph) -> dict[Node, int]:
    """``{node: how many steps read it, plus one if the graph hands it back}``."""
    readers: dict[Node, int] = {}
    for n in graph.nodes:
        for d in set(node_deps(n)):
            readers[d] = readers.get(d, 0) + 1
    for o in {o for o in graph.outputs if isinstance(o, Node)}:
        readers[o] = readers.get(o, 0) + 1
    return readers


#: elementwise ATen ops whose ``.out`` form writes any output strides with the same values: a
#: clone of such a result, read by nothing else, can become the op's own output layout
POINTWISE_OPS = frozenset(
    f"aten.{name}" for name in (
        "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "mul.Tensor", "mul.Scalar",
        "div.Tensor", "div.Scalar", "neg.default", "exp.default", "sigmoid.default",
        "tanh.default", "silu.default", "gelu.default", "relu.default", "rsqrt.default",
        "sqrt.default", "pow.Tensor_Scalar", "where.self", "clamp.default"))


#: views that set a lazy bit (conjugate, negative) on their result: the bytes are not its
#: values, and a ``clone`` of such a view (``resolve_conj``, ``resolve_neg``) makes them so
LAZY_BIT_VIEWS = frozenset({"aten._conj.default", "aten._neg_view.default"})


def _has_lazy_bit(node: Node) -> bool:
    """``node``'s value is (a view of) a conjugate or negative view (:data:`LAZY_BIT_VIEWS`)."""
    while node is not None:
        if node.op in LAZY_BIT_VIEWS:
            return True
        node = node.view_of
    return False


def elide_identity_clones(graph: Graph, metas: Callable[[Node], Any],
                          set_meta: Callable[[Node, Any], None] | None = None) -> int:
    """Remove clones that copy for nothing; returns how many.

    - A ``clone`` whose source already has the clone's layout: its readers read the source (a
      functional graph's clone of a value nobody writes in place is that value).
    - With ``set_meta``: a ``clone`` of the result of an elementwise op (:data:`POINTWISE_OPS`)
      that nothing else reads: the op writes the clone's layout itself (``set_meta(op node,
      clone's metadata)``) and the clone's readers read it.  SD3's and PixArt's patch embedding
      add the position embedding to a transposed convolution output, whose layout the sum
      takes, and then copy the sum into contiguous rows: the sum now writes the rows.

    Clones handed back to the caller stay, as do clones of values written in place and clones
    of conjugate or negative views (:data:`LAZY_BIT_VIEWS`): those copies resolve the bit
    (``view_as_real`` of an unresolved conjugate raises, a kernel reading the bytes would
    see the values unconjugated)."""
    from .fusion import replace_uses_from
    written = _written_roots(graph)
    outputs = {o for o in graph.outputs if isinstance(o, Node)}
    readers = _reader_counts(graph)
    done = 0
    for c in list(graph.nodes):
        if c.op != "aten.clone.default" or c in outputs or len(c.srcs) != 1:
            continue
        x = c.srcs[0]
        m, xm = metas(c), metas(x)
        if not isinstance(m, TensorMeta) or not isinstance(xm, TensorMeta) or m.is_symbolic \
                or xm.is_symbolic or xm.shape != m.shape or xm.dtype != m.dtype \
                or xm.device != m.device or storage_root(x) in written \
                or (c, None) in written or _has_lazy_bit(x):
            continue
        if not any(n > 1 and a != b for n, a, b in zip(m.shape, m.stride, xm.stride)):
            pass  # already the clone's layout
        elif (set_meta is not None and x.op in POINTWISE_OPS and readers.get(x) == 1
              and storage_root(x) == (x, None)
              and m.storage_offset == 0):
            set_meta(x, m)
        else:
            continue
        replace_uses_from(graph, c, x, graph.nodes.index(c) + 1)
        done += 1
    return done


def plan_concat(graph: Graph, metas: Callable[[Node], Any], native: Callable[[Node], bool],
                no_storage: Callable[[tuple], bool] = lambda key: False,
                strided_ok: Callable[[Node], bool] = lambda node: False) -> ConcatPlan:
    """Decide which parts of which concatenations are written in place (module docstring).

    ``native(node)``: the node runs its native ATen kernel (only such cats are planned);
    ``no_storage(key)``: the buffer key gets no storage in this plan; ``strided_ok(node)``: the
    node's kernel writes correctly through any output strides.
    """
    plan = ConcatPlan()
    written = _written_roots(graph)
    returned = _output_roots(graph)
    readers = _reader_counts(graph)
    for cat in graph.nodes:
        if cat.op != CAT_OP or not native(cat):
            continue
        m = metas(cat)
        if not isinstance(m, TensorMeta) or m.is_symbolic or not _dense(m) \
                or m.storage_offset != 0:
            continue
        d = _cat_dim(cat, m)
        if d is None:
            continue
        root = (cat, None)
        if root in returned or root in written or no_storage((cat.id, None)):
            continue
        placed: set = set()
        seen: set = set()
        start = 0
        for j, s in enumerate(cat.srcs):
            sm = metas(s)
            if not isinstance(sm, TensorMeta):
                break
            if sm.numel == 0:
                continue  # an empty part (possibly a legacy 1-d empty tensor) adds nothing
            if len(sm.shape) != len(m.shape):
                break
            length = sm.shape[d]
            plan.dest[(cat, j)] = (d, start, length)
            owner, index = storage_root(s)
            key = (owner.id, index)
            om = metas(owner)
            if index is not None:
                om = om[index] if isinstance(om, tuple) else None
            ok = (isinstance(om, TensorMeta) and not owner.is_input and owner.op != "constant"
                  and not owner.is_scalar and owner is not cat
                  and (owner, index) not in returned and (owner, index) not in written
                  and key not in plan.aliases and key not in seen and not no_storage(key)
                  and sm.dtype == m.dtype == om.dtype and sm.device == m.device == om.device
                  and sm.storage_offset == 0 and _dense(sm)
                  and sm.numel * sm.itemsize == _buffer_bytes(om))
            # the part's view already has the slice's strides (it covers its whole buffer, so
            # the buffer placed at the slice's start is the slice), or else it is contiguous and
            # takes them: only a direct result read by the cat alone (and not a cat with parts
            # of its own placed: they were laid out for its current strides)
            same = all(n == 1 or a == b for n, a, b in zip(sm.shape, sm.stride, m.stride))
            if ok and not same:
                ok = sm.is_contiguous and owner is s and index is None \
                    and readers.get(s) == 1 and strided_ok(s) and s not in plan.placed
            seen.add(key)
            if ok:
                placed.add(j)
                plan.aliases[key] = ((cat.id, None), start * m.stride[d] * m.itemsize)
                if not same:
                    plan.relayout[s] = TensorMeta(sm.shape, m.stride, sm.dtype, sm.device, 0)
            start += length
        else:
            if placed:
                plan.placed[cat] = placed
            continue
        # a source this planner does not understand: undo this cat's decisions
        for j in placed:
            owner, index = storage_root(cat.srcs[j])
            plan.aliases.pop((owner.id, index), None)
            plan.relayout.pop(cat.srcs[j], None)
        for j in range(len(cat.srcs)):
            plan.dest.pop((cat, j), None)
    return plan
