"""Lowering: an ATen-level FX graph (from aot_autograd) to the flat node list of :mod:`ir`.

Every ``call_function`` becomes one node.  Tensor arguments become ``srcs`` (in schema order,
lists flattened); every other argument becomes a param named after the schema argument, holding
a plain value or, for a symbolic size, the scalar node that computes it.  Views and in-place
writes are read from the op schema's alias annotations, never from op names.
"""
from __future__ import annotations

import math
import re
import operator
from typing import Any, Sequence

import torch
import torch.fx

from .ir import Graph, Node, ScalarMeta, TensorMeta

__all__ = ["lower", "is_tensor_type", "SYM_OPS"]

#: Python-level integer operations that appear in symbolic-shape graphs, by node op name.
SYM_OPS: dict[str, Any] = {
    "sym.add": operator.add, "sym.sub": operator.sub, "sym.mul": operator.mul,
    "sym.floordiv": operator.floordiv, "sym.truediv": operator.truediv, "sym.mod": operator.mod,
    "sym.pow": operator.pow, "sym.neg": operator.neg, "sym.eq": operator.eq,
    "sym.ne": operator.ne, "sym.lt": operator.lt, "sym.le": operator.le, "sym.gt": operator.gt,
    "sym.ge": operator.ge, "sym.and": operator.and_, "sym.or": operator.or_,
    "sym.xor": operator.xor, "sym.lshift": operator.lshift, "sym.rshift": operator.rshift,
    "sym.abs": operator.abs, "sym.trunc": math.trunc,
    "sym.ceil": math.ceil, "sym.floor": math.floor, "sym.sym_max": torch.sym_max,
    "sym.sym_min": torch.sym_min, "sym.sym_not": torch.sym_not, "sym.sym_float": torch.sym_float,
    "sym.sym_int": torch.sym_int, "sym.sym_sum": torch.sym_sum, "sym.sym_ite": torch.sym_ite,
    "sym.sym_sqrt": getattr(torch, "_sym_sqrt", math.sqrt),
}
# torch's math functions on symbolic floats (``math.log2(size)`` traces to ``torch._sym_log2``)
for _name in ("cos", "sin", "tan", "cosh", "sinh", "tanh", "asin", "acos", "atan", "log2"):
    if hasattr(torch, f"_sym_{_name}"):
        SYM_OPS[f"sym.sym_{_name}"] = getattr(torch, f"_sym_{_name}")
_SYM_BY_TARGET = {v: k for k, v in SYM_OPS.items()}


def lower(gm: torch.fx.GraphModule, weight_mask: Sequence[bool] | None = None) -> Graph:
    """Lower ``gm`` (ATen, functional, with ``meta['val']`` on every node) to a :class:`Graph`.

    ``weight_mask`` marks which placeholders are weights (parameters and buffers); when it is
    None or does not match the placeholder count, no input is marked as a weight.
    """
    g = Graph()
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if weight_mask is not None and len(weight_mask) != len(placeholders):
        weight_mask = None
    n_ph = 0
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            val = fx_node.meta.get("val")
            node = g.append(g.new_node("input", meta=_meta(val), is_input=True,
                                       is_weight=bool(weight_mask and weight_mask[n_ph])))
            if isinstance(val, torch.SymInt):
                node.annotations["expr"] = val.node.expr
            node.annotations["name"] = fx_node.name
            n_ph += 1
            env[fx_node] = node
        elif fx_node.op == "get_attr":
            value = _fetch_attr(gm, fx_node.target)
            if isinstance(value, torch.Tensor):
                node = g.append(g.new_node("constant", meta=TensorMeta.of(value), is_weight=True))
                node.annotations["value"] = value
                node.annotations["name"] = fx_node.target
                env[fx_node] = node
            else:
                env[fx_node] = value
        elif fx_node.op == "call_function":
            env[fx_node] = g.append(_lower_call(g, fx_node, env))
        elif fx_node.op == "output":
            outs = fx_node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            g.outputs = [_convert(o, env) for o in outs]
            for o in g.outputs:
                if isinstance(o, Node):
                    o.is_output = True
        else:
            raise NotImplementedError(f"fxbackend cannot lower FX node kind {fx_node.op!r} "
                                      f"({fx_node.format_node()})")
    return g


def _lower_call(g: Graph, fx_node: torch.fx.Node, env: dict) -> Node:
    target = fx_node.target
    meta = _meta(fx_node.meta.get("val"))
    if target is operator.getitem:
        parent, index = env[fx_node.args[0]], fx_node.args[1]
        node = g.new_node("getitem", [parent], {"index": index}, meta)
    elif target in _SYM_BY_TARGET:
        args = [_convert(a, env) for a in fx_node.args]
        node = g.new_node(_SYM_BY_TARGET[target], [], {"args": args}, meta)
    elif isinstance(target, torch._ops.OpOverload):
        node = _lower_overload(g, fx_node, target, meta, env)
    else:
        # A callable without an ATen schema (higher-order ops, Python functions): called as is,
        # its tensor arguments become srcs and the call shape is kept in params.
        args = _convert(list(fx_node.args), env)
        kwargs = _convert(dict(fx_node.kwargs), env)
        srcs = [n for n in _walk((args, kwargs)) if isinstance(n, Node) and not n.is_scalar]
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", str(target))
        node = g.new_node(f"py.{name}", srcs, {"args": args, "kwargs": kwargs}, meta)
    node.target = target
    node.annotations["name"] = fx_node.name
    return node


def _lower_overload(g: Graph, fx_node: torch.fx.Node, op: torch._ops.OpOverload, meta: Any,
                    env: dict) -> Node:
    schema = op._schema
    bound = _bind(schema, fx_node.args, fx_node.kwargs)
    srcs: list[Node] = []
    params: dict[str, Any] = {}
    layout: list[Any] = []
    arg_src: dict[str, list[Node]] = {}
    for arg in schema.arguments:
        if arg.name not in bound:
            continue
        value = bound[arg.name]
        if is_tensor_type(arg.type) and _holds_tensors(value, env):
            if isinstance(value, (list, tuple)):
                mask = tuple(v is not None for v in value)
                layout.append((arg.name, mask))
                items = [env[v] for v in value if v is not None]
            else:
                layout.append((arg.name, value is not None))
                items = [] if value is None else [env[value]]
            arg_src[arg.name] = items
            srcs.extend(items)
        else:
            params[arg.name] = _convert(value, env)
    node = g.new_node(str(op), srcs, params, meta, tensor_layout=tuple(layout))
    # aliasing from the schema: an output that shares an input's alias set is a view of it, or
    # an in-place write into it when that input is written
    if str(op) in _UNANNOTATED_VIEWS and srcs:
        node.view_of = srcs[0]
        return node
    ret_sets = _return_alias_sets(schema)
    for arg in schema.arguments:
        info = arg.alias_info
        if info is None or not (info.before_set & ret_sets) or not arg_src.get(arg.name):
            continue
        if info.is_write:
            node.inplace_of = arg_src[arg.name][0]
        else:
            node.view_of = arg_src[arg.name][0]
        break
    return node


def is_tensor_type(t: Any) -> bool:
    """True for schema types Tensor, Tensor?, Tensor[] and Tensor?[]."""
    s = str(t)
    return s in ("Tensor", "Tensor?", "Tensor[]", "Tensor?[]", "List[Tensor]",
                 "List[Optional[Tensor]]", "Optional[Tensor]")


def _holds_tensors(value: Any, env: dict) -> bool:
    """Whether a Tensor-typed argument's value is tensors (not a Python or symbolic scalar,
    which ATen wraps into a tensor: those are params)."""
    if value is None or isinstance(value, (list, tuple)):
        return True
    return isinstance(value, torch.fx.Node) and not env[value].is_scalar


#: ops whose schema carries no alias annotation but whose result shares its input's storage
#: (``_unsafe_view`` is ``view`` with autograd's aliasing bookkeeping turned off)
_UNANNOTATED_VIEWS = {"aten._unsafe_view.default"}


_ALIAS_RE = re.compile(r"Tensor\(([a-z]+)!?\)")


def _return_alias_sets(schema: Any) -> set[str]:
    """Alias sets of a schema's returns.  Read from the text form, because a list return
    (``Tensor(a)[]``) keeps its annotation on the element type."""
    text = str(schema)
    returns = text[text.rindex(") -> ") + 5:]
    return set(_ALIAS_RE.findall(returns))


def _bind(schema: Any, args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
    """Schema argument name -> value, for the arguments the call passed."""
    bound: dict[str, Any] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for a, v in zip(positional, args):
        bound[a.name] = v
    bound.update(kwargs)
    return bound


def _convert(v: Any, env: dict) -> Any:
    if isinstance(v, torch.fx.Node):
        return env[v]
    if isinstance(v, (list, tuple)):
        return type(v)(_convert(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _convert(x, env) for k, x in v.items()}
    return v


def _walk(v: Any):
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from _walk(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _walk(x)
    else:
        yield v


def _meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return TensorMeta.of(val)
    if isinstance(val, (list, tuple)):
        return tuple(_meta(v) for v in val)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return ScalarMeta(int)
    if isinstance(val, (torch.SymFloat, float)):
        return ScalarMeta(float)
    if isinstance(val, (torch.SymBool, bool)):
        return ScalarMeta(bool)
    return None


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
