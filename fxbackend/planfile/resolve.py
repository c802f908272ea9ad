"""Op resolution: what a node's op name may resolve to, and how a file names an op.

A name resolves only against ATen/prims overloads (``torch.ops.aten``, ``torch.ops.prims``),
the symbolic-int helpers of :data:`fxbackend.lower.SYM_OPS`, ``getitem``, and custom ops
registered with :func:`fxbackend.register_op`.  Names are looked up in PyTorch's operator
registry and fxbackend's op table only: nothing is imported or evaluated.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from .. import ops as _ops
from ..ir import Node
from ..lower import SYM_OPS, _UNANNOTATED_VIEWS, _return_alias_sets
from .errors import ReplayError

__all__ = ["torch_overload", "library_overload", "op_kind", "schema_aliases", "unknown_op",
           "TORCH_NAMESPACES"]

_OP_NAME = re.compile(r"^([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
#: namespaces resolved through ``torch.ops.<ns>`` (PyTorch's own operator sets)
TORCH_NAMESPACES = ("aten", "prims")


def torch_overload(name: str) -> Any | None:
    """The ATen/prims ``OpOverload`` called ``name`` (``aten.mul.Tensor``), or None.  Looks the
    name up in PyTorch's operator registry only; never imports or evaluates anything."""
    m = _OP_NAME.match(name)
    if m is None or m[1] not in TORCH_NAMESPACES or m[2].startswith("__") \
            or m[3].startswith("__"):
        return None
    namespace = getattr(torch.ops, m[1])
    try:
        packet = getattr(namespace, m[2])
    except Exception:  # no such operator: the registry says so in several ways
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or m[3] not in packet.overloads():
        return None
    op = getattr(packet, m[3])
    return op if isinstance(op, torch._ops.OpOverload) else None


def library_overload(name: str) -> Any | None:
    """The ``torch.library`` twin of a registered custom op (``torch.ops.ns.name.vN``), or None.
    Only asked for ops registered with fxbackend whose file entry says they have one."""
    m = _OP_NAME.match(name)
    if m is None or m[2].startswith("__") or m[3].startswith("__"):
        return None
    try:
        packet = getattr(getattr(torch.ops, m[1]), m[2])
        op = getattr(packet, m[3])
    except Exception:  # not defined in this process: the custom op's reference runs instead
        return None
    return op if isinstance(op, torch._ops.OpOverload) and str(op) == name else None


def op_kind(n: Node) -> str:
    """How a node's op is named in a file: ``sym``, ``getitem``, ``torch`` or ``custom``;
    raises ReplayError for ops a file cannot name."""
    if n.op in SYM_OPS:
        return "sym"
    if n.op == "getitem":
        return "getitem"
    if _ops.get_op(n.op) is not None:
        return "custom"
    if isinstance(n.target, torch._ops.OpOverload) and n.op.split(".")[0] in TORCH_NAMESPACES:
        return "torch"
    where = f"node %{n.id}"
    if n.op.startswith("py."):
        raise ReplayError(f"{where}: op {n.op} is a Python callable without an ATen schema; a "
                          f"saved plan names its ops, and loading resolves only ATen overloads "
                          f"and registered fxbackend custom ops")
    if isinstance(n.target, torch._ops.OpOverload):
        raise ReplayError(f"{where}: op {n.op} is neither an ATen op nor a registered fxbackend "
                          f"custom op; register it with fxbackend.register_op (with serialize "
                          f"and deserialize) to save plans that use it")
    raise ReplayError(f"{where}: op {n.op} is not a registered fxbackend custom op")


def schema_aliases(op: Any, layout: tuple, srcs: list) -> tuple[int | None, int | None]:
    """Indices into ``srcs`` of the node a call of ``op`` views and writes in place, from the
    op's schema exactly as :func:`fxbackend.lower.lower` derives them."""
    first: dict[str, int] = {}
    i = 0
    spec = dict(layout)
    for arg in op._schema.arguments:
        if arg.name not in spec:
            continue
        mask = spec[arg.name]
        count = sum(mask) if isinstance(mask, tuple) else int(bool(mask))
        if count:
            first[arg.name] = i
        i += count
    if str(op) in _UNANNOTATED_VIEWS and srcs:
        return 0, None
    ret_sets = _return_alias_sets(op._schema)
    for arg in op._schema.arguments:
        info = arg.alias_info
        if info is None or not (info.before_set & ret_sets) or arg.name not in first:
            continue
        return (None, first[arg.name]) if info.is_write else (first[arg.name], None)
    return None, None


def unknown_op(op: str, where: str, custom_ops: dict) -> ReplayError:
    """The error for an op name that resolves to nothing here, naming the extension module the
    file says provides it (never imported automatically)."""
    module = custom_ops.get(op, {}).get("module") if isinstance(custom_ops.get(op), dict) \
        else None
    hint = (f"; the file says the extension module {module!r} provides it: install it and "
            f"register it (import it, or list it in FXB_EXTENSIONS) before loading"
            if isinstance(module, str) else "")
    op = op if len(op) <= 200 else op[:197] + "..."
    return ReplayError(f"{where}: unknown op {op!r}: not an ATen/prims overload, not a "
                       f"sym/getitem helper, and no fxbackend custom op of this name is "
                       f"registered{hint}")
