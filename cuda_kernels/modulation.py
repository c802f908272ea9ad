"""adaLN modulation on CUDA: a Triton kernel computing ``modulation_reference``
(``patterns/modulation.py``), registered at the end as the kernel of the ``modulation`` fusion
rule for "cuda" (:class:`ModulationCUDA`).

Maths (per row of x, C features; float32 arithmetic; ``round`` = to T, nearest even: the scale's
dtype, x's unless a 16-bit x is widened in the step; the last one to out's dtype, T's unless
the float32 result is narrowed to bf16/fp16 in the step)::

    mean = sum(x) / C                           LayerNorm (rms: mean = 0)
    var  = sum((x - mean)^2) / C                biased (rms: mean(x^2))
    r    = 1 / sqrt(var + eps)                  IEEE-rounded sqrt and divisions
    n    = round((x - mean) * r)
    s1   = round(s + c)                         with the ``c + scale`` add (HAS_ADD)
    out  = round(round(n * s1) + shift)

The sums are tree reductions, so mean/r differ from torch's by float32 rounding (~1e-7
relative), which may move a 16-bit result by one unit in the last place; every other step rounds
where the unfused chain does (launches pass ``enable_fp_fusion=False``: no FMA).  Sources: Ba et
al., "Layer Normalization" (arXiv 1607.06450); Peebles and Xie (arXiv 2212.09748), adaLN;
Liger-Kernel ``ops/layer_norm.py`` (one program per row block, the row held in registers).

Layout.  One program handles BLOCK_R rows by BLOCK_D (>= C, a power of two) features: each row
of x is read once and each output row written once.  x's leading dims may have any strides and
its features any stride (PixArt's first block: a transposed patch embedding); scale and shift
are read through the strides of their expansion to x's shape (stride 0 where broadcast: a
``[B, 1, C]`` row is read per token from cache, never materialised).  Leading dims are merged
where contiguous in x, scale and shift alike (``rope._merge_lead_dims``), at most MAX_LEAD_DIMS
after merging, recovered in the kernel with div/mod (rope's ``_lead_index``/``_lead_offset``).
C is at most MAX_D.  Importing this module does not import Triton (``rope.lazy_kernel``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels import rope as _rope
from fxbackend.cuda_kernels.rmsnorm import num_warps
from fxbackend.cuda_kernels.rope import (DTYPES, MAX_LEAD_DIMS, TILE, _launch_on,
                                         _merge_lead_dims, _next_pow2, _warmup_on, lazy_kernel)
from fxbackend.patterns.modulation import NORMS, ModulationFusion, dtypes_why_not

__all__ = ["modulation_triton", "ModulationCUDA", "why_not", "MAX_D"]

#: the widest row the kernel takes (a row block is held in registers, as in rmsnorm.py)
MAX_D = 8192

#: triton.language, bound by :func:`~fxbackend.cuda_kernels.rope.lazy_kernel` on first use
tl: Any = None


def _modulation_kernel(x_ptr, s_ptr, h_ptr, out_ptr, n_rows, D, size1, size2, size3,
                       xs0, xs1, xs2, xs3, ss0, ss1, ss2, ss3, hs0, hs1, hs2, hs3,
                       x_sf, s_sf, h_sf, eps, c,
                       IS_RMS: tl.constexpr, HAS_ADD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, i0, i1, i2, i3 = _rope._lead_index(n_rows, size1, size2, size3, BLOCK_R)
    x_row = _rope._lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)
    s_row = _rope._lead_offset(i0, i1, i2, i3, ss0, ss1, ss2, ss3)
    h_row = _rope._lead_offset(i0, i1, i2, i3, hs0, hs1, hs2, hs3)

    f = tl.arange(0, BLOCK_D)
    m = row_ok[:, None] & (f < D)[None, :]
    # the chain rounds to the scale's dtype (x's, unless x was widened in the step); the store
    # rounds to out's (the scale's, unless the float32 result is narrowed in the step)
    v = _modulated(x_ptr, s_ptr, h_ptr, x_row, s_row, h_row, f, m, D, x_sf, s_sf, h_sf, eps, c,
                   s_ptr.dtype.element_ty, IS_RMS, HAS_ADD)
    tl.store(out_ptr + rows[:, None] * D + f[None, :], v.to(out_ptr.dtype.element_ty), mask=m)


def _modulated(x_ptr, s_ptr, h_ptr, x_row, s_row, h_row, f, m, D, x_sf, s_sf, h_sf, eps, c,
               t: tl.constexpr, IS_RMS: tl.constexpr, HAS_ADD: tl.constexpr):
    """``@triton.jit`` helper (jitted by :func:`_kernel`; ``int8_fusions.py``'s
    modulation_quantize kernel calls it too): the float32 ``y + shift`` of the rows at element
    offsets ``x_row``/``s_row``/``h_row`` (features ``f``, mask ``m``), each step before it
    rounded to T = ``t`` (module docstring); the caller rounds it to T."""
    x = tl.load(x_ptr + x_row[:, None] + f[None, :] * x_sf, mask=m, other=0.0).to(tl.float32)
    if IS_RMS:
        diff = x
    else:
        # D + 0.0: a float whether D comes as an int or (D == 1) as a constexpr
        mean = tl.div_rn(tl.sum(x, axis=1), D + 0.0)
        diff = tl.where(m, x - mean[:, None], 0.0)
    var = tl.div_rn(tl.sum(diff * diff, axis=1), D + 0.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    # every .to(t).to(float32) is a no-op for float32
    n = (diff * rstd[:, None]).to(t).to(tl.float32)
    s = tl.load(s_ptr + s_row[:, None] + f[None, :] * s_sf, mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:
        s = (s + c).to(t).to(tl.float32)
    y = (n * s).to(t).to(tl.float32)
    h = tl.load(h_ptr + h_row[:, None] + f[None, :] * h_sf, mask=m, other=0.0).to(tl.float32)
    return y + h


#: the jitted kernel (``rope.lazy_kernel``; :func:`_modulated` jitted in this module first)
_kernel = lazy_kernel(_modulation_kernel, helpers=("_modulated",))


# -- launch parameters (pure Python, metadata only) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Launch:
    grid: tuple
    args: tuple  # n_rows, D, three inner sizes, x/scale/shift leading strides, feature strides
    block_r: int
    block_d: int
    num_warps: int


@functools.lru_cache(maxsize=512)
def _plan(shape: tuple, x_stride: tuple, s_stride: tuple, h_stride: tuple) -> _Launch:
    """Launch parameters for x's shape and the strides of x and of scale/shift expanded to x's
    shape; ValueError for arguments the kernel does not take."""
    for v in (*shape, *x_stride, *s_stride, *h_stride):
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")
    if not shape or shape[-1] < 1:
        raise ValueError("x has no features")
    if not len(shape) == len(x_stride) == len(s_stride) == len(h_stride):
        raise ValueError("scale and shift must be expanded to x's shape")
    d = shape[-1]
    if d > MAX_D:
        raise ValueError(f"row size {d} is over the kernel's MAX_D={MAX_D}")
    lead = shape[:-1]
    dims = _merge_lead_dims(lead, x_stride[:-1], s_stride[:-1], h_stride[:-1])
    if len(dims) > MAX_LEAD_DIMS:
        raise ValueError(f"leading dims {lead} merge to {len(dims)} dims; the kernel takes at "
                         f"most {MAX_LEAD_DIMS}")
    dims = [(1, 0, 0, 0)] * (MAX_LEAD_DIMS - len(dims)) + dims
    n_rows = math.prod(lead)
    block_d = max(_next_pow2(d), 2)
    block_r = max(1, min(TILE // block_d, _next_pow2(max(n_rows, 1))))
    args = (n_rows, d, dims[1][0], dims[2][0], dims[3][0], *(t[1] for t in dims),
            *(t[2] for t in dims), *(t[3] for t in dims), x_stride[-1], s_stride[-1],
            h_stride[-1])
    grid = ((n_rows + block_r - 1) // block_r,)
    return _Launch(grid, args, block_r, block_d, num_warps(block_r, block_d))


def why_not(x: Any, scale: Any, shift: Any, out: Any, norm: Any) -> str | None:
    """None when :func:`modulation_triton` takes tensors with these metadata (``scale``/``shift``
    expanded to x's shape), else a short reason.  Metadata only; never raises."""
    try:
        metas = (x, scale, shift, out)
        if not all(isinstance(m, TensorMeta) for m in metas):
            return "inputs are not tensors"
        if x.device.type != "cuda" or any(m.device != x.device for m in metas):
            return "not on one CUDA device"
        why = dtypes_why_not(x.dtype, scale.dtype, shift.dtype, out.dtype)
        if why is not None:
            return why
        if norm not in NORMS:
            return f"norm {norm!r} (one of {NORMS})"
        if tuple(out.shape) != tuple(x.shape) or \
                tuple(out.stride) != tuple(torch.empty(tuple(x.shape), device="meta").stride()):
            return "out is not contiguous with x's shape"
        _plan(tuple(x.shape), tuple(x.stride), tuple(scale.stride), tuple(shift.stride))
        if tuple(scale.shape) != tuple(x.shape) or tuple(shift.shape) != tuple(x.shape):
            return "scale/shift are not expanded to x's shape"
        return None
    except (ValueError, TypeError, AttributeError) as e:
        return str(e)


def _launch(p: _Launch, device: torch.device, x, scale, shift, out, norm: str, eps: float,
            add_c: float | None) -> None:
    if p.grid[0] == 0:
        return
    _launch_on(device, _kernel()[p.grid],
               (x, scale, shift, out, *p.args, float(eps), 0.0 if add_c is None else float(add_c)),
               dict(IS_RMS=norm == "rms", HAS_ADD=add_c is not None, BLOCK_R=p.block_r,
                    BLOCK_D=p.block_d, num_warps=p.num_warps, enable_fp_fusion=False))


def modulation_triton(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                      out: torch.Tensor | None = None, *, norm: str = "layer",
                      eps: float = 1e-6, add_c: float | None = 1.0) -> torch.Tensor:
    """``modulation_reference(x, scale, shift, eps, norm, add_c)`` into ``out`` (allocated when
    None; else contiguous, x's shape, not overlapping the inputs; x's dtype, or bf16/fp16 around
    float32 scale and shift: the float32 result rounded once; a bf16/fp16 x with float32 scale
    and shift is widened exactly) with the Triton kernel.  ``scale``/``shift`` broadcast to x.
    One CUDA device (its current stream), or the CPU under ``TRITON_INTERPRET=1``.  Raises
    ValueError for arguments the kernel does not take."""
    for label, t in (("x", x), ("scale", scale), ("shift", shift)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"modulation_triton: {label} is not a tensor")
        if t.device != x.device:
            raise ValueError(f"modulation_triton: {label} is on {t.device}, x on {x.device}")
    try:
        scale, shift = scale.expand(x.shape), shift.expand(x.shape)
    except RuntimeError as e:
        raise ValueError(f"modulation_triton: scale/shift do not broadcast to x: {e}") from None
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"modulation_triton: out must be contiguous on {x.device} with x's "
                         f"shape {tuple(x.shape)}")
    why = dtypes_why_not(x.dtype, scale.dtype, shift.dtype, out.dtype)
    if why is not None:
        raise ValueError(f"modulation_triton: {why}")
    if norm not in NORMS:
        raise ValueError(f"modulation_triton: norm must be one of {NORMS}, got {norm!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"modulation_triton: eps must be a number >= 0, got {eps!r}")
    try:
        p = _plan(tuple(x.shape), tuple(x.stride()), tuple(scale.stride()),
                  tuple(shift.stride()))
    except ValueError as e:
        raise ValueError(f"modulation_triton: {e}") from None
    _launch(p, x.device, x, scale, shift, out, norm, eps, add_c)
    return out


class ModulationCUDA:
    """The Triton kernel behind the ``modulation`` fusion rule on CUDA (see
    ``fxbackend.patterns.modulation.ModulationFusion`` for the interface)."""

    name = "modulation_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, x, scale, shift, out, norm):
        return why_not(x, scale, shift, out, norm)

    def compile(self, x, scale, shift, out, norm, has_add):
        """Plan-time warm-up into Triton's caches; a no-op off CUDA or without a GPU."""
        if x.device.type != "cuda":
            return
        p = _plan(tuple(x.shape), tuple(x.stride), tuple(scale.stride), tuple(shift.stride))
        if p.grid[0] == 0:
            return
        _warmup_on(x.device, _kernel, (x.dtype, scale.dtype, shift.dtype, out.dtype, *p.args,
                                       1e-6, 1.0),
                   dict(IS_RMS=norm == "rms", HAS_ADD=has_add, BLOCK_R=p.block_r,
                        BLOCK_D=p.block_d, num_warps=p.num_warps, enable_fp_fusion=False,
                        grid=p.grid))

    def run(self, x, scale, shift, out, *, norm, eps, add_c):
        p = _plan(tuple(x.shape), tuple(x.stride()), tuple(scale.stride()),
                  tuple(shift.stride()))
        _launch(p, x.device, x, scale, shift, out, norm, eps, add_c)


fxbackend.register_fusion("cuda", ModulationFusion(ModulationCUDA()))
