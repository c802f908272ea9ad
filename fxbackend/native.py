"""How the native (ATen) kernel calls an op: ``.out`` overload discovery and call building."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .ir import Node
from .lower import is_tensor_type

__all__ = ["out_overload", "out_is_copy", "call_args"]


#: ops whose ``.out`` kernel is not "the functional op, written into ``out``": on the CPU,
#: with a reduction, these resize ``out`` to the elementwise loss and use it as scratch space,
#: writing past a planned buffer into its neighbours (and ``binary_cross_entropy``'s ``out``
#: then holds the first element's loss, not the reduced one).  They are called functionally.
#: ``linalg_qr``'s kernel, given Q and R in one storage (as in the arena), fails an internal
#: assert or writes a wrong R.
_OUT_NOT_FUNCTIONAL = frozenset({
    "aten::binary_cross_entropy", "aten::huber_loss", "aten::soft_margin_loss",
    "aten::linalg_qr"})


@functools.lru_cache(maxsize=None)
def out_overload(op: torch._ops.OpOverload) -> tuple[Any, tuple[str, ...]] | None:
    """The ``.out`` overload of a functional ATen op and its out-argument names, or None.

    An out overload takes the functional op's arguments (same names and types) plus one
    kwarg-only written tensor per return value.  None also for the ops whose ``.out`` kernel
    writes outside ``out`` (``_OUT_NOT_FUNCTIONAL``).
    """
    schema = op._schema
    if schema.is_mutable or not schema.returns or schema.name in _OUT_NOT_FUNCTIONAL:
        return None
    if not all(str(r.type) == "Tensor" for r in schema.returns):
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        cs = cand._schema
        outs = [a for a in cs.arguments if a.alias_info is not None and a.alias_info.is_write]
        if len(outs) != len(schema.returns) or not all(a.kwarg_only for a in outs):
            continue
        rest = [(a.name, str(a.type)) for a in cs.arguments if a not in outs]
        if rest == want:
            return cand, tuple(a.name for a in outs)
    return None


#: the dispatch key of a device type's own kernels
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


@functools.lru_cache(maxsize=None)
def out_is_copy(op: torch._ops.OpOverload, device_type: str) -> bool:
    """True when ``op``'s ``.out`` overload has no kernel of its own for ``device_type``, only
    the generated composite one (``convolution``, ``native_layer_norm``, ``native_group_norm``,
    ...): it calls the functional op and copies the result into ``out``, so a plan gains nothing
    from it and loses one pass.  False without an ``.out`` overload or for unknown devices."""
    found = out_overload(op)
    key = _DISPATCH_KEY.get(device_type)
    if found is None or key is None:
        return False
    name = found[0]._schema.name + "." + found[0]._overloadname
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeExplicitAutograd") and not has(name, key)


def call_args(node: Node, src: Callable[[Node], Any], value: Callable[[Any], Any],
              scalar_operand: Callable[[Any], Any] | None = None) -> tuple[list, dict]:
    """``(args, kwargs)`` that call ``node.target`` for ``node``.

    ``scalar_operand(v)``, when given, maps a plain number passed to a Tensor-typed argument
    (ATen wraps it into a tensor at every call); None from it keeps ``value(v)``.

    ``src(n)`` maps a tensor input to what the call gets; ``value(v)`` maps each param leaf
    (a plain value or a scalar node).
    """
    if node.op.startswith("py."):
        def tree(v):
            if isinstance(v, Node):
                return value(v) if v.is_scalar else src(v)
            if isinstance(v, (list, tuple)):
                return type(v)(tree(x) for x in v)
            if isinstance(v, dict):
                return {k: tree(x) for k, x in v.items()}
            return value(v)
        return list(tree(node.params["args"])), dict(tree(node.params["kwargs"]))
    args: list = []
    kwargs: dict = {}
    srcs = iter(node.srcs)
    layout = dict(node.tensor_layout)
    kw = False
    for arg in node.target._schema.arguments:
        if arg.name in layout:
            spec = layout[arg.name]
            if isinstance(spec, tuple):
                v = [src(next(srcs)) if present else None for present in spec]
            else:
                v = src(next(srcs)) if spec else None
        elif arg.name in node.params:
            v = None
            if scalar_operand is not None and is_tensor_type(arg.type):
                v = scalar_operand(node.params[arg.name])
            if v is None:
                v = _map_leaves(node.params[arg.name], value)
        else:
            kw = True
            continue
        if kw or arg.kwarg_only:
            kwargs[arg.name] = v
        else:
            args.append(v)
    return args, kwargs


def _map_leaves(v: Any, f: Callable[[Any], Any]) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_map_leaves(x, f) for x in v)
    return f(v)
