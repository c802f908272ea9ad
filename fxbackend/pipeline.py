"""The pass pipeline: one straight list of named passes over the node list.

With ``FXB_DUMP=1`` (or ``options={"dump": True}``) the node list is printed after each pass.
Passes that need concrete shapes (kernel selection, memory planning) run per plan in
:class:`~fxbackend.executor.Plan`.
"""
from __future__ import annotations

import sys
from typing import Callable

from .ir import Graph, Node
from .options import Options

__all__ = ["run_pipeline", "PASSES", "eliminate_dead_nodes"]


def eliminate_dead_nodes(graph: Graph, options: Options) -> Graph:
    """Drop nodes whose value nobody reads (pure ops only: in-place writes stay)."""
    live: set[Node] = {o for o in graph.outputs if isinstance(o, Node)}
    from .ir import node_deps
    keep = []
    for n in reversed(graph.nodes):
        if n in live or n.is_input or n.inplace_of is not None or n.meta is None \
                or n.op.startswith("py."):
            keep.append(n)
            live.update(node_deps(n))
    graph.nodes = keep[::-1]
    return graph


PASSES: list[tuple[str, Callable[[Graph, Options], Graph]]] = [
    ("eliminate_dead_nodes", eliminate_dead_nodes),
]


def run_pipeline(graph: Graph, options: Options, name: str = "graph") -> Graph:
    """Run every pass in :data:`PASSES` in order."""
    if options.dump:
        print(f"[fxbackend] {name} after lower:\n{graph.format()}", file=sys.stderr)
    for pass_name, fn in PASSES:
        graph = fn(graph, options)
        if options.dump:
            print(f"[fxbackend] {name} after {pass_name}:\n{graph.format()}", file=sys.stderr)
    return graph
