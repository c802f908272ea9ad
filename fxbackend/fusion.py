"""Fusion rules, the engine's legality check, and graph reordering (``graph_delay``).

A fusion rule is an object registered per device type with :func:`register_fusion`:

- ``name`` (str) and optional ``priority`` (int, higher tried first, default 0);
- ``match(graph, i) -> n``: claims nodes ``i..i+n-1`` (0: no match; ``(0, reason)``: the chain is
  recognised but declined, e.g. a layout or dtype its kernel lacks, and the reason goes into the
  fusion report).  It judges only whether the range is *worth* fusing and computable by its
  kernel; the engine judges whether it is *legal*;
- optional ``optimize(graph)``: runs before matching; may move producer ranges later with
  :func:`graph_delay` so that a chain becomes consecutive;
- ``execute(ctx, node, state, inputs, out, workspace)``: runs the fused range.  ``node`` is the
  fused node (``node.annotations["fused"]`` lists the original nodes), ``inputs`` the range's
  external inputs in order of first use, ``out`` the final node's storage (a terminal copy's
  destination);
- optional ``prepare(node) -> (state, workspace_bytes)`` and ``destroy(state)``, as for kernels.

The selection is frozen before memory planning: each claimed range becomes one node, its
intermediates get no storage, and its external inputs stay allocated through the final node.
Input/output overlap (the allocator reusing an input's storage for the output) is the rule's to
handle, with workspace scratch.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from typing import Any

import torch

from . import registry
from .ir import Graph, Node, TensorMeta, node_deps, storage_root

__all__ = ["register_fusion", "unregister_fusion", "fusions_for", "graph_delay", "check_claim",
           "replace_uses_from",
           "apply_fusions", "FusionReport"]

_lock = threading.RLock()
_rules: dict[str, list[Any]] = defaultdict(list)


def register_fusion(device: str, rule: Any) -> Any:
    """Register a fusion rule for device type ``device``; returns the rule.

    A fusion registration does not claim single-node support (``supports_op`` ignores it).
    """
    for attr in ("name", "match", "execute"):
        if not hasattr(rule, attr):
            raise TypeError(f"fusion rule {rule!r} has no {attr!r}; a rule needs name, "
                            f"match(graph, i) and execute(ctx, node, state, inputs, out, workspace)")
    with _lock:
        if any(r.name == rule.name for r in _rules[device]):
            raise ValueError(f"a fusion rule named {rule.name!r} is already registered on "
                             f"{device!r}")
        _rules[device].append(rule)
        _rules[device].sort(key=lambda r: -getattr(r, "priority", 0))
        registry._bump()
    return rule


def unregister_fusion(device: str, rule: Any) -> None:
    """Remove a rule registered with :func:`register_fusion`."""
    with _lock:
        _rules[device].remove(rule)
        registry._bump()


def fusions_for(device: str) -> list[Any]:
    """Rules registered for ``device``, highest priority first."""
    return list(_rules.get(device, ()))


@dataclasses.dataclass
class FusionReport:
    """What fusion did to one plan: ranges fired and claims declined, with the reason."""

    fired: list = dataclasses.field(default_factory=list)     # (rule name, [node ids])
    declined: list = dataclasses.field(default_factory=list)  # (rule name, [node ids], reason)
    disabled: str | None = None

    def format(self) -> str:
        lines = []
        if self.disabled:
            lines.append(f"fusion disabled: {self.disabled}")
        for name, ids in self.fired:
            lines.append(f"fused {name}: " + ", ".join(f"%{i}" for i in ids))
        for name, ids, why in self.declined:
            lines.append(f"declined {name} on " + ", ".join(f"%{i}" for i in ids) + f": {why}")
        return "\n".join(lines) if lines else "no fusion rule matched"


def _is_compute(n: Node) -> bool:
    return not (n.is_input or n.op == "constant" or n.is_scalar or n.op.startswith("py.")
                or n.meta is None)


def check_claim(graph: Graph, i: int, n: int, users: dict | None = None) -> str | None:
    """Why claiming nodes ``i..i+n-1`` of ``graph`` would be illegal, or None when it is legal:
    the engine's own check of a rule's claim (intermediates read only inside, not outputs,
    views and in-place writes owned inside, one device).  Public so that a rule can choose
    between a longer and a shorter claim before answering ``match``; ``users`` is
    ``graph.users()`` when the caller has it (computed otherwise)."""
    nodes = graph.nodes[i:i + n]
    if n < 1 or len(nodes) != n:
        return f"claims {n} nodes from %{graph.nodes[i].id}, past the end of the graph"
    inside = set(nodes)
    users = users if users is not None else graph.users()
    outputs = {o for o in graph.outputs if isinstance(o, Node)}
    devices = {m.device for x in nodes for m in (x.meta if isinstance(x.meta, tuple) else (x.meta,))
               if isinstance(m, TensorMeta)}
    if len(devices) > 1:
        return f"spans devices {sorted(map(str, devices))}"
    last = nodes[-1]
    for x in nodes:
        if not _is_compute(x):
            return f"%{x.id} ({x.op}) is not a compute node"
    for x in nodes[:-1]:
        outside = [u for u in users.get(x, ()) if u not in inside]
        if outside:
            return (f"intermediate %{x.id} ({x.op}) is read by %{outside[0].id} outside the "
                    f"match")
        if x in outputs:
            return f"intermediate %{x.id} ({x.op}) is a graph output"
    pos = {x: k for k, x in enumerate(nodes)}
    for x in nodes:
        owner, _ = storage_root(x)
        if x is not last and (x.view_of is not None or x.op == "getitem") and owner not in inside:
            return f"view %{x.id} ({x.op}) aliases storage of %{owner.id} outside the match"
        if x is not last and x.inplace_of is not None and (owner not in inside
                                                           or pos[owner] >= pos[x]):
            return (f"in-place %{x.id} ({x.op}) writes storage of %{owner.id}, which is not an "
                    f"earlier node of the match")
    if not isinstance(last.meta, TensorMeta):
        return f"final node %{last.id} ({last.op}) does not have one tensor output"
    owner, _ = storage_root(last)
    if owner is not last:
        if last.op == "aten.copy_.default" and last.inplace_of is not None:
            if owner in inside:
                return (f"terminal copy %{last.id} writes storage of %{owner.id} inside the "
                        f"match")
        else:
            return f"final node %{last.id} ({last.op}) does not own its storage"
    return None


def _roots(nodes) -> set:
    return {storage_root(x)[0] for x in nodes if isinstance(x, Node)}


def _side_effects_unknown(m: Node) -> bool:
    if m.op.startswith("py."):
        return True
    schema = getattr(m.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    # known: exactly one written argument, recorded as inplace_of
    return m.inplace_of is None or len(written) != 1


def graph_delay(graph: Graph, start: int, end: int, after: int | Node) -> bool:
    """Move the producer range ``start..end-1`` to just after node ``after``.

    Refuses (returns False, graph unchanged) when a node in between reads the range, has unknown
    side effects, or writes storage that aliases the range's inputs or outputs (or the range
    writes storage a node in between uses).  Independent copies, in-place ops that alias
    nothing of the range, and owning dtype conversions may be crossed.  Edges and metadata are
    kept; fusion legality is checked after reordering, at matching.
    """
    a = graph.nodes.index(after) if isinstance(after, Node) else int(after)
    if not (0 <= start < end <= len(graph.nodes)) or a >= len(graph.nodes):
        return False
    if a < end:
        # already right after ``after`` (or ``after`` is the range's own last node): nothing to do
        return a == end - 1 or a == start - 1
    moving = graph.nodes[start:end]
    between = graph.nodes[end:a + 1]
    inside = set(moving)
    if any(x.is_input for x in moving):
        return False
    range_reads = _roots(d for x in moving for d in node_deps(x))
    range_writes = _roots(x for x in moving if x.inplace_of is not None)
    range_owns = _roots(moving)
    for m in between:
        if any(d in inside for d in node_deps(m)):
            return False
        if _side_effects_unknown(m):
            return False
        if m.inplace_of is not None:
            written = storage_root(m)[0]
            if written in range_reads or written in range_owns or written in range_writes:
                return False
        if range_writes and (_roots(node_deps(m)) & range_writes or storage_root(m)[0]
                             in range_writes):
            return False
    graph.nodes[start:a + 1] = between + moving
    return True


def replace_uses_from(graph: Graph, old: Node, new: Node, from_index: int) -> None:
    """Make the nodes from ``graph.nodes[from_index]`` on, and the graph outputs, read
    ``new`` where they read ``old`` (sources, params, the view/in-place links).  The one
    implementation: ``rewrite.replace_uses`` is this from just after ``new``, moving the
    output flag too."""
    def has(v) -> bool:
        return v is old or (isinstance(v, (list, tuple)) and any(has(x) for x in v))

    def sub(v):
        if v is old:
            return new
        if isinstance(v, list):
            return [sub(x) for x in v]
        if isinstance(v, tuple):
            return tuple(sub(x) for x in v)
        return v
    for x in graph.nodes[from_index:]:
        if any(s is old for s in x.srcs):
            x.srcs = [new if s is old else s for s in x.srcs]
        for k, v in x.params.items():
            if has(v):  # a param is rebuilt only where it holds old
                x.params[k] = sub(v)
        if x.view_of is old:
            x.view_of = new
        if x.inplace_of is old:
            x.inplace_of = new
    graph.outputs = [new if o is old else o for o in graph.outputs]


def _update_users(users: dict, nodes: list, fused: Node) -> None:
    """``users`` (``graph.users()``) after ``nodes`` became ``fused``, whose sources are the
    values the nodes read from outside and whose readers are the last node's: the same map as
    recomputing it, without a pass over the graph per fusion."""
    inside = set(nodes)
    ext = set(node_deps(fused))
    for d in {d for x in nodes for d in node_deps(x) if d not in inside}:
        old, new, placed = users.get(d, []), [], False
        for u in old:  # graph order: the nodes were consecutive, fused takes their place
            if u not in inside:
                new.append(u)
            elif d in ext and not placed:
                new.append(fused)
                placed = True
        users[d] = new
    readers = users.get(nodes[-1], [])
    for x in nodes:
        users.pop(x, None)
    users[fused] = [u for u in readers if u not in inside]


def _match_result(rule: Any, result: Any) -> tuple[int, str | None]:
    """``match`` returns n (0: no match) or ``(0, reason)``: a chain the rule recognised but
    declines (layout, dtype, no kernel for it), reported in the fusion report."""
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], str) or int(result[0]) != 0:
            raise TypeError(f"fusion rule {rule.name!r}: match returned {result!r}; expected "
                            f"an int, or (0, reason) to decline a recognised chain")
        return 0, result[1]
    return int(result or 0), None


def apply_fusions(graph: Graph, device_of, report: FusionReport) -> Graph:
    """Run every rule's ``optimize``, then match left to right; legal claims become fused nodes.

    ``device_of(node)`` gives the device type whose rules apply to a node.
    """
    devices = {device_of(x) for x in graph.nodes if _is_compute(x)}
    for dev in sorted(devices):
        for rule in fusions_for(dev):
            opt = getattr(rule, "optimize", None)
            if opt is not None:
                opt(graph)
    users = graph.users()
    i = 0
    while i < len(graph.nodes):
        node = graph.nodes[i]
        claimed = 0
        if _is_compute(node):
            for rule in fusions_for(device_of(node)):
                n, why_not = _match_result(rule, rule.match(graph, i))
                if n <= 0:
                    if why_not:
                        report.declined.append((rule.name, [node.id], why_not))
                    continue
                ids = [x.id for x in graph.nodes[i:i + n]]
                why = check_claim(graph, i, n, users)
                if why is None and any(device_of(x) != device_of(node)
                                       for x in graph.nodes[i:i + n]):
                    why = "spans devices"
                if why is not None:
                    report.declined.append((rule.name, ids, why))
                    continue
                nodes = graph.nodes[i:i + n]
                last = nodes[-1]
                inside = set(nodes)
                ext: list[Node] = []
                for x in nodes:
                    for s in x.srcs:
                        if s not in inside and s not in ext:
                            ext.append(s)
                fused = graph.new_node(f"fused.{rule.name}", ext, {}, last.meta,
                                       inplace_of=last.inplace_of, is_output=last.is_output)
                fused.annotations["fused"] = nodes
                fused.annotations["rule"] = rule
                graph.nodes[i:i + n] = [fused]
                replace_uses_from(graph, last, fused, i + 1)
                _update_users(users, nodes, fused)
                report.fired.append((rule.name, ids))
                claimed = 1
                break
        i += max(claimed, 1)
    return graph
