"""Saving and replaying plans: one file, loaded anywhere, run without Dynamo or the model's code.

What is saved is the lowered node list (``CompiledGraph.graph``: after ``lower`` and the pass
pipeline, *before* rewrites, fusion, kernel selection and memory planning, which every
:class:`~fxbackend.executor.Plan` does for its own device), the weights, and how to call it.
Loading rebuilds a :class:`~fxbackend.executor.CompiledGraph` for the load device, so rewrites,
fusions, kernel selection and memory planning rerun there: a file saved on the CPU loads on
CUDA and the other way round.  ``docs/FORMAT.md`` describes the file byte by byte.

Contracts:
- Loading never executes code from the file: no pickle, no ``eval``, no parsing of expressions
  by sympy.  An op name resolves only against ATen/prims overloads (``torch.ops.aten``,
  ``torch.ops.prims``), the symbolic-int helpers of :data:`fxbackend.lower.SYM_OPS`,
  ``getitem``, and custom ops registered with :func:`fxbackend.register_op`.  Anything else is a
  :class:`ReplayError` naming the op (and the extension module the file says provides it,
  which is never imported automatically).
- Every failure to read a file is a :class:`ReplayError` (a ``ValueError``) whose message names
  what was wrong: bad header, truncated file, corrupted or malformed JSON, unknown op, weights
  missing or misshaped, a format version newer than this loader.
- Saving checks everything first and writes nothing when it fails (a custom op without the
  ``serialize``/``deserialize`` capabilities, a Python callable without a schema, a value the
  format cannot hold); the file is written to a temporary name and renamed into place.
- A loaded plan's metadata is checked against the ops themselves (every node's shape, strides
  and dtype are recomputed on the meta device and must match the file).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
import zlib
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from . import ops as _ops
from .executor import CompiledGraph, Plan, _propagate
from .inputs import SymbolRange, check_inputs, is_dense, relaid, substitute
from .ir import Graph, Node, ScalarMeta, TensorMeta, contiguous_strides, storage_root
from .lower import SYM_OPS, _UNANNOTATED_VIEWS, _return_alias_sets, is_tensor_type
from .options import parse_options

__all__ = ["ReplayError", "ExportedPlan", "SymbolRange", "save", "load", "describe",
           "read_sections", "write_sections", "portable_attention", "FORMAT_VERSION",
           "OLDEST_FORMAT_VERSION", "MAGIC"]

#: the format version this fxbackend writes; :func:`load` reads every version from
#: :data:`OLDEST_FORMAT_VERSION` up to it (see docs/FORMAT.md, "Versioning")
FORMAT_VERSION = 1
OLDEST_FORMAT_VERSION = 1
#: the first 8 bytes of every plan file
MAGIC = b"FXBPLAN\x00"
#: magic, format version, CRC-32 of the JSON section, JSON length, weights length
_HEADER = struct.Struct("<8sIIQQ")

_MAX_INT = 2 ** 62  # bound on sizes, ids and ranges read from a file (params are int64)
_MAX_DEPTH = 48  # bound on the nesting of values and expressions read from a file
_MAX_DIMS = 64
_MAX_EXPR_NODES = 512
_IDS = itertools.count()


class ReplayError(ValueError):
    """A plan cannot be saved, loaded or replayed; the message names what was wrong."""


# -- plain values: params, outputs, constants of the input tree ------------------------------------

def _dtype_table() -> dict[str, torch.dtype]:
    names = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
             "uint8", "uint16", "uint32", "uint64", "bool", "complex32", "complex64",
             "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


_DTYPES = _dtype_table()
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
_LAYOUTS = {n: getattr(torch, n) for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc",
                                           "sparse_bsr", "sparse_bsc", "_mkldnn")
            if isinstance(getattr(torch, n, None), torch.layout)}
_LAYOUT_NAMES = {v: k for k, v in _LAYOUTS.items()}
_MEMORY_FORMATS = {n: getattr(torch, n) for n in ("contiguous_format", "channels_last",
                                                  "channels_last_3d", "preserve_format")}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_DEVICE_RE = re.compile(r"^([a-z][a-z0-9_]{0,15})(?::([0-9]{1,3}))?$")
_TAGS = ("node", "tuple", "float", "dtype", "device", "layout", "memory_format", "complex")


def _enc_value(v: Any, where: str) -> Any:
    """A param or output value as JSON (see docs/FORMAT.md, "Values")."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, Node):
        return {"node": v.id}
    if isinstance(v, list):
        return [_enc_value(x, where) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [_enc_value(x, where) for x in v]}
    if isinstance(v, torch.dtype) and v in _DTYPE_NAMES:
        return {"dtype": _DTYPE_NAMES[v]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout) and v in _LAYOUT_NAMES:
        return {"layout": _LAYOUT_NAMES[v]}
    if isinstance(v, torch.memory_format) and v in _MEMORY_FORMAT_NAMES:
        return {"memory_format": _MEMORY_FORMAT_NAMES[v]}
    if isinstance(v, complex) and math.isfinite(v.real) and math.isfinite(v.imag):
        return {"complex": [v.real, v.imag]}
    raise ReplayError(f"{where}: cannot save a value of type {type(v).__name__} ({v!r}); the "
                      f"format holds numbers, strings, lists, tuples, dtypes, devices, layouts, "
                      f"memory formats and references to scalar nodes")


class _Reader:
    """Decoding context: the nodes read so far, symbols, the device mapping, and the place in
    the file that error messages name."""

    def __init__(self, device: torch.device | None, saved_device: torch.device | None) -> None:
        self.nodes: dict[int, Node] = {}
        self.symbols: dict[str, Any] = {}
        self.device = device
        self.saved_device = saved_device

    def fail(self, where: str, what: str) -> ReplayError:
        return ReplayError(f"{where}: {what}")

    def int_(self, j: Any, where: str, lo: int = -_MAX_INT, hi: int = _MAX_INT) -> int:
        if isinstance(j, bool) or not isinstance(j, int):
            raise self.fail(where, f"expected an integer, got {_short(j)}")
        if not lo <= j <= hi:
            raise self.fail(where, f"integer {j} out of range [{lo}, {hi}]")
        return j

    def str_(self, j: Any, where: str) -> str:
        if not isinstance(j, str):
            raise self.fail(where, f"expected a string, got {_short(j)}")
        return j

    def list_(self, j: Any, where: str) -> list:
        if not isinstance(j, list):
            raise self.fail(where, f"expected a list, got {_short(j)}")
        return j

    def dict_(self, j: Any, where: str) -> dict:
        if not isinstance(j, dict):
            raise self.fail(where, f"expected an object, got {_short(j)}")
        return j

    def device_(self, j: Any, where: str) -> torch.device:
        s = self.str_(j, where)
        m = _DEVICE_RE.match(s)
        if m is None:
            raise self.fail(where, f"malformed device {s!r}")
        try:
            dev = torch.device(s)
        except (RuntimeError, ValueError) as e:
            raise self.fail(where, f"unknown device {s!r} ({e})") from None
        if self.device is not None and self.saved_device is not None \
                and dev.type == self.saved_device.type:
            return self.device
        return dev

    def node_ref(self, j: Any, where: str) -> Node:
        i = self.int_(j, where, 0)
        node = self.nodes.get(i)
        if node is None:
            raise self.fail(where, f"refers to node %{i}, which is not defined before it")
        return node

    def value(self, j: Any, where: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail(where, "values nested too deeply")
        if j is None or isinstance(j, (bool, str)):
            return j
        if isinstance(j, int):  # params are int64 for ATen (slice ends are 2**63 - 1)
            return self.int_(j, where, -2 ** 63, 2 ** 63 - 1)
        if isinstance(j, float):
            return j
        if isinstance(j, list):
            return [self.value(x, where, depth + 1) for x in j]
        if isinstance(j, dict) and len(j) == 1:
            (tag, v), = j.items()
            if tag == "node":
                node = self.node_ref(v, where)
                if not node.is_scalar:
                    raise self.fail(where, f"a param refers to %{node.id}, which is not a "
                                           f"scalar node")
                return node
            if tag == "tuple":
                return tuple(self.value(x, where, depth + 1) for x in self.list_(v, where))
            if tag == "float" and v in ("inf", "-inf", "nan"):
                return float(v)
            if tag == "dtype" and isinstance(v, str) and v in _DTYPES:
                return _DTYPES[v]
            if tag == "device":
                return self.device_(v, where)
            if tag == "layout" and isinstance(v, str) and v in _LAYOUTS:
                return _LAYOUTS[v]
            if tag == "memory_format" and isinstance(v, str) and v in _MEMORY_FORMATS:
                return _MEMORY_FORMATS[v]
            if tag == "complex" and isinstance(v, list) and len(v) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                return complex(v[0], v[1])
        raise self.fail(where, f"unknown value encoding {_short(j)}")

    def dtype_(self, j: Any, where: str) -> torch.dtype:
        if not isinstance(j, str) or j not in _DTYPES:
            raise self.fail(where, f"unknown dtype {_short(j)}")
        return _DTYPES[j]


def _short(j: Any, limit: int = 80) -> str:
    try:
        txt = json.dumps(j)
    except (TypeError, ValueError):
        txt = repr(j)
    return txt if len(txt) <= limit else txt[:limit - 3] + "..."


# -- symbolic sizes: a JSON tree, never a string for sympy to parse --------------------------------

def _expr_functions() -> dict[str, Any]:
    import sympy
    from torch.utils._sympy import functions as F
    table = {"Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow}
    for name in ("FloorDiv", "CeilDiv", "CleanDiv", "ModularIndexing", "PythonMod", "Mod", "Max",
                 "Min", "PowByNatural", "TruncToInt", "FloorToInt", "CeilToInt", "Identity"):
        cls = getattr(F, name, None)
        if cls is not None:
            table[name] = cls
    return table


_EXPR_FUNCS: dict[str, Any] | None = None


def _funcs() -> dict[str, Any]:
    global _EXPR_FUNCS
    if _EXPR_FUNCS is None:
        _EXPR_FUNCS = _expr_functions()
    return _EXPR_FUNCS


def _enc_dim(d: Any, where: str) -> Any:
    """An int, or a symbolic size as ``{"s": name}`` / ``{"f": function, "a": [args]}``."""
    if type(d) is int:
        return d
    if getattr(d, "is_Integer", False):
        return int(d)
    if getattr(d, "is_Symbol", False):
        return {"s": d.name}
    if getattr(d, "is_Rational", False):
        return {"q": [int(d.p), int(d.q)]}
    name = type(d).__name__
    cls = _funcs().get(name)
    if cls is None or type(d) is not cls:
        raise ReplayError(f"{where}: cannot save the symbolic size {d} (function {name} is not "
                          f"one the format knows: {sorted(_funcs())})")
    return {"f": name, "a": [_enc_dim(a, where) for a in d.args]}


def _make_symbol(name: str, positive: bool) -> Any:
    import sympy
    return sympy.Symbol(name, integer=True, positive=positive) if positive \
        else sympy.Symbol(name, integer=True)


def _dec_dim(r: _Reader, j: Any, where: str, budget: list | None = None, depth: int = 0) -> Any:
    import sympy
    if isinstance(j, int) and not isinstance(j, bool):
        return r.int_(j, where)
    budget = [_MAX_EXPR_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        raise r.fail(where, "symbolic size too large")
    d = r.dict_(j, where)
    if set(d) == {"s"}:
        sym = r.symbols.get(d["s"]) if isinstance(d["s"], str) else None
        if sym is None:
            raise r.fail(where, f"unknown symbol {_short(d['s'])} (not in 'symbols')")
        return sym
    if set(d) == {"q"}:
        pq = r.list_(d["q"], where)
        if len(pq) != 2:
            raise r.fail(where, f"malformed rational {_short(d)}")
        p, q = r.int_(pq[0], where), r.int_(pq[1], where, 1)
        return sympy.Rational(p, q)
    if set(d) == {"f", "a"}:
        cls = _funcs().get(d["f"]) if isinstance(d["f"], str) else None
        if cls is None:
            raise r.fail(where, f"unknown size function {_short(d['f'])}")
        args = [_dec_dim(r, a, where, budget, depth + 1) for a in r.list_(d["a"], where)]
        if d["f"] in ("Pow", "PowByNatural"):
            if len(args) != 2 or not getattr(args[1], "is_Integer", isinstance(args[1], int)) \
                    or abs(int(args[1])) > 64:
                raise r.fail(where, "a power needs an integer exponent in [-64, 64]")
        try:
            value = cls(*args)
        except Exception as e:  # a wrong arity or argument kind for this function
            raise r.fail(where, f"bad arguments for {d['f']}: {e}") from None
        if getattr(value, "is_Integer", False) and abs(int(value)) > _MAX_INT:
            raise r.fail(where, "symbolic size evaluates out of range")
        return value
    raise r.fail(where, f"malformed symbolic size {_short(j)}")


# -- metadata --------------------------------------------------------------------------------------

def _enc_meta(m: Any, where: str) -> Any:
    if m is None:
        return None
    if isinstance(m, ScalarMeta):
        return {"scalar": m.kind.__name__}
    if isinstance(m, tuple):
        return {"tuple": [_enc_meta(x, where) for x in m]}
    if isinstance(m, TensorMeta):
        if m.dtype not in _DTYPE_NAMES:
            raise ReplayError(f"{where}: cannot save dtype {m.dtype}")
        return {"dtype": _DTYPE_NAMES[m.dtype], "shape": [_enc_dim(s, where) for s in m.shape],
                "stride": [_enc_dim(s, where) for s in m.stride],
                "offset": _enc_dim(m.storage_offset, where), "device": str(m.device)}
    raise ReplayError(f"{where}: cannot save metadata {m!r}")


_SCALAR_KINDS = {"int": int, "float": float, "bool": bool}


def _dec_meta(r: _Reader, j: Any, where: str, depth: int = 0) -> Any:
    if j is None:
        return None
    d = r.dict_(j, where)
    if set(d) == {"scalar"}:
        if not isinstance(d["scalar"], str) or d["scalar"] not in _SCALAR_KINDS:
            raise r.fail(where, f"unknown scalar kind {_short(d['scalar'])}")
        return ScalarMeta(_SCALAR_KINDS[d["scalar"]])
    if set(d) == {"tuple"}:
        if depth > 2:
            raise r.fail(where, "tuple metadata nested too deeply")
        return tuple(_dec_meta(r, x, where, depth + 1) for x in r.list_(d["tuple"], where))
    if set(d) == {"dtype", "shape", "stride", "offset", "device"}:
        shape = r.list_(d["shape"], where)
        stride = r.list_(d["stride"], where)
        if len(shape) != len(stride) or len(shape) > _MAX_DIMS:
            raise r.fail(where, f"shape {_short(shape)} and strides {_short(stride)} do not "
                                f"match")
        dims = [_dec_dim(r, s, where) for s in shape]
        strides = [_dec_dim(r, s, where) for s in stride]
        offset = _dec_dim(r, d["offset"], where)
        for v in (*dims, *strides, offset):
            if type(v) is int and v < 0:
                raise r.fail(where, f"negative size, stride or offset {v}")
        return TensorMeta(tuple(dims), tuple(strides), r.dtype_(d["dtype"], where),
                          r.device_(d["device"], where), offset)
    raise r.fail(where, f"malformed metadata {_short(j)}")


# -- ops: what a node's name may resolve to --------------------------------------------------------

_OP_NAME = re.compile(r"^([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
#: namespaces resolved through ``torch.ops.<ns>`` (PyTorch's own operator sets)
_TORCH_NAMESPACES = ("aten", "prims")


def _torch_overload(name: str) -> Any | None:
    """The ATen/prims ``OpOverload`` called ``name`` (``aten.mul.Tensor``), or None.  Looks the
    name up in PyTorch's operator registry only; never imports or evaluates anything."""
    m = _OP_NAME.match(name)
    if m is None or m[1] not in _TORCH_NAMESPACES or m[2].startswith("__") \
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


def _library_overload(name: str) -> Any | None:
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


def _op_kind(n: Node) -> str:
    """How a node's op is named in a file: ``sym``, ``getitem``, ``torch`` or ``custom``;
    raises ReplayError for ops a file cannot name."""
    if n.op in SYM_OPS:
        return "sym"
    if n.op == "getitem":
        return "getitem"
    if _ops.get_op(n.op) is not None:
        return "custom"
    if isinstance(n.target, torch._ops.OpOverload) and n.op.split(".")[0] in _TORCH_NAMESPACES:
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


def _schema_aliases(op: Any, layout: tuple, srcs: list) -> tuple[int | None, int | None]:
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


# -- encoding a graph ------------------------------------------------------------------------------

def _encode_graph(graph: Graph, roles: dict[Node, tuple[str, str]]) -> tuple[dict, dict]:
    """The ``graph`` section and the ``custom_ops`` table of a file; raises ReplayError (before
    anything is written) for what the format cannot hold."""
    records = []
    custom: dict[str, dict] = {}
    for n in graph.nodes:
        where = f"node %{n.id} ({n.op})"
        rec: dict[str, Any] = {"id": n.id, "op": n.op}
        if n.is_input:
            role, name = roles[n]
            rec.update(role=role, name=name, meta=_enc_meta(n.meta, where))
            expr = n.annotations.get("expr")
            if expr is not None:
                rec["expr"] = _enc_dim(expr, where)
            records.append(rec)
            continue
        if n.op == "constant":
            rec.update(name=roles[n][1], meta=_enc_meta(n.meta, where))
            records.append(rec)
            continue
        kind = _op_kind(n)
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
            rec["params"] = {k: _enc_value(v, f"{where} param {k!r}")
                             for k, v in n.params.items()}
        if n.tensor_layout:
            rec["layout"] = [[name, list(mask) if isinstance(mask, tuple) else bool(mask)]
                             for name, mask in n.tensor_layout]
        if n.view_of is not None:
            rec["view_of"] = n.view_of.id
        if n.inplace_of is not None:
            rec["inplace_of"] = n.inplace_of.id
        rec["meta"] = _enc_meta(n.meta, where)
        if isinstance(n.annotations.get("name"), str):
            rec["name"] = n.annotations["name"]
        records.append(rec)
    outputs = [_enc_value(o, "graph output") for o in graph.outputs]
    return {"next_id": graph._next_id, "nodes": records, "outputs": outputs}, custom


# -- decoding a graph ------------------------------------------------------------------------------

_ROLES = ("user", "weight", "derived")


def _decode_graph(r: _Reader, doc: dict, custom_ops: dict, tolerant: bool = False) -> Graph:
    """Rebuild the node list.  With ``tolerant`` (``inspect``), ops that do not resolve are kept
    by name (target None) instead of failing."""
    g = Graph()
    nodes = r.list_(doc.get("nodes"), "graph.nodes")
    max_id = -1
    for k, j in enumerate(nodes):
        rec = r.dict_(j, f"graph.nodes[{k}]")
        nid = r.int_(rec.get("id"), f"graph.nodes[{k}].id", 0, _MAX_INT)
        if nid in r.nodes:
            raise r.fail(f"graph.nodes[{k}]", f"duplicate node id {nid}")
        op = r.str_(rec.get("op"), f"node %{nid}.op")
        where = f"node %{nid} ({op if len(op) <= 80 else op[:77] + '...'})"
        node = _decode_node(r, g, nid, op, rec, where, custom_ops, tolerant)
        r.nodes[nid] = node
        g.nodes.append(node)
        max_id = max(max_id, nid)
    g._next_id = r.int_(doc.get("next_id"), "graph.next_id", max_id + 1, _MAX_INT)
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


def _decode_node(r: _Reader, g: Graph, nid: int, op: str, rec: dict, where: str,
                 custom_ops: dict, tolerant: bool) -> Node:
    kind = op if op in ("input", "constant") else "node"
    extra = set(rec) - _KEYS[kind]
    if extra:
        raise r.fail(where, f"unknown field(s) {sorted(extra)}")
    meta = _dec_meta(r, rec.get("meta"), f"{where}.meta")
    if op == "input":
        role = rec.get("role")
        if role not in _ROLES:
            raise r.fail(where, f"role must be one of {list(_ROLES)}, got {_short(role)}")
        name = r.str_(rec.get("name"), f"{where}.name")
        if not isinstance(meta, (TensorMeta, ScalarMeta)):
            raise r.fail(where, "an input is a tensor or a scalar")
        n = Node(nid, "input", meta=meta, is_input=True, is_weight=role == "weight")
        n.annotations["name"] = n.annotations["source"] = name
        n.annotations["role"] = role
        if "expr" in rec:
            if not isinstance(meta, ScalarMeta):
                raise r.fail(where, "only a scalar input has an 'expr'")
            n.annotations["expr"] = _dec_dim(r, rec["expr"], f"{where}.expr")
        return n
    if op == "constant":
        if not isinstance(meta, TensorMeta):
            raise r.fail(where, "a constant is a tensor")
        n = Node(nid, "constant", meta=meta, is_weight=True)
        n.annotations["name"] = r.str_(rec.get("name"), f"{where}.name")
        return n
    srcs = [r.node_ref(s, f"{where}.srcs") for s in r.list_(rec.get("srcs"), f"{where}.srcs")]
    layout = []
    for item in r.list_(rec.get("layout", []), f"{where}.layout"):
        item = r.list_(item, f"{where}.layout")
        if len(item) != 2 or not isinstance(item[0], str):
            raise r.fail(where, f"malformed layout entry {_short(item)}")
        mask = item[1]
        if isinstance(mask, list) and all(isinstance(x, bool) for x in mask):
            mask = tuple(mask)
        elif not isinstance(mask, bool):
            raise r.fail(where, f"malformed layout entry {_short(item)}")
        layout.append((item[0], mask))
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
    target = _torch_overload(op)
    if target is None:
        if tolerant:
            n.params = {"...": "unresolved"}
            return n
        raise _unknown_op(op, where, custom_ops)
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
        raise r.fail(where, f"layout {_short(rec.get('layout'))} does not match its "
                            f"{len(srcs)} sources")
    params = r.dict_(rec.get("params", {}), f"{where}.params")
    for key, v in params.items():
        if key not in schema or key in dict(layout):
            raise r.fail(where, f"param {key!r} is not an argument of {op}")
        n.params[key] = r.value(v, f"{where} param {key!r}")
    view, inplace = _schema_aliases(target, n.tensor_layout, srcs)
    want = (srcs[view] if view is not None else None, srcs[inplace] if inplace is not None
            else None)
    if (n.view_of, n.inplace_of) != want:
        raise r.fail(where, f"view_of/inplace_of do not match the aliasing of {op}'s schema")
    return n


def _decode_helper(r: _Reader, n: Node, rec: dict, where: str) -> None:
    """``sym.*`` integer arithmetic and ``getitem``: fixed params, no aliasing."""
    if n.view_of is not None or n.inplace_of is not None or n.tensor_layout or "attrs" in rec:
        raise r.fail(where, "this op has no layout, aliasing or attrs")
    params = r.dict_(rec.get("params", {}), f"{where}.params")
    if n.op == "getitem":
        if set(params) != {"index"} or len(n.srcs) != 1:
            raise r.fail(where, "getitem takes one multi-output source and {'index': int}")
        idx = r.int_(params["index"], f"{where}.index", 0, len(n.srcs[0].meta) - 1)
        n.params["index"] = idx
        n.target = __import__("operator").getitem
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


def _decode_custom(r: _Reader, n: Node, op: Any, rec: dict, where: str,
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
        raise r.fail(where, f"bad attributes {_short(data)}: {type(e).__name__}: {e}") from None
    if not isinstance(n.meta, TensorMeta):
        raise r.fail(where, "a custom op has one tensor output")
    if library:
        target = _library_overload(n.op)
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


def _unknown_op(op: str, where: str, custom_ops: dict) -> ReplayError:
    module = custom_ops.get(op, {}).get("module") if isinstance(custom_ops.get(op), dict) \
        else None
    hint = (f"; the file says the extension module {module!r} provides it: install it and "
            f"register it (import it, or list it in FXB_EXTENSIONS) before loading"
            if isinstance(module, str) else "")
    op = op if len(op) <= 200 else op[:197] + "..."
    return ReplayError(f"{where}: unknown op {op!r}: not an ATen/prims overload, not a "
                       f"sym/getitem helper, and no fxbackend custom op of this name is "
                       f"registered{hint}")


# -- checks of a decoded graph ---------------------------------------------------------------------

def _check_metas(graph: Graph, hints: dict) -> None:
    """Recompute every node's metadata on the meta device (ops' own meta kernels and custom ops'
    ``infer_meta``) and compare it with the file's.  ``hints`` gives every symbol of a symbolic
    graph a sample value (the file's ``hint``: the size it was exported or first run at)."""
    args = []
    for n in graph.inputs:
        if isinstance(n.meta, TensorMeta):
            shape = [substitute(s, hints) for s in n.meta.shape]
            stride = [substitute(s, hints) for s in n.meta.stride]
            offset = substitute(n.meta.storage_offset, hints)
            if not all(type(v) is int for v in (*shape, *stride, offset)):
                raise ReplayError(f"input %{n.id}: sizes {n.meta.short()} with a symbol that "
                                  f"has no sample value")
            args.append(torch.empty_strided(shape, stride, dtype=n.meta.dtype, device="meta"))
        else:
            expr = n.annotations.get("expr")
            value = substitute(expr, hints) if expr is not None else None
            if type(value) is not int:
                raise ReplayError(f"input %{n.id}: a scalar input needs an 'expr' whose symbols "
                                  f"have sample values")
            args.append(value)
    try:
        metas, _ = _propagate(graph, args)
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
        if not _same_meta(want, got, hints, offsets=n.view_of is not None):
            raise ReplayError(f"node %{n.id} ({n.op}): the file says "
                              f"{_fmt_meta(want)} but the op computes {_fmt_meta(got)}")


def _same_meta(want: Any, got: Any, hints: dict, offsets: bool = True) -> bool:
    """Whether the file's metadata ``want`` is what the op computes (``got``): dtype, shape,
    strides of dims longer than 1 and, with ``offsets``, the storage offset."""
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(
            _same_meta(a, b, hints, offsets) for a, b in zip(want, got))
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


def _fmt_meta(m: Any) -> str:
    if isinstance(m, tuple):
        return "(" + ", ".join(_fmt_meta(x) for x in m) + ")"
    return "nothing" if m is None else m.short()


# -- moving a graph to another device type ---------------------------------------------------------

#: attention ops that exist for one device type only; a graph moved to another device type runs
#: ``aten.scaled_dot_product_attention`` instead (their first output, same maths), which
#: dispatches to that device's kernel
_DEVICE_SDPA = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "attn_mask",
    "aten._scaled_dot_product_flash_attention.default": None,
    "aten._scaled_dot_product_efficient_attention.default": "attn_bias",
    "aten._scaled_dot_product_cudnn_attention.default": "attn_bias",
}


def portable_attention(graph: Graph) -> int:
    """Replace device-specific attention nodes by ``aten.scaled_dot_product_attention`` (where
    only their first output is read); returns how many were replaced.  Applied when a plan is
    loaded on another device type than it was saved from.

    The replacement keeps the output's memory layout: a contiguous ``[B, H, S, D]`` output
    (the CPU kernel's) is the new node itself; a ``[B, S, H, D]``-major one (the CUDA kernels')
    is the new node's output transposed, made contiguous and transposed back, so that the views
    after it stay valid when a symbolic graph is re-planned.  Raises ReplayError for a node
    whose auxiliary outputs (log-sum-exp, ...) are read or whose layout is neither."""
    users = graph.users()
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    count = 0
    for n in list(graph.nodes):
        if n.op not in _DEVICE_SDPA:
            continue
        gets = users.get(n, [])
        if any(u.op != "getitem" for u in gets) or any(
                u.params["index"] != 0 and (u.is_output or users.get(u)) for u in gets):
            raise ReplayError(f"node %{n.id}: {n.op} runs on one device type only, and its "
                              f"auxiliary outputs are read, so the plan cannot move to another")
        layout = dict(n.tensor_layout)
        mask_arg = _DEVICE_SDPA[n.op]
        srcs = list(n.srcs[:3])
        new_layout = [("query", True), ("key", True), ("value", True)]
        if mask_arg is not None and layout.get(mask_arg):
            srcs.append(n.srcs[3])
            new_layout.append(("attn_mask", True))
        p = n.params
        params = {"dropout_p": p.get("dropout_p", 0.0), "is_causal": p.get("is_causal", False)}
        if p.get("scale") is not None:
            params["scale"] = p["scale"]
        want = n.meta[0]
        shape = tuple(want.shape)
        plain = TensorMeta.contiguous(shape, want.dtype, want.device)
        chain = [graph.new_node(str(sdpa), srcs, params, plain, tensor_layout=tuple(new_layout))]
        chain[0].target = sdpa
        if len(shape) == 4 and tuple(want.stride) != tuple(plain.stride):
            bshd = (shape[0], shape[2], shape[1], shape[3])
            dense = TensorMeta.contiguous(bshd, want.dtype, want.device)
            back = (dense.stride[0], dense.stride[2], dense.stride[1], dense.stride[3])
            if tuple(want.stride) != back:
                raise ReplayError(f"node %{n.id}: {n.op}'s output layout {want.short()} has no "
                                  f"portable equivalent")
            chain.append(_aten_node(graph, torch.ops.aten.transpose.int, chain[-1],
                                    {"dim0": 1, "dim1": 2},
                                    TensorMeta(bshd, (plain.stride[0], plain.stride[2],
                                                      plain.stride[1], plain.stride[3]),
                                               want.dtype, want.device), view=True))
            chain.append(_aten_node(graph, torch.ops.aten.clone.default, chain[-1],
                                    {"memory_format": torch.contiguous_format}, dense))
            chain.append(_aten_node(graph, torch.ops.aten.transpose.int, chain[-1],
                                    {"dim0": 1, "dim1": 2}, want, view=True))
        elif tuple(want.stride) != tuple(plain.stride):
            raise ReplayError(f"node %{n.id}: {n.op}'s output layout {want.short()} has no "
                              f"portable equivalent")
        for c in chain:
            c.annotations["name"] = n.annotations.get("name", "attention")
        i = graph.nodes.index(n)
        graph.nodes[i:i + 1] = chain
        for u in gets:
            graph.nodes.remove(u)
            if u.params["index"] == 0:
                _replace_node(graph, u, chain[-1])
        count += 1
    return count


def _aten_node(graph: Graph, op: Any, src: Node, params: dict, meta: TensorMeta,
               view: bool = False) -> Node:
    n = graph.new_node(str(op), [src], params, meta, tensor_layout=(("self", True),),
                       view_of=src if view else None)
    n.target = op
    return n


def _replace_node(graph: Graph, old: Node, new: Node) -> None:
    """Every read of ``old`` (sources, aliasing, outputs) reads ``new`` instead."""
    for m in graph.nodes:
        m.srcs = [new if s is old else s for s in m.srcs]
        if m.view_of is old:
            m.view_of = new
        if m.inplace_of is old:
            m.inplace_of = new
    if old.is_output:
        new.is_output = True
        graph.outputs = [new if o is old else o for o in graph.outputs]


# -- the plan --------------------------------------------------------------------------------------

_MISSING = object()


class ExportedPlan:
    """A lowered graph with its weights and calling convention: run it, save it, swap weights.

    Built by :func:`export` (``torch.export``), :func:`from_compiled` (a graph that
    ``torch.compile(backend="fxbackend")`` compiled) or :func:`load`.  Calls go through a
    :class:`~fxbackend.executor.CompiledGraph` (``.compiled``): one :class:`Plan` per input-shape
    signature, built on first use on the plan's device.

    - ``plan(*args, **kwargs)``: the exported model's calling convention; returns the model's
      output structure (tuples, lists, dicts) for export plans, a flat list of outputs for plans
      from ``torch.compile`` (whose graph has no output structure).
    - ``plan.run(inputs)``: ``inputs`` is a list in :attr:`input_names` order or a mapping from
      those names (or ``"0"``, ``"1"``, ...); returns the flat list of outputs.
    - ``plan.update_weights(state_dict, strict=True)``, ``plan.save(path)``, ``plan.report()``,
      ``plan.memory_report()``, ``plan.graph`` (the lowered node list).

    Weights are the plan's tensors, passed to every call.  A plan from :func:`export` or
    :func:`from_compiled` shares them with the model it came from (no copy), so
    :meth:`update_weights` writes into that model's parameters too; a loaded plan owns them.
    """

    def __init__(self, compiled: CompiledGraph, *, names: dict[Node, str],
                 weights: dict[str, torch.Tensor], weight_kinds: dict[str, str],
                 symbols: dict[Any, SymbolRange], in_tree: Any = None, out_tree: Any = None,
                 source: str = "export", user_inputs: Sequence[Node] | None = None,
                 custom_modules: dict | None = None) -> None:
        self.compiled = compiled
        self.graph = compiled.graph
        self.names = dict(names)
        self.weights = weights
        self.weight_kinds = weight_kinds
        self.symbols = symbols
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.source = source
        self.custom_modules = dict(custom_modules or {})
        inputs = self.graph.inputs
        tensor_dims = {}
        for n in inputs:
            if not n.is_weight and isinstance(n.meta, TensorMeta):
                for d, s in enumerate(n.meta.shape):
                    if getattr(s, "is_Symbol", False):
                        tensor_dims.setdefault(s, (n, d))
        self._slots: list[tuple[str, Any]] = []
        derived = []
        for n in inputs:
            if n.is_weight:
                self._slots.append(("weight", self.names[n]))
            elif n.is_scalar and getattr(n.annotations.get("expr"), "is_Symbol", False) \
                    and n.annotations["expr"] in tensor_dims:
                self._slots.append(("derived", n.annotations["expr"]))
                derived.append(n)
            else:
                self._slots.append(("user", n))
        if user_inputs is None:
            user_inputs = [n for kind, n in self._slots if kind == "user"]
        self.user_inputs = list(user_inputs)
        self._position = {n: i for i, n in enumerate(self.user_inputs)}
        self.derived_inputs = derived
        # input signature -> (symbol values, ((input position, strides it is copied to), ...))
        self._checked: dict = {}
        self._scalar_positions = [i for i, n in enumerate(self.user_inputs)
                                  if isinstance(n.meta, ScalarMeta)]
        # user inputs the graph writes in place (the model's own writes into its inputs)
        self._written = {storage_root(n)[0] for n in self.graph.nodes
                         if n.inplace_of is not None} & set(self.user_inputs)
        for n in self.graph.nodes:
            if n.op == "constant" and n.annotations.get("value") is not \
                    self.weights[self.names[n]]:
                n.annotations["value"] = self.weights[self.names[n]]

    # -- what it takes ------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        """Names of the user inputs, in the order :meth:`run` takes a list."""
        return [self.names[n] for n in self.user_inputs]

    @property
    def device(self) -> torch.device:
        """The device the plan runs on (its inputs' and weights' device)."""
        for n in self.graph.nodes:
            if isinstance(n.meta, TensorMeta):
                return n.meta.device
        return torch.device("cpu")

    @property
    def plans(self) -> list[Plan]:
        """The plans built so far (one per input-shape signature)."""
        cg = self.compiled
        return list(cg.plans.values()) + ([cg._static] if cg._static is not None else [])

    def describe_inputs(self) -> list[str]:
        """One line per user input: name and metadata (symbolic sizes with their ranges)."""
        lines = []
        for n in self.user_inputs:
            lines.append(f"{self.names[n]}: {n.meta.short()}")
        for sym, rng in sorted(self.symbols.items(), key=lambda kv: str(kv[0])):
            hi = "inf" if rng.max is None else rng.max
            lines.append(f"  {sym} in [{rng.min}, {hi}]" +
                         (f" (exported at {rng.hint})" if rng.hint is not None else ""))
        return lines

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run with the exported model's calling convention (see the class docstring)."""
        if self.in_tree is None:
            values = self._values_from_names(dict(kwargs), list(args))
        else:
            values = self._bind_call(args, kwargs)
        outs = self.run(values)
        if self.out_tree is None:
            return outs
        return _build_tree(self.out_tree, outs)

    def run(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list:
        """Run on the user inputs (a list in :attr:`input_names` order, or a mapping from those
        names or from ``"0"``, ``"1"``, ...); returns the flat list of outputs."""
        if isinstance(inputs, Mapping):
            values = self._values_from_names(dict(inputs), [])
        else:
            values = list(inputs)
            if len(values) != len(self.user_inputs):
                raise ReplayError(f"expected {len(self.user_inputs)} inputs "
                                  f"{self.input_names}, got {len(values)}")
        for i in self._scalar_positions:  # a number given as a 0-dim tensor: its value
            if isinstance(values[i], torch.Tensor) and values[i].dim() == 0:
                values[i] = values[i].item()
        key = tuple((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor)
                    else (type(v), v if isinstance(v, (int, float, str)) else id(v))
                    for v in values)
        seen = self._checked.get(key)
        if seen is None:  # new shapes: check them (sizes, ranges, layouts) once
            checked, bind = self._check_inputs(list(values))  # it replaces what it relays out
            fix = tuple((i, b.stride()) for i, (a, b) in enumerate(zip(values, checked))
                        if a is not b and isinstance(b, torch.Tensor))
            if len(self._checked) < 64:
                self._checked[key] = (bind, fix)
        else:
            bind, fix = seen
            checked = list(values) if fix else values
            for i, stride in fix:
                checked[i] = relaid(values[i], stride)
        given, values = values, checked
        args = []
        for kind, x in self._slots:
            if kind == "weight":
                args.append(self.weights[x])
            elif kind == "derived":
                args.append(bind[x])
            else:
                args.append(values[self._position[x]])
        with torch.no_grad():
            outs = self.compiled.run(args)
            for i, _ in fix:  # an input the plan writes, given in another layout: write it back
                if self.user_inputs[i] in self._written:
                    given[i].copy_(values[i])
        return outs

    def _bind_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
        """Flat user inputs from a call shaped like the exported one."""
        values = [_MISSING] * len(self.user_inputs)
        positional, keywords = self.in_tree["tuple"]
        n_pos = len(positional["tuple"])
        if len(args) > n_pos:
            raise ReplayError(f"expected at most {n_pos} positional argument(s), got "
                              f"{len(args)}")
        _bind_tree(positional, tuple(args) + (_MISSING,) * (n_pos - len(args)),
                   "positional arguments", values)
        _bind_tree(keywords, dict(kwargs), "keyword arguments", values)
        missing = [self.input_names[i] for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise ReplayError(f"missing input(s) {missing}")
        return values

    def _values_from_names(self, named: dict, positional: list) -> list:
        names = self.input_names
        if len(positional) > len(names):
            raise ReplayError(f"expected at most {len(names)} inputs {names}, got "
                              f"{len(positional)}")
        values = positional + [_MISSING] * (len(names) - len(positional))
        for key, v in named.items():
            if key in names:
                i = names.index(key)
            elif isinstance(key, str) and key.isdigit() and int(key) < len(names):
                i = int(key)
            else:
                raise ReplayError(f"unknown input {key!r}; this plan takes {names}")
            if values[i] is not _MISSING:
                raise ReplayError(f"input {names[i]!r} given twice")
            values[i] = v
        missing = [names[i] for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise ReplayError(f"missing input(s) {missing}; this plan takes {names}")
        return values

    def _check_inputs(self, values: list) -> tuple[list, dict]:
        """The user inputs checked against the saved metadata and symbol ranges
        (:func:`fxbackend.inputs.check_inputs`): the values, with inputs in another layout
        than the plan's copied to the plan's where that is dense (a ReplayError where it is
        not), and the value of every symbol."""
        return check_inputs(self.user_inputs, values,
                            [f"input {self.names[n]!r}" for n in self.user_inputs],
                            ranges=self.symbols, strides="relayout", scalar_tensors=True,
                            error=ReplayError)

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy new values into the plan's weights in place: addresses do not change and
        nothing is re-planned.

        Every given name must be one of the plan's weights (``strict``; otherwise unknown names
        are ignored), and with ``strict`` every parameter and buffer must be given (constants a
        model computes, such as lifted tensors, may be left out).  A shape or dtype that differs
        from the weight's is always an error naming the weight.  Everything is checked before
        anything is written.  Weights that kernels derive data from (the INT8 kernels'
        quantized copies) are re-derived by those kernels on the next call, since the write
        bumps each tensor's version counter.
        """
        if not isinstance(state_dict, Mapping):
            raise ReplayError(f"update_weights takes a mapping name -> tensor, got "
                              f"{type(state_dict).__name__}")
        unknown = sorted(k for k in state_dict if k not in self.weights)
        if strict and unknown:
            raise ReplayError(f"update_weights: unknown weight name(s) {unknown[:10]}"
                              f"{' ...' if len(unknown) > 10 else ''}; this plan's weights are "
                              f"e.g. {sorted(self.weights)[:5]}")
        if strict:
            missing = sorted(k for k, kind in self.weight_kinds.items()
                             if kind in ("parameter", "buffer") and k not in state_dict)
            if missing:
                raise ReplayError(f"update_weights: missing weight(s) {missing[:10]}"
                                  f"{' ...' if len(missing) > 10 else ''} (strict=True)")
        todo = []
        for k, v in state_dict.items():
            if k not in self.weights:
                continue
            cur = self.weights[k]
            if not isinstance(v, torch.Tensor):
                raise ReplayError(f"weight {k!r}: expected a tensor, got {type(v).__name__}")
            if tuple(v.shape) != tuple(cur.shape):
                raise ReplayError(f"weight {k!r}: expected shape {tuple(cur.shape)}, got "
                                  f"{tuple(v.shape)}")
            if v.dtype != cur.dtype:
                raise ReplayError(f"weight {k!r}: expected dtype {cur.dtype}, got {v.dtype}")
            todo.append((cur, v))
        with torch.no_grad():
            for cur, v in todo:
                cur.copy_(v)
        # Data a kernel derives from a weight at plan time (quantized copies of the INT8 work)
        # is re-derived by that kernel, not here: copy_ keeps the weight's address and bumps
        # its version counter (``tensor._version``), which such a kernel compares with the one
        # it derived from.  No derived data is stored in the file or in this object.

    @property
    def weight_bytes(self) -> int:
        """Bytes of the plan's weights (each storage counted once)."""
        seen, total = set(), 0
        for t in self.weights.values():
            key = (t.data_ptr(), t.nbytes)
            if key not in seen:
                seen.add(key)
                total += t.nbytes
        return total

    # -- reports ------------------------------------------------------------------------------
    def memory_report(self) -> str:
        """Weights, and per plan built so far its arena and workspace."""
        lines = [f"weights: {len(self.weights)} tensors, {self.weight_bytes / 2**20:.2f} MB"]
        if not self.plans:
            lines.append("no plan built yet (call the plan once)")
        for p in self.plans:
            lines.append(f"plan {p.name} on {p._plan_device()}: {p.memory.summary()}, workspace "
                         f"{p.workspace_bytes / 2**20:.2f} MB ({p.workspace_bytes} bytes)")
        return "\n".join(lines)

    def report(self) -> str:
        """Inputs, weights, and each built plan's steps with their kernels and what fusion
        did."""
        head = [f"exported plan ({self.source}) on {self.device}: {len(self.user_inputs)} "
                f"input(s), {len(self.graph.nodes)} nodes"] + \
            ["  " + ln for ln in self.describe_inputs()] + [self.memory_report()]
        return "\n".join(head + [p.report() for p in self.plans])

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` (see :func:`save`)."""
        save(self, path)

    # -- the document -------------------------------------------------------------------------
    def _document(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The JSON document and the tensors of the safetensors section."""
        roles: dict[Node, tuple[str, str]] = {}
        for n in self.graph.nodes:
            if n.is_input:
                role = "weight" if n.is_weight else \
                    ("derived" if n in self.derived_inputs else "user")
                roles[n] = (role, self.names[n])
            elif n.op == "constant":
                roles[n] = ("weight", self.names[n])
        graph_doc, custom = _encode_graph(self.graph, roles)
        tensors, weights_doc = _pack_weights(self.weights, self.weight_kinds)
        device = self.device
        symbols = {}
        for sym, rng in self.symbols.items():
            symbols[str(sym)] = {"min": rng.min, "max": rng.max, "hint": rng.hint,
                                 "positive": bool(getattr(sym, "is_positive", False))}
        for n in self.graph.nodes:  # every symbol the node list uses needs an entry
            metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
            exprs = [n.annotations.get("expr")]
            for m in metas:
                if isinstance(m, TensorMeta):
                    exprs.extend((*m.shape, *m.stride, m.storage_offset))
            if n.is_input and n.is_scalar and exprs[0] is None:
                raise ReplayError(f"input %{n.id}: a scalar input that is not a symbolic size "
                                  f"cannot be saved")
            for e in exprs:
                for s in getattr(e, "free_symbols", ()):
                    if symbols.get(str(s), {}).get("hint") is None:
                        raise ReplayError(f"the symbolic size {s} has no sample value (node "
                                          f"%{n.id}): call the plan once before saving it")
        doc = {
            "format": "fxbackend-plan",
            "format_version": FORMAT_VERSION,
            "producer": {"fxbackend": _version(), "torch": torch.__version__,
                         "source": self.source},
            "device": str(device),
            "symbols": symbols,
            "graph": graph_doc,
            "user_inputs": [n.id for n in self.user_inputs],
            "weights": weights_doc,
            "custom_ops": custom,
            "in_tree": self.in_tree,
            "out_tree": self.out_tree,
        }
        return doc, tensors


def _own_copy(t: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    """``t`` copied into new memory on ``m``'s device with ``m``'s (dense) strides.

    safetensors hands out tensors that are views into read-only bytes objects, whose data is
    aligned to as little as the element size.  Kept as they are, a loaded plan's weights would
    be read at other alignments than the saved plan's, and results can depend on that: torch's
    CPU GEMM gives other bits for an operand aligned to less than 16 bytes (a linear's input at
    4 or 8 bytes, measured); and ``update_weights`` would write into the bytes objects."""
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device).copy_(t)


def _version() -> str:
    from . import __version__
    return __version__


def _pack_weights(weights: dict[str, torch.Tensor], kinds: dict[str, str]
                  ) -> tuple[dict[str, torch.Tensor], dict]:
    """The safetensors dict (each tensor once: tied weights share one entry) and the
    ``weights`` table of the document."""
    tensors: dict[str, torch.Tensor] = {}
    table: dict[str, dict] = {}
    same: dict[tuple, str] = {}
    storages: dict[int, list[str]] = {}
    for name, t in weights.items():
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        entry = {"kind": kinds.get(name, "parameter")}
        if key in same and t.numel():
            entry["tensor"] = same[key]
        else:
            same[key] = name
            data = t.detach().to("cpu")
            storages.setdefault(data.untyped_storage().data_ptr(), []).append(name)
            tensors[name] = data.contiguous()
            entry["tensor"] = name
        table[name] = entry
    for names in storages.values():  # safetensors refuses tensors that share memory
        if len(names) > 1:
            for name in names:
                tensors[name] = tensors[name].clone()
    return tensors, table


# -- input and output trees ------------------------------------------------------------------------

def _bind_tree(tree: Any, value: Any, path: str, out: list) -> None:
    """Match a call's arguments against the saved input tree, filling ``out`` (flat user
    inputs).  A constant leaf takes its exported value; a different one is an error."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ReplayError(f"malformed input tree at {path}")
    (tag, v), = tree.items()
    if tag == "input":
        if value is not _MISSING:
            out[v] = value
        return
    if tag == "const":
        if value is not _MISSING and not _same_constant(value, v):
            raise ReplayError(f"{path}: the plan was exported with {v!r} here, got {value!r}")
        return
    if tag in ("tuple", "list"):
        if value is _MISSING:
            items = [_MISSING] * len(v)
        elif isinstance(value, (tuple, list)):
            if len(value) != len(v):
                raise ReplayError(f"{path}: expected {len(v)} items, got {len(value)}")
            items = list(value)
        else:
            raise ReplayError(f"{path}: expected a {tag}, got {type(value).__name__}")
        for i, (t, x) in enumerate(zip(v, items)):
            _bind_tree(t, x, f"{path}[{i}]", out)
        return
    if tag == "dict":
        if value is _MISSING:
            value = {}
        if not isinstance(value, Mapping):
            raise ReplayError(f"{path}: expected a dict, got {type(value).__name__}")
        keys = [k for k, _ in v]
        extra = [k for k in value if k not in keys]
        if extra:
            raise ReplayError(f"{path}: unexpected key(s) {extra}; expected {keys}")
        for k, t in v:
            _bind_tree(t, value.get(k, _MISSING), f"{path}[{k!r}]", out)
        return
    raise ReplayError(f"malformed input tree at {path}")


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b) or (a is None and b is None)
    except Exception:  # an exotic value: not the exported one
        return False


def _build_tree(tree: Any, outs: list) -> Any:
    (tag, v), = tree.items()
    if tag == "output":
        return outs[v]
    if tag == "const":
        return v
    if tag == "tuple":
        return tuple(_build_tree(t, outs) for t in v)
    if tag == "list":
        return [_build_tree(t, outs) for t in v]
    return {k: _build_tree(t, outs) for k, t in v}


def _check_tree(r: _Reader, tree: Any, leaf_tag: str, n_leaves: int, where: str,
                depth: int = 0) -> set:
    """Validate a tree read from a file; returns the leaf indices it uses."""
    if depth > _MAX_DEPTH:
        raise r.fail(where, "tree nested too deeply")
    d = r.dict_(tree, where)
    if len(d) != 1:
        raise r.fail(where, f"malformed tree node {_short(d)}")
    (tag, v), = d.items()
    if tag == leaf_tag:
        return {r.int_(v, where, 0, n_leaves - 1)}
    if tag == "const":
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise r.fail(where, f"constant leaves are plain values, got {_short(v)}")
        return set()
    used: set = set()
    if tag in ("tuple", "list"):
        for x in r.list_(v, where):
            used |= _check_tree(r, x, leaf_tag, n_leaves, where, depth + 1)
        return used
    if tag == "dict":
        for item in r.list_(v, where):
            item = r.list_(item, where)
            if len(item) != 2 or not isinstance(item[0], str):
                raise r.fail(where, f"malformed dict entry {_short(item)}")
            used |= _check_tree(r, item[1], leaf_tag, n_leaves, where, depth + 1)
        return used
    raise r.fail(where, f"unknown tree node {tag!r}")


# -- files -----------------------------------------------------------------------------------------

def save(plan: ExportedPlan | CompiledGraph, path: str | os.PathLike, *,
         model: torch.nn.Module | None = None,
         weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``plan`` to ``path`` as one file (docs/FORMAT.md).

    ``plan`` is an :class:`ExportedPlan`, or a :class:`CompiledGraph` from ``torch.compile``
    (then ``model`` or ``weights`` name its weights, as in :func:`from_compiled`).  Everything is
    checked before anything is written (a custom op without ``serialize``/``deserialize`` is a
    :class:`ReplayError` naming it, and ``path`` is left untouched); the file is written under a
    temporary name and renamed into place.
    """
    import safetensors.torch
    if isinstance(plan, (CompiledGraph, Graph)):
        from .exporter import from_compiled
        plan = from_compiled(plan, model=model, weights=weights)
    if not isinstance(plan, ExportedPlan):
        raise TypeError(f"save takes an ExportedPlan or a CompiledGraph, got "
                        f"{type(plan).__name__}")
    doc, tensors = plan._document()
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ReplayError(f"cannot save: the plan holds a value JSON cannot (custom op "
                          f"attributes?): {e}") from None
    blob = safetensors.torch.save(tensors, metadata={"format": "fxbackend-plan-weights"})
    write_sections(path, doc, blob)


def write_sections(path: str | os.PathLike, doc: dict, weights: bytes,
                   version: int = FORMAT_VERSION) -> None:
    """Write a plan file from its JSON document and safetensors bytes (the header and its
    CRC-32 are computed here).  :func:`save` is the way to write a plan; this is for tools
    (and tests) that rewrite files.  Written under a temporary name and renamed into place."""
    body = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")
    header = _HEADER.pack(MAGIC, version, zlib.crc32(body), len(body), len(weights))
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(body)
            f.write(weights)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_sections(path: str | os.PathLike) -> tuple[int, dict, bytes]:
    """``(format version, JSON document, safetensors bytes)`` of a plan file, with the header,
    the sizes and the CRC-32 checked but the document not validated (tools and tests; raises
    :class:`ReplayError`)."""
    version, doc, blob, _ = _read(path)
    return version, doc, blob


def _read(path: str | os.PathLike) -> tuple[int, dict, bytes, int]:
    """``(format version, document, weights bytes, file size)``; every failure a ReplayError."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise ReplayError(f"{path}: truncated: {len(head)} bytes, shorter than the "
                                  f"{_HEADER.size}-byte header")
            magic, version, crc, n_json, n_weights = _HEADER.unpack(head)
            if magic != MAGIC:
                raise ReplayError(f"{path}: not an fxbackend plan file (magic {magic!r}, "
                                  f"expected {MAGIC!r})")
            if version > FORMAT_VERSION:
                raise ReplayError(f"{path}: format version {version} is newer than this "
                                  f"fxbackend reads (versions {OLDEST_FORMAT_VERSION} to "
                                  f"{FORMAT_VERSION}); upgrade fxbackend")
            if version < OLDEST_FORMAT_VERSION:
                raise ReplayError(f"{path}: format version {version} is not a version this "
                                  f"fxbackend reads ({OLDEST_FORMAT_VERSION} to "
                                  f"{FORMAT_VERSION})")
            size = os.fstat(f.fileno()).st_size
            expected = _HEADER.size + n_json + n_weights
            if size != expected:
                raise ReplayError(f"{path}: {'truncated' if size < expected else 'trailing data'}"
                                  f": the header says {expected} bytes, the file has {size}")
            body = f.read(n_json)
            blob = f.read(n_weights)
    except OSError as e:
        raise ReplayError(f"{path}: cannot read: {e}") from None
    if zlib.crc32(body) != crc:
        raise ReplayError(f"{path}: the graph section is corrupted (CRC-32 mismatch)")
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ReplayError(f"{path}: the graph section is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ReplayError(f"{path}: the graph section is not a JSON object")
    if doc.get("format") != "fxbackend-plan" or doc.get("format_version") != version:
        raise ReplayError(f"{path}: the graph section says format {_short(doc.get('format'))} "
                          f"version {_short(doc.get('format_version'))}, the header version "
                          f"{version}")
    return version, _upgrade(doc, version), blob, size


def _upgrade(doc: dict, version: int) -> dict:
    """The document in the current version's shape.  Each format version adds one step here
    (version N -> N+1) and keeps its golden files in tests/golden/."""
    return doc


def load(path: str | os.PathLike, device: str | torch.device | None = None,
         options: dict | None = None, check: bool = True) -> ExportedPlan:
    """Read a plan written by :func:`save` (any format version from
    :data:`OLDEST_FORMAT_VERSION` on) and rebuild it for ``device`` (default: the device it was
    saved from) with backend ``options``.  Kernel selection, rewrites, fusion and memory
    planning run again there, when the plan is first called.  Raises :class:`ReplayError` for
    anything wrong with the file; nothing in the file is executed (see the module docstring).

    ``check`` recomputes every node's metadata on the meta device and compares it with the
    file's (the first time in a process, PyTorch imports its ``torch._dynamo`` module for its
    meta kernels: about a second; no compile runs).  ``check=False`` skips that for files you
    trust: a file whose metadata lies can then fail inside a kernel instead of at load."""
    from .extensions import load_extensions
    load_extensions()
    version, doc, blob, _ = _read(path)
    try:
        return _build(doc, blob, device, options, check)
    except ReplayError as e:
        raise ReplayError(f"{os.fspath(path)}: {e}") from None
    except RecursionError:
        raise ReplayError(f"{os.fspath(path)}: structures nested too deeply") from None
    except Exception as e:  # a check this loader lacks: still the project's error, named
        raise ReplayError(f"{os.fspath(path)}: malformed plan: {type(e).__name__}: {e}") from e


def _reader_for(doc: dict, device: Any) -> _Reader:
    saved = _Reader(None, None).device_(doc.get("device"), "device")
    target = torch.device(device) if device is not None else None
    r = _Reader(target, saved)
    symbols = r.dict_(doc.get("symbols", {}), "symbols")
    for name, spec in symbols.items():
        if not re.match(r"^[a-z][a-z0-9_]{0,31}$", name):
            raise r.fail("symbols", f"malformed symbol name {_short(name)}")
        spec = r.dict_(spec, f"symbols.{name}")
        positive = spec.get("positive", True)
        if not isinstance(positive, bool):
            raise r.fail(f"symbols.{name}", "positive must be a bool")
        r.symbols[name] = _make_symbol(name, positive)
    return r


def _symbol_ranges(r: _Reader, doc: dict) -> dict:
    out = {}
    for name, spec in doc.get("symbols", {}).items():
        where = f"symbols.{name}"
        lo = r.int_(spec.get("min", 0), f"{where}.min", 0)
        hi = spec.get("max")
        hi = None if hi is None else r.int_(hi, f"{where}.max", lo)
        hint = r.int_(spec.get("hint"), f"{where}.hint", lo, _MAX_INT if hi is None else hi)
        out[r.symbols[name]] = SymbolRange(lo, hi, hint)
    return out


def _build(doc: dict, blob: bytes, device: Any, options: dict | None, check: bool
           ) -> ExportedPlan:
    import safetensors.torch
    r = _reader_for(doc, device)
    symbols = _symbol_ranges(r, doc)
    custom_ops = r.dict_(doc.get("custom_ops", {}), "custom_ops")
    for k, v in custom_ops.items():
        r.dict_(v, f"custom_ops.{k}")
    graph = _decode_graph(r, r.dict_(doc.get("graph"), "graph"), custom_ops)
    if not any(isinstance(n.meta, TensorMeta) for n in graph.nodes):
        raise ReplayError("the node list has no tensor")
    # weights
    try:
        stored = safetensors.torch.load(blob)
    except Exception as e:  # safetensors' own errors name the problem
        raise ReplayError(f"the weights section is not valid safetensors: {e}") from None
    table = r.dict_(doc.get("weights", {}), "weights")
    weights: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    names: dict[Node, str] = {}
    moved: dict[str, torch.Tensor] = {}
    for n in graph.nodes:
        if not (n.is_weight or n.is_input):
            continue
        name = n.annotations["name"]
        names[n] = name
        if not n.is_weight:
            continue
        where = f"weight {name!r}"
        entry = table.get(name)
        if entry is None:
            raise ReplayError(f"{where} (node %{n.id}) is missing from the weights table")
        entry = r.dict_(entry, where)
        key = entry.get("tensor")
        kind = entry.get("kind", "parameter")
        if kind not in ("parameter", "buffer", "constant"):
            raise r.fail(where, f"unknown kind {_short(kind)}")
        if not isinstance(key, str) or key not in stored:
            raise ReplayError(f"{where}: its tensor {_short(key)} is missing from the weights "
                              f"section")
        t = moved[key] if key in moved else stored[key]
        m = n.meta
        if not isinstance(m, TensorMeta) or m.is_symbolic:
            raise r.fail(where, "a weight has static tensor metadata")
        if tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
            raise ReplayError(f"{where}: the file holds {t.dtype} {list(t.shape)}, the graph "
                              f"needs {m.dtype} {list(m.shape)}")
        if not is_dense(m.shape, m.stride) or m.storage_offset != 0:
            raise r.fail(where, f"weight strides {list(m.stride)} (offset {m.storage_offset}) "
                                f"are not a dense layout of shape {list(m.shape)}")
        if key not in moved:
            # the plan's own memory: safetensors' tensors are views into read-only bytes, at
            # any alignment (_own_copy)
            moved[key] = _own_copy(t, m)
            stored[key] = None  # its bytes can go
        have = moved[key]
        if any(sz > 1 and a != b for sz, a, b in zip(m.shape, have.stride(), m.stride)):
            raise r.fail(where, f"strides {list(m.stride)} differ from those of the tensor it "
                                f"shares ({list(have.stride())})")
        if name in weights and weights[name] is not moved[key]:
            raise ReplayError(f"{where}: two graph inputs use this name with different tensors")
        weights[name] = moved[key]
        kinds[name] = kind
    # the calling convention
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
        used = _check_tree(r, in_tree, "input", len(user_inputs), "in_tree")
        if used != set(range(len(user_inputs))):
            raise r.fail("in_tree", "must use every user input")
        t = r.dict_(in_tree, "in_tree")
        if set(t) != {"tuple"} or len(t["tuple"]) != 2 \
                or set(r.dict_(t["tuple"][1], "in_tree")) != {"dict"}:
            raise r.fail("in_tree", "must be (positional arguments, keyword arguments)")
    if out_tree is not None:
        _check_tree(r, out_tree, "output", len(graph.outputs), "out_tree")
    # consistency with the ops themselves, on the meta device
    if check:
        hints = {s: rng.hint for s, rng in symbols.items() if rng.hint is not None}
        _check_metas(graph, hints)
    opts = parse_options(options)
    saved_type = r.saved_device.type
    if r.device is not None and r.device.type != saved_type:
        portable_attention(graph)
    producer = doc.get("producer") if isinstance(doc.get("producer"), dict) else {}
    source = producer.get("source") if isinstance(producer.get("source"), str) else "file"
    derived = [n for n in graph.inputs if n.annotations.get("role") == "derived"]
    plan = ExportedPlan(CompiledGraph(graph, opts, f"loaded{next(_IDS)}"), names=names,
                        weights=weights, weight_kinds=kinds, symbols=symbols, in_tree=in_tree,
                        out_tree=out_tree, source=source, user_inputs=user_inputs,
                        custom_modules={k: v.get("module") for k, v in custom_ops.items()})
    if [n.id for n in plan.derived_inputs] != [n.id for n in derived]:
        raise ReplayError("the derived inputs do not match sizes of the user inputs")
    return plan


# -- inspection ------------------------------------------------------------------------------------

def describe(path: str | os.PathLike, device: str | None = None, steps: bool = True) -> str:
    """A readable summary of a plan file: header, inputs, weights, symbols, custom ops, the node
    list, the ops it uses and, for a static graph (with ``steps``), the steps of a plan built
    on ``device`` (default: the saved device) with the kernel of each and the ops each fused
    step covers.  Reads no weights; unknown ops are listed, not fatal."""
    version, doc, blob, size = _read(path)
    lines = [f"fxbackend plan {os.fspath(path)}: format version {version}, {size} bytes "
             f"({size - len(blob) - _HEADER.size} bytes of graph JSON, {len(blob)} bytes of "
             f"weights)"]
    try:
        r = _reader_for(doc, device)
        producer = doc.get("producer") if isinstance(doc.get("producer"), dict) else {}
        lines.append(f"produced by fxbackend {producer.get('fxbackend')} with torch "
                     f"{producer.get('torch')}, from {producer.get('source')}, on "
                     f"{doc.get('device')}")
        custom = r.dict_(doc.get("custom_ops", {}), "custom_ops")
        graph = _decode_graph(r, r.dict_(doc.get("graph"), "graph"), custom, tolerant=True)
        symbols = _symbol_ranges(r, doc)
    except Exception as e:  # inspect reports what it can
        lines.append(f"cannot read the node list: {e}")
        return "\n".join(lines)
    lines.append("inputs:")
    for n in graph.inputs:
        role = n.annotations.get("role")
        if role != "weight":
            lines.append(f"  {n.annotations['name']} ({role}): {_fmt_meta(n.meta)}")
    weights = [n for n in graph.nodes if n.is_weight]
    nbytes = sum(n.meta.numel * n.meta.itemsize for n in weights
                 if isinstance(n.meta, TensorMeta) and not n.meta.is_symbolic)
    lines.append(f"weights: {len(weights)} ({nbytes / 2**20:.3f} MB)")
    for sym, rng in symbols.items():
        lines.append(f"symbol {sym}: [{rng.min}, {'inf' if rng.max is None else rng.max}]"
                     + (f", exported at {rng.hint}" if rng.hint is not None else ""))
    for op, info in custom.items():
        mod = info.get("module") if isinstance(info, dict) else None
        state = "registered" if _ops.get_op(op) is not None else "NOT registered here"
        lines.append(f"custom op {op}: from {mod} ({state})")
    lines.append("node list:")
    lines.append(graph.format())
    counts = Counter(n.op for n in graph.nodes if not n.is_input and n.op != "constant")
    lines.append("ops used:")
    for op, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        kind = "sym helper" if op in SYM_OPS or op == "getitem" else (
            "custom op" if _ops.get_op(op) is not None else
            ("ATen" if _torch_overload(op) is not None else "UNKNOWN"))
        lines.append(f"  {c:5d}  {op}  ({kind})")
    unresolved = [n for n in graph.nodes if n.params == {"...": "unresolved"}]
    if not steps:
        return "\n".join(lines)
    if unresolved:
        lines.append(f"no plan: {len(unresolved)} node(s) use ops unknown here "
                     f"({sorted({n.op for n in unresolved})})")
    elif graph.is_symbolic:
        lines.append("no plan: the graph has symbolic sizes (replay it with inputs to see one)")
    else:
        try:
            if r.device is not None and r.device.type != r.saved_device.type:
                portable_attention(graph)
            for n in graph.nodes:  # no weights are read: constants get placeholders
                if n.op == "constant":
                    n.annotations["value"] = torch.empty_strided(
                        n.meta.shape, n.meta.stride, dtype=n.meta.dtype, device=n.meta.device)
            plan = Plan(graph, parse_options(None), {n: n.meta for n in graph.nodes}, {},
                        "inspect")
        except Exception as e:  # a plan that cannot be built here: say why
            lines.append(f"no plan: building one failed: {type(e).__name__}: {e}")
            return "\n".join(lines)
        lines.append(f"plan on {plan._plan_device()} ({plan.memory.summary()}, workspace "
                     f"{plan.workspace_bytes} bytes); steps and the ops each uses:")
        k = 0
        for n in plan.graph.nodes:
            kernel = plan.kernels.get(n)
            if kernel is None:
                continue
            fused = n.annotations.get("fused")
            used = [m.op for m in fused] if fused else [n.op]
            lines.append(f"  step {k}: %{n.id} [{kernel.name}] uses {', '.join(used)}")
            k += 1
    return "\n".join(lines)
