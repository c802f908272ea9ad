"""Nearest-neighbour upsampling gathered by index becomes copies from broadcast views.

``F.interpolate(x, scale_factor=2, mode="nearest")`` (diffusers' ``Upsample2D`` in every SD and
SDXL UNet decoder stage and their VAE decoders; ``Upsample1D``; 3-D video VAEs' spatial and
temporal upsampling) reaches the backend decomposed into ``aten._unsafe_index(x, [None, None,
*idx])``, one index tensor per spatial dim computed from sizes alone (``[H_out, 1]`` and
``[W_out]`` in 2-D).  Run as it is, that is ATen's generic gather: on the small UNet 1.2 ms for
a 1.6 MB result (1.3 GB/s, one thread); eager's ``upsample_nearest2d`` kernel is no faster
there (1.2 ms).

The rewrite rule ``index_upsample`` reads the index tensors (``RewriteContext.constant``: they
read no input) and, when each is ``arange(S * f) // f`` for an integer factor ``f`` (nearest,
and nearest-exact, at integer factors), replaces the gather by one copy per factor above 1,
from the last spatial dim to the first: in 2-D each pixel repeated ``sw`` times along its row
(``x[..., None].expand(..., sw)``, copied to ``[B, C, H, W * sw]``), then each such row
repeated ``sh`` times (``[B, C, H, sh, W * sw]``), which is the result viewed as
``[B, C, H * sh, W * sw]``; in 3-D the planes next.  All are plain copies of x's values:
bit-identical.  Small UNet, ``[1, 256, 20, 20]`` to 40 x 40, one thread
(``scripts/bench_upsample.py``): 0.38 ms against the gather's 1.30 ms and Inductor's fused
loop's 0.62 ms; 2.5-3.5x the gather on SD1.5's shapes, behind Inductor on 8x8 maps (0.70 vs
0.51 ms: copies of 8-float rows).

A channels-last image (``channels_last_convs`` lays 16-bit UNets out so) upsampled into a
channels-last result is one copy instead: ``[B, H, W, C]`` in memory, each pixel's channel row
repeated along the row and each row repeated (``[B, H, 1, W, 1, C]`` expanded to ``[B, H, fh,
W, fw, C]``), the result its channels-last ``[B, C, H * fh, W * fw]`` view.

CPU only: in 2-D the copies move 1.5x the gather's bytes, which a GPU's gather kernel may well
beat; that is unmeasured, so the rule leaves other devices alone.  Declined, with the reason in
the plan's report: a result not in the default (contiguous) layout, indices that read an input,
and indices that are not such an upsampling.  Index lists of another form (other dims indexed,
or more than 3 spatial dims) are not this idiom and are left alone silently.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.ir import Node
from fxbackend.rewrite import AtenBuilder

from .channels_last import is_channels_last

__all__ = ["IndexUpsample"]

_OP = "aten._unsafe_index.Tensor"


def _factors(indices: list, sizes: tuple) -> list | None:
    """The integer factors ``f_j >= 1`` when ``indices[j]`` is ``arange(sizes[j] * f_j) //
    f_j`` shaped ``[sizes[j] * f_j, 1, ..., 1]`` (one 1 per later spatial dim: the
    decomposition's broadcast layout), else None."""
    factors = []
    for j, (idx, size) in enumerate(zip(indices, sizes)):
        trailing = len(sizes) - 1 - j
        if idx.dim() != 1 + trailing or any(d != 1 for d in idx.shape[1:]) or \
                idx.dtype not in (torch.int64, torch.int32) or idx.shape[0] % size:
            return None
        f = idx.shape[0] // size
        if f < 1 or not torch.equal(idx.reshape(-1).cpu(),
                                    torch.arange(size * f, dtype=idx.dtype) // f):
            return None
        factors.append(f)
    return factors


def _upsample(make: AtenBuilder, x: Node, factors: list) -> Node:
    """``x`` (contiguous ``[B, C, *spatial]`` metadata) upsampled by ``factors`` through nodes
    ``make`` inserts: from the last spatial dim to the first, each element (a row, a plane)
    repeated ``f`` times (``unsqueeze`` after the dim, ``expand`` to ``f``, a contiguous
    ``clone``, a ``view`` merging the two), factors of 1 skipped (one ``clone`` when all are
    1: the gather's own copy)."""
    cur, out = list(x.meta.shape), x
    for j in reversed(range(len(factors))):
        f, d = factors[j], 2 + j
        if f == 1:
            continue
        out = make("expand", [make("unsqueeze", [out], {"dim": d + 1})],
                   {"size": cur[:d + 1] + [f] + cur[d + 1:]})
        out = make("clone", [out], {"memory_format": torch.contiguous_format})
        cur[d] *= f
        out = make("view", [out], {"size": list(cur)})
    if out is x:
        out = make("clone", [x], {"memory_format": torch.contiguous_format})
    return out


def _upsample_channels_last(make: AtenBuilder, x: Node, factors: list) -> Node:
    """``x`` (channels-last ``[B, C, H, W]`` metadata: ``[B, H, W, C]`` in memory) upsampled
    by ``(fh, fw)`` in one copy: each pixel's channel row repeated ``fw`` times along the row
    and each row ``fh`` times (``[B, H, 1, W, 1, C]`` expanded to ``[B, H, fh, W, fw, C]``),
    returned as the channels-last ``[B, C, H * fh, W * fw]`` view of it."""
    b, c, h, w = x.meta.shape
    fh, fw = factors
    rows = make("permute", [x], {"dims": [0, 2, 3, 1]})
    u = make("unsqueeze", [make("unsqueeze", [rows], {"dim": 3})], {"dim": 2})
    e = make("expand", [u], {"size": [b, h, fh, w, fw, c]})
    out = make("clone", [e], {"memory_format": torch.contiguous_format})
    out = make("view", [out], {"size": [b, h * fh, w * fw, c]})
    return make("permute", [out], {"dims": [0, 3, 1, 2]})


class IndexUpsample:
    """Rewrite rule ``index_upsample`` (see the module docstring)."""

    name = "index_upsample"

    def rewrite(self, graph, ctx) -> int:
        """Replace every nearest-upsampling gather (1, 2 or 3 spatial dims) by broadcast
        copies; returns how many."""
        count = 0
        for n in list(graph.nodes):
            spec = dict(n.tensor_layout).get("indices") if n.op == _OP else None
            if not spec or spec[:2] != (False, False) or not all(spec[2:]) or \
                    len(spec) not in (3, 4, 5):
                continue
            x, idx_nodes = n.srcs[0], n.srcs[1:]
            mx, mn = x.meta, n.meta
            if not (isinstance(mx, TensorMeta) and isinstance(mn, TensorMeta)) or \
                    len(mx.shape) != len(spec) or mx.is_symbolic or mn.is_symbolic or \
                    mx.device.type != "cpu":
                continue
            nhwc = len(mx.shape) == 4 and is_channels_last(mx) and is_channels_last(mn) and \
                not mn.is_contiguous
            if not mn.is_contiguous and not nhwc:
                ctx.decline(n, "the result is neither contiguous nor a channels-last image "
                               "upsampled from one (the copies write one of those layouts)")
                continue
            indices = [ctx.constant(i) for i in idx_nodes]
            if any(i is None for i in indices):
                ctx.decline(n, "the indices read an input (not computed from sizes alone)")
                continue
            factors = _factors(indices, tuple(mx.shape[2:]))
            if factors is None or tuple(mn.shape) != tuple(mx.shape[:2]) + tuple(
                    s * f for s, f in zip(mx.shape[2:], factors)):
                ctx.decline(n, "the indices are not a nearest-neighbour upsampling by integer "
                               "factors")
                continue
            build = _upsample_channels_last if nhwc else _upsample
            fxbackend.replace_uses(graph, n, build(AtenBuilder(graph, n), x, factors))
            count += 1
        return count


fxbackend.register_rewrite(IndexUpsample)
