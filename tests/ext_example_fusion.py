"""Example extension: a fusion rule for a real chain, with a reordering ``optimize`` step.

    # mul(x, w) -> add(_, b)  =>  torch.addcmul(b, x, w)

Written only against fxbackend's public API (``register_fusion``, ``graph_delay``,
``TensorMeta``, and the documented fields of graph nodes), the way an out-of-tree extension would
be.  Importing this module registers nothing: call :func:`register` / :func:`unregister`.

Two rules:

- :class:`MulAdd` fuses the chain only where the two nodes are already consecutive;
- :class:`MulAddReorder` (the one :func:`register` installs) first runs ``optimize``: when the
  model interleaves independent work between the producer and its consumer
  (``y = x * w; z = other.sin(); out = y + b``, or two chains ``q``/``k`` written side by side),
  it moves the ``mul`` down to just before its ``add`` with ``fxbackend.graph_delay``, which
  refuses any move that would change the result.

The rule only says whether the chain is worth fusing and computable by ``addcmul``; whether a
claim is legal (the product has no other reader, is not an output, ...) is the engine's call.
Input/output overlap needs no workspace here: the engine never places a step's output over its
inputs, and ``addcmul`` reads each element before writing it.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

MUL = "aten.mul.Tensor"
ADD = "aten.add.Tensor"


def _tensor(n) -> TensorMeta | None:
    return n.meta if isinstance(n.meta, TensorMeta) else None


def _fusable(mul, add) -> bool:
    """Dataflow check: ``add`` reads ``mul`` once, and everything is one floating dtype."""
    if mul.op != MUL or add.op != ADD or len(mul.srcs) != 2 or len(add.srcs) != 2:
        return False
    if sum(s is mul for s in add.srcs) != 1 or add.params.get("alpha", 1) != 1:
        return False
    metas = [_tensor(n) for n in (*mul.srcs, *add.srcs, add)]
    if any(m is None for m in metas):
        return False
    dtype = metas[-1].dtype
    return dtype.is_floating_point and all(m.dtype == dtype for m in metas)


class MulAdd:
    """``mul(x, w) -> add(_, b)`` where the two are consecutive, into one ``addcmul``."""

    name = "example_mul_add_no_reorder"
    priority = 0

    def match(self, graph, i: int) -> int:
        if i + 1 >= len(graph.nodes):
            return 0
        return 2 if _fusable(graph.nodes[i], graph.nodes[i + 1]) else 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        mul, add = node.annotations["fused"]
        value = dict(zip(node.srcs, inputs))  # the range's external inputs, in order
        x, w = (value[s] for s in mul.srcs)
        b = value[next(s for s in add.srcs if s is not mul)]
        torch.addcmul(b, x, w, out=out)


class MulAddReorder(MulAdd):
    """:class:`MulAdd`, plus ``optimize``: make interleaved chains consecutive first."""

    name = "example_mul_add"

    def optimize(self, graph) -> None:
        # Each successful move makes one chain consecutive without splitting any other one
        # (the nodes crossed keep their order), so one pass per node is an upper bound; the
        # bound also stops a ping-pong between chains that read each other.
        for _ in range(len(graph.nodes)):
            if not self._delay_one(graph):
                return

    @staticmethod
    def _delay_one(graph) -> bool:
        nodes = graph.nodes
        for i, mul in enumerate(nodes):
            if mul.op != MUL:
                continue
            j = next((k for k in range(i + 1, len(nodes)) if mul in nodes[k].srcs), None)
            if j is None or j == i + 1 or not _fusable(mul, nodes[j]):
                continue
            if fxbackend.graph_delay(graph, i, i + 1, j - 1):
                return True
        return False


_registered: list = []


def register(rule=None):
    """Register ``rule`` (default: a :class:`MulAddReorder`) for "cpu"; returns it."""
    rule = rule if rule is not None else MulAddReorder()
    fxbackend.register_fusion("cpu", rule)
    _registered.append(rule)
    return rule


def unregister() -> None:
    """Undo every :func:`register`."""
    while _registered:
        fxbackend.unregister_fusion("cpu", _registered.pop())
