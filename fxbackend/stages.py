"""Graphs with data-dependent steps, planned and run in stages (:class:`Stages`).

A data-dependent step (:func:`fxbackend.concrete.data_dependent`: ``nonzero``,
``masked_select``, ``unique``, ...) has a result whose sizes depend on tensor values; a
:class:`~fxbackend.executor.Plan` is built from sizes before a call, so it cannot hold one.
A replayed plan (:class:`fxbackend.exported.ExportedPlan`) cuts its graph at them: stages
planned as any graph, and the data-dependent steps run natively (eager ATen) between them.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .executor import CompiledGraph, Plan
from .ir import Graph, Node, TensorMeta, node_deps
from .lower import SYM_OPS
from .native import call_args

__all__ = ["Stages", "native_value", "copy_node"]


class Stages:
    """A graph with data-dependent steps (:func:`fxbackend.concrete.data_dependent`:
    ``nonzero``, ``masked_select``, ...), planned and run in stages.

    A plan is built from sizes before a call, and these steps' result sizes depend on values;
    so the graph is cut at them.  Stage 0 holds the steps that read no data-dependent result,
    directly or through other steps; stage k + 1 those that read results of the data-dependent
    steps run after stage k (in-place writes keep their order with every other step).  Each
    stage is a :class:`CompiledGraph` of its own, planned per signature as any symbolic graph:
    a data-dependent size is a size of one of its inputs.  The data-dependent steps run
    natively between the stages, in graph order.  Size arithmetic and constants are computed
    in every stage that reads them; a tensor one stage computes and a later one reads is an
    output of the first and an input of the second.  ``run``, ``all_plans``, ``graph`` and
    ``options`` are those of a :class:`CompiledGraph`."""

    def __init__(self, graph: Graph, options: Any, name: str, steps: Sequence[Node]) -> None:
        self.graph, self.options, self.name = graph, options, name
        self.steps = list(steps)
        self._inputs = graph.inputs
        self._constants = [n for n in graph.nodes if n.op == "constant"]
        between = set(steps) | {n for n in graph.nodes
                                if n.op == "getitem" and n.srcs[0] in set(steps)}
        level = _stage_levels(graph, between)
        last = max(level.values(), default=0)
        members: list[list[Node]] = [[] for _ in range(last + 1)]
        self._after: list[list[Node]] = [[] for _ in range(last + 1)]
        for n in graph.nodes:
            if n in between:
                self._after[level[n]].append(n)
            elif not (n.is_input or n.is_scalar or n.op == "constant"):
                members[level[n]].append(n)
        order = {n: i for i, n in enumerate(graph.nodes)}
        reads = [sorted(_needs(_reads_of(m))[1] - set(m), key=order.__getitem__)
                 for m in members]
        wanted = set().union(*map(set, reads), _needs(_reads_of(between))[1],
                             _needs(o for o in graph.outputs if isinstance(o, Node))[1])
        self._stages: list[tuple[CompiledGraph, list[Node], list[Node]] | None] = []
        for k, (m, ins) in enumerate(zip(members, reads)):
            outs = [n for n in m if n in wanted]
            self._stages.append((CompiledGraph(_stage_graph(graph, m, ins, outs), options,
                                               f"{name}.stage{k}"), ins, outs) if m else None)

    def run(self, args: list) -> list:
        """The graph's outputs for its inputs ``args`` (checked by the caller)."""
        values = self._values(args)
        for stage, after in zip(self._stages, self._after):
            if stage is not None:
                cg, ins, outs = stage
                values.update(zip(outs, cg.run([values[n] for n in ins])))
            for n in after:
                native_value(n, values)
        return [native_value(o, values) if isinstance(o, Node) else o
                for o in self.graph.outputs]

    def data_sizes(self, args: list) -> dict:
        """``{symbol: int}`` of the data-dependent results' plain symbolic sizes for inputs
        ``args``: the steps they read run natively (not planned)."""
        need = _ancestors(self.steps)
        if any(n.inplace_of is not None for n in need):  # the caller's tensors stay unwritten
            args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        values = self._values(args)
        for n in self.graph.nodes:  # in graph order: each step's reads computed before it
            if n in need and not n.is_input:
                native_value(n, values)
        bind: dict = {}
        for n in self.steps:
            v = values[n]
            results = v if isinstance(v, (tuple, list)) else (v,)
            metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
            for m, t in zip(metas, results):
                if isinstance(m, TensorMeta) and isinstance(t, torch.Tensor):
                    for want, got in zip(m.shape, t.shape):
                        if getattr(want, "is_Symbol", False):
                            bind.setdefault(want, int(got))
        return bind

    def _values(self, args: list) -> dict:
        """node -> value at the start of a call: the inputs' and the constants'."""
        values = dict(zip(self._inputs, args))
        for n in self._constants:
            values[n] = n.annotations["value"]
        return values

    def all_plans(self) -> list[Plan]:
        return [p for stage in self._stages if stage is not None for p in stage[0].all_plans()]

    def summary(self) -> str:
        """One line: the data-dependent steps and the stages they run between."""
        steps = ", ".join(f"%{n.id} {n.op}" for n in self.steps)
        sizes = [str(len(st[0].graph.nodes)) if st else "0" for st in self._stages]
        return (f"{len(self.steps)} data-dependent step(s) run natively between "
                f"{len(self._stages)} stages (nodes per stage: {', '.join(sizes)}): {steps}")


def _ancestors(nodes: Sequence[Node]) -> set:
    """``nodes`` and every node they read, transitively."""
    seen: set = set()
    todo = list(nodes)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(_reads(d))
    return seen


def _reads(n: Node) -> list[Node]:
    """Every node ``n`` reads, or whose storage it views or writes."""
    return node_deps(n) + [x for x in (n.view_of, n.inplace_of) if x is not None]


def _stage_levels(graph: Graph, between: set) -> dict[Node, int]:
    """Each node's stage: how many steps run between stages (``between``: the data-dependent
    steps and their getitems, whose own level is the stage they run after) precede it along
    its reads.  An in-place write runs after every step before it (in a later stage than a
    data-dependent step before it, which runs after its own stage), and every step after it
    after the write."""
    level: dict[Node, int] = {}
    top = floor = 0  # the earliest stage after every step so far; the last write's stage
    for n in graph.nodes:
        k = 0
        for d in _reads(n):
            k = max(k, level[d] + (d in between and not (n in between and n.op == "getitem")))
        if n.inplace_of is not None:
            k = floor = max(k, top)
        level[n] = k = max(k, floor)
        top = max(top, k + (n in between))
    return level


def _needs(values: Any) -> tuple[set, set]:
    """``(computed, read)`` for the nodes ``values``: the size computations and constants among
    them or that those read, transitively (a stage computes them itself), and the other nodes
    (tensors, inputs) among them or that those computations read."""
    computed: set = set()
    read: set = set()
    todo = list(values)
    while todo:
        d = todo.pop()
        if d in computed or d in read:
            continue
        if d.op == "constant" or (d.is_scalar and not d.is_input):
            computed.add(d)
            todo.extend(_reads(d))
        else:
            read.add(d)
    return computed, read


def _reads_of(nodes: Any) -> list[Node]:
    return [d for n in nodes for d in _reads(n)]


def _stage_graph(graph: Graph, members: list[Node], inputs: list[Node],
                 outputs: list[Node]) -> Graph:
    """The graph of one stage: ``inputs`` as its input nodes (weights stay weights), the size
    arithmetic and constants ``members`` read, ``members``, returning ``outputs``."""
    g = Graph()
    g._next_id = graph._next_id
    new: dict[Node, Node] = {}
    for d in inputs:
        new[d] = g.append(Node(d.id, "input", meta=d.meta, is_input=True,
                               is_weight=d.is_weight, annotations=dict(d.annotations)))
    inside = set(members) | _needs(_reads_of(members))[0]
    for n in graph.nodes:
        if n in inside:
            new[n] = g.append(copy_node(n, new, is_output=n in outputs))
    g.outputs = [new[n] for n in outputs]
    return g


def copy_node(n: Node, new: Mapping[Node, Node], **changes: Any) -> Node:
    """A copy of ``n`` whose sources, params and storage links are the copies ``new`` of its
    nodes (metadata and target shared, annotations copied)."""
    def mp(v: Any) -> Any:
        if isinstance(v, Node):
            return new[v]
        if isinstance(v, (list, tuple)):
            return type(v)(mp(x) for x in v)
        if isinstance(v, dict):
            return {k: mp(x) for k, x in v.items()}
        return v

    fields = dict(view_of=new.get(n.view_of) if n.view_of is not None else None,
                  inplace_of=new.get(n.inplace_of) if n.inplace_of is not None else None,
                  is_input=n.is_input, is_weight=n.is_weight, is_output=n.is_output,
                  target=n.target, tensor_layout=n.tensor_layout,
                  annotations=dict(n.annotations))
    fields.update(changes)
    return Node(n.id, n.op, [new[x] for x in n.srcs], {k: mp(v) for k, v in n.params.items()},
                n.meta, **fields)


def native_value(n: Node, values: dict) -> Any:
    """``n``'s value, computed natively (eager ATen) from ``values`` (node -> value, for the
    nodes computed so far; the values it computes are added)."""
    if n in values:
        return values[n]

    def leaf(v: Any) -> Any:
        if isinstance(v, Node):
            return native_value(v, values)
        if isinstance(v, (list, tuple)):
            return type(v)(leaf(x) for x in v)
        return v

    if n.op == "getitem":
        v = native_value(n.srcs[0], values)[n.params["index"]]
    elif n.op in SYM_OPS:
        v = SYM_OPS[n.op](*leaf(n.params["args"]))
    else:
        a, kw = call_args(n, leaf, leaf)
        v = n.target(*a, **kw)
    values[n] = v
    return v
