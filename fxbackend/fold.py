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

__all__ = ["fold_constants", "constant_value", "MAX_BYTES"]

#: the largest value (bytes) a folded step may have; larger ones are computed per call
MAX_BYTES = 16 * 1024 * 1024


def _foldable_op(n: Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and n.inplace_of is None and not n.is_multi \
        and not n.is_input and isinstance(n.meta, TensorMeta) and not n.meta.is_symbolic \
        and torch.Tag.nondeterministic_seeded not in t.tags


def _evaluate(n: Node, values: dict) -> torch.Tensor | None:
    """The value of the foldable step ``n`` whose deps' values are in ``values``, laid out as
    its metadata says; None when it is too large or its op fails or disagrees with the
    metadata (it then runs per call, where an error surfaces)."""
    from .native import call_args
    m = n.meta
    if m.numel * m.itemsize > MAX_BYTES:
        return None
    try:
        a, kw = call_args(n, values.__getitem__, lambda v: v)
        out = n.target(*a, **kw)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(m.shape) or \
            out.dtype != m.dtype:
        return None
    if n.view_of is None and tuple(out.stride()) != tuple(m.stride):
        out = torch.empty_strided(m.shape, m.stride, dtype=m.dtype,
                                  device=out.device).copy_(out)
    return out


def constant_value(node: Node, cache: dict | None = None) -> torch.Tensor | None:
    """The value of ``node`` when it reads no input: a ``constant`` node's tensor, or a
    foldable native ATen step (see the module docstring) over such values, evaluated here with
    the same kernels (bit-identical to a per-call run); else None.  ``cache`` (node -> value)
    keeps values between calls.  For rewrite rules that need an index or a table the model
    computes from sizes alone (``RewriteContext.constant``); the graph is not changed."""
    values = {} if cache is None else cache
    missing = object()

    def value(n: Node):
        got = values.get(n, missing)
        if got is not missing:
            return got
        out = None
        if n.op == "constant":
            v = n.annotations.get("value")
            out = v if isinstance(v, torch.Tensor) else None
        elif _foldable_op(n):
            deps = node_deps(n)
            if all(value(d) is not None for d in deps):
                out = _evaluate(n, values)
        values[n] = out
        return out
    return value(node)


def fold_constants(graph: Graph) -> int:
    """Fold the graph's constant steps (module docstring); returns how many steps were folded.
    The folded steps stay in the graph, unread: the caller drops dead nodes."""
    from .fusion import replace_uses_from

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
        out = _evaluate(n, values)
        if out is not None:
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
        replace_uses_from(graph, n, c, 1)
        count += 1
    return count
