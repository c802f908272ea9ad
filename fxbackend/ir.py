"""The node list: fxbackend's intermediate representation.

A :class:`Graph` is a flat list of :class:`Node` in execution order (ggml style).  Each node
has an ``op`` (an ATen overload name such as ``aten.mul.Tensor``, a versioned custom name such as
``sd.rope_apply.v1``, ``getitem`` or a ``sym.*`` integer operation), tensor inputs ``srcs`` in
schema order, plain non-tensor ``params``, and ``meta`` describing its value.

Contracts:
- ``srcs`` hold tensor-valued inputs only.  Integer values computed from shapes (symbolic sizes)
  are nodes too, with a :class:`ScalarMeta`; a param that depends on one holds the node itself.
- ``view_of`` names the node whose storage a view aliases; ``inplace_of`` the node whose storage
  an in-place node writes.  A node with neither owns fresh storage (one buffer per tensor output).
- Graph inputs (user inputs and weights) are nodes with op ``input``; their storage belongs to the
  caller and is never planned.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Sequence

import torch

__all__ = ["TensorMeta", "ScalarMeta", "Node", "Graph", "storage_root", "format_node",
           "contiguous_strides", "same_strides", "same_layout"]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Shape, strides, dtype and device of one tensor value.

    ``shape``/``stride`` entries are ints, or sympy expressions while a graph is symbolic.
    """

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    storage_offset: Any = 0

    @staticmethod
    def contiguous(shape: Sequence, dtype: torch.dtype, device: torch.device) -> "TensorMeta":
        """Metadata of a contiguous tensor of ``shape`` (what a custom op's output must be)."""
        return TensorMeta(tuple(shape), contiguous_strides(shape), dtype, device)

    @property
    def is_contiguous(self) -> bool:
        """Row-major dense (strides of size-1 dims are ignored, as torch does)."""
        return _is_contiguous(self.shape, self.stride)

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        """Metadata of a real or fake tensor (symbolic sizes become sympy expressions)."""
        return TensorMeta(
            tuple(_expr(s) for s in t.shape),
            tuple(_expr(s) for s in t.stride()),
            t.dtype,
            t.device,
            _expr(t.storage_offset()),
        )

    @property
    def is_symbolic(self) -> bool:
        return not all(type(v) is int for v in (*self.shape, *self.stride, self.storage_offset))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def span_bytes(self) -> int:
        """Bytes of storage this tensor touches, from its storage offset (0 when empty)."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        return (last + 1) * self.itemsize

    def short(self) -> str:
        dims = ",".join(str(s) for s in self.shape)
        txt = f"{_DTYPE_SHORT.get(self.dtype, str(self.dtype).replace('torch.', ''))}[{dims}]"
        if not _is_contiguous(self.shape, self.stride):
            txt += "{" + ",".join(str(s) for s in self.stride) + "}"
        if self.device.type != "cpu":
            txt += f"@{self.device}"
        return txt


@dataclasses.dataclass(frozen=True)
class ScalarMeta:
    """A Python scalar value (a symbolic size or the result of integer arithmetic on sizes)."""

    kind: type = int

    def short(self) -> str:
        return self.kind.__name__


@dataclasses.dataclass(eq=False)
class Node:
    """One step of the node list.  See the module docstring for the field contracts."""

    id: int
    op: str
    srcs: list = dataclasses.field(default_factory=list)
    params: dict = dataclasses.field(default_factory=dict)
    meta: Any = None
    view_of: "Node | None" = None
    inplace_of: "Node | None" = None
    is_input: bool = False
    is_weight: bool = False
    is_output: bool = False
    #: the callable that computes this node natively (an OpOverload, or a Python function)
    target: Any = None
    #: per tensor-typed schema argument: how many srcs it takes (list arguments) or a mask
    tensor_layout: tuple = ()
    #: free-form annotations of passes (e.g. the name of the input it came from)
    annotations: dict = dataclasses.field(default_factory=dict)

    @property
    def is_scalar(self) -> bool:
        return isinstance(self.meta, ScalarMeta)

    @property
    def is_multi(self) -> bool:
        """True for a node with several outputs (a tuple of tensors), read through ``getitem``."""
        return isinstance(self.meta, tuple)

    def __repr__(self) -> str:  # short, so that lists of nodes stay readable
        return f"%{self.id}"


class Graph:
    """A node list with its inputs and outputs.

    ``nodes`` includes the input nodes, first, in call order.  ``outputs`` is a list whose
    entries are nodes or plain Python values (a graph may return a constant).
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.outputs: list[Any] = []
        self._next_id = 0

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.is_input]

    def new_node(self, op: str, srcs: Sequence[Node] = (), params: dict | None = None,
                 meta: Any = None, **fields: Any) -> Node:
        """Create a node (not yet placed; use :meth:`append` or :meth:`insert`)."""
        node = Node(self._next_id, op, list(srcs), dict(params or {}), meta, **fields)
        self._next_id += 1
        return node

    def append(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def insert(self, index: int, node: Node) -> Node:
        self.nodes.insert(index, node)
        return node

    def users(self) -> dict[Node, list[Node]]:
        """Map each node to the nodes that read it (as a source or through a param)."""
        out: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for d in node_deps(n):
                out.setdefault(d, []).append(n)
        return out

    @property
    def is_symbolic(self) -> bool:
        """Some size is symbolic: in a step's metadata, or a scalar input (a dynamic compile's
        plan keeps those though its metadata is concrete)."""
        return self.has_symbolic_metas or any(n.is_input and n.is_scalar for n in self.nodes)

    @property
    def has_symbolic_metas(self) -> bool:
        """Some step's shape, strides or offset is symbolic."""
        for n in self.nodes:
            metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
            if any(isinstance(m, TensorMeta) and m.is_symbolic for m in metas):
                return True
        return False

    def format(self) -> str:
        """The stable one-line-per-node text form used by golden tests and ``FXB_DUMP``."""
        lines = [format_node(n) for n in self.nodes]
        outs = ", ".join(repr(o) if isinstance(o, Node) else _fmt_value(o) for o in self.outputs)
        lines.append(f"return ({outs})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def node_deps(node: Node) -> list[Node]:
    """Every node ``node`` reads: its sources, then scalar nodes referenced from params."""
    deps = list(node.srcs)
    for v in node.params.values():
        deps.extend(_nodes_in(v))
    return deps


def _nodes_in(v: Any) -> Iterable[Node]:
    if isinstance(v, Node):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _nodes_in(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _nodes_in(x)


def storage_root(node: Node) -> tuple[Node, int | None]:
    """The (node, output index) that owns the storage ``node``'s value lives in.

    Follows views, in-place writes and ``getitem`` of multi-output nodes.  The index is None for
    single-output owners.  An owner that is an input means the caller owns the storage.
    """
    index = None
    while True:
        if node.op == "getitem" and not node.srcs[0].is_input:
            parent = node.srcs[0]
            if parent.view_of is None and parent.inplace_of is None and parent.is_multi:
                return parent, node.params["index"]
            node = parent
        elif node.view_of is not None:
            node = node.view_of
        elif node.inplace_of is not None:
            node = node.inplace_of
        else:
            return node, index


def format_node(n: Node) -> str:
    if n.is_input:
        kind = "weight" if n.is_weight else "input"
        return f"%{n.id} = {kind} : {_fmt_meta(n.meta)}"
    srcs = ", ".join(f"%{s.id}" for s in n.srcs)
    params = ", ".join(f"{k}={_fmt_value(v)}" for k, v in n.params.items())
    flags = []
    if n.view_of is not None:
        flags.append(f"view_of=%{n.view_of.id}")
    if n.inplace_of is not None:
        flags.append(f"inplace_of=%{n.inplace_of.id}")
    if n.is_output:
        flags.append("output")
    txt = f"%{n.id} = {n.op}({srcs})"
    if params:
        txt += " {" + params + "}"
    txt += f" : {_fmt_meta(n.meta)}"
    if flags:
        txt += "  # " + " ".join(flags)
    return txt


def _fmt_meta(m: Any) -> str:
    if isinstance(m, tuple):
        return "(" + ", ".join(_fmt_meta(x) for x in m) + ")"
    if m is None:
        return "none"
    return m.short()


def _fmt_value(v: Any) -> str:
    if isinstance(v, Node):
        return f"%{v.id}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, torch.dtype):
        return _DTYPE_SHORT.get(v, str(v))
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, torch.device):
        return str(v)
    if isinstance(v, torch.memory_format):
        return str(v).replace("torch.", "")
    return str(v)


def _expr(v: Any) -> Any:
    """An int, or the sympy expression behind a SymInt."""
    if isinstance(v, torch.SymInt):
        expr = v.node.expr
        if getattr(expr, "is_Integer", False):
            return int(expr)
        return expr
    return int(v)


def contiguous_strides(shape: Sequence) -> tuple:
    """Row-major strides of ``shape``, as torch gives a contiguous tensor (a size-0 dim counts
    as 1)."""
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1) if type(size) is int else size
    return tuple(reversed(strides))


def same_strides(shape: Sequence, a: Sequence, b: Sequence) -> bool:
    """Strides ``a`` and ``b`` of ``shape`` address the same elements: equal on every dim of
    size > 1 (a dim of size 0 or 1 is never stepped along)."""
    return all(size <= 1 or x == y for size, x, y in zip(shape, a, b))


def same_layout(a: Any, b: Any) -> bool:
    """Metadata ``a`` and ``b`` (TensorMeta, or tuples of them for a multi-output step; None
    entries match None) lay out the same elements: equal shape, dtype and storage offset, and
    :func:`same_strides`."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and \
            all(same_layout(x, y) for x, y in zip(a, b))
    if not isinstance(a, TensorMeta) or not isinstance(b, TensorMeta):
        return a is None and b is None
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and \
        a.storage_offset == b.storage_offset and same_strides(a.shape, a.stride, b.stride)


def _is_contiguous(shape: tuple, stride: tuple) -> bool:
    expected = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected = expected * s
    return True


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
