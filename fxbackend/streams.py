"""Concurrent branches: fork/join regions found by dataflow, run side by side.

A **region** is a run of consecutive steps ``graph.nodes[start:end]`` whose compute nodes fall
into two or more **branches** that never read each other's values: the branches only read what
was computed before ``start`` (the fork: everything before it is done), and the first step
after the region (the join) waits for all of them.  Typical cases: the image and text streams of
a Flux double block before joint attention; the Q, K and V projections with their norms; an MoE
layer's shared expert next to its routed experts.

Finding them (:func:`find_regions`) is one pass over the node list with a union-find of the
nodes since the last region boundary: a node joins the branch of everything it reads; a node
that reads two or more branches that each hold real work is a join and closes the region before
it.  Nodes that compute nothing (views, ``getitem``, plan-time values) attach to whichever
branch reads them.  A node that writes storage it does not own (in-place writes, terminal
copies), a Python-level op, or a step whose kernel says ``concurrent_safe = False`` is a barrier:
no region spans it.  Names play no part.

Running them.  The branch with the largest estimated cost stays on the main thread (on CUDA:
the main stream); the others run, in order, on one auxiliary thread (CUDA: one auxiliary
stream), with one fork and one join per region.  The plan makes it safe:

- memory: every buffer a region's steps write or read lives over the whole region
  (:func:`region_lifetimes`), so no two of them share arena storage while branches overlap;
- workspace: auxiliary branches use a second workspace tensor of their own;
- BLAS: a matmul on the auxiliary stream runs under that stream, so the framework uses that
  stream's handle and workspace (``services.cuda_blas()`` returns the current stream's).

When: ``options.streams`` True forces regions on (CPU: on the thread pool, which is how CI
tests the logic, the disjointness and byte-identical results without a GPU), False off; None
(default) decides per plan: on CUDA, regions whose branches are memory-bound (few rows per
matmul, see :func:`worth_it`); never on the CPU, where the intra-op thread pool already keeps
the cores busy.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .ir import Graph, Node, TensorMeta, node_deps

__all__ = ["Region", "find_regions", "region_lifetimes", "worth_it", "node_cost"]

#: ops whose cost is counted in multiply-adds rather than bytes
_MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
            "aten.convolution.default"}
#: ATen attention ops (cost: 4 * B * H * Lq * Lk * D)
_ATTENTION_PREFIX = "aten._scaled_dot_product"


#: how many steps past the best region end found so far :func:`find_regions` keeps looking
SCAN_WINDOW = 256


@dataclasses.dataclass
class Region:
    """Steps ``start..end-1`` of the node list, split into independent ``branches`` (node lists
    in graph order); ``main`` is the index of the branch that stays on the main thread/stream.
    ``free`` holds the region's nodes in no branch: they compute nothing and read only values
    from before the region, and run before the fork."""

    start: int
    end: int
    branches: list
    main: int
    costs: list
    free: list = dataclasses.field(default_factory=list)

    @property
    def aux(self) -> list:
        """The nodes of the auxiliary branches, in graph order."""
        out = [n for i, b in enumerate(self.branches) if i != self.main for n in b]
        return sorted(out, key=lambda n: n.annotations.get("_pos", 0))

    def describe(self) -> str:
        return (f"region steps {self.start}..{self.end - 1}: {len(self.branches)} branches "
                f"(sizes {[len(b) for b in self.branches]}, main {self.main})")


def _meta_bytes(m: Any) -> int:
    if isinstance(m, tuple):
        return sum(_meta_bytes(x) for x in m)
    if isinstance(m, TensorMeta) and not m.is_symbolic:
        return m.numel * m.itemsize
    return 0


def node_cost(n: Node, metas: Callable[[Node], Any]) -> float:
    """A rough time estimate of a step, in bytes-equivalents: bytes read and written, or for
    matmuls and attention the multiply-adds divided by 8 (a machine does about 8 float
    multiply-adds per byte it moves).  Views and metadata-only steps cost 0."""
    if n.view_of is not None or n.is_input or n.op in ("getitem", "constant"):
        return 0.0
    out = metas(n)
    if not isinstance(out, (TensorMeta, tuple)):
        return 0.0
    nbytes = _meta_bytes(out) + sum(_meta_bytes(metas(s)) for s in n.srcs)
    try:
        if n.op in ("aten.mm.default", "aten.addmm.default") and isinstance(out, TensorMeta):
            k = metas(n.srcs[-1]).shape[0]
            return max(nbytes, out.numel * k / 8)
        if n.op in ("aten.bmm.default", "aten.baddbmm.default") and isinstance(out, TensorMeta):
            k = metas(n.srcs[-1]).shape[-2]
            return max(nbytes, out.numel * k / 8)
        if n.op.startswith(_ATTENTION_PREFIX):
            q, k = metas(n.srcs[0]), metas(n.srcs[1])
            lq, d = q.shape[-2], q.shape[-1]
            rest = q.numel // (lq * d)
            return max(nbytes, 4 * rest * lq * k.shape[-2] * d / 8)
    except Exception:  # a cost estimate never fails a plan
        pass
    return float(nbytes)


def _is_barrier(n: Node, kernels: dict) -> bool:
    if n.inplace_of is not None or n.op.startswith("py."):
        return True
    k = kernels.get(n)
    return k is not None and getattr(k, "concurrent_safe", True) is False


def _computes(n: Node, kernels: dict) -> bool:
    return n in kernels and n.view_of is None


def find_regions(graph: Graph, kernels: dict, metas: Callable[[Node], Any] | None = None,
                 min_branch_cost: float = 0.0) -> list[Region]:
    """Fork/join regions of ``graph`` (see the module docstring).  ``kernels`` maps each step
    to its kernel (steps absent from it compute nothing: inputs, constants, plan-time scalars);
    a branch counts only when its estimated cost exceeds ``min_branch_cost``.

    From a fork point ``a``, the steps ``a..e-1`` split into the connected components of their
    dataflow (a union-find, extended one step at a time).  Run on one auxiliary thread or
    stream next to the largest, the other components save ``min(largest, rest)``; the region
    ends before the step ``e`` where that saving is largest (the later one on a tie: the
    region with the most work), scanned until :data:`SCAN_WINDOW` steps bring no better end.  The next region starts at its join.  Steps that cost nothing and read
    only values from before the fork (views of weights, ``getitem`` of earlier results) belong
    to no branch: they run before the fork."""
    metas = metas or (lambda n: n.meta)
    nodes = graph.nodes
    for i, n in enumerate(nodes):
        n.annotations["_pos"] = i
    cost = {n: node_cost(n, metas) if _computes(n, kernels) else 0.0 for n in nodes}
    barrier = [_is_barrier(n, kernels) for n in nodes]

    def scan(a: int, stop: int | None = None):
        """Union-find over steps a.. (up to ``stop``, or until everything joins); returns
        (best end, its saving, the end of the scan, parent map)."""
        parent: dict[Node, Node] = {}
        work: dict[Node, float] = {}
        heavy: set = set()
        best_e, best_save = a, 0.0

        def find(x: Node) -> Node:
            root = x
            while parent[root] is not root:
                root = parent[root]
            while parent[x] is not root:
                parent[x], x = root, parent[x]
            return root

        e = a
        while e < len(nodes) and (stop is None or e < stop):
            n = nodes[e]
            if barrier[e]:
                break
            if stop is None and len(heavy) >= 2:
                loads = sorted((work[r] for r in heavy), reverse=True)
                save = min(loads[0], sum(loads[1:]))
                if save >= best_save and save > 0:
                    best_e, best_save = e, save
            roots = {find(d) for d in node_deps(n) if d in parent}
            if roots or cost[n] > 0:
                parent[n] = n
                work[n] = cost[n]
                for r in roots:
                    parent[r] = n
                    work[n] += work[r]
                    heavy.discard(r)
                if work[n] > min_branch_cost:
                    heavy.add(n)
            e += 1
            if stop is None and best_save > 0 and e - best_e > SCAN_WINDOW:
                break  # no better end for a while: later steps start the next region
        return best_e, best_save, e, parent, work, find

    regions: list[Region] = []
    a = 0
    while a < len(nodes):
        if barrier[a]:
            a += 1
            continue
        best_e, save, scanned, _, _, _ = scan(a)
        if save <= 0:
            a = max(scanned, a + 1)
            continue
        _, _, _, parent, work, find = scan(a, stop=best_e)
        groups: dict[Node, list[Node]] = {}
        for n in nodes[a:best_e]:
            if n in parent:
                groups.setdefault(find(n), []).append(n)
        heavy = [(r, g) for r, g in groups.items() if work[r] > min_branch_cost]
        if len(heavy) >= 2:
            branches = [g for _, g in heavy]
            costs = [work[r] for r, _ in heavy]
            main = max(range(len(branches)), key=lambda i: costs[i])
            in_branch = {n for g in branches for n in g}
            free = [n for n in nodes[a:best_e] if n not in in_branch]
            regions.append(Region(a, best_e, branches, main, costs, free))
        a = best_e
    return regions


def region_lifetimes(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """``(start, end_inclusive)`` step ranges over which the memory planner keeps every buffer
    a region touches alive (see :func:`fxbackend.memory.buffers_of`)."""
    return [(r.start, r.end - 1) for r in regions]


def worth_it(region: Region, metas: Callable[[Node], Any], device: torch.device) -> bool:
    """The default gate (``options.streams`` None): on CUDA, overlap a region when each of its
    matmuls has few rows (at most 64: memory-bound, the GPU is mostly idle during each) and
    every auxiliary branch has at least one; never on the CPU."""
    if device.type != "cuda":
        return False
    found = False
    for i, b in enumerate(region.branches):
        rows = []
        for n in b:
            if n.op in _MATMULS and isinstance(metas(n), TensorMeta):
                shape = metas(n).shape
                rows.append(shape[0] if n.op != "aten.convolution.default" else 1 << 30)
        if i != region.main and not rows:
            return False
        if rows and max(rows) > 64:
            return False
        found = found or bool(rows)
    return found
