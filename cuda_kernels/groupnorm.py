"""GroupNorm [-> SiLU] on CUDA: one Triton kernel computing ``group_norm_silu_reference``
(``patterns/groupnorm.py``), registered at the end as the kernel of the ``group_norm_silu``
fusion rule for "cuda" (:class:`GroupNormSiluCUDA`) and, without the SiLU, as the kernel of the
op ``sd.group_norm.v1`` (:class:`GroupNormCUDA`: dense NCHW x only, as the op's output is
contiguous; channels-last x is declined and runs the op's reference).

Maths per (sample n, group g) over its m = (C/G) * HxW elements (float32; ``round`` is the
conversion to x's dtype, round-to-nearest-even, a no-op for float32)::

    x0    = float(x[first element of the group])
    s1    = sum(x - x0),  s2 = sum((x - x0)^2)              float32 partial sums, tree-reduced
    mean  = x0 + s1 / m,  var = max(s2 / m - (s1 / m)^2, 0),  rstd = 1 / sqrt(var + eps)
    scale = rstd * w[c],  bias = fma(-scale, mean, b[c])    torch's CPU form (group_norm_kernel.cpp)
    y     = round(fma(x, scale, bias))                       = native_group_norm(...)[0]
    out   = round(y / (1 + exp(-y)))                         with SiLU (IEEE division)

Shifting by the group's first element keeps the one-pass variance accurate when |mean| is
large against the spread.  The moments differ from torch's (a Welford reduction on CUDA, a
vectorised cascade on the CPU) by the order of the sums only, about 1e-7 relative.  Sources: Wu
and He, "Group Normalization" (arXiv 1803.08494); torch ``group_norm_kernel.cpp``; diffusers
``ResnetBlock2D``.

Layout.  One program per (n, g) (``grid = N * G``), looping over the group in BLOCK-element
chunks twice: once for the moments, once for the output (the second read mostly hits L2).  Dense
NCHW (the group is one contiguous run) or dense channels-last (``CHANNELS_LAST``: the group is
``HxW`` runs of C/G channels at stride C), the same for x and out.  Not tuned on a GPU yet: at
SD1.5 sizes the grid is only 64 programs (N=2, G=32), below one per SM on large GPUs; a split
reduction (moments from several programs per group, then an apply kernel over the whole
tensor) would be the next step.  Importing this module does not import Triton
(``rope.lazy_kernel``).
"""
from __future__ import annotations

from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels.rope import DTYPES, _launch_on, _warmup_on, lazy_kernel
from fxbackend.patterns.groupnorm import (GroupNormOpKernel, GroupNormSiluFusion,
                                          group_norm_silu_reference, layout_why_not,
                                          memory_format_of)

__all__ = ["why_not", "group_norm_silu_triton", "compile_kernels", "GroupNormSiluCUDA",
           "GroupNormCUDA"]

#: triton.language, bound by ``rope.lazy_kernel`` on first use
tl: Any = None

BLOCK = 1024
NUM_WARPS = 4


def _group_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, C, HW, G, D, M, eps,
                       SILU: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    c0 = (pid % G) * D
    if CHANNELS_LAST:
        base = n * HW * C + c0
    else:
        base = n * C * HW + c0 * HW
    x0 = tl.load(x_ptr + base).to(tl.float32)
    k = tl.arange(0, BLOCK)
    a1 = tl.zeros([BLOCK], dtype=tl.float32)
    a2 = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, M, BLOCK):
        kk = k0 + k
        ok = kk < M
        if CHANNELS_LAST:
            off = (kk // D) * C + kk % D
        else:
            off = kk
        v = tl.load(x_ptr + base + off, mask=ok, other=0.0).to(tl.float32)
        v = tl.where(ok, v - x0, 0.0)
        a1 += v
        a2 += v * v
    d1 = tl.div_rn(tl.sum(a1, axis=0), M + 0.0)
    var = tl.maximum(tl.div_rn(tl.sum(a2, axis=0), M + 0.0) - d1 * d1, 0.0)
    mean = x0 + d1
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    for k0 in range(0, M, BLOCK):
        kk = k0 + k
        ok = kk < M
        if CHANNELS_LAST:
            j = kk % D
            off = (kk // D) * C + j
        else:
            j = kk // HW
            off = kk
        xv = tl.load(x_ptr + base + off, mask=ok, other=0.0)
        w = tl.load(w_ptr + c0 + j, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + c0 + j, mask=ok, other=0.0).to(tl.float32)
        scale = rstd * w
        bias = tl.fma(-scale, mean, b)
        y = tl.fma(xv.to(tl.float32), scale, bias)
        if SILU:
            y = y.to(xv.dtype).to(tl.float32)  # native_group_norm's output rounding
            y = tl.div_rn(y, 1.0 + tl.exp(-y))
        tl.store(out_ptr + base + off, y.to(out_ptr.dtype.element_ty), mask=ok)


_kernel = lazy_kernel(_group_norm_kernel)


def why_not(x: Any, w: Any, b: Any, out: Any, groups: Any, eps: Any) -> str | None:
    """None when :func:`group_norm_silu_triton` takes these arguments on CUDA, else a short
    reason.  Metadata only; never raises.  Takes x float32/bf16/fp16, dense NCHW or dense
    channels-last (out the same, x's dtype and shape), contiguous ``[C]`` weight and bias of
    float32 or x's dtype, groups dividing C, a finite eps >= 0, all on one CUDA device."""
    try:
        metas = (("x", x), ("weight", w), ("bias", b), ("out", out))
        for name, mt in metas:
            if not isinstance(mt, TensorMeta):
                return f"{name} is not a tensor"
            if mt.is_symbolic:
                return "symbolic metadata"
        if x.device.type != "cuda":
            return f"x is on {x.device}, not a CUDA device"
        for name, mt in metas[1:]:
            if mt.device != x.device:
                return f"{name} is on {mt.device}, x on {x.device}"
        if x.dtype not in DTYPES:
            return f"x dtype {x.dtype}"
        return layout_why_not(x, w, b, out, groups, eps)
    except Exception as exc:  # malformed metadata: decline, never raise
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _args(shape, stride, groups: int) -> tuple:
    n, c = int(shape[0]), int(shape[1])
    hw = 1
    for s in shape[2:]:
        hw *= int(s)
    d = c // groups
    return (n * groups,), (c, hw, groups, d, d * hw), memory_format_of(shape, stride) == "nhwc"


def group_norm_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           out: torch.Tensor, *, groups: int, eps: float,
                           silu: bool = True) -> torch.Tensor:
    """``out = group_norm_silu_reference(x, weight, bias, groups, eps, silu)`` with the Triton
    kernel; returns ``out`` (x's shape, dtype and memory format; no overlap with the inputs,
    not checked).  On one CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.  Raises
    ValueError naming the problem for arguments the kernel does not take."""
    ts = {"x": x, "weight": weight, "bias": bias, "out": out}
    for name, t in ts.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"group_norm_silu_triton: {name} is not a tensor")
    metas = [TensorMeta.of(t) for t in ts.values()]
    if x.device.type == "cpu":  # the interpreter: check as if on CUDA
        cuda = torch.device("cuda")
        metas = [TensorMeta(m.shape, m.stride, m.dtype, cuda, m.storage_offset) for m in metas]
    why = why_not(*metas, groups, eps)
    if why is not None:
        raise ValueError(f"group_norm_silu_triton: unsupported input: {why}")
    _launch(x, weight, bias, out, groups, eps, silu)
    return out


def _launch(x, weight, bias, out, groups: int, eps: float, silu: bool) -> None:
    """The launch alone (arguments already checked)."""
    if x.numel() == 0:
        return
    grid, ints, cl = _args(x.shape, x.stride(), groups)
    _launch_on(x.device, _kernel()[grid], (x, weight, bias, out, *ints, float(eps)),
               dict(SILU=bool(silu), CHANNELS_LAST=cl, BLOCK=BLOCK, num_warps=NUM_WARPS))


def compile_kernels(x, w, b, out, groups: int, silu: bool) -> None:
    """Plan-time warm-up for these metadata (a no-op off CUDA or without a GPU)."""
    if x.device.type != "cuda" or why_not(x, w, b, out, groups, 1e-5) is not None:
        return
    grid, ints, cl = _args(x.shape, x.stride, groups)
    if grid[0] == 0:
        return
    _warmup_on(x.device, _kernel, (x.dtype, w.dtype, b.dtype, out.dtype, *ints, 1e-5),
               dict(SILU=bool(silu), CHANNELS_LAST=cl, BLOCK=BLOCK, num_warps=NUM_WARPS,
                    grid=grid))


class GroupNormSiluCUDA:
    """The Triton kernel behind the ``group_norm_silu`` fusion rule on CUDA (interface:
    ``fxbackend.patterns.groupnorm.GroupNormSiluFusion``)."""

    name = "group_norm_silu_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, x, w, b, out, groups, eps):
        return why_not(x, w, b, out, groups, eps)

    def compile(self, x, w, b, out, groups, silu):
        compile_kernels(x, w, b, out, groups, silu)

    def run(self, x, w, b, out, *, groups, eps, silu):
        group_norm_silu_triton(x, w, b, out, groups=groups, eps=eps, silu=silu)


class GroupNormCUDA(GroupNormOpKernel):
    """The Triton kernel (``SILU=False``) for the op ``sd.group_norm.v1``: what :func:`why_not`
    takes with the node's contiguous output, i.e. dense NCHW x.  Workspace: none."""

    name = "group_norm_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True
    why_not = staticmethod(why_not)

    def compile(self, node) -> None:
        x, w, b = (s.meta for s in node.srcs)
        compile_kernels(x, w, b, node.meta, node.params["groups"], False)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x, w, b = inputs
        groups, eps = node.params["groups"], node.params["eps"]
        if memory_format_of(x.shape, x.stride()) != "nchw":
            # strides other than planned (behind Dynamo's guards): never write the wrong layout
            out.copy_(group_norm_silu_reference(x, w, b, groups, eps, silu=False))
            return
        _launch(x, w, b, out, groups, eps, False)


fxbackend.register_fusion("cuda", GroupNormSiluFusion(GroupNormSiluCUDA()))
fxbackend.register_kernel("cuda", GroupNormCUDA)
