"""Identity arithmetic: a multiplication or division by the number 1 is dropped.

Diffusion models write such steps where a scale factor is configurable and left at its default:
diffusers' ``ResnetBlock2D`` ends with ``(input + hidden) / output_scale_factor`` and its
attention processors with ``hidden / rescale_output_factor`` (both 1.0 in SD1.5/SDXL UNets), and
timestep embeddings multiply by ``scale = 1``.  Each is a full pass over its tensor that returns
the same numbers (IEEE ``x * 1`` and ``x / 1`` are exact for every value: -0.0, infinities and
subnormals included; a signalling NaN would come back quieted from the op and unchanged here,
and ATen's ops never produce one).

The rewrite rule ``identity_arith`` redirects the readers of ``aten.mul``/``aten.div``
(``.Tensor`` or ``.Scalar``) by a plain number equal to 1 to the op's input, when that is the
same value in the same layout: one tensor input, the result's dtype, device, shape and strides
equal to the input's.  It leaves the step alone (the engine then drops nothing) when the result
is a graph output (the caller must get a tensor of its own, not an alias of an input), or when
the input or the result is written in place later (an alias would then see the write).  Runs per
plan on concrete shapes, through the public rewrite API, like every rule of this package.
"""
from __future__ import annotations

from typing import Any

import fxbackend
from fxbackend import TensorMeta
from fxbackend.ir import storage_root

__all__ = ["IdentityArith", "IDENTITY_OPS"]

#: the ops whose ``other`` = 1 makes them the identity
IDENTITY_OPS = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar")


def _is_one(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1


def _same_value(x, n) -> bool:
    mx, mn = x.meta, n.meta
    return isinstance(mx, TensorMeta) and isinstance(mn, TensorMeta) and \
        mx.dtype == mn.dtype and mx.device == mn.device and \
        tuple(mx.shape) == tuple(mn.shape) and tuple(mx.stride) == tuple(mn.stride)


class IdentityArith:
    """Rewrite rule ``identity_arith`` (see the module docstring)."""

    name = "identity_arith"

    def rewrite(self, graph) -> int:
        """Redirect the readers of every identity step to its input; returns how many."""
        written = {storage_root(m) for m in graph.nodes if m.inplace_of is not None}
        count = 0
        for n in list(graph.nodes):
            if n.op not in IDENTITY_OPS or len(n.srcs) != 1 or n.is_output or \
                    set(n.params) != {"other"} or not _is_one(n.params["other"]):
                continue
            x = n.srcs[0]
            if storage_root(n) in written or storage_root(x) in written or \
                    not _same_value(x, n):
                continue
            fxbackend.replace_uses(graph, n, x)
            count += 1
        return count


fxbackend.register_rewrite(IdentityArith())
