"""Constant folding: steps that read no input are computed once, when the plan is built.

Diffusion models compute some tensors from sizes alone: PixArt's 2-D sin-cos position embedding
at a resolution other than the one it was built for (``arange``, ``outer``, ``sin``, ``cos``,
``cat``), the frequency table of every timestep embedding (``exp(-log(10000) * arange(half) /
half)``).  Eager mode and a plan without this pass recompute them on every call.

:func:`fold_constants` evaluates, in graph order, every native ATen step whose tensor sources
are all ``constant`` nodes or steps folded before it, and whose params hold no scalar node;
the readers of a folded step then read a new ``constant`` node holding its value (laid out as
the step's metadata says), and the folded steps become dead.  Left alone:

- ops tagged ``nondeterministic_seeded`` (``rand``, ``dropout``, ...): a new value per call;
- in-place steps, steps with several outputs, Python-level (``py.*``) and custom-op steps;
- a step whose storage something writes in place later (the constant would carry the write
  into the next call), or that a graph output is (or views): the caller must get a tensor of
  its own on every call;
- results over :data:`MAX_BYTES` (their memory would stay with the plan).

Folding runs the same ATen kernels eager runs, once, so results are bit-identical.
"""
from __future__ import annotations

import torch

from .ir import Graph, Node, TensorMeta, node_deps, storage_root

__all__ = ["fold_constants", "MAX_BYTES"]

#: the largest value (bytes) a folded step may have; larger ones are computed per call
MAX_BYTES = 16 * 1024 * 1024


def _foldable_op(n: Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and n.inplace_of is None and not n.is_multi \
        and not n.is_input and isinstance(n.meta, TensorMeta) and not n.meta.is_symbolic \
        and torch.Tag.nondeterministic_seeded not in t.tags


def fold_constants(graph: Graph) -> int:
    """Fold the graph's constant steps (module docstring); returns how many steps were folded.
    The folded steps stay in the graph, unread: the caller drops dead nodes."""
    from .fusion import _replace_uses
    from .native import call_args

    written = {storage_root(n) for n in graph.nodes if n.inplace_of is not None}
    returned = {storage_root(o) for o in graph.outputs if isinstance(o, Node)}
    values: dict[Node, torch.Tensor] = {}
    for n in graph.nodes:
        if n.op == "constant" and isinstance(n.annotations.get("value"), torch.Tensor):
            values[n] = n.annotations["value"]
    folded: list[Node] = []
    for n in list(graph.nodes):
        # node_deps: the sources, and any scalar node a param holds (never a constant)
        if n.op == "constant" or not _foldable_op(n) or \
                not all(d in values for d in node_deps(n)):
            continue
        m = n.meta
        if m.numel * m.itemsize > MAX_BYTES:
            continue
        try:
            a, kw = call_args(n, values.__getitem__, lambda v: v)
            out = n.target(*a, **kw)
        except Exception:  # leave it to run per call, where its error (if any) surfaces
            continue
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(m.shape) or \
                out.dtype != m.dtype:
            continue
        if n.view_of is None and tuple(out.stride()) != tuple(m.stride):
            out = torch.empty_strided(m.shape, m.stride, dtype=m.dtype,
                                      device=out.device).copy_(out)
        values[n] = out
        folded.append(n)
    # the folded values a step that runs per call reads, directly or through views (views
    # stay views, of the constant their source becomes); the others need no constant
    folded_set = set(folded)
    needed: set = set()
    for n in reversed(graph.nodes):
        if n not in folded_set or (n.view_of is not None and n in needed):
            needed.update(s for s in n.srcs if s in folded_set)
    count = 0
    for n in folded:
        if n.view_of is not None or n not in needed:
            continue
        root = storage_root(n)
        if root in written or root in returned:
            continue
        value = values[n]
        c = graph.new_node("constant", meta=TensorMeta.of(value), is_weight=True)
        c.annotations["value"] = value
        c.annotations["name"] = f"folded_{n.id}"
        graph.insert(0, c)
        _replace_uses(graph, n, c, 1)
        count += 1
    return count
