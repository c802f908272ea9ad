"""The memory planner: node list in, arena offsets out.  Small, pure, no device needed.

Every tensor a plan computes lives in one preallocated arena per device, except the storage of
values handed back to the caller (allocated per call: the caller keeps them) and of inputs
(the caller's).  A buffer lives from the step that defines it through the last step that reads
it or any view of it; a buffer freed at step t can be reused from step t+1 on, so a step's
output never overlaps its inputs.  Offsets are chosen online, in step order, best fit: the
smallest free block that fits, else the end of the arena.

An *alias* places one buffer inside another (``aliases={key: (target key, byte offset)}``, as
:mod:`fxbackend.concat` asks for a part of a concatenation): the aliased key gets no block of its
own, its steps count towards the target's lifetime, and its offset is the target's plus the byte
offset.  Chains (a part of a part) resolve to the outermost buffer.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Hashable, Iterable

from .ir import Graph, Node, TensorMeta, node_deps, storage_root

__all__ = ["Buffer", "MemoryPlan", "assign_offsets", "buffers_of", "plan_memory", "ALIGNMENT"]

ALIGNMENT = 64


@dataclasses.dataclass
class Buffer:
    """One planned allocation: ``nbytes`` live over steps ``start..end`` (inclusive)."""

    key: Hashable
    nbytes: int
    start: int
    end: int
    device: str = "cpu"


@dataclasses.dataclass
class MemoryPlan:
    """Where each buffer lives: ``offsets[key]`` in the arena of ``devices[key]``."""

    offsets: dict
    arena_bytes: dict  # device -> bytes
    buffers: list
    per_call: list  # keys of owners allocated per call (graph outputs)
    aliases: dict = dataclasses.field(default_factory=dict)  # key -> (target key, byte offset)

    @property
    def total_arena(self) -> int:
        return sum(self.arena_bytes.values())

    @property
    def sum_intermediates(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def summary(self) -> str:
        return (f"arena {self.total_arena / 2**20:.2f} MB "
                f"(sum of intermediates {self.sum_intermediates / 2**20:.2f} MB)")


def _align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def assign_offsets(buffers: Iterable[Buffer], alignment: int = ALIGNMENT) -> tuple[dict, int]:
    """Best-fit offsets for buffers of one device.  Returns ``({key: offset}, arena_bytes)``.

    Two buffers whose step ranges intersect never overlap in memory.
    """
    buffers = list(buffers)
    by_start: dict[int, list[Buffer]] = {}
    by_end: dict[int, list[Buffer]] = {}
    for b in buffers:
        if b.end < b.start:
            raise ValueError(f"buffer {b.key!r} ends (step {b.end}) before it starts ({b.start})")
        by_start.setdefault(b.start, []).append(b)
        by_end.setdefault(b.end, []).append(b)
    free: list[list[int]] = []  # sorted [offset, size] blocks
    offsets: dict = {}
    top = 0
    for t in sorted(set(by_start) | set(by_end)):
        # larger first: they are the hardest to place well
        for b in sorted(by_start.get(t, ()), key=lambda b: -b.nbytes):
            size = _align(max(b.nbytes, 1), alignment)
            best = None
            for i, (off, sz) in enumerate(free):
                if sz >= size and (best is None or sz < free[best][1]):
                    best = i
            if best is not None:
                off, sz = free[best]
                offsets[b.key] = off
                if sz == size:
                    free.pop(best)
                else:
                    free[best] = [off + size, sz - size]
            elif free and free[-1][0] + free[-1][1] == top:
                # grow the arena from the last free block
                off = free.pop()[0]
                offsets[b.key] = off
                top = off + size
            else:
                offsets[b.key] = top
                top += size
        for b in by_end.get(t, ()):
            _release(free, offsets[b.key], _align(max(b.nbytes, 1), alignment))
    return offsets, top


def _release(free: list[list[int]], off: int, size: int) -> None:
    i = bisect.bisect_left(free, [off, 0])
    free.insert(i, [off, size])
    if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
        free[i][1] += free.pop(i + 1)[1]
    if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
        free[i - 1][1] += free.pop(i)[1]


def owner_meta(metas: Callable[[Node], Any], owner: Node, index: int | None) -> TensorMeta | None:
    m = metas(owner)
    if index is not None:
        m = m[index] if isinstance(m, tuple) else None
    return m if isinstance(m, TensorMeta) else None


def buffers_of(graph: Graph, metas: Callable[[Node], Any] | None = None,
               skip: Callable[[Node], bool] | None = None,
               skip_key: Callable[[tuple], bool] | None = None,
               regions: Iterable[tuple[int, int]] = (),
               aliases: dict | None = None) -> tuple[list[Buffer], list]:
    """Buffers (lifetimes in node order) of every tensor the graph computes.

    Returns ``(arena_buffers, per_call_keys)``: owners whose storage is (or is viewed by) a graph
    output are allocated per call and not planned.  ``metas(node)`` gives concrete metadata
    (default: ``node.meta``); ``skip(node)`` marks nodes that get no storage (fused away);
    ``skip_key((node_id, index))`` single outputs that need none.  ``regions``: step ranges
    ``(first, last)`` whose steps may run concurrently (``fxbackend.streams``): a buffer whose
    lifetime meets such a range is stretched over all of it, so that no two buffers the range
    touches share storage while it runs.  ``aliases``: see the module docstring; an aliased key
    is not a buffer, its uses extend its target's lifetime.
    """
    metas = metas or (lambda n: n.meta)
    resolve = _resolver(aliases or {})
    start: dict = {}
    end: dict = {}
    order: list = []

    def keys_of(node: Node) -> list:
        owner, index = storage_root(node)
        if owner.is_input or owner.op == "constant" or owner.is_scalar:
            return []
        m = metas(owner)
        if index is None and isinstance(m, tuple):  # the whole tuple of a multi-output node
            return [resolve((owner.id, i))[0] for i, x in enumerate(m) if isinstance(x, TensorMeta)]
        if owner_meta(metas, owner, index) is None:
            return []
        return [resolve((owner.id, index))[0]]

    for t, node in enumerate(graph.nodes):
        if skip is not None and skip(node):
            continue
        for d in node_deps(node):
            for k in keys_of(d):
                end[k] = t
        owner, _ = storage_root(node)
        if owner is node:
            for k in keys_of(node):
                if k not in start:
                    start[k] = t
                    end.setdefault(k, t)
                    order.append(k)
                end[k] = max(end[k], t)
        else:
            for k in keys_of(node):
                end[k] = max(end.get(k, t), t)
    per_call = set()
    for o in graph.outputs:
        if isinstance(o, Node):
            per_call.update(keys_of(o))
    for first, last in regions:
        for k in order:
            if start[k] <= last and end[k] >= first:
                start[k] = min(start[k], first)
                end[k] = max(end[k], last)
    by_id = {n.id: n for n in graph.nodes}
    bufs = []
    for k in order:
        if k in per_call or (skip_key is not None and skip_key(k)):
            continue
        m = owner_meta(metas, by_id[k[0]], k[1])
        nbytes = m.span_bytes + m.storage_offset * m.itemsize
        bufs.append(Buffer(k, nbytes, start[k], end[k], str(m.device)))
    return bufs, [k for k in order if k in per_call]


def _resolver(aliases: dict) -> Callable[[Hashable], tuple[Hashable, int]]:
    """``key -> (outermost target key, byte offset in it)`` (the key itself when not aliased)."""
    def resolve(key):
        off = 0
        seen = set()
        while key in aliases:
            if key in seen:
                raise ValueError(f"alias cycle through buffer {key!r}")
            seen.add(key)
            key, o = aliases[key]
            off += o
        return key, off
    return resolve


def plan_memory(graph: Graph, metas: Callable[[Node], Any] | None = None,
                skip: Callable[[Node], bool] | None = None,
                skip_key: Callable[[tuple], bool] | None = None,
                alignment: int = ALIGNMENT,
                regions: Iterable[tuple[int, int]] = (),
                aliases: dict | None = None) -> MemoryPlan:
    """Plan every intermediate of ``graph`` into one arena per device (``regions``, ``aliases``:
    see :func:`buffers_of`).  An aliased key's offset is its target's plus the alias's bytes."""
    aliases = dict(aliases or {})
    bufs, per_call = buffers_of(graph, metas, skip, skip_key, regions, aliases)
    offsets: dict = {}
    arena: dict = {}
    for dev in sorted({b.device for b in bufs}):
        offs, top = assign_offsets([b for b in bufs if b.device == dev], alignment)
        offsets.update(offs)
        arena[dev] = top
    resolve = _resolver(aliases)
    for key in aliases:
        target, off = resolve(key)
        if target in offsets:
            offsets[key] = offsets[target] + off
        else:
            raise ValueError(f"buffer {key!r} is aliased into {target!r}, which has no arena "
                             f"storage (handed back to the caller or never planned)")
    return MemoryPlan(offsets, arena, bufs, per_call, aliases)
