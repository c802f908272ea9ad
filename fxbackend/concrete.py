"""Concrete metadata for a plan: the graph's values for one input signature.

:func:`concretize` checks call arguments against a lowered graph and gives every node its
concrete metadata for them (a symbolic graph is run on the meta device, :func:`propagate`);
:func:`instantiate` makes the per-plan copy of the graph that the plan-time passes rewrite,
with that metadata on its nodes (``node.meta``: the one truth from then on).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from .inputs import check_inputs
from .ir import Graph, Node, ScalarMeta, TensorMeta
from .lower import SYM_OPS
from .native import call_args

__all__ = ["concretize", "instantiate", "propagate", "describe_input", "meta_tensor",
           "fake_layout_call", "FAKE_LAYOUT_OPS", "node_symbols", "data_dependent"]

_PLAN_TIME_SCALAR_OPS = {"aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                         "aten.sym_storage_offset.default"}


def instantiate(graph: Graph, metas: dict, scalars: dict) -> tuple[Graph, dict, dict]:
    """A copy of ``graph`` for one plan: concrete metadata on every node, and plan-time scalar
    values substituted into params.  Per-plan passes (fusion, placement) rewrite the copy."""
    g = Graph()
    g._next_id = graph._next_id
    new: dict[Node, Node] = {}

    def mp(v: Any) -> Any:
        if isinstance(v, Node):
            return scalars[v] if v in scalars else new[v]
        if isinstance(v, (list, tuple)):
            return type(v)(mp(x) for x in v)
        if isinstance(v, dict):
            return {k: mp(x) for k, x in v.items()}
        return v

    out_metas: dict = {}
    out_scalars: dict = {}
    for n in graph.nodes:
        c = Node(n.id, n.op, [new[x] for x in n.srcs], {k: mp(v) for k, v in n.params.items()},
                 metas[n], view_of=new.get(n.view_of) if n.view_of is not None else None,
                 inplace_of=new.get(n.inplace_of) if n.inplace_of is not None else None,
                 is_input=n.is_input, is_weight=n.is_weight, is_output=n.is_output,
                 target=n.target, tensor_layout=n.tensor_layout,
                 annotations=dict(n.annotations))
        new[n] = c
        g.nodes.append(c)
        out_metas[c] = metas[n]
        if n in scalars:
            out_scalars[c] = scalars[n]
    g.outputs = [new[o] if isinstance(o, Node) else o for o in graph.outputs]
    return g, out_metas, out_scalars


def describe_input(graph: Graph, i: int, node: Node) -> str:
    name = node.annotations.get("source") or node.annotations.get("name") or f"arg{i}"
    kind = "weight" if node.is_weight else "input"
    return f"{kind} {i} ({name})"


def concretize(graph: Graph, args: Sequence[Any]) -> tuple[dict, dict]:
    """Concrete metadata of every node for these inputs: ``(metas, scalars)``.

    ``scalars`` holds the values of scalar nodes known at plan time (sizes and integer
    arithmetic on them).  Raises ValueError naming the first input whose count, kind, dtype,
    device or shape does not fit the graph (``inputs.check_inputs``, the validator replayed
    plans share).
    """
    inputs = graph.inputs
    check_inputs(inputs, args, [describe_input(graph, i, n) for i, n in enumerate(inputs)])
    if not graph.is_symbolic:
        return {n: n.meta for n in graph.nodes}, {}
    return propagate(graph, args)


_META = torch.device("meta")
#: ops whose result layout the plan checks with their fake-tensor implementation instead of
#: the meta device, whose answer is not the real device's: its convolution returns NCHW for a
#: channels-last input, while the CPU's returns channels-last; its ``native_layer_norm``
#: returns float32 mean and rstd for a 16-bit input, while the CPU's returns them in the input's
#: dtype (the fake implementations, which Dynamo and export recorded, say what the device does)
FAKE_LAYOUT_OPS = frozenset({"aten.convolution.default", "aten.native_layer_norm.default"})


def _map_tree(v: Any, f) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tree(x, f) for x in v)
    return f(v)


def meta_tensor(m: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def fake_layout_call(n: Node, args: tuple, kwargs: dict) -> Any:
    """``n``'s op on fake tensors of its device laid out as the meta tensors ``args`` (see
    ``FAKE_LAYOUT_OPS``), its results as meta tensors of the same layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    metas = [m for m in _walk_metas(n.meta) if isinstance(m, TensorMeta)]
    device = metas[0].device if metas else torch.device("cpu")

    def layouts(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.dtype
        return tuple(layouts(x) for x in v) if isinstance(v, (list, tuple)) else v

    def to_meta(v, like):
        if isinstance(like, torch.Tensor):
            return torch.empty_strided(v[0], v[1], dtype=v[2], device="meta")
        if isinstance(like, (list, tuple)):
            return tuple(to_meta(a, b) for a, b in zip(v, like))
        return v

    with FakeTensorMode():
        def fake(t):
            if isinstance(t, torch.Tensor):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            return t
        r = n.target(*[_map_tree(x, fake) for x in args],
                      **{k: _map_tree(v, fake) for k, v in kwargs.items()})
        shapes = layouts(r)
    return to_meta(shapes, r)


def _walk_metas(m: Any):
    if isinstance(m, tuple):
        for x in m:
            yield from _walk_metas(x)
    else:
        yield m


def node_symbols(n: Node) -> set:
    """The symbols of ``n``'s metadata (sizes, strides and offsets of its tensors) and of its
    size expression (a symbolic-int input's ``expr``)."""
    exprs = [n.annotations.get("expr")]
    for m in _walk_metas(n.meta):
        if isinstance(m, TensorMeta):
            exprs.extend((*m.shape, *m.stride, m.storage_offset))
    return {s for e in exprs for s in getattr(e, "free_symbols", ())}


def data_dependent(graph: Graph) -> list[Node]:
    """The steps whose result's sizes depend on tensor values, not on the inputs' sizes
    (``nonzero``, ``masked_select``, ``unique``: torch.export's unbacked symbols ``u0``, ...):
    the steps whose metadata holds a symbol that no input and no earlier step holds.  Planning
    on the meta device cannot know their sizes (:func:`propagate` refuses them); a replayed
    plan runs them between stages (:class:`fxbackend.stages.Stages`)."""
    known: set = set()
    steps = []
    for n in graph.nodes:
        syms = node_symbols(n)
        if syms - known and not n.is_input:
            steps.append(n)
        known |= syms
    return steps


def _refuse_data_dependent(graph: Graph, n: Node) -> None:
    """A clear error for a data-dependent step ``n`` (:func:`data_dependent`), which the meta
    device cannot run."""
    if n in data_dependent(graph):
        sizes = ", ".join(m.short() for m in _walk_metas(n.meta) if isinstance(m, TensorMeta))
        raise NotImplementedError(
            f"%{n.id} ({n.op}) is data-dependent: the sizes of its result ({sizes}) depend on "
            f"the values of its inputs, not on their sizes, so the graph cannot be planned "
            f"ahead of a call (a replayed plan runs such steps between stages)")


def propagate(graph: Graph, args: Sequence[Any],
              given: dict | None = None) -> tuple[dict, dict]:
    """Run the graph on the meta device to get concrete shapes for these inputs.  ``given``:
    the concrete metadata of some steps, taken as it is instead of computed (a data-dependent
    step's, :func:`data_dependent`, at sample sizes)."""
    vals: dict[Node, Any] = {}
    metas: dict[Node, Any] = {}
    scalars: dict[Node, Any] = {}
    it = iter(args)

    def val(v):
        if isinstance(v, Node):
            if v not in vals:
                raise NotImplementedError(
                    f"%{v.id} ({v.op}) depends on tensor data; fxbackend cannot plan "
                    f"data-dependent shapes")
            return vals[v]
        if isinstance(v, torch.device):  # factories (arange, full, ...) build on meta too
            return _META
        return v

    for n in graph.nodes:
        if n.is_input:
            a = next(it)
            if isinstance(a, torch.Tensor):
                vals[n] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                metas[n] = TensorMeta.of(a)
            else:
                vals[n] = a
                scalars[n] = a
                metas[n] = n.meta
            continue
        if n.op == "constant" or (given and n in given):
            metas[n] = m = n.meta if n.op == "constant" else given[n]
            vals[n] = _map_tree(m, meta_tensor)
            continue
        if n.op == "getitem":
            parent = vals.get(n.srcs[0])
            if parent is None:
                raise NotImplementedError(f"%{n.id}: cannot plan after data-dependent %{n.srcs[0].id}")
            vals[n] = parent[n.params["index"]]
            metas[n] = metas[n.srcs[0]][n.params["index"]]
            continue
        if n.op in SYM_OPS:
            v = SYM_OPS[n.op](*[_map_tree(a, val) for a in n.params["args"]])
            vals[n] = scalars[n] = v
            metas[n] = n.meta
            continue
        if n.is_scalar and n.op not in _PLAN_TIME_SCALAR_OPS:
            metas[n] = n.meta  # data-dependent: known per call only
            continue
        if n.target is None:  # a custom op: its infer_meta gives the concrete metadata
            m = _custom_meta(n, metas)
            metas[n] = dataclasses.replace(m, device=n.meta.device)
            vals[n] = meta_tensor(m)
            continue
        try:
            vals[n] = out = _meta_call(n, *call_args(n, val, val))
        except NotImplementedError:
            _refuse_data_dependent(graph, n)
            raise
        if n.is_scalar:
            scalars[n] = out
            metas[n] = n.meta
        else:
            metas[n] = _to_meta(out, n.meta)
            if not _same_kind(metas[n], n.meta):
                raise NotImplementedError(f"re-planning %{n.id} ({n.op}) for new shapes gave "
                                          f"{metas[n]}, where the graph has {n.meta}")
    return metas, scalars


def _custom_meta(n: Node, metas: dict) -> Any:
    """The concrete metadata of custom op step ``n`` from its op's ``infer_meta``, given its
    sources' (``metas``)."""
    from .ops import get_op, infer_node_meta
    op = get_op(n.op)
    if op is None:
        raise NotImplementedError(f"%{n.id}: no custom op named {n.op} is registered")
    return infer_node_meta(op, [metas[x] for x in n.srcs], n.params)


def _meta_call(n: Node, a: list, kw: dict) -> Any:
    """``n``'s op run on the meta-device arguments ``a``, ``kw`` (fake tensors where the meta
    device lacks the op or gives another layout), with the recorded strides where the result
    differs from them only on size-1 dims.  An error names the node."""
    try:
        out = fake_layout_call(n, a, kw) if n.op in FAKE_LAYOUT_OPS else n.target(*a, **kw)
    except NotImplementedError as e:
        # no meta kernel (``histogram``, ...): fake tensors, as Dynamo traced it (their
        # fallback runs the op's own kernel on zeros where its output sizes allow)
        try:
            out = fake_layout_call(n, a, kw)
        except Exception as e2:
            raise NotImplementedError(f"cannot re-plan %{n.id} ({n.op}) for new shapes on "
                                      f"the meta device: {e}; with fake tensors: {e2}") from e
    except Exception as e:  # say which node
        raise NotImplementedError(f"cannot re-plan %{n.id} ({n.op}) for new shapes on the "
                                  f"meta device: {e}") from e
    if isinstance(out, torch.Tensor) and _same_layout(out, n.meta) and \
            tuple(out.stride()) != tuple(n.meta.stride):
        # the recorded strides where they differ only on size-1 dims (which torch's
        # meta and fake functions stride differently): later ops choose their layouts
        # (suggest_memory_format) from them, as they did when the graph was recorded; a
        # view stays a view of the same storage
        out = out.as_strided(n.meta.shape, n.meta.stride, out.storage_offset()) \
            if n.view_of is not None else meta_tensor(n.meta)
    return out


def _to_meta(x: Any, like: Any) -> Any:
    """The metadata of meta-device result ``x`` on the device of ``like`` (the recorded
    metadata): tuples for tuples, ``ScalarMeta`` for numbers, None for anything else."""
    if isinstance(x, torch.Tensor):
        m = TensorMeta.of(x)
        return dataclasses.replace(m, device=like.device if isinstance(like, TensorMeta)
                                   else m.device)
    if isinstance(x, (list, tuple)):
        likes = like if isinstance(like, tuple) else (None,) * len(x)
        return tuple(_to_meta(a, b) for a, b in zip(x, likes))
    return ScalarMeta(type(x)) if isinstance(x, (int, float, bool)) else None


def _same_kind(new: Any, traced: Any) -> bool:
    """``new`` has ``traced``'s structure: a tensor where it has a tensor, tuples as long."""
    if isinstance(traced, TensorMeta):
        return isinstance(new, TensorMeta)
    if isinstance(traced, tuple):
        return isinstance(new, tuple) and len(new) == len(traced) and \
            all(_same_kind(a, b) for a, b in zip(new, traced))
    return True


def _same_layout(t: torch.Tensor, m: Any) -> bool:
    """``t`` (a meta tensor) has the concrete metadata ``m``'s dtype and shape, and its strides
    on every dim longer than 1."""
    return isinstance(m, TensorMeta) and not m.is_symbolic and t.dtype == m.dtype and \
        tuple(t.shape) == tuple(m.shape) and \
        all(sz <= 1 or a == b for sz, a, b in zip(m.shape, t.stride(), m.stride))
