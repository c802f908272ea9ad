"""What ``python -m fxbackend inspect`` prints: a plan file's header, inputs, weights, symbols,
custom ops, node list, the ops it uses and the steps a plan of it would run.

No plan is built (no arena, no code generation, no kernel compiled or prepared) and no weight
is read: the steps come from the file's node list with the registered rewrites, dead-node
elimination and the fusion rules applied to it, and each step's kernel from the kernel
registry's selection.  A plan's other graph passes are not run, so steps that a plan folds
into constants (``fold.fold_constants``) or elides as identity copies (``concat``) are listed.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from .. import ops as _ops
from .. import registry
from ..fusion import FusionReport, apply_fusions
from ..ir import Graph, Node, TensorMeta
from ..lower import SYM_OPS
from ..options import parse_options
from ..pipeline import eliminate_dead_nodes
from ..rewrite import RewriteContext, apply_rewrites
from .codec import format_meta
from .container import HEADER, read_file
from .document import reader_for, symbol_ranges
from .graphs import decode_graph
from .portable import portable_attention
from .resolve import torch_overload

__all__ = ["describe"]


def describe(path: str | os.PathLike, device: str | None = None, steps: bool = True) -> str:
    """A readable summary of a plan file: header, inputs, weights, symbols, custom ops, the node
    list, the ops it uses and, for a static graph (with ``steps``), the steps a plan on
    ``device`` (default: the saved device) would run, with the kernel of each and the ops each
    fused step covers.  Builds no plan and reads no weights; unknown ops are listed, not
    fatal."""
    version, doc, blob, size = read_file(path)
    lines = [f"fxbackend plan {os.fspath(path)}: format version {version}, {size} bytes "
             f"({size - len(blob) - HEADER.size} bytes of graph JSON, {len(blob)} bytes of "
             f"weights)"]
    try:
        r = reader_for(doc, device)
        producer = doc.get("producer") if isinstance(doc.get("producer"), dict) else {}
        lines.append(f"produced by fxbackend {producer.get('fxbackend')} with torch "
                     f"{producer.get('torch')}, from {producer.get('source')}, on "
                     f"{doc.get('device')}")
        custom = r.dict_(doc.get("custom_ops", {}), "custom_ops")
        graph = decode_graph(r, r.dict_(doc.get("graph"), "graph"), custom, tolerant=True)
        symbols = symbol_ranges(r, doc)
    except Exception as e:  # inspect reports what it can
        lines.append(f"cannot read the node list: {e}")
        return "\n".join(lines)
    lines += _contents(graph, symbols, custom)
    if steps:
        moved = r.device is not None and r.device.type != r.saved_device.type
        lines += _step_lines(graph, moved)
    return "\n".join(lines)


def _contents(graph: Graph, symbols: dict, custom: dict) -> list[str]:
    """Inputs, weights, symbols, custom ops, the node list and the ops used."""
    lines = ["inputs:"]
    for n in graph.inputs:
        role = n.annotations.get("role")
        if role != "weight":
            lines.append(f"  {n.annotations['name']} ({role}): {format_meta(n.meta)}")
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
            ("ATen" if torch_overload(op) is not None else "UNKNOWN"))
        lines.append(f"  {c:5d}  {op}  ({kind})")
    return lines


def _step_lines(graph: Graph, moved: bool) -> list[str]:
    """The steps of a static graph with their kernels, or why there are none (``moved``: the
    graph goes to another device type than it was saved from)."""
    unresolved = [n for n in graph.nodes if n.params == {"...": "unresolved"}]
    if unresolved:
        return [f"no plan: {len(unresolved)} node(s) use ops unknown here "
                f"({sorted({n.op for n in unresolved})})"]
    if graph.is_symbolic:
        return ["no plan: the graph has symbolic sizes (replay it with inputs to see one)"]
    try:
        if moved:
            portable_attention(graph)
        chosen = _select_steps(graph)
    except Exception as e:  # steps that cannot be chosen here: say why
        return [f"no plan: choosing the steps failed: {type(e).__name__}: {e}"]
    device = next((n.meta.device for n in graph.nodes if isinstance(n.meta, TensorMeta)),
                  torch.device("cpu"))
    lines = [f"steps on {device} (rewrites, fusions and kernels as chosen here; no plan is "
             f"built) and the ops each uses:"]
    for k, (n, kernel) in enumerate(chosen):
        fused = n.annotations.get("fused")
        used = [m.op for m in fused] if fused else [n.op]
        lines.append(f"  step {k}: %{n.id} [{kernel.name}] uses {', '.join(used)}")
    return lines


def _select_steps(graph: Graph) -> list[tuple[Node, Any]]:
    """``[(step, kernel)]`` of ``graph`` (changed in place) after the registered rewrites,
    dead-node elimination and the fusion rules, with default options: a fused step's rule, the
    native kernel for views and in-place writes, else the registry's choice for the step's
    device (the CPU's where that device has none)."""
    for n in graph.nodes:  # no weights are read: constants get placeholders
        if n.op == "constant":
            n.annotations["value"] = torch.empty_strided(
                n.meta.shape, n.meta.stride, dtype=n.meta.dtype, device=n.meta.device)
    options = parse_options(None)
    if apply_rewrites(graph, RewriteContext(options)):
        eliminate_dead_nodes(graph, options)  # replaced steps would split the runs rules match
    if options.fusion:
        apply_fusions(graph, _device_type, FusionReport())
    chosen = []
    for n in graph.nodes:
        if n.is_input or n.op in ("constant", "getitem") or n.op in SYM_OPS:
            continue
        if n.op.startswith("fused."):
            kernel = n.annotations["rule"]
        elif n.view_of is not None or n.inplace_of is not None or \
                (options.force_native and registry.NATIVE.supports(n)):
            kernel = registry.NATIVE
        else:
            try:
                kernel = registry.select_kernel(_device_type(n), n)
            except NotImplementedError:
                if _device_type(n) == "cpu":
                    raise
                kernel = registry.select_kernel("cpu", n)
        chosen.append((n, kernel))
    return chosen


def _device_type(n: Node) -> str:
    """The device type of a node's (first) tensor result, else of its first tensor source."""
    for m in (n.meta if isinstance(n.meta, tuple) else (n.meta,)):
        if isinstance(m, TensorMeta):
            return m.device.type
    for s in n.srcs:
        if isinstance(s.meta, TensorMeta):
            return s.meta.device.type
    return "cpu"
