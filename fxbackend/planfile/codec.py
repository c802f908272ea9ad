"""The JSON codec: plain values, symbolic sizes and tensor metadata (docs/FORMAT.md, "Values",
"Sizes", "Metadata").

Encoding raises :class:`ReplayError` for what the format cannot hold; decoding goes through a
:class:`Reader`, which checks every value read from a file (types, ranges, nesting) and names
the place in the file in its errors.  Nothing read is evaluated: a symbolic size is a JSON tree
of known sympy functions, never a string for sympy to parse.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..ir import Node, ScalarMeta, TensorMeta
from .errors import MAX_DEPTH, MAX_DIMS, MAX_EXPR_NODES, MAX_INT, ReplayError, short

__all__ = ["Reader", "enc_value", "enc_dim", "dec_dim", "make_symbol", "enc_meta", "dec_meta",
           "format_meta"]

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


def enc_value(v: Any, where: str) -> Any:
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
        return [enc_value(x, where) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [enc_value(x, where) for x in v]}
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


class Reader:
    """Decoding context: the nodes read so far, symbols, the device mapping, and the place in
    the file that error messages name."""

    def __init__(self, device: torch.device | None, saved_device: torch.device | None) -> None:
        self.nodes: dict[int, Node] = {}
        self.symbols: dict[str, Any] = {}
        self.device = device
        self.saved_device = saved_device

    def fail(self, where: str, what: str) -> ReplayError:
        return ReplayError(f"{where}: {what}")

    def int_(self, j: Any, where: str, lo: int = -MAX_INT, hi: int = MAX_INT) -> int:
        if isinstance(j, bool) or not isinstance(j, int):
            raise self.fail(where, f"expected an integer, got {short(j)}")
        if not lo <= j <= hi:
            raise self.fail(where, f"integer {j} out of range [{lo}, {hi}]")
        return j

    def _typed(self, j: Any, where: str, kind: type, name: str) -> Any:
        if not isinstance(j, kind):
            raise self.fail(where, f"expected {name}, got {short(j)}")
        return j

    def str_(self, j: Any, where: str) -> str:
        return self._typed(j, where, str, "a string")

    def list_(self, j: Any, where: str) -> list:
        return self._typed(j, where, list, "a list")

    def dict_(self, j: Any, where: str) -> dict:
        return self._typed(j, where, dict, "an object")

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
        if depth > MAX_DEPTH:
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
        raise self.fail(where, f"unknown value encoding {short(j)}")

    def dtype_(self, j: Any, where: str) -> torch.dtype:
        if not isinstance(j, str) or j not in _DTYPES:
            raise self.fail(where, f"unknown dtype {short(j)}")
        return _DTYPES[j]



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


def enc_dim(d: Any, where: str) -> Any:
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
    return {"f": name, "a": [enc_dim(a, where) for a in d.args]}


def make_symbol(name: str, positive: bool) -> Any:
    import sympy
    return sympy.Symbol(name, integer=True, positive=positive) if positive \
        else sympy.Symbol(name, integer=True)


def dec_dim(r: Reader, j: Any, where: str, budget: list | None = None, depth: int = 0) -> Any:
    import sympy
    if isinstance(j, int) and not isinstance(j, bool):
        return r.int_(j, where)
    budget = [MAX_EXPR_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise r.fail(where, "symbolic size too large")
    d = r.dict_(j, where)
    if set(d) == {"s"}:
        sym = r.symbols.get(d["s"]) if isinstance(d["s"], str) else None
        if sym is None:
            raise r.fail(where, f"unknown symbol {short(d['s'])} (not in 'symbols')")
        return sym
    if set(d) == {"q"}:
        pq = r.list_(d["q"], where)
        if len(pq) != 2:
            raise r.fail(where, f"malformed rational {short(d)}")
        p, q = r.int_(pq[0], where), r.int_(pq[1], where, 1)
        return sympy.Rational(p, q)
    if set(d) == {"f", "a"}:
        cls = _funcs().get(d["f"]) if isinstance(d["f"], str) else None
        if cls is None:
            raise r.fail(where, f"unknown size function {short(d['f'])}")
        args = [dec_dim(r, a, where, budget, depth + 1) for a in r.list_(d["a"], where)]
        if d["f"] in ("Pow", "PowByNatural"):
            if len(args) != 2 or not getattr(args[1], "is_Integer", isinstance(args[1], int)) \
                    or abs(int(args[1])) > 64:
                raise r.fail(where, "a power needs an integer exponent in [-64, 64]")
        try:
            value = cls(*args)
        except Exception as e:  # a wrong arity or argument kind for this function
            raise r.fail(where, f"bad arguments for {d['f']}: {e}") from None
        if getattr(value, "is_Integer", False) and abs(int(value)) > MAX_INT:
            raise r.fail(where, "symbolic size evaluates out of range")
        return value
    raise r.fail(where, f"malformed symbolic size {short(j)}")


# -- metadata --------------------------------------------------------------------------------------

def enc_meta(m: Any, where: str) -> Any:
    if m is None:
        return None
    if isinstance(m, ScalarMeta):
        return {"scalar": m.kind.__name__}
    if isinstance(m, tuple):
        return {"tuple": [enc_meta(x, where) for x in m]}
    if isinstance(m, TensorMeta):
        if m.dtype not in _DTYPE_NAMES:
            raise ReplayError(f"{where}: cannot save dtype {m.dtype}")
        return {"dtype": _DTYPE_NAMES[m.dtype], "shape": [enc_dim(s, where) for s in m.shape],
                "stride": [enc_dim(s, where) for s in m.stride],
                "offset": enc_dim(m.storage_offset, where), "device": str(m.device)}
    raise ReplayError(f"{where}: cannot save metadata {m!r}")


_SCALAR_KINDS = {"int": int, "float": float, "bool": bool}


def dec_meta(r: Reader, j: Any, where: str, depth: int = 0) -> Any:
    if j is None:
        return None
    d = r.dict_(j, where)
    if set(d) == {"scalar"}:
        if not isinstance(d["scalar"], str) or d["scalar"] not in _SCALAR_KINDS:
            raise r.fail(where, f"unknown scalar kind {short(d['scalar'])}")
        return ScalarMeta(_SCALAR_KINDS[d["scalar"]])
    if set(d) == {"tuple"}:
        if depth > 2:
            raise r.fail(where, "tuple metadata nested too deeply")
        return tuple(dec_meta(r, x, where, depth + 1) for x in r.list_(d["tuple"], where))
    if set(d) == {"dtype", "shape", "stride", "offset", "device"}:
        shape = r.list_(d["shape"], where)
        stride = r.list_(d["stride"], where)
        if len(shape) != len(stride) or len(shape) > MAX_DIMS:
            raise r.fail(where, f"shape {short(shape)} and strides {short(stride)} do not "
                                f"match")
        dims = [dec_dim(r, s, where) for s in shape]
        strides = [dec_dim(r, s, where) for s in stride]
        offset = dec_dim(r, d["offset"], where)
        for v in (*dims, *strides, offset):
            if type(v) is int and v < 0:
                raise r.fail(where, f"negative size, stride or offset {v}")
        return TensorMeta(tuple(dims), tuple(strides), r.dtype_(d["dtype"], where),
                          r.device_(d["device"], where), offset)
    raise r.fail(where, f"malformed metadata {short(j)}")



def format_meta(m: Any) -> str:
    if isinstance(m, tuple):
        return "(" + ", ".join(format_meta(x) for x in m) + ")"
    return "nothing" if m is None else m.short()

