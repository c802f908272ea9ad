"""Gated residual epilogue on CUDA: a Triton kernel computing ``gated_residual_reference``
(``patterns/gated_residual.py``) over the GEMM result of the fused ``gated_residual`` step,
registered at the end as the epilogue of that rule for "cuda" (:class:`GatedResidualCUDA`).
The GEMM itself runs natively in the rule (``torch.addmm``/``torch.mm`` with ``out=``, on the
current stream); this kernel follows it on the same stream.

Maths per element (T the common dtype; ``round`` to T, round-to-nearest-even as ``Tensor.to``,
a no-op for float32; float32 arithmetic)::

    t   = round(y * float32(s))                       mul by a Python scalar
    t   = round(y * (float32(1) / float32(s)))        div by a Python scalar (see below)
    g   = round(gate * t)
    out = round(residual + g)

Around a float32 gate, y, the residual and out may each be bf16/fp16 (the rule's widening and
narrowing casts): loads widen, ``t`` rounds to y's dtype, ``g`` to the gate's, and the store
rounds the float32 sum to out's dtype.

CUDA's eager ``div`` by a CPU scalar multiplies by the reciprocal (``div_true_kernel_cuda``:
"this may lose one bit of precision compared to computing the division"), so the fused kernel
does the same and equals the unfused chain on the GPU bit for bit; it may differ from the CPU's
true division by one unit in the last place (``gated_residual_reference(...,
div_reciprocal=True)`` is the GPU meaning).  Launches pass ``enable_fp_fusion=False``: the chain
rounds ``gate * t`` before adding the residual, so no fused multiply-add.  Sources: ATen
``BinaryMulKernel.cu`` / ``BinaryDivTrueKernel.cu`` (scalars in opmath type).

Layout.  ``patterns/gated_residual.epilogue_layout``: rows (b, s) by C features; y contiguous,
the gate, the residual and out through their (broadcast) strides.  A 2-D grid of tiles of
BLOCK_R rows by BLOCK_C features; offsets in int64.  ``out`` may be ``y`` itself (each element
is loaded and stored by the same program).  Importing this module does not import Triton
(``rope.lazy_kernel``).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend.cuda_kernels.rope import (DTYPES, _launch_on, _next_pow2, _warmup_on,
                                         lazy_kernel)
from fxbackend.patterns.gated_residual import (GatedResidualFusion, epilogue_layout,
                                               epilogue_why_not)

__all__ = ["why_not", "gated_residual_triton", "compile_kernels", "GatedResidualCUDA"]

#: triton.language, bound by ``rope.lazy_kernel`` on first use
tl: Any = None
#: elements per program (a tile of BLOCK_R x BLOCK_C)
TILE = 2048
MAX_BLOCK_C = 512
NUM_WARPS = 4


def _gated_residual_kernel(y_ptr, g_ptr, r_ptr, o_ptr, n_rows, ns, C,
                           gsb, gss, gsc, rsb, rss, rsc, osb, oss, osc, scale,
                           HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < n_rows)[:, None] & (cols < C)[None, :]
    b = rows // ns
    s = rows - b * ns
    t_ = y_ptr.dtype.element_ty
    y = tl.load(y_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (b * gsb + s * gss)[:, None] + cols[None, :] * gsc, mask=m,
                other=0.0).to(tl.float32)
    r = tl.load(r_ptr + (b * rsb + s * rss)[:, None] + cols[None, :] * rsc, mask=m,
                other=0.0).to(tl.float32)
    if HAS_SCALE:
        y = (y * scale).to(t_).to(tl.float32)
    # rounded to the gate's dtype: the chain's (y's, unless a float32 gate multiplies a
    # widened 16-bit y)
    gy = (g * y).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + (b * osb + s * oss)[:, None] + cols[None, :] * osc,
             (r + gy).to(o_ptr.dtype.element_ty), mask=m)


_kernel = lazy_kernel(_gated_residual_kernel)


@functools.lru_cache(maxsize=512)
def _plan(shape: tuple, g_shape: tuple, g_stride: tuple, r_shape: tuple, r_stride: tuple,
          o_stride: tuple) -> tuple:
    """``(grid, args, BLOCK_R, BLOCK_C)``; ValueError for layouts the kernel does not take."""
    lay = epilogue_layout(shape, g_shape, g_stride, r_shape, r_stride, o_stride)
    n_rows = lay.nb * lay.ns
    block_c = max(2, min(_next_pow2(lay.c), MAX_BLOCK_C))
    block_r = max(1, min(TILE // block_c, _next_pow2(max(n_rows, 1))))
    grid = (-(-n_rows // block_r) if lay.c else 0, -(-lay.c // block_c))
    if grid[1] > 65535:
        raise ValueError(f"{lay.c} features is too many for the grid")
    args = (n_rows, lay.ns, lay.c, *lay.g, *lay.r, *lay.o)
    return grid, args, block_r, block_c


def _scale_value(scale_op, scale) -> float:
    if scale_op == "div":  # CUDA eager: multiply by the float32 reciprocal (module docstring)
        return float(np.float32(1.0) / np.float32(scale))
    return 1.0 if scale_op is None else float(np.float32(scale))


def why_not(y: Any, gate: Any, residual: Any, out: Any) -> str | None:
    """None when :func:`gated_residual_triton` takes tensors with these metadata on CUDA; else a
    short reason.  Metadata only; never raises.  Declines non-CUDA devices, mixed devices,
    dtypes other than float32/bfloat16/float16, mixed dtypes except around a float32 gate, and
    what ``_plan`` (``epilogue_layout`` and the grid limit) declines (``epilogue_why_not``)."""
    return epilogue_why_not(y, gate, residual, out, "cuda", _plan, mixed=True)


def _plan_of(y, gate, res, out) -> tuple:
    return _plan(tuple(y.shape), tuple(gate.shape), tuple(gate.stride()), tuple(res.shape),
                 tuple(res.stride()), tuple(out.stride()))


def _launch(p: tuple, y, gate, res, out, scale_op, scale) -> None:
    grid, args, block_r, block_c = p
    if grid[0] == 0 or grid[1] == 0:
        return
    _launch_on(y.device, _kernel()[grid], (y, gate, res, out, *args,
                                           _scale_value(scale_op, scale)),
               dict(HAS_SCALE=scale_op is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                    num_warps=NUM_WARPS, enable_fp_fusion=False))


def gated_residual_triton(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                          out: torch.Tensor, *, scale_op: str | None = None,
                          scale: float | None = None) -> torch.Tensor:
    """``out = gated_residual_reference(y, gate, residual, scale_op, scale,
    div_reciprocal=True)`` with the Triton kernel; returns ``out``.  ``y`` contiguous; gate and
    residual broadcastable to y's shape (any non-negative strides); out of y's shape, either y
    itself or overlapping no input (not checked).  All on one CUDA device (its current stream),
    or on the CPU under ``TRITON_INTERPRET=1``.  Raises ValueError naming the problem."""
    ts = (("y", y), ("gate", gate), ("residual", residual), ("out", out))
    for name, t in ts:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"gated_residual_triton: {name} is not a tensor")
        if t.dtype not in DTYPES or (t.dtype != y.dtype and gate.dtype != torch.float32):
            raise ValueError(f"gated_residual_triton: {name} has dtype {t.dtype}; the kernel "
                             f"takes one of {[str(d) for d in DTYPES]} for all, or any of them "
                             f"around a float32 gate")
        if t.device != y.device:
            raise ValueError(f"gated_residual_triton: {name} is on {t.device}, y on {y.device}")
    if not y.is_contiguous() or out.shape != y.shape:
        raise ValueError("gated_residual_triton: y must be contiguous and out of y's shape")
    if scale_op not in (None, "mul", "div"):
        raise ValueError(f"gated_residual_triton: scale_op {scale_op!r} (None, 'mul', 'div')")
    if scale_op is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise ValueError(f"gated_residual_triton: scale {scale!r} is not a Python number")
    try:
        p = _plan_of(y, gate, residual, out)
    except ValueError as e:
        raise ValueError(f"gated_residual_triton: {e}") from None
    _launch(p, y, gate, residual, out, scale_op, scale)
    return out


def compile_kernels(y, gate, residual, out, scale_op) -> None:
    """Plan-time warm-up for these metadata (a no-op off CUDA or without a GPU); call it only
    when :func:`why_not` returned None.  Safe to call from several threads."""
    if y.device.type != "cuda":
        return
    grid, args, block_r, block_c = _plan(tuple(y.shape), tuple(gate.shape), tuple(gate.stride),
                                         tuple(residual.shape), tuple(residual.stride),
                                         tuple(out.stride))
    if grid[0] == 0 or grid[1] == 0:
        return
    _warmup_on(y.device, _kernel, (y.dtype, gate.dtype, residual.dtype, out.dtype, *args, 1.0),
               dict(HAS_SCALE=scale_op is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                    num_warps=NUM_WARPS, enable_fp_fusion=False, grid=grid))


class GatedResidualCUDA:
    """The Triton epilogue behind the ``gated_residual`` fusion rule on CUDA (see
    ``fxbackend.patterns.gated_residual.GatedResidualFusion`` for the interface)."""

    name = "gated_residual_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, y, gate, residual, out):
        return why_not(y, gate, residual, out)

    def compile(self, y, gate, residual, out, scale_op):
        compile_kernels(y, gate, residual, out, scale_op)

    def run(self, y, gate, residual, out, *, scale_op, scale):
        _launch(_plan_of(y, gate, residual, out), y, gate, residual, out, scale_op, scale)


fxbackend.register_fusion("cuda", GatedResidualFusion(GatedResidualCUDA()))
