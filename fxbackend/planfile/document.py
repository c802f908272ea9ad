"""Loading and saving: a plan's parts (:class:`PlanParts`) from a file's document and weights,
and a file from a plan's parts (docs/FORMAT.md, "The document", "Weights").

Contracts: :func:`decode_plan` executes nothing from the file and checks everything it reads
(every failure a :class:`ReplayError`); :func:`save_plan` checks everything first and writes
nothing when it fails, then writes under a temporary name and renames into place.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch

from ..concrete import node_symbols
from ..inputs import SymbolRange, is_dense
from ..ir import Graph, Node, TensorMeta
from .checks import check_convention, check_metas
from .codec import Reader, make_symbol
from .container import FORMAT_VERSION, write_sections
from .errors import MAX_INT, ReplayError, short
from .graphs import decode_graph, encode_graph
from .portable import portable_attention

__all__ = ["PlanParts", "decode_plan", "save_plan", "encode_plan", "reader_for",
           "symbol_ranges", "used_symbols"]


@dataclasses.dataclass
class PlanParts:
    """What a plan file holds: the lowered node list and how to call it.

    ``names`` names every input and constant node (weights by their state-dict name);
    ``weights`` maps those names to tensors, ``weight_kinds`` to ``parameter``, ``buffer`` or
    ``constant``; ``symbols`` gives each symbolic size its range and sample value;
    ``user_inputs`` are the inputs a caller passes, in call order; ``derived_inputs`` the scalar
    inputs computed from the user inputs' sizes; ``in_tree`` / ``out_tree`` the call's
    structure (None: flat); ``custom_modules`` the module each custom op came from."""

    graph: Graph
    names: dict[Node, str]
    weights: dict[str, torch.Tensor]
    weight_kinds: dict[str, str]
    symbols: dict[Any, SymbolRange]
    user_inputs: list[Node]
    derived_inputs: list[Node]
    in_tree: Any = None
    out_tree: Any = None
    source: str = "file"
    custom_modules: dict = dataclasses.field(default_factory=dict)


# -- loading ---------------------------------------------------------------------------------------

def reader_for(doc: dict, device: Any) -> Reader:
    """A reader for ``doc`` that maps the saved device type to ``device`` (None: keep it),
    with the document's symbols defined."""
    saved = Reader(None, None).device_(doc.get("device"), "device")
    target = torch.device(device) if device is not None else None
    r = Reader(target, saved)
    symbols = r.dict_(doc.get("symbols", {}), "symbols")
    for name, spec in symbols.items():
        if not re.match(r"^[a-z][a-z0-9_]{0,31}$", name):
            raise r.fail("symbols", f"malformed symbol name {short(name)}")
        spec = r.dict_(spec, f"symbols.{name}")
        positive = spec.get("positive", True)
        if not isinstance(positive, bool):
            raise r.fail(f"symbols.{name}", "positive must be a bool")
        r.symbols[name] = make_symbol(name, positive)
    return r


def symbol_ranges(r: Reader, doc: dict) -> dict:
    """``{symbol: SymbolRange}`` of the document's ``symbols`` table."""
    out = {}
    for name, spec in doc.get("symbols", {}).items():
        where = f"symbols.{name}"
        lo = r.int_(spec.get("min", 0), f"{where}.min", 0)
        hi = spec.get("max")
        hi = None if hi is None else r.int_(hi, f"{where}.max", lo)
        hint = r.int_(spec.get("hint"), f"{where}.hint", lo, MAX_INT if hi is None else hi)
        out[r.symbols[name]] = SymbolRange(lo, hi, hint)
    return out


def decode_plan(doc: dict, blob: bytes, device: Any, check: bool) -> PlanParts:
    """The parts of a plan from its document and safetensors bytes, for ``device`` (None: the
    saved device; on another device type, device-specific attention is made portable).
    ``check``: every node's metadata recomputed on the meta device and compared with the
    file's (:func:`.checks.check_metas`)."""
    r = reader_for(doc, device)
    symbols = symbol_ranges(r, doc)
    custom_ops = r.dict_(doc.get("custom_ops", {}), "custom_ops")
    for k, v in custom_ops.items():
        r.dict_(v, f"custom_ops.{k}")
    graph = decode_graph(r, r.dict_(doc.get("graph"), "graph"), custom_ops)
    if not any(isinstance(n.meta, TensorMeta) for n in graph.nodes):
        raise ReplayError("the node list has no tensor")
    names, weights, kinds = _decode_weights(r, doc, blob, graph)
    user_inputs, in_tree, out_tree = check_convention(r, doc, graph)
    if check:
        hints = {s: rng.hint for s, rng in symbols.items() if rng.hint is not None}
        check_metas(graph, hints)
    if r.device is not None and r.device.type != r.saved_device.type:
        portable_attention(graph)
    producer = doc.get("producer") if isinstance(doc.get("producer"), dict) else {}
    source = producer.get("source") if isinstance(producer.get("source"), str) else "file"
    derived = [n for n in graph.inputs if n.annotations.get("role") == "derived"]
    return PlanParts(graph, names, weights, kinds, symbols, user_inputs, derived, in_tree,
                     out_tree, source, {k: v.get("module") for k, v in custom_ops.items()})


def _decode_weights(r: Reader, doc: dict, blob: bytes, graph: Graph
                    ) -> tuple[dict[Node, str], dict[str, torch.Tensor], dict[str, str]]:
    """``(names of the input and constant nodes, weights by name, their kinds)``: each weight
    node's tensor from the safetensors bytes, checked against the node's metadata and copied
    into memory of the plan's own (tied weights share one copy)."""
    import safetensors.torch
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
            raise r.fail(where, f"unknown kind {short(kind)}")
        if not isinstance(key, str) or key not in stored:
            raise ReplayError(f"{where}: its tensor {short(key)} is missing from the weights "
                              f"section")
        t = moved[key] if key in moved else stored[key]
        _check_stored(r, where, t, n.meta)
        if key not in moved:
            moved[key] = _own_copy(t, n.meta)
            stored[key] = None  # its bytes can go
        have = moved[key]
        if any(sz > 1 and a != b for sz, a, b in zip(n.meta.shape, have.stride(), n.meta.stride)):
            raise r.fail(where, f"strides {list(n.meta.stride)} differ from those of the tensor "
                                f"it shares ({list(have.stride())})")
        if name in weights and weights[name] is not moved[key]:
            raise ReplayError(f"{where}: two graph inputs use this name with different tensors")
        weights[name] = moved[key]
        kinds[name] = kind
    return names, weights, kinds


def _own_copy(t: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    """``t`` copied into new memory on ``m``'s device with ``m``'s (dense) strides.

    safetensors hands out tensors that are views into read-only bytes objects, whose data is
    aligned to as little as the element size.  Kept as they are, a loaded plan's weights would
    be read at other alignments than the saved plan's, and results can depend on that: torch's
    CPU GEMM gives other bits for an operand aligned to less than 16 bytes (a linear's input at
    4 or 8 bytes, measured); and ``update_weights`` would write into the bytes objects."""
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device).copy_(t)


def _check_stored(r: Reader, where: str, t: torch.Tensor, m: Any) -> None:
    """A weight's tensor against its node's metadata: static, same sizes and dtype, dense."""
    if not isinstance(m, TensorMeta) or m.is_symbolic:
        raise r.fail(where, "a weight has static tensor metadata")
    if tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
        raise ReplayError(f"{where}: the file holds {t.dtype} {list(t.shape)}, the graph "
                          f"needs {m.dtype} {list(m.shape)}")
    if not is_dense(m.shape, m.stride) or m.storage_offset != 0:
        raise r.fail(where, f"weight strides {list(m.stride)} (offset {m.storage_offset}) "
                            f"are not a dense layout of shape {list(m.shape)}")


# -- saving ----------------------------------------------------------------------------------------

def save_plan(path: str | os.PathLike, parts: PlanParts, device: torch.device) -> None:
    """Write ``parts`` (a plan on ``device``) to ``path``: everything is checked before anything
    is written."""
    import safetensors.torch
    doc, tensors = encode_plan(parts, device)
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ReplayError(f"cannot save: the plan holds a value JSON cannot (custom op "
                          f"attributes?): {e}") from None
    blob = safetensors.torch.save(tensors, metadata={"format": "fxbackend-plan-weights"})
    write_sections(path, doc, blob)


def encode_plan(parts: PlanParts, device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON document and the tensors of the safetensors section."""
    roles: dict[Node, tuple[str, str]] = {}
    for n in parts.graph.nodes:
        if n.is_input:
            role = "weight" if n.is_weight else \
                ("derived" if n in parts.derived_inputs else "user")
            roles[n] = (role, parts.names[n])
        elif n.op == "constant":
            roles[n] = ("weight", parts.names[n])
    graph_doc, custom = encode_graph(parts.graph, roles)
    tensors, weights_doc = _pack_weights(parts.weights, parts.weight_kinds)
    doc = {
        "format": "fxbackend-plan",
        "format_version": FORMAT_VERSION,
        "producer": {"fxbackend": _version(), "torch": torch.__version__,
                     "source": parts.source},
        "device": str(device),
        "symbols": _encode_symbols(parts),
        "graph": graph_doc,
        "user_inputs": [n.id for n in parts.user_inputs],
        "weights": weights_doc,
        "custom_ops": custom,
        "in_tree": parts.in_tree,
        "out_tree": parts.out_tree,
    }
    return doc, tensors


def used_symbols(graph: Graph) -> dict[Any, Node]:
    """``{symbol: the first node using it}`` for every symbol in the node list's metadata (shapes,
    strides, offsets) and scalar nodes' expressions: the symbols a plan of ``graph`` needs."""
    used: dict[Any, Node] = {}
    for n in graph.nodes:
        for s in sorted(node_symbols(n), key=str):
            used.setdefault(s, n)
    return used


def _encode_symbols(parts: PlanParts) -> dict:
    """The ``symbols`` table: the symbols the node list uses, each with its range and sample
    value.  A symbol the plan knows but the node list does not use is left out: it constrains
    nothing and may have no sample value (``torch.export`` gives ranges to the sizes of the base
    of an example input that is a view), and the loader requires one.  A symbol the node list
    uses without a sample value, and a scalar input that is not a symbolic size, are a
    ReplayError."""
    for n in parts.graph.inputs:
        if n.is_scalar and n.annotations.get("expr") is None:
            raise ReplayError(f"input %{n.id}: a scalar input that is not a symbolic size "
                              f"cannot be saved")
    used = {str(s): n for s, n in used_symbols(parts.graph).items()}
    symbols = {str(s): {"min": r.min, "max": r.max, "hint": r.hint,
                        "positive": bool(getattr(s, "is_positive", False))}
               for s, r in parts.symbols.items() if str(s) in used}
    for name, n in used.items():
        if symbols.get(name, {}).get("hint") is None:
            raise ReplayError(f"the symbolic size {name} has no sample value (node %{n.id}): "
                              f"call the plan once before saving it")
    return symbols


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


def _version() -> str:
    from .._version import __version__  # not the package root, which imports this module
    return __version__
