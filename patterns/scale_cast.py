"""Scale -> cast to fp16/bf16 as a terminal step: ``mul(x, c) -> .to(half)`` in one pass.

The chain, as ATen gives it (e.g. ``(latents * scaling_factor).to(torch.float16)``, a scaled
activation handed to a 16-bit consumer, ``dst.copy_(x * c)`` functionalised)::

    y   = aten.mul.Tensor(x, c)                          c a Python number
    out = aten._to_copy(y) {dtype=bf16|fp16}             only a dtype change
        | aten.copy.default(dst, y)                      dst fp16/bf16 of y's shape (its values
                                                         are not read: a cast into dst's dtype)

Meaning (:func:`scale_cast_reference`; T = x's dtype, O = the half output dtype)::

    out = round_O(round_T(float32(x) * float32(c)))

the float32 product of torch's CPU ``mul`` with a scalar, rounded to T (the identity for float32
x), then the cast, so the fused step is bit-exact.  The step reads x once and writes the half
output once (the unfused chain writes and re-reads a T-sized intermediate).
x and the output must have the same strides and be dense (then both are flat arrays in the
same element order); other layouts are declined.
"""
from __future__ import annotations

import torch

from fxbackend import TensorMeta

from .rmsnorm import is_cast_to

__all__ = ["scale_cast_reference", "ScaleCastFusion", "ReferenceScaleCast", "is_dense"]

_HALF = (torch.bfloat16, torch.float16)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_cast_reference(x: torch.Tensor, c: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``(x * c).to(out_dtype)`` in plain torch: the unfused chain."""
    return (x * c).to(out_dtype)


def is_dense(shape, stride) -> bool:
    """The elements of a tensor with this shape and these strides cover exactly ``numel``
    consecutive storage slots (any dim order, no gaps, no overlap)."""
    dims = sorted((st, n) for n, st in zip(shape, stride) if n != 1)
    acc = 1
    for st, n in dims:
        if st != acc:
            return False
        acc *= n
    return True


class ScaleCastFusion:
    """Fusion rule ``scale_cast``: ``mul(x, c) -> cast/copy to fp16|bf16`` as one kernel
    (meaning: :func:`scale_cast_reference`).

    # mul(x, c) -> _to_copy(half) | copy(dst_half, _)  =>  fused.scale_cast

    ``impl``: ``name``, ``why_not(x, out) -> str | None`` (metadata; never raises), optional
    ``compile(x, out)`` and ``run(x, out, *, c)`` (``out`` the half output, x's strides, not
    overlapping x).  Registered by ``cpu_kernels/scale_cast.py`` and
    ``cuda_kernels/scale_cast.py``.  Lower priority than ``rms_rope``, which absorbs a scale
    and a cast after a RoPE itself.
    """

    priority = 1

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "scale_cast"

    @staticmethod
    def _scale(n):
        c = n.params.get("other")
        if n.op == "aten.mul.Tensor" and len(n.srcs) == 1 and isinstance(c, (int, float)) and \
                not isinstance(c, bool) and isinstance(n.meta, TensorMeta):
            return float(c)
        return None

    @staticmethod
    def _is_cast(n, y) -> bool:
        if not isinstance(n.meta, TensorMeta) or n.meta.dtype not in _HALF:
            return False
        if n.srcs == [y] and is_cast_to(n, n.meta.dtype):
            return True
        return n.op == "aten.copy.default" and len(n.srcs) == 2 and n.srcs[1] is y and \
            n.srcs[0] is not y and tuple(n.meta.shape) == tuple(y.meta.shape) and \
            not n.params.get("non_blocking")

    def match(self, graph, i: int):
        nodes = graph.nodes
        mul = nodes[i]
        c = self._scale(mul)
        if c is None or i + 1 >= len(nodes) or not self._is_cast(nodes[i + 1], mul):
            return 0
        x, out = mul.srcs[0].meta, nodes[i + 1].meta
        why = None
        if not isinstance(x, TensorMeta) or x.dtype not in _DTYPES or mul.meta.dtype != x.dtype:
            why = "x is not float32/bfloat16/float16 (or the product changes its dtype)"
        elif x.is_symbolic or out.is_symbolic:
            why = "symbolic metadata"
        elif tuple(x.shape) != tuple(out.shape) or tuple(x.stride) != tuple(out.stride) or \
                not is_dense(x.shape, x.stride):
            why = f"layouts differ or are not dense (x {x.stride}, out {out.stride})"
        else:
            why = self.impl.why_not(x, out)
            why = None if why is None else f"{self.impl.name}: {why}"
        return (0, why) if why else 2

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            comp(node.annotations["fused"][0].srcs[0].meta, node.meta)

    def prepare(self, node):
        mul = node.annotations["fused"][0]
        return (mul.srcs[0], self._scale(mul)), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x_node, c = state
        self.impl.run(dict(zip(node.srcs, inputs))[x_node], out, c=c)


class ReferenceScaleCast:
    """A torch implementation of the ``scale_cast`` kernel interface (tests); not registered."""

    name = "scale_cast_reference"

    def why_not(self, x, out):
        return None

    def run(self, x, out, *, c):
        out.copy_(scale_cast_reference(x, c, out.dtype))
