"""The JSON codec of node lists: a graph section from a :class:`~fxbackend.ir.Graph` and back
(docs/FORMAT.md, "The graph").

Decoding checks every record against the op it names (sources, layout, params against the
op's schema, aliasing against the schema's annotations) and fails with a :class:`ReplayError`
naming the node; metadata is checked against the ops later, by :mod:`.checks`.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from .. import ops as _ops
from ..ir import Graph, Node, ScalarMeta, TensorMeta
from ..lower import SYM_OPS, is_tensor_type
from .codec import Reader, dec_dim, dec_meta, enc_dim, enc_meta, enc_value
from .errors import MAX_INT, ReplayError, short
from .resolve import library_overload, op_kind, schema_aliases, torch_overload, unknown_op

__all__ = ["encode_graph", "decode_graph", "ROLES"]

# -- encoding a graph ------------------------------------------------------------------------------

def encode_graph(graph: Graph, roles: dict[Node, tuple[str, str]]) -> tuple[dict, dict]:
    """The ``graph`` section and the ``custom_ops`` table of a file; raises ReplayError (before
    anything is written) for what the format cannot hold."""
    records = []
    custom: dict[str, dict] = {}
    for n in graph.nodes:
        where = f"node %{n.id} ({n.op})"
        rec: dict[str, Any] = {"id": n.id, "op": n.op}
        if n.is_input:
            role, name = roles[n]
            rec.update(role=role, name=name, meta=enc_meta(n.meta, where))
            expr = n.annotations.get("expr")
            if expr is not None:
                rec["expr"] = enc_dim(expr, where)
            records.append(rec)
            continue
        if n.op == "constant":
            rec.update(name=roles[n][1], meta=enc_meta(n.meta, where))
            records.append(rec)
            continue
        kind = op_kind(n)
        rec["srcs"] = [s.id for s in n.srcs]
        if kind == "custom":
            op = _ops.get_op(n.op)
            if not _ops.can_serialize(op):
                raise ReplayError(f"{where}: custom op {n.op} ({type(op).__module__}."
                                  f"{type(op).__qualname__}) has no serialize/deserialize "
                                  f"capability, so a plan that uses it cannot be saved")
            try:
                rec["attrs"] = _ops.serialize_attrs(op, n)
            except Exception as e:  # the op's serialize failed or returned non-JSON data
                raise ReplayError(f"{where}: {n.op}.serialize: {type(e).__name__}: {e}") from None
            entry = custom.setdefault(n.op, {"module": type(op).__module__})
            if isinstance(n.target, torch._ops.OpOverload):
                entry["library"] = True
        else:
            rec["params"] = {k: enc_value(v, f"{where} param {k!r}")
                             for k, v in n.params.items()}
        if n.tensor_layout:
            rec["layout"] = [[name, list(mask) if isinstance(mask, tuple) else bool(mask)]
                             for name, mask in n.tensor_layout]
        if n.view_of is not None:
            rec["view_of"] = n.view_of.id
        if n.inplace_of is not None:
            rec["inplace_of"] = n.inplace_of.id
        rec["meta"] = enc_meta(n.meta, where)
        if isinstance(n.annotations.get("name"), str):
            rec["name"] = n.annotations["name"]
        records.append(rec)
    outputs = [enc_value(o, "graph output") for o in graph.outputs]
    return {"next_id": graph._next_id, "nodes": records, "outputs": outputs}, custom


# -- decoding a graph ------------------------------------------------------------------------------

ROLES = ("user", "weight", "derived")


def decode_graph(r: Reader, doc: dict, custom_ops: dict, tolerant: bool = False) -> Graph:
    """Rebuild the node list.  With ``tolerant`` (``inspect``), ops that do not resolve are kept
    by name (target None) instead of failing."""
    g = Graph()
    nodes = r.list_(doc.get("nodes"), "graph.nodes")
    max_id = -1
    for k, j in enumerate(nodes):
        rec = r.dict_(j, f"graph.nodes[{k}]")
        nid = r.int_(rec.get("id"), f"graph.nodes[{k}].id", 0, MAX_INT)
        if nid in r.nodes:
            raise r.fail(f"graph.nodes[{k}]", f"duplicate node id {nid}")
        op = r.str_(rec.get("op"), f"node %{nid}.op")
        where = f"node %{nid} ({op if len(op) <= 80 else op[:77] + '...'})"
        node = _decode_node(r, g, nid, op, rec, where, custom_ops, tolerant)
        r.nodes[nid] = node
        g.nodes.append(node)
        max_id = max(max_id, nid)
    g._next_id = r.int_(doc.get("next_id"), "graph.next_id", max_id + 1, MAX_INT)
    outs = r.list_(doc.get("outputs"), "graph.outputs")
    g.outputs = [r.value(o, f"graph.outputs[{i}]") if not (isinstance(o, dict) and "node" in o)
                 else r.node_ref(o["node"], f"graph.outputs[{i}]") for i, o in enumerate(outs)]
    for o in g.outputs:
        if isinstance(o, Node):
            o.is_output = True
    return g


_KEYS = {
    "input": {"id", "op", "role", "name", "meta", "expr"},
    "constant": {"id", "op", "name", "meta"},
    "node": {"id", "op", "srcs", "params", "attrs", "layout", "view_of", "inplace_of", "meta",
             "name"},
}


def _decode_node(r: Reader, g: Graph, nid: int, op: str, rec: dict, where: str,
                 custom_ops: dict, tolerant: bool) -> Node:
    kind = op if op in ("input", "constant") else "node"
    extra = set(rec) - _KEYS[kind]
    if extra:
        raise r.fail(where, f"unknown field(s) {sorted(extra)}")
    meta = dec_meta(r, rec.get("meta"), f"{where}.meta")
    if op == "input":
        return _decode_input(r, nid, rec, meta, where)
    if op == "constant":
        if not isinstance(meta, TensorMeta):
            raise r.fail(where, "a constant is a tensor")
        n = Node(nid, "constant", meta=meta, is_weight=True)
        n.annotations["name"] = r.str_(rec.get("name"), f"{where}.name")
        return n
    srcs = [r.node_ref(s, f"{where}.srcs") for s in r.list_(rec.get("srcs"), f"{where}.srcs")]
    layout = _decode_layout(r, rec, where)
    view_of = r.node_ref(rec["view_of"], f"{where}.view_of") \
        if rec.get("view_of") is not None else None
    inplace_of = r.node_ref(rec["inplace_of"], f"{where}.inplace_of") \
        if rec.get("inplace_of") is not None else None
    n = Node(nid, op, srcs, {}, meta, view_of=view_of, inplace_of=inplace_of,
             tensor_layout=tuple(layout))
    if isinstance(rec.get("name"), str):
        n.annotations["name"] = rec["name"]
    getitem_src = op == "getitem"
    for s in srcs:
        ok = isinstance(s.meta, tuple) if getitem_src else isinstance(s.meta, TensorMeta)
        if not ok:
            raise r.fail(where, f"source %{s.id} is not a "
                                f"{'multi-output node' if getitem_src else 'tensor'}")
    if op in SYM_OPS or op == "getitem":
        _decode_helper(r, n, rec, where)
        return n
    custom = _ops.get_op(op)
    if custom is not None:
        _decode_custom(r, n, custom, rec, where, custom_ops)
        return n
    target = torch_overload(op)
    if target is None:
        if tolerant:
            n.params = {"...": "unresolved"}
            return n
        raise unknown_op(op, where, custom_ops)
    _decode_aten(r, n, target, rec, where)
    return n


def _decode_input(r: Reader, nid: int, rec: dict, meta: Any, where: str) -> Node:
    role = rec.get("role")
    if role not in ROLES:
        raise r.fail(where, f"role must be one of {list(ROLES)}, got {short(role)}")
    name = r.str_(rec.get("name"), f"{where}.name")
    if not isinstance(meta, (TensorMeta, ScalarMeta)):
        raise r.fail(where, "an input is a tensor or a scalar")
    n = Node(nid, "input", meta=meta, is_input=True, is_weight=role == "weight")
    n.annotations["name"] = n.annotations["source"] = name
    n.annotations["role"] = role
    if "expr" in rec:
        if not isinstance(meta, ScalarMeta):
            raise r.fail(where, "only a scalar input has an 'expr'")
        n.annotations["expr"] = dec_dim(r, rec["expr"], f"{where}.expr")
    return n


def _decode_layout(r: Reader, rec: dict, where: str) -> list:
    """``[(argument name, True | (bool, ...))]``: which schema arguments the sources fill."""
    layout = []
    for item in r.list_(rec.get("layout", []), f"{where}.layout"):
        item = r.list_(item, f"{where}.layout")
        if len(item) != 2 or not isinstance(item[0], str):
            raise r.fail(where, f"malformed layout entry {short(item)}")
        mask = item[1]
        if isinstance(mask, list) and all(isinstance(x, bool) for x in mask):
            mask = tuple(mask)
        elif not isinstance(mask, bool):
            raise r.fail(where, f"malformed layout entry {short(item)}")
        layout.append((item[0], mask))
    return layout


def _decode_aten(r: Reader, n: Node, target: Any, rec: dict, where: str) -> None:
    """An ATen/prims node: layout and params checked against the overload's schema, aliasing
    against its annotations."""
    op, srcs, layout = n.op, n.srcs, n.tensor_layout
    if "attrs" in rec:
        raise r.fail(where, "an ATen node has 'params', not 'attrs'")
    n.target = target
    schema = {a.name: a for a in target._schema.arguments}
    consumed = 0
    for name, mask in layout:
        arg = schema.get(name)
        if arg is None or not is_tensor_type(arg.type):
            raise r.fail(where, f"layout names {name!r}, which is not a tensor argument of "
                                f"{op}")
        consumed += sum(mask) if isinstance(mask, tuple) else int(mask)
    if consumed != len(srcs) or len({name for name, _ in layout}) != len(layout):
        raise r.fail(where, f"layout {short(rec.get('layout'))} does not match its "
                            f"{len(srcs)} sources")
    params = r.dict_(rec.get("params", {}), f"{where}.params")
    for key, v in params.items():
        if key not in schema or key in dict(layout):
            raise r.fail(where, f"param {key!r} is not an argument of {op}")
        n.params[key] = r.value(v, f"{where} param {key!r}")
    view, inplace = schema_aliases(target, layout, srcs)
    want = (srcs[view] if view is not None else None, srcs[inplace] if inplace is not None
            else None)
    if (n.view_of, n.inplace_of) != want:
        raise r.fail(where, f"view_of/inplace_of do not match the aliasing of {op}'s schema")


def _decode_helper(r: Reader, n: Node, rec: dict, where: str) -> None:
    """``sym.*`` integer arithmetic and ``getitem``: fixed params, no aliasing."""
    if n.view_of is not None or n.inplace_of is not None or n.tensor_layout or "attrs" in rec:
        raise r.fail(where, "this op has no layout, aliasing or attrs")
    params = r.dict_(rec.get("params", {}), f"{where}.params")
    if n.op == "getitem":
        if set(params) != {"index"} or len(n.srcs) != 1:
            raise r.fail(where, "getitem takes one multi-output source and {'index': int}")
        idx = r.int_(params["index"], f"{where}.index", 0, len(n.srcs[0].meta) - 1)
        n.params["index"] = idx
        n.target = operator.getitem
        return
    if set(params) != {"args"} or n.srcs:
        raise r.fail(where, f"{n.op} takes params {{'args': [...]}} and no sources")
    args = r.value(params["args"], f"{where}.args")
    if not isinstance(args, list):
        raise r.fail(where, f"{n.op}: args must be a list")
    n.params["args"] = args
    n.target = SYM_OPS[n.op]
    if not isinstance(n.meta, ScalarMeta):
        raise r.fail(where, f"{n.op} computes a scalar")


def _decode_custom(r: Reader, n: Node, op: Any, rec: dict, where: str,
                   custom_ops: dict) -> None:
    library = bool(custom_ops.get(n.op, {}).get("library"))
    if n.view_of is not None or n.inplace_of is not None or "params" in rec \
            or (n.tensor_layout and not library):
        raise r.fail(where, "a custom-op node has 'attrs' and no aliasing (and a layout only "
                            "when the op has a torch.library twin)")
    if not callable(getattr(op, "deserialize", None)):
        raise r.fail(where, f"the registered custom op {n.op} has no deserialize capability, "
                            f"so it cannot load saved nodes")
    data = r.dict_(rec.get("attrs", {}), f"{where}.attrs")
    try:
        n.params = _ops.deserialize_attrs(op, data)
    except ReplayError:
        raise
    except Exception as e:  # the op's deserialize or the attribute schema refused the data
        raise r.fail(where, f"bad attributes {short(data)}: {type(e).__name__}: {e}") from None
    if not isinstance(n.meta, TensorMeta):
        raise r.fail(where, "a custom op has one tensor output")
    if library:
        target = library_overload(n.op)
        if target is not None:
            schema = {a.name: a for a in target._schema.arguments}
            bad = [k for k in (*(name for name, _ in n.tensor_layout), *n.params)
                   if k not in schema]
            consumed = sum(sum(m) if isinstance(m, tuple) else int(m)
                           for _, m in n.tensor_layout)
            if bad or consumed != len(n.srcs):
                raise r.fail(where, f"layout and attributes do not match the schema of "
                                    f"{n.op}'s torch.library twin")
        n.target = target
