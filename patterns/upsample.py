"""Nearest-neighbour upsampling gathered by index becomes two broadcast copies.

``F.interpolate(x, scale_factor=2, mode="nearest")`` (diffusers' ``Upsample2D`` in every SD and
SDXL UNet decoder stage, and in their VAE decoders) reaches the backend decomposed into
``aten._unsafe_index(x, [None, None, rows, cols])`` with ``rows`` ``[H_out, 1]`` and ``cols``
``[W_out]`` index tensors computed from sizes alone.  Run as it is, that is ATen's generic
gather: on the small UNet 1.2 ms for a 1.6 MB result (1.3 GB/s, one thread); eager's
``upsample_nearest2d`` kernel is no faster there (1.2 ms).

The rewrite rule ``index_upsample`` reads the two index tensors (``RewriteContext.constant``:
they read no input) and, when they are ``arange(H * sh) // sh`` and ``arange(W * sw) // sw``
for integer factors ``sh``, ``sw`` (nearest, and nearest-exact, at integer factors), replaces
the gather by two copies from broadcast views: each pixel repeated ``sw`` times along its row
(``x[..., None].expand(..., sw)``, copied to ``[B, C, H, W * sw]``), then each such row
repeated ``sh`` times (``[B, C, H, sh, W * sw]``), which is the result viewed as
``[B, C, H * sh, W * sw]``.  Both are plain copies of x's values: bit-identical.  Small UNet,
``[1, 256, 20, 20]`` to 40 x 40, one thread (``scripts/bench_upsample.py``): 0.38 ms against
the gather's 1.30 ms and Inductor's fused loop's 0.62 ms; 2.5-3.5x the gather on SD1.5's
shapes, behind Inductor on 8x8 maps (0.70 vs 0.51 ms: copies of 8-float rows).

CPU only: the two copies move 1.5x the gather's bytes, which a GPU's gather kernel may well
beat; that is unmeasured, so the rule leaves other devices alone.  Declined, with the reason in
the plan's report: a result not contiguous NCHW, indices that read an input, and indices that
are not such an upsampling.  Index lists of another form (other dims indexed, or other ranks)
are not this idiom and are left alone silently.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.ir import Node

__all__ = ["IndexUpsample"]

_OP = "aten._unsafe_index.Tensor"


def _contiguous(m: TensorMeta) -> bool:
    """Whether ``m`` has the default (row-major) strides (sizes-1 dims may have any)."""
    expect = 1
    for size, stride in reversed(list(zip(m.shape, m.stride))):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def _factors(rows: torch.Tensor, cols: torch.Tensor, h: int, w: int) -> tuple | None:
    """``(sh, sw)`` when ``rows`` is ``arange(h * sh)[:, None] // sh`` and ``cols``
    ``arange(w * sw) // sw`` for integers ``sh, sw >= 1``, else None."""
    if rows.dim() != 2 or rows.shape[1] != 1 or cols.dim() != 1 or \
            rows.dtype not in (torch.int64, torch.int32) or cols.dtype != rows.dtype or \
            rows.shape[0] % h or cols.shape[0] % w:
        return None
    sh, sw = rows.shape[0] // h, cols.shape[0] // w
    if sh < 1 or sw < 1:
        return None
    want_rows = torch.arange(h * sh, dtype=rows.dtype) // sh
    want_cols = torch.arange(w * sw, dtype=cols.dtype) // sw
    ok = torch.equal(rows.reshape(-1).cpu(), want_rows) and torch.equal(cols.cpu(), want_cols)
    return (sh, sw) if ok else None


def _insert_chain(graph, at: Node, x: Node, steps: list) -> Node:
    """Insert ``steps`` (``(aten op name, params, is a view)``), each reading the one before
    (the first reads ``x``), before ``at``; each node's metadata is its op run on the meta
    device.  Returns the last node."""
    m = x.meta
    val = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    prev = x
    for name, params, is_view in steps:
        op = getattr(torch.ops.aten, name).default
        val = op(val, **params)
        meta = TensorMeta(tuple(val.shape), tuple(val.stride()), val.dtype, m.device,
                          val.storage_offset())
        node = graph.new_node(f"aten.{name}.default", [prev], params, meta, target=op,
                              tensor_layout=(("self", True),),
                              view_of=prev if is_view else None)
        graph.insert(graph.nodes.index(at), node)
        prev = node
    return prev


class IndexUpsample:
    """Rewrite rule ``index_upsample`` (see the module docstring)."""

    name = "index_upsample"

    def rewrite(self, graph, ctx) -> int:
        """Replace every nearest-upsampling gather by broadcast copies; returns how many."""
        count = 0
        for n in list(graph.nodes):
            if n.op != _OP or dict(n.tensor_layout).get("indices") != (False, False, True, True):
                continue
            x, rows_n, cols_n = n.srcs
            mx, mn = x.meta, n.meta
            if not (isinstance(mx, TensorMeta) and isinstance(mn, TensorMeta)) or \
                    len(mx.shape) != 4 or mx.is_symbolic or mn.is_symbolic or \
                    mx.device.type != "cpu":
                continue
            if not _contiguous(mn):
                ctx.decline(n, "the result is not contiguous NCHW (the copies write NCHW)")
                continue
            rows, cols = ctx.constant(rows_n), ctx.constant(cols_n)
            if rows is None or cols is None:
                ctx.decline(n, "the indices read an input (not computed from sizes alone)")
                continue
            b, c, h, w = mx.shape
            factors = _factors(rows, cols, h, w)
            if factors is None or tuple(mn.shape) != (b, c, h * factors[0], w * factors[1]):
                ctx.decline(n, "the indices are not a nearest-neighbour upsampling by integer "
                               "factors")
                continue
            sh, sw = factors
            copy = ("clone", {"memory_format": torch.contiguous_format}, False)
            steps = []
            if sw > 1:  # each pixel sw times along its row
                steps += [("unsqueeze", {"dim": 4}, True),
                          ("expand", {"size": [b, c, h, w, sw]}, True), copy,
                          ("view", {"size": [b, c, h, w * sw]}, True)]
            if sh > 1 or not steps:  # each row sh times (or the gather's copy of x)
                steps += [("unsqueeze", {"dim": 3}, True),
                          ("expand", {"size": [b, c, h, sh, w * sw]}, True), copy]
            steps.append(("view", {"size": [b, c, h * sh, w * sw]}, True))
            out = _insert_chain(graph, n, x, steps)
            fxbackend.replace_uses(graph, n, out)
            count += 1
        return count


fxbackend.register_rewrite(IndexUpsample)
