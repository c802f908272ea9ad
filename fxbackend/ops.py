"""Custom ops: versioned names, attribute schemas, metadata inference, and the node builder.

An op is a class (or an instance of one; one instance per type, shared by every node).  It has
``name`` (``ns.name.vN``), ``attrs`` (attribute schema: ``{name: type}`` or
``{name: (type, default)}``; types are int, float, bool, str, or tuple of those) and
``infer_meta(srcs, attrs) -> TensorMeta`` (``srcs`` are the inputs' TensorMeta; reads metadata
only).  Optional capabilities, found by presence:

- ``execute(ctx, node, state, inputs, out, workspace)``: a reference implementation, used as the
  op's native kernel on any device (extension kernels registered for the op come first);
- ``compile(node)``: ahead-of-time work at plan time; may run in parallel across nodes, so any
  shared state must be thread-safe;
- ``serialize(node) -> dict`` / ``deserialize(data) -> attrs``: needed to save plans
  (:mod:`fxbackend.replay`).  ``serialize`` returns the node's attributes as plain JSON data (a
  dict with string keys; values None, bool, int, finite float, str, and lists/dicts of those);
  ``deserialize`` turns that data back into the attribute dict, which the loader then checks
  against ``attrs`` like :func:`op_create` does.  It gets data read from a file: it must only
  read it (raise on anything unexpected; never import, evaluate or unpickle).  An op's name is
  versioned: when its attributes change meaning, register a new version rather than reading
  old data differently.  Saving a plan with a custom op lacking either method fails before
  anything is written, naming the op;
- ``update_args(node, state, inputs)``: called before a step runs when one of its inputs'
  addresses differs from the previous call (kernels may have it too).

Contract of a custom node: explicit tensor inputs (``srcs``); attributes are small plain values
copied into the node (a tensor an op needs is a source, never an attribute); one contiguous,
out-of-place output of an existing dtype (``TensorMeta.contiguous(shape, dtype, device)`` builds
its metadata).
"""
from __future__ import annotations

import copy
import re
import threading
from typing import Any, Sequence

import torch

from .generation import bump as bump_generation
from .ir import Graph, Node, TensorMeta, _is_contiguous

__all__ = ["register_op", "unregister_op", "get_op", "op_create", "registered_ops",
           "can_serialize", "serialize_attrs", "deserialize_attrs"]

_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*\.v[0-9]+$")
_PLAIN = (bool, int, float, str, type(None))
_lock = threading.RLock()
_ops: dict[str, Any] = {}


def register_op(op: Any) -> Any:
    """Register a custom op (class or instance); returns the live instance.

    Raises ValueError for a malformed name or a name already registered (the live op stays in
    place), TypeError for a missing ``infer_meta`` or a malformed attribute schema.  A
    registration bumps the registry generation: plans built before it are rebuilt on their next
    call.
    """
    inst = op() if isinstance(op, type) else op
    name = getattr(inst, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"custom op name {name!r} must look like 'namespace.name.vN' "
                         f"(lower case, versioned), e.g. 'sd.rope_apply.v1'")
    if not callable(getattr(inst, "infer_meta", None)):
        raise TypeError(f"custom op {name}: needs an infer_meta(srcs, attrs) method")
    attrs = getattr(inst, "attrs", {})
    if not isinstance(attrs, dict):
        raise TypeError(f"custom op {name}: attrs must be a dict name -> type or (type, default)")
    for k, spec in attrs.items():
        typ = spec[0] if isinstance(spec, tuple) else spec
        if typ not in (int, float, bool, str, tuple):
            raise TypeError(f"custom op {name}: attribute {k!r} has type {typ!r}; attributes are "
                            f"int, float, bool, str or tuple (a tensor is a source)")
    with _lock:
        if name in _ops:
            raise ValueError(f"custom op {name} is already registered; register a new version "
                             f"(e.g. {name.rsplit('.v', 1)[0]}.v{int(name.rsplit('.v', 1)[1]) + 1})")
        _ops[name] = inst
        bump_generation()
    return inst


def unregister_op(name: str) -> None:
    """Remove a custom op (tests, plugin unloading); bumps the registry generation."""
    with _lock:
        del _ops[name]
        bump_generation()


def get_op(name: str) -> Any | None:
    """The registered op instance for ``name``, or None (ATen and internal ops)."""
    return _ops.get(name)


def registered_ops() -> list[str]:
    """Names of every registered custom op."""
    return sorted(_ops)


def _check_attr(opname: str, key: str, value: Any, typ: type) -> Any:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{opname}: attribute {key!r} is a tensor; a tensor an op needs is a "
                        f"source (pass it in srcs), never an attribute")
    if typ is tuple:
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, _PLAIN) for v in value):
            raise TypeError(f"{opname}: attribute {key!r} must be a tuple of plain values, "
                            f"got {value!r}")
        return tuple(value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise TypeError(f"{opname}: attribute {key!r} must be {typ.__name__}, got "
                        f"{type(value).__name__} {value!r}")
    return value


def normalize_attrs(op: Any, attrs: dict | None) -> dict:
    """Check ``attrs`` against the op's schema, fill defaults, and copy the values."""
    schema = getattr(op, "attrs", {})
    attrs = dict(attrs or {})
    unknown = sorted(set(attrs) - set(schema))
    if unknown:
        raise ValueError(f"{op.name}: unknown attribute(s) {unknown}; the op takes "
                         f"{sorted(schema) or 'no attributes'}")
    out = {}
    for key, spec in schema.items():
        typ, has_default, default = (spec[0], True, spec[1]) if isinstance(spec, tuple) \
            else (spec, False, None)
        if key in attrs:
            out[key] = _check_attr(op.name, key, attrs[key], typ)
        elif has_default:
            out[key] = copy.deepcopy(default)
        else:
            raise ValueError(f"{op.name}: missing attribute {key!r}")
    return out


def infer_node_meta(op: Any, srcs: Sequence[TensorMeta], attrs: dict) -> TensorMeta:
    """Run the op's ``infer_meta`` and check the output contract."""
    meta = op.infer_meta(list(srcs), dict(attrs))
    if not isinstance(meta, TensorMeta):
        raise TypeError(f"{op.name}.infer_meta must return a TensorMeta, got {meta!r}")
    if not isinstance(meta.dtype, torch.dtype):
        raise TypeError(f"{op.name}.infer_meta returned dtype {meta.dtype!r}; expected a "
                        f"torch.dtype")
    if (len(meta.stride) != len(meta.shape) or not _is_contiguous(meta.shape, meta.stride)
            or meta.storage_offset != 0):
        raise ValueError(f"{op.name}.infer_meta returned {meta.short()}: a custom op has one "
                         f"contiguous output (use contiguous strides, storage offset 0)")
    return meta


def op_create(graph: Graph, name: str, srcs: Sequence[Node], attrs: dict | None = None,
              after: Node | None = None) -> Node:
    """Create a custom-op node in ``graph``, placed right after ``after`` (default: at the end).

    ``srcs`` are the tensor inputs (nodes of ``graph``); ``attrs`` small plain values, checked
    against the op's schema and copied.  The node's metadata comes from the op's ``infer_meta``.
    """
    op = get_op(name)
    if op is None:
        raise KeyError(f"no custom op named {name!r} is registered (register_op first); "
                       f"registered: {registered_ops()}")
    srcs = list(srcs)
    for i, s in enumerate(srcs):
        if not isinstance(s, Node):
            raise TypeError(f"{name}: source {i} must be a node of the graph, got "
                            f"{type(s).__name__}")
        if not isinstance(s.meta, TensorMeta):
            raise TypeError(f"{name}: source {i} (%{s.id}) is not a tensor ({s.meta!r})")
    attrs = normalize_attrs(op, attrs)
    meta = infer_node_meta(op, [s.meta for s in srcs], attrs)
    node = graph.new_node(name, srcs, attrs, meta)
    if after is None:
        graph.append(node)
    else:
        graph.insert(graph.nodes.index(after) + 1, node)
    return node


# -- the serialize/deserialize capability (saved plans) -------------------------------------------

def can_serialize(op: Any) -> bool:
    """Whether ``op`` has both the ``serialize`` and the ``deserialize`` capability."""
    return callable(getattr(op, "serialize", None)) and callable(getattr(op, "deserialize", None))


def _check_json(value: Any, path: str, depth: int = 0) -> None:
    if depth > 32:
        raise ValueError(f"{path}: nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{path}: {value} is not a finite float")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path}: key {k!r} is not a string")
            _check_json(v, f"{path}[{k!r}]", depth + 1)
        return
    raise ValueError(f"{path}: {type(value).__name__} is not plain JSON data")


def serialize_attrs(op: Any, node: Node) -> dict:
    """``op.serialize(node)``, checked to be a dict of plain JSON data (ValueError if not)."""
    data = op.serialize(node)
    if not isinstance(data, dict):
        raise ValueError(f"{op.name}.serialize returned {type(data).__name__}, expected a dict")
    _check_json(data, f"{op.name}.serialize()")
    return data


def deserialize_attrs(op: Any, data: dict) -> dict:
    """``op.deserialize(data)``, checked against the op's attribute schema (filled defaults,
    copied values; ValueError/TypeError for anything that does not fit)."""
    attrs = op.deserialize(data)
    if not isinstance(attrs, dict):
        raise TypeError(f"{op.name}.deserialize returned {type(attrs).__name__}, expected a "
                        f"dict of attributes")
    return normalize_attrs(op, attrs)
