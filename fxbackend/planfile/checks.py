"""Load-time checks of a decoded plan: its metadata against the ops themselves, and its calling
convention (user inputs, input and output trees) against its node list.

The metadata check recomputes every node's metadata on the meta device with the ops' own
meta kernels and custom ops' ``infer_meta`` (through :func:`fxbackend.concrete.propagate`),
at the symbols' saved sample values; a data-dependent step (``nonzero``) gets its file metadata
at those values.  All failures are :class:`ReplayError`.
"""
from __future__ import annotations

from typing import Any

import torch

from ..concrete import data_dependent, propagate
from ..inputs import substitute
from ..ir import Graph, Node, ScalarMeta, TensorMeta
from .codec import Reader, format_meta
from .errors import MAX_DEPTH, ReplayError, short

__all__ = ["check_metas", "same_meta", "check_tree", "check_convention"]


def check_metas(graph: Graph, hints: dict) -> None:
    """Recompute every node's metadata on the meta device (ops' own meta kernels and custom ops'
    ``infer_meta``) and compare it with the file's.  ``hints`` gives every symbol of a symbolic
    graph a sample value (the file's ``hint``: the size it was exported or first run at)."""
    args = []
    for n in graph.inputs:
        if isinstance(n.meta, TensorMeta):
            m = _at(n.meta, hints, f"input %{n.id}")
            args.append(torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta"))
        else:
            expr = n.annotations.get("expr")
            value = substitute(expr, hints) if expr is not None else None
            if type(value) is not int:
                raise ReplayError(f"input %{n.id}: a scalar input needs an 'expr' whose symbols "
                                  f"have sample values")
            args.append(value)
    # a data-dependent step's sizes are known per call only: its file metadata at the hints,
    # for the steps after it (its sources are checked as every step's)
    given = {n: _at(n.meta, hints, f"node %{n.id} ({n.op})") for n in data_dependent(graph)}
    try:
        metas, _ = propagate(graph, args, given)
    except ReplayError:
        raise
    except Exception as e:  # the ops refuse the file's sources or params
        raise ReplayError(f"the node list is inconsistent: {type(e).__name__}: {e}") from None
    for n in graph.nodes:
        if n.is_input or n.op == "constant":
            continue
        got = metas.get(n)
        want = n.meta
        # a node that owns its storage gets it from the planner at offset 0 (torch's meta
        # functions may report another: aten.copy of an odd-strided slice keeps its offset)
        if not same_meta(want, got, hints, offsets=n.view_of is not None):
            raise ReplayError(f"node %{n.id} ({n.op}): the file says "
                              f"{format_meta(want)} but the op computes {format_meta(got)}")


def _at(m: Any, hints: dict, where: str) -> Any:
    """Metadata ``m`` with the symbols at their sample values ``hints`` (``where`` names its
    node in the error for a symbol without one)."""
    if isinstance(m, tuple):
        return tuple(_at(x, hints, where) for x in m)
    if not isinstance(m, TensorMeta):
        return m
    shape, stride = ([substitute(s, hints) for s in dims] for dims in (m.shape, m.stride))
    offset = substitute(m.storage_offset, hints)
    if not all(type(v) is int for v in (*shape, *stride, offset)):
        raise ReplayError(f"{where}: sizes {m.short()} with a symbol that has no sample value")
    return TensorMeta(tuple(shape), tuple(stride), m.dtype, m.device, offset)


def same_meta(want: Any, got: Any, hints: dict, offsets: bool = True) -> bool:
    """Whether the file's metadata ``want`` is what the op computes (``got``): dtype, shape,
    strides of dims longer than 1 and, with ``offsets``, the storage offset."""
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(
            same_meta(a, b, hints, offsets) for a, b in zip(want, got))
    if isinstance(want, TensorMeta):
        if not isinstance(got, TensorMeta) or got.dtype != want.dtype \
                or len(got.shape) != len(want.shape):
            return False
        shape = [substitute(s, hints) for s in want.shape]
        if list(got.shape) != shape:
            return False
        stride = [substitute(s, hints) for s in want.stride]
        return all(sz <= 1 or a == b for sz, a, b in zip(shape, got.stride, stride)) \
            and (not offsets or substitute(want.storage_offset, hints) == got.storage_offset)
    if isinstance(want, ScalarMeta):
        return isinstance(got, ScalarMeta)
    return got is None


def check_tree(r: Reader, tree: Any, leaf_tag: str, n_leaves: int, where: str,
               depth: int = 0) -> set:
    """Validate a tree read from a file; returns the leaf indices it uses."""
    if depth > MAX_DEPTH:
        raise r.fail(where, "tree nested too deeply")
    d = r.dict_(tree, where)
    if len(d) != 1:
        raise r.fail(where, f"malformed tree node {short(d)}")
    (tag, v), = d.items()
    if tag == leaf_tag:
        return {r.int_(v, where, 0, n_leaves - 1)}
    if tag == "const":
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise r.fail(where, f"constant leaves are plain values, got {short(v)}")
        return set()
    used: set = set()
    if tag in ("tuple", "list"):
        for x in r.list_(v, where):
            used |= check_tree(r, x, leaf_tag, n_leaves, where, depth + 1)
        return used
    if tag == "dict":
        for item in r.list_(v, where):
            item = r.list_(item, where)
            if len(item) != 2 or not isinstance(item[0], str):
                raise r.fail(where, f"malformed dict entry {short(item)}")
            used |= check_tree(r, item[1], leaf_tag, n_leaves, where, depth + 1)
        return used
    raise r.fail(where, f"unknown tree node {tag!r}")


def check_convention(r: Reader, doc: dict, graph: Graph) -> tuple[list[Node], Any, Any]:
    """``(user inputs in call order, input tree, output tree)`` of the document, each checked
    against the node list: every user input listed once, trees whose leaves are user inputs
    (every one) and outputs, the input tree shaped ``(positional arguments, keyword
    arguments)``."""
    user_ids = r.list_(doc.get("user_inputs"), "user_inputs")
    user_inputs = []
    for i in user_ids:
        node = r.node_ref(i, "user_inputs")
        if not node.is_input or node.annotations.get("role") != "user":
            raise r.fail("user_inputs", f"%{node.id} is not a user input")
        user_inputs.append(node)
    declared = [n for n in graph.inputs if n.annotations.get("role") == "user"]
    if sorted(n.id for n in declared) != sorted(n.id for n in user_inputs) \
            or len(set(user_ids)) != len(user_ids):
        raise r.fail("user_inputs", "must list every user input once")
    in_tree, out_tree = doc.get("in_tree"), doc.get("out_tree")
    if in_tree is not None:
        used = check_tree(r, in_tree, "input", len(user_inputs), "in_tree")
        if used != set(range(len(user_inputs))):
            raise r.fail("in_tree", "must use every user input")
        t = r.dict_(in_tree, "in_tree")
        if set(t) != {"tuple"} or len(t["tuple"]) != 2 \
                or set(r.dict_(t["tuple"][1], "in_tree")) != {"dict"}:
            raise r.fail("in_tree", "must be (positional arguments, keyword arguments)")
    if out_tree is not None:
        check_tree(r, out_tree, "output", len(graph.outputs), "out_tree")
    return user_inputs, in_tree, out_tree
