"""The INT8 fusions on CUDA (``patterns/int8_fusions.py``): Triton kernels registered at the
bottom as the implementations of ``int8_gated_residual``, ``int8_linear_act_quantize``,
``int8_linear_glu_quantize``, ``int8_linear_cast``, ``modulation_quantize``, ``rms_norm_quantize``, ``act_quantize`` and ``scale_quantize`` for
"cuda".  The integer GEMM
runs through ``torch._int_mm`` (cuBLASLt) on the current stream, as in ``cuda_kernels/int8.py``.

Every kernel writes the statements of the kernels whose chain it fuses, in their order, and
calls their ``@triton.jit`` helpers (``cuda_kernels/int8.py``'s ``_rotate`` and ``_codes``,
``cuda_kernels/activation.py``'s ``_act``, rope's lead-dim helpers); launches pass
``enable_fp_fusion=False`` (no FMA: each product is rounded before it is added, as the unfused
chain rounds it).

- ``int8_gated_residual`` (``_i8_gr_kernel``): tiles of BLOCK_R rows by BLOCK_C features
  (``cuda_kernels/gated_residual.py``'s launch plan and layout: the gate and residual through
  their broadcast strides, out through its own)::

      y   = float32(acc) * x_scale[m]  ;  y = y * w_scale[n]  ;  y = y + bias[n]
      t   = y * s          (s = float32(scale), or float32(1) / float32(scale) for a division:
                            CUDA's eager division by a Python scalar)
      out = residual + round(gate * t)

  The accumulator may be the output's own storage: every element is loaded and stored by the
  same program.
- ``int8_linear_act_quantize`` (``_i8_actq_kernel``): the accumulator in workspace, then one
  program per packed row, blocks of BLOCK features: ``linear_i8``'s epilogue statements, the
  activation, zero tail, rotation; two passes for rows longer than MAX_BLOCK (Flux's 12288).
- ``int8_linear_glu_quantize`` (``_i8_gluq_kernel``): the same over N/2 packed features, each
  block reading both halves of the accumulator row (the epilogue statements on each), then the
  activation of one half times the other (``act_quantize``'s prologue with a multiplier).
- ``modulation_quantize`` (``_modq_kernel``): one program per packed row: the modulation
  kernel's statements on a ``[1, BLOCK_D]`` row (``cuda_kernels/modulation.py``; at Flux's and
  SD3's widths its plan also takes one row per program, with the same warps, so the statistics'
  reduction is the same code), masked tail features set to zero, then the quantize kernel's
  one-pass rotation, ``amax / 127`` and codes.  C is at most MAX_D (a row held in registers).
- ``rms_norm_quantize`` (``_rmsq_kernel``): the same with ``cuda_kernels/rmsnorm.py``'s
  statements (diffusers' weight order; ``weight_in_float`` only with float32 x and weight).
- ``act_quantize`` / ``scale_quantize`` (``_preq_kernel``): one program per packed row, blocks
  of BLOCK features: load, activation (``activation._act``; sigmoid ``1 / (1 + exp(-x))``),
  times the multiplier, scale, each rounded to x's dtype, zero tail, rotation; rows longer than
  MAX_BLOCK take two passes (amax, then codes; the prologue and rotation recomputed, bit for
  bit), as the quantize kernel does.

Padding rows ``M .. Mp-1`` of the packed layout are written as zero codes and scale 0.0.
Importing this module does not import Triton (``rope.lazy_kernel``).  Untuned on a GPU: block
sizes and warps follow the kernels they fuse.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from fxbackend import TensorMeta
from fxbackend.cuda_kernels import activation as _actk
from fxbackend.cuda_kernels import gated_residual as _grk
from fxbackend.cuda_kernels import int8 as _i8
from fxbackend.cuda_kernels import modulation as _modk
from fxbackend.cuda_kernels import rmsnorm as _rmsk
from fxbackend.cuda_kernels import rope as _rope
from fxbackend.cuda_kernels.rmsnorm import num_warps
from fxbackend.cuda_kernels.rope import (DTYPES, MAX_LEAD_DIMS, _launch_on, _merge_lead_dims,
                                         _next_pow2, _warmup_on, lazy_kernel)
from fxbackend.patterns.gated_residual import epilogue_why_not
from fxbackend.patterns.int8 import (REGULAR_HADAMARD_GROUPS, check_linear, hadamard_stages,
                                     packed_nbytes, padded_rows)
from fxbackend.patterns.int8_fusions import (ACT_IDS, PRE_ACTS, SCALE_OPS, FusedKernel,
                                             bias_dtype, direct_gemm, expand_scale_shift,
                                             packed_out, register_int8_fusions)
from fxbackend.patterns.modulation import NORMS
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype

__all__ = ["int8_gated_residual_triton", "int8_linear_act_quantize_triton",
           "int8_linear_glu_quantize_triton",
           "modulation_quantize_triton", "rms_norm_quantize_triton", "act_quantize_triton",
           "KERNELS", "MAX_D"]

#: the widest row the norm-quantize kernels hold in registers (the quantize kernel's one-pass
#: limit)
MAX_D = _i8.MAX_BLOCK
#: triton.language, bound on first use (``rope.lazy_kernel``)
tl: Any = None
#: output dtype codes of ``_round_to``
_DT_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# -- @triton.jit helpers (jitted on first use, see ``_lazy``) -------------------------------------

def _round_to(v, DT: tl.constexpr):
    """float32 ``v`` rounded to the dtype ``DT`` (0 float32: unchanged, 1 bf16, 2 fp16)."""
    if DT == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif DT == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


def _prologue(v, o, scale, t: tl.constexpr, ACT: tl.constexpr, HAS_O: tl.constexpr,
              OP: tl.constexpr):
    """``act``, ``* o``, ``* scale`` on float32 ``v``, each rounded to the element type t."""
    if ACT == 4:
        v = (1.0 / (1.0 + tl.exp(-v))).to(t).to(tl.float32)
    elif ACT != 0:
        v = _actk._act(v, ACT - 1).to(t).to(tl.float32)
    if HAS_O:
        v = (v * o).to(t).to(tl.float32)
    if OP != 0:
        v = (v * scale).to(t).to(tl.float32)
    return v


def _row_offset(row, size1, size2, size3, s0, s1, s2, s3):
    """The element offset of packed row ``row`` (a scalar) over four merged leading dims."""
    i3 = row % size3
    r = row // size3
    i2 = r % size2
    r = r // size2
    i1 = r % size1
    return (r // size1) * s0 + i1 * s1 + i2 * s2 + i3 * s3


#: the ``@triton.jit`` helpers of this module's kernels (jitted by ``rope.lazy_kernel``; more
#: are added below, where they are defined)
_HELPERS = ("_round_to", "_prologue", "_row_offset")
#: the getters that jit the other modules' helpers these kernels call (int8's rotation and
#: codes, activation's ``_act``, modulation's ``_modulated``, rmsnorm's ``_normed``)
_REQUIRES = (_i8._quantize, _actk._inplace, _modk._kernel, _rmsk._kernel)


def _lazy(fn):
    """``rope.lazy_kernel`` of one of this module's kernels, with its helpers."""
    return lazy_kernel(fn, helpers=_HELPERS, requires=_REQUIRES)


# -- kernels -------------------------------------------------------------------------------------

def _i8_gr_kernel(acc_ptr, xs_ptr, ws_ptr, b_ptr, g_ptr, r_ptr, o_ptr, n_rows, ns, C,
                  gsb, gss, gsc, rsb, rss, rsc, osb, oss, osc, scale,
                  HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = rows < n_rows
    c_ok = cols < C
    m = r_ok[:, None] & c_ok[None, :]
    b = rows // ns
    s = rows - b * ns
    acc = tl.load(acc_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0)
    xs = tl.load(xs_ptr + rows, mask=r_ok, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=c_ok, other=0.0)
    y = acc.to(tl.float32) * xs[:, None]
    y = y * ws[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        y = y * scale
    g = tl.load(g_ptr + (b * gsb + s * gss)[:, None] + cols[None, :] * gsc, mask=m, other=0.0)
    r = tl.load(r_ptr + (b * rsb + s * rss)[:, None] + cols[None, :] * rsc, mask=m, other=0.0)
    gy = g * y
    tl.store(o_ptr + (b * osb + s * oss)[:, None] + cols[None, :] * osc, r + gy, mask=m)


def _store_packed(q_ptr, s_ptr, row, row_ok, r, f, D, BLOCK: tl.constexpr):
    """Quantize the rotated row ``r`` (BLOCK features, zeros past D) into packed row ``row``;
    a padding row (``row_ok`` false) gets zero codes and scale 0.0."""
    scale = tl.div_rn(tl.max(tl.abs(r), axis=0), 127.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    codes = tl.where(row_ok, _i8._codes(r, scale), 0).to(tl.int8)
    tl.store(q_ptr + row * D + f, codes, mask=f < D)
    tl.store(s_ptr + row, tl.where(row_ok, scale, 0.0))


def _modq_kernel(x_ptr, s_ptr, h_ptr, q_ptr, sc_ptr, n_rows, D, size1, size2, size3,
                 xs0, xs1, xs2, xs3, ss0, ss1, ss2, ss3, hs0, hs1, hs2, hs3,
                 x_sf, s_sf, h_sf, eps, c, inv,
                 IS_RMS: tl.constexpr, HAS_ADD: tl.constexpr, NST: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # modulation's kernel with BLOCK_R = 1 (its statements, in its order), program = packed row
    rows, row_ok, i0, i1, i2, i3 = _rope._lead_index(n_rows, size1, size2, size3, 1)
    x_row = _rope._lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)
    s_row = _rope._lead_offset(i0, i1, i2, i3, ss0, ss1, ss2, ss3)
    h_row = _rope._lead_offset(i0, i1, i2, i3, hs0, hs1, hs2, hs3)
    f = tl.arange(0, BLOCK_D)
    m = row_ok[:, None] & (f < D)[None, :]
    t = x_ptr.dtype.element_ty  # T
    v = _modk._modulated(x_ptr, s_ptr, h_ptr, x_row, s_row, h_row, f, m, D, x_sf, s_sf, h_sf,
                         eps, c, t, IS_RMS, HAS_ADD)
    v = tl.where(m, v.to(t).to(tl.float32), 0.0)
    # the quantize kernel's one-pass path on that row
    r = _i8._rotate(tl.reshape(v, (BLOCK_D,)), inv, NST, BLOCK_D)
    row = tl.program_id(0).to(tl.int64)
    _store_packed(q_ptr, sc_ptr, row, row < n_rows, r, f, D, BLOCK_D)


def _rmsq_kernel(x_ptr, w_ptr, q_ptr, sc_ptr, n_rows, D, size1, size2, size3,
                 xs0, xs1, xs2, xs3, w_sf, eps, inv,
                 HAS_WEIGHT: tl.constexpr, OUT_DT: tl.constexpr, NST: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # rmsnorm's kernel with BLOCK_R = 1, its output rounded to the norm's dtype (OUT_DT)
    rows, row_ok, i0, i1, i2, i3 = _rope._lead_index(n_rows, size1, size2, size3, 1)
    x_row = _rope._lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)
    f = tl.arange(0, BLOCK_D)
    n, m = _rmsk._normed(x_ptr, w_ptr, x_row, row_ok, f, D, w_sf, eps, HAS_WEIGHT)
    v = tl.where(m, _round_to(n, OUT_DT), 0.0)
    r = _i8._rotate(tl.reshape(v, (BLOCK_D,)), inv, NST, BLOCK_D)
    row = tl.program_id(0).to(tl.int64)
    _store_packed(q_ptr, sc_ptr, row, row < n_rows, r, f, D, BLOCK_D)


def _preq_block(x_ptr, o_ptr, x_row, o_row, start, f, K, x_sf, o_sf, scale, inv,
                ACT: tl.constexpr, HAS_O: tl.constexpr, OP: tl.constexpr, NST: tl.constexpr,
                BLOCK: tl.constexpr):
    """One block of a row through the prologue and the rotation (zeros past K)."""
    ok = start + f < K
    v = tl.load(x_ptr + x_row + (start + f) * x_sf, mask=ok, other=0.0).to(tl.float32)
    o = v
    if HAS_O:
        o = tl.load(o_ptr + o_row + (start + f) * o_sf, mask=ok, other=0.0).to(tl.float32)
    v = _prologue(v, o, scale, x_ptr.dtype.element_ty, ACT, HAS_O, OP)
    return _i8._rotate(tl.where(ok, v, 0.0), inv, NST, BLOCK)


def _preq_kernel(x_ptr, o_ptr, q_ptr, sc_ptr, n_rows, K, size1, size2, size3,
                 xs0, xs1, xs2, xs3, os0, os1, os2, os3, x_sf, o_sf, scale, inv,
                 ACT: tl.constexpr, HAS_O: tl.constexpr, OP: tl.constexpr, NST: tl.constexpr,
                 BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ok = row < n_rows
    rr = tl.where(row_ok, row, 0)  # padding rows read row 0 (masked out below)
    x_row = _row_offset(rr, size1, size2, size3, xs0, xs1, xs2, xs3)
    o_row = _row_offset(rr, size1, size2, size3, os0, os1, os2, os3)
    f = tl.arange(0, BLOCK)
    if ONE_PASS:
        r = _preq_block(x_ptr, o_ptr, x_row, o_row, 0, f, K, x_sf, o_sf, scale, inv, ACT, HAS_O,
                        OP, NST, BLOCK)
        _store_packed(q_ptr, sc_ptr, row, row_ok, r, f, K, BLOCK)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            r = _preq_block(x_ptr, o_ptr, x_row, o_row, start, f, K, x_sf, o_sf, scale, inv,
                            ACT, HAS_O, OP, NST, BLOCK)
            amax = tl.maximum(amax, tl.abs(r))
        qs = tl.div_rn(tl.max(amax, axis=0), 127.0)
        qs = tl.where(qs == 0.0, 1.0, qs)
        for start in range(0, K, BLOCK):
            r = _preq_block(x_ptr, o_ptr, x_row, o_row, start, f, K, x_sf, o_sf, scale, inv,
                            ACT, HAS_O, OP, NST, BLOCK)
            codes = tl.where(row_ok, _i8._codes(r, qs), 0).to(tl.int8)
            tl.store(q_ptr + row * K + start + f, codes, mask=start + f < K)
        tl.store(sc_ptr + row, tl.where(row_ok, qs, 0.0))


def _actq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, inv,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NST: tl.constexpr,
                BLOCK: tl.constexpr):
    """One block of an accumulator row through linear_i8's epilogue, the activation and the
    rotation (zeros past ``lim``: N, or 0 in a padding row)."""
    ok = start + f < lim
    a = tl.load(acc_ptr + row * N + start + f, mask=ok, other=0)
    y = a.to(tl.float32) * xs
    y = y * tl.load(ws_ptr + start + f, mask=ok, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + start + f, mask=ok, other=0.0).to(tl.float32)
    y = _prologue(y, y, 1.0, tl.float32, ACT, False, 0)
    return _i8._rotate(tl.where(ok, y, 0.0), inv, NST, BLOCK)


def _i8_actq_kernel(acc_ptr, xs_ptr, ws_ptr, b_ptr, q_ptr, sc_ptr, n_rows, N, inv,
                    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NST: tl.constexpr,
                    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ok = row < n_rows
    xs = tl.load(xs_ptr + tl.where(row_ok, row, 0))
    lim = tl.where(row_ok, N, 0)
    f = tl.arange(0, BLOCK)
    if ONE_PASS:
        r = _actq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, 0, f, N, inv, ACT, HAS_BIAS,
                        NST, BLOCK)
        _store_packed(q_ptr, sc_ptr, row, row_ok, r, f, N, BLOCK)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            r = _actq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, inv, ACT,
                            HAS_BIAS, NST, BLOCK)
            amax = tl.maximum(amax, tl.abs(r))
        qs = tl.div_rn(tl.max(amax, axis=0), 127.0)
        qs = tl.where(qs == 0.0, 1.0, qs)
        for start in range(0, N, BLOCK):
            r = _actq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, inv, ACT,
                            HAS_BIAS, NST, BLOCK)
            codes = tl.where(row_ok, _i8._codes(r, qs), 0).to(tl.int8)
            tl.store(q_ptr + row * N + start + f, codes, mask=start + f < N)
        tl.store(sc_ptr + row, tl.where(row_ok, qs, 0.0))


def _epilogue_at(acc_ptr, xs, ws_ptr, b_ptr, row, col, ok, N, HAS_BIAS: tl.constexpr):
    """linear_i8's epilogue of the accumulator row ``row`` at columns ``col`` (float32)."""
    a = tl.load(acc_ptr + row * N + col, mask=ok, other=0)
    y = a.to(tl.float32) * xs
    y = y * tl.load(ws_ptr + col, mask=ok, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    return y


def _gluq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, H, g0, inv,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NST: tl.constexpr,
                BLOCK: tl.constexpr):
    """One block of H features: linear_i8's epilogue of both halves of an accumulator row
    (the activated half at column ``g0``), the activation times the other half, the rotation
    (zeros past ``lim``: H, or 0 in a padding row)."""
    ok = start + f < lim
    yg = _epilogue_at(acc_ptr, xs, ws_ptr, b_ptr, row, g0 + start + f, ok, N, HAS_BIAS)
    yo = _epilogue_at(acc_ptr, xs, ws_ptr, b_ptr, row, H - g0 + start + f, ok, N, HAS_BIAS)
    v = _prologue(yg, yo, 1.0, tl.float32, ACT, True, 0)
    return _i8._rotate(tl.where(ok, v, 0.0), inv, NST, BLOCK)


def _i8_gluq_kernel(acc_ptr, xs_ptr, ws_ptr, b_ptr, q_ptr, sc_ptr, n_rows, N, H, g0, inv,
                    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NST: tl.constexpr,
                    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ok = row < n_rows
    xs = tl.load(xs_ptr + tl.where(row_ok, row, 0))
    lim = tl.where(row_ok, H, 0)
    f = tl.arange(0, BLOCK)
    if ONE_PASS:
        r = _gluq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, 0, f, N, H, g0, inv, ACT,
                        HAS_BIAS, NST, BLOCK)
        _store_packed(q_ptr, sc_ptr, row, row_ok, r, f, H, BLOCK)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            r = _gluq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, H, g0, inv, ACT,
                            HAS_BIAS, NST, BLOCK)
            amax = tl.maximum(amax, tl.abs(r))
        qs = tl.div_rn(tl.max(amax, axis=0), 127.0)
        qs = tl.where(qs == 0.0, 1.0, qs)
        for start in range(0, H, BLOCK):
            r = _gluq_block(acc_ptr, xs, ws_ptr, b_ptr, row, lim, start, f, N, H, g0, inv, ACT,
                            HAS_BIAS, NST, BLOCK)
            codes = tl.where(row_ok, _i8._codes(r, qs), 0).to(tl.int8)
            tl.store(q_ptr + row * H + start + f, codes, mask=start + f < H)
        tl.store(sc_ptr + row, tl.where(row_ok, qs, 0.0))


_HELPERS = _HELPERS + ("_store_packed", "_preq_block", "_actq_block", "_epilogue_at",
                       "_gluq_block")
_actq = _lazy(_i8_actq_kernel)
_gluq = _lazy(_i8_gluq_kernel)
_gr_kernel = _lazy(_i8_gr_kernel)
_modq = _lazy(_modq_kernel)
_rmsq = _lazy(_rmsq_kernel)
_preq = _lazy(_preq_kernel)


# -- int8_gated_residual ---------------------------------------------------------------------------

def _scale_value(scale_op, scale) -> float:
    return _grk._scale_value(scale_op, scale)


def _gr_plan(y_shape, gate, res, out) -> tuple:
    return _grk._plan(tuple(y_shape), tuple(gate.shape), tuple(gate.stride()),
                      tuple(res.shape), tuple(res.stride()), tuple(out.stride()))


def _gr_launch(p, acc, xs, ws, bias, gate, res, out, scale_op, scale) -> None:
    grid, args, block_r, block_c = p
    if grid[0] == 0 or grid[1] == 0:
        return
    _launch_on(acc.device, _gr_kernel()[grid],
               (acc, xs, ws, acc if bias is None else bias, gate, res, out, *args,
                _scale_value(scale_op, scale)),
               dict(HAS_BIAS=bias is not None, HAS_SCALE=scale_op is not None, BLOCK_R=block_r,
                    BLOCK_C=block_c, num_warps=_grk.NUM_WARPS, enable_fp_fusion=False))


def int8_gated_residual_triton(x, w, w_scale, x_scale=None, bias=None, *, gate, residual,
                               x_kind, group=1, m=-1, lead=(), y_shape=None, scale_op=None,
                               scale=None, out=None, block=None) -> torch.Tensor:
    """``int8_gated_residual_reference(..., div_reciprocal=True)`` with an int8 weight through
    this file's kernel and ``torch._int_mm`` (direct calls, benchmarks, interpreter tests):
    returns ``out`` (allocated contiguous when None).  Checks the op's contract only: shapes
    that ``torch._int_mm`` on CUDA rejects raise its error (the rule declines them instead)."""
    M, K, N, lead_out = check_linear(*(None if t is None else TensorMeta.of(t)
                                       for t in (x, w, w_scale, x_scale, bias)),
                                     x_kind=x_kind, w_kind="int8", group=group, m=m,
                                     lead=lead, who="int8_gated_residual_triton")
    y_shape = tuple(lead_out) + (N,) if y_shape is None else tuple(y_shape)
    if not y_shape or y_shape[-1] != N or math.prod(y_shape) != M * N:
        raise ValueError(f"int8_gated_residual_triton: y_shape {y_shape} is not [..., {N}] "
                         f"with {M * N} elements")
    if out is None:
        out = torch.empty(y_shape, dtype=torch.float32, device=x.device)
    for label, t in (("gate", gate), ("residual", residual), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"int8_gated_residual_triton: {label} must be a float32 tensor "
                             f"on {x.device}")
    try:
        p = _gr_plan(y_shape, gate, residual, out)
    except ValueError as e:
        raise ValueError(f"int8_gated_residual_triton: {e}") from None
    acc, xs = direct_gemm(_i8._device(block), x_kind, group, M, K, N, x, x_scale, w, out)
    _gr_launch(p, acc, xs, w_scale, bias, gate, residual, out, scale_op, scale)
    return out


# -- int8_linear_act_quantize ----------------------------------------------------------------------

def _actq_plan(m: int, n: int, group: int, block: int | None = None) -> tuple:
    _check_group(n, group)
    blk = _i8._block(n, block)
    if blk % group or blk & (blk - 1):
        raise ValueError(f"block {blk} must be a power of two and a multiple of group={group}")
    return (padded_rows(m),), blk, 4 if blk <= 1024 else 8


def _actq_launch(acc, xs, ws, bias, out, act, group, block=None) -> None:
    m, n = acc.shape
    grid, blk, nw = _actq_plan(m, n, group, block)
    if grid[0] == 0:
        return
    q, sc = _packed_parts(out, m, n)
    nst = hadamard_stages(group)
    _launch_on(acc.device, _actq()[grid],
               (acc, xs, ws, acc if bias is None else bias, q, sc, m, n, 2.0 ** -nst),
               dict(ACT=ACT_IDS[act], HAS_BIAS=bias is not None, NST=nst, BLOCK=blk,
                    ONE_PASS=n <= blk, num_warps=nw, enable_fp_fusion=False))


def int8_linear_act_quantize_triton(qx, x_scale, w, w_scale, bias=None, *, act, group=1,
                                    out=None, block=None) -> torch.Tensor:
    """``quantize(act(linear_i8(qx, w)), group)`` for int8 rows ``qx [M, K]`` (their float32
    scales ``x_scale``) and an int8 weight ``w [N, K]`` (``w_scale``): ``torch._int_mm`` into a
    temporary accumulator, then ``_i8_actq_kernel``; the packed layout (into ``out`` when
    given).  ``block``: features per block (tests: small ones take the two-pass path).  Checks
    the op's contract only (shapes ``torch._int_mm`` on CUDA rejects raise its error)."""
    M, K, N, _ = check_linear(*(None if t is None else TensorMeta.of(t)
                                for t in (qx, w, w_scale, x_scale, bias)),
                              x_kind="int8", w_kind="int8", group=1, m=-1, lead=(),
                              who="int8_linear_act_quantize_triton")
    if act not in PRE_ACTS:
        raise ValueError(f"int8_linear_act_quantize_triton: activation {act!r}")
    if out is None:
        out = torch.empty(packed_nbytes(M, N), dtype=torch.int8, device=qx.device)
    try:
        _actq_plan(M, N, group, block)
    except ValueError as e:
        raise ValueError(f"int8_linear_act_quantize_triton: {e}") from None
    acc = torch.empty(M, N, dtype=torch.int32, device=qx.device)
    _i8.int_mm(qx, w, acc)
    _actq_launch(acc, x_scale, w_scale, bias, out, act, group, block)
    return out


# -- int8_linear_glu_quantize ----------------------------------------------------------------------

def _gluq_plan(m: int, n: int, gate: Any, group: int, block: int | None = None) -> tuple:
    if isinstance(gate, bool) or gate not in (0, 1):
        raise ValueError(f"gate {gate!r} (0 or 1: the half the activation takes)")
    if n % 2:
        raise ValueError(f"{n} output features do not split into two halves")
    return _actq_plan(m, n // 2, group, block)


def _gluq_launch(acc, xs, ws, bias, out, act, gate, group, block=None) -> None:
    m, n = acc.shape
    grid, blk, nw = _gluq_plan(m, n, gate, group, block)
    if grid[0] == 0:
        return
    h = n // 2
    q, sc = _packed_parts(out, m, h)
    nst = hadamard_stages(group)
    _launch_on(acc.device, _gluq()[grid],
               (acc, xs, ws, acc if bias is None else bias, q, sc, m, n, h, gate * h,
                2.0 ** -nst),
               dict(ACT=ACT_IDS[act], HAS_BIAS=bias is not None, NST=nst, BLOCK=blk,
                    ONE_PASS=h <= blk, num_warps=nw, enable_fp_fusion=False))


def int8_linear_glu_quantize_triton(qx, x_scale, w, w_scale, bias=None, *, act, gate, group=1,
                                    out=None, block=None) -> torch.Tensor:
    """``quantize(act(y[..., gate half]) * y[..., other half], group)`` of ``y =
    linear_i8(qx, w)`` for int8 rows ``qx [M, K]`` (their float32 scales ``x_scale``) and an
    int8 weight ``w [N, K]`` (N even; ``w_scale``): ``torch._int_mm`` into a temporary
    accumulator, then ``_i8_gluq_kernel``; the packed layout of ``[M, N/2]`` (into ``out``
    when given).  ``gate`` 0 activates the first half, 1 the second.  ``block``: features per
    block (tests: small ones take the two-pass path).  Checks the op's contract only."""
    who = "int8_linear_glu_quantize_triton"
    M, K, N, _ = check_linear(*(None if t is None else TensorMeta.of(t)
                                for t in (qx, w, w_scale, x_scale, bias)),
                              x_kind="int8", w_kind="int8", group=1, m=-1, lead=(), who=who)
    if act not in PRE_ACTS:
        raise ValueError(f"{who}: activation {act!r}")
    try:
        _gluq_plan(M, N, gate, group, block)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
    if out is None:
        out = torch.empty(packed_nbytes(M, N // 2), dtype=torch.int8, device=qx.device)
    acc = torch.empty(M, N, dtype=torch.int32, device=qx.device)
    _i8.int_mm(qx, w, acc)
    _gluq_launch(acc, x_scale, w_scale, bias, out, act, gate, group, block)
    return out


# -- the quantize-feeding kernels: launch plans (pure Python, metadata only) -----------------------

def _check_group(k: int, group: Any) -> None:
    if isinstance(group, bool) or group not in REGULAR_HADAMARD_GROUPS:
        raise ValueError(f"group {group!r} (one of {REGULAR_HADAMARD_GROUPS})")
    if k == 0 or k % group:
        raise ValueError(f"{k} features is not a positive multiple of group={group}")


def _lead(shape: tuple, *strides: tuple) -> list:
    dims = _merge_lead_dims(tuple(shape[:-1]), *(tuple(s[:-1]) for s in strides))
    if len(dims) > MAX_LEAD_DIMS:
        raise ValueError(f"leading dims {tuple(shape[:-1])} merge to {len(dims)} dims; the "
                         f"kernel takes at most {MAX_LEAD_DIMS}")
    return [(1,) + (0,) * len(strides)] * (MAX_LEAD_DIMS - len(dims)) + dims


@dataclasses.dataclass(frozen=True)
class _RowLaunch:
    grid: tuple
    args: tuple
    block: int
    num_warps: int


def _concrete(*vals) -> None:
    for v in vals:
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")


@functools.lru_cache(maxsize=512)
def _modq_plan(shape: tuple, xst: tuple, sst: tuple, hst: tuple, group: int) -> _RowLaunch:
    """Launch parameters of ``_modq_kernel`` (scale/shift strides expanded to x's shape);
    ValueError for what it does not take."""
    _concrete(*shape, *xst, *sst, *hst)
    if not shape or not len(shape) == len(xst) == len(sst) == len(hst):
        raise ValueError("scale and shift must be expanded to x's shape")
    d = shape[-1]
    _check_group(d, group)
    if d > MAX_D:
        raise ValueError(f"row size {d} is over MAX_D={MAX_D} (a row held in registers)")
    dims = _lead(shape, xst, sst, hst)
    n_rows = math.prod(shape[:-1])
    block_d = max(_next_pow2(d), 4)
    args = (n_rows, d, dims[1][0], dims[2][0], dims[3][0], *(t[1] for t in dims),
            *(t[2] for t in dims), *(t[3] for t in dims), xst[-1], sst[-1], hst[-1])
    return _RowLaunch((padded_rows(n_rows),), args, block_d, num_warps(1, max(_next_pow2(d), 2)))


@functools.lru_cache(maxsize=512)
def _rmsq_plan(shape: tuple, xst: tuple, w_stride: int, group: int) -> _RowLaunch:
    _concrete(*shape, *xst, w_stride)
    if not shape:
        raise ValueError("x is a scalar")
    d = shape[-1]
    _check_group(d, group)
    if d > MAX_D:
        raise ValueError(f"row size {d} is over MAX_D={MAX_D} (a row held in registers)")
    if xst[-1] != 1 and d > 1:
        raise ValueError("x's features are strided")
    dims = _lead(shape, xst)
    n_rows = math.prod(shape[:-1])
    args = (n_rows, d, dims[1][0], dims[2][0], dims[3][0], *(t[1] for t in dims), w_stride)
    return _RowLaunch((padded_rows(n_rows),), args, max(_next_pow2(d), 4),
                      num_warps(1, max(_next_pow2(d), 2)))


@functools.lru_cache(maxsize=512)
def _preq_plan(shape: tuple, xst: tuple, ost: tuple, group: int,
               block: int | None = None) -> _RowLaunch:
    _concrete(*shape, *xst, *ost)
    if not shape or len(xst) != len(shape) or len(ost) != len(shape):
        raise ValueError("the multiplier must be expanded to x's shape")
    k = shape[-1]
    _check_group(k, group)
    blk = _i8._block(k, block)
    if blk % group or blk & (blk - 1):
        raise ValueError(f"block {blk} must be a power of two and a multiple of group={group}")
    dims = _lead(shape, xst, ost)
    n_rows = math.prod(shape[:-1])
    args = (n_rows, k, dims[1][0], dims[2][0], dims[3][0], *(t[1] for t in dims),
            *(t[2] for t in dims), xst[-1], ost[-1])
    return _RowLaunch((padded_rows(n_rows),), args, blk, 4 if blk <= 1024 else 8)


def _errors_as_reasons(why_not):
    """A kernel's check whose launch plan raises ValueError for what the kernel does not take
    (TypeError, AttributeError for metadata it cannot read): the error's text is the reason."""
    @functools.wraps(why_not)
    def checked(*args, **kw) -> str | None:
        try:
            return why_not(*args, **kw)
        except (ValueError, TypeError, AttributeError) as e:
            return str(e)
    return checked


def _why_not_cuda(metas: tuple, any_device: bool = False) -> str | None:
    if not all(isinstance(m, TensorMeta) for m in metas):
        return "inputs are not tensors"
    dev = metas[0].device
    if (dev.type != "cuda" and not any_device) or any(m.device != dev for m in metas):
        return "not on one CUDA device"
    if any(m.is_symbolic for m in metas):
        return "symbolic metadata"
    return None


def _why_not_out(out, m, k) -> str | None:
    if out.dtype != torch.int8 or tuple(out.shape) != (packed_nbytes(m, k),) or \
            not out.is_contiguous or out.storage_offset % 4:
        return f"out must be the packed int8 vector of {packed_nbytes(m, k)} bytes at a " \
               f"storage offset divisible by 4"
    return None


def _packed_parts(out, m, k) -> tuple:
    mp = padded_rows(m)
    return out[:mp * k], out[mp * k:mp * k + 4 * mp].view(torch.float32)


def _launch_packed(p: _RowLaunch, kernel, x, out, group, ins: tuple, scalars: tuple,
                   **constexprs) -> None:
    """A quantize-feeding kernel (``kernel()``) on ``p``'s grid: its operands ``ins``, the codes
    and scales of the packed ``out``, p's sizes and strides, ``scalars``, then 2^-NST;
    ``constexprs`` besides NST and the warps."""
    if p.grid[0] == 0:
        return
    k = x.shape[-1]
    q, sc = _packed_parts(out, x.numel() // k, k)
    nst = hadamard_stages(group)
    _launch_on(x.device, kernel()[p.grid], (*ins, q, sc, *p.args, *scalars, 2.0 ** -nst),
               dict(constexprs, NST=nst, num_warps=p.num_warps, enable_fp_fusion=False))


def _warm_packed(p: _RowLaunch, kernel, x, group, in_dtypes: tuple, scalars: tuple,
                 **constexprs) -> None:
    """Plan-time warm-up of what :func:`_launch_packed` launches (``in_dtypes``: the operands')."""
    if p.grid[0] == 0:
        return
    nst = hadamard_stages(group)
    _warmup_on(x.device, kernel, (*in_dtypes, torch.int8, torch.float32, *p.args, *scalars,
                                  2.0 ** -nst),
               dict(constexprs, NST=nst, num_warps=p.num_warps, enable_fp_fusion=False,
                    grid=p.grid))


# -- modulation_quantize ---------------------------------------------------------------------------

@_errors_as_reasons
def _modq_why_not(x, scale, shift, out, norm, group, any_device=False, **_) -> str | None:
    why = _why_not_cuda((x, scale, shift, out), any_device)
    if why is not None:
        return why
    if x.dtype not in DTYPES or scale.dtype != x.dtype or shift.dtype != x.dtype:
        return "dtypes (one of float32, bfloat16, float16 for x, scale and shift)"
    if norm not in NORMS:
        return f"norm {norm!r} (one of {NORMS})"
    if tuple(scale.shape) != tuple(x.shape) or tuple(shift.shape) != tuple(x.shape):
        return "scale/shift are not expanded to x's shape"
    _modq_plan(tuple(x.shape), tuple(x.stride), tuple(scale.stride), tuple(shift.stride),
               group)
    k = int(x.shape[-1])
    return _why_not_out(out, x.numel // k, k)


def _modq_launch(p: _RowLaunch, x, scale, shift, out, norm, eps, add_c, group) -> None:
    _launch_packed(p, _modq, x, out, group, (x, scale, shift),
                   (float(eps), 0.0 if add_c is None else float(add_c)),
                   IS_RMS=norm == "rms", HAS_ADD=add_c is not None, BLOCK_D=p.block)


def modulation_quantize_triton(x, scale, shift, out=None, *, norm="layer", eps=1e-6, add_c=1.0,
                               group=1) -> torch.Tensor:
    """``quantize_i8_convrot_triton(modulation_triton(x, scale, shift, ...), group)`` in one
    kernel: the packed layout (into ``out`` when given).  ``scale``/``shift`` broadcast to x.
    One CUDA device, or the CPU under ``TRITON_INTERPRET=1``.  ValueError for what the kernel
    does not take."""
    scale, shift = expand_scale_shift("modulation_quantize_triton", x, scale, shift)
    out = packed_out(x, out, x.device)
    TM = TensorMeta.of
    why = _modq_why_not(TM(x), TM(scale), TM(shift), TM(out), norm, group, any_device=True)
    if why is not None:
        raise ValueError(f"modulation_quantize_triton: unsupported input: {why}")
    p = _modq_plan(tuple(x.shape), tuple(x.stride()), tuple(scale.stride()),
                   tuple(shift.stride()), group)
    _modq_launch(p, x, scale, shift, out, norm, eps, add_c, group)
    return out


# -- rms_norm_quantize -----------------------------------------------------------------------------

@_errors_as_reasons
def _rmsq_why_not(x, w, out, norm_dtype, group, weight_in_float=False, any_device=False,
                  **_) -> str | None:
    why = _why_not_cuda((x, out) if w is None else (x, w, out), any_device)
    if why is not None:
        return why
    if weight_in_float and w is not None and (x.dtype != torch.float32 or
                                              w.dtype != torch.float32):
        return "weight_in_float (torch.nn.RMSNorm's 16-bit order): not the Triton " \
               "RMSNorm's order"
    if x.dtype not in DTYPES or (w is not None and w.dtype not in DTYPES):
        return "dtypes (float32, bfloat16 or float16)"
    if norm_dtype not in _DT_ID:
        return "the norm's output metadata"
    if w is not None and (tuple(w.shape) != (x.shape[-1],) or len(w.stride) != 1):
        return f"weight shape {tuple(w.shape)}"
    _rmsq_plan(tuple(x.shape), tuple(x.stride), int(w.stride[0]) if w is not None else 0,
               group)
    k = int(x.shape[-1])
    return _why_not_out(out, x.numel // k, k)


def _rmsq_launch(x, w, out, eps, norm_dtype, group) -> None:
    p = _rmsq_plan(tuple(x.shape), tuple(x.stride()), int(w.stride(0)) if w is not None else 0,
                   group)
    _launch_packed(p, _rmsq, x, out, group, (x, x if w is None else w), (float(eps),),
                   HAS_WEIGHT=w is not None, OUT_DT=_DT_ID[norm_dtype], BLOCK_D=p.block)


def rms_norm_quantize_triton(x, weight, eps, group=1, out=None) -> torch.Tensor:
    """``quantize_i8_convrot_triton(rms_norm_triton(x, weight, eps), group)`` in one kernel
    (diffusers' weight order); the packed layout.  ValueError for what it does not take."""
    if not isinstance(x, torch.Tensor):
        raise ValueError("rms_norm_quantize_triton: x is not a tensor")
    out = packed_out(x, out, x.device)
    nd = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype)
    TM = TensorMeta.of
    why = _rmsq_why_not(TM(x), None if weight is None else TM(weight), TM(out), nd, group,
                        any_device=True)
    if why is not None:
        raise ValueError(f"rms_norm_quantize_triton: unsupported input: {why}")
    _rmsq_launch(x, weight, out, eps, nd, group)
    return out


# -- act_quantize / scale_quantize -----------------------------------------------------------------

@_errors_as_reasons
def _preq_why_not(x, other, out, act, scale_op, group, any_device=False, **_) -> str | None:
    why = _why_not_cuda((x, out) if other is None else (x, other, out), any_device)
    if why is not None:
        return why
    if x.dtype not in DTYPES or (other is not None and other.dtype != x.dtype):
        return "dtypes (one of float32, bfloat16, float16 for x and the multiplier)"
    if act not in ACT_IDS or scale_op not in SCALE_OPS:
        return f"activation {act!r} / scale {scale_op!r}"
    if other is not None and tuple(other.shape) != tuple(x.shape):
        return "the multiplier must be expanded to x's shape"
    _preq_plan(tuple(x.shape), tuple(x.stride),
               tuple(x.stride if other is None else other.stride), group)
    k = int(x.shape[-1])
    return _why_not_out(out, x.numel // k, k)


def _preq_launch(x, other, out, act, scale_op, scale, group, block=None) -> None:
    p = _preq_plan(tuple(x.shape), tuple(x.stride()),
                   tuple(x.stride() if other is None else other.stride()), group, block)
    _launch_packed(p, _preq, x, out, group, (x, x if other is None else other),
                   (_scale_value(scale_op, scale),), ACT=ACT_IDS[act], HAS_O=other is not None,
                   OP=SCALE_OPS[scale_op], BLOCK=p.block, ONE_PASS=x.shape[-1] <= p.block)


def act_quantize_triton(x, other=None, out=None, *, act=None, scale_op=None, scale=None,
                        group=1, block=None) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(v) {group}`` of ``v = [act](x) [* other] [* | / scale]``
    (each step rounded to x's dtype; the activation is ``cuda_kernels/activation.py``'s; a
    division multiplies by the float32 reciprocal, as CUDA eager) in one kernel: the packed
    layout.  ``block``: the features per block (tests: a small one takes the two-pass path).
    ValueError for what the kernel does not take."""
    if not isinstance(x, torch.Tensor):
        raise ValueError("act_quantize_triton: x is not a tensor")
    if other is not None:
        try:
            other = other.expand(x.shape)
        except RuntimeError as e:
            raise ValueError(f"act_quantize_triton: other does not broadcast to x: {e}") \
                from None
    out = packed_out(x, out, x.device)
    TM = TensorMeta.of
    why = _preq_why_not(TM(x), None if other is None else TM(other), TM(out), act, scale_op,
                        group, any_device=True)
    if why is None and block is not None:
        try:
            _preq_plan(tuple(x.shape), tuple(x.stride()),
                       tuple(x.stride() if other is None else other.stride()), group, block)
        except ValueError as e:
            why = str(e)
    if why is not None:
        raise ValueError(f"act_quantize_triton: unsupported input: {why}")
    _preq_launch(x, other, out, act, scale_op, scale, group, block)
    return out


# -- the kernels of the rules (patterns/int8_fusions.FusedKernel) ----------------------------------

def _gr_why_not(y, out, gate, residual, **_) -> str | None:
    why = epilogue_why_not(y, gate, residual, out, "cuda", _grk._plan)
    if why is None and y.dtype != torch.float32:
        why = f"dtype {y.dtype} (the int8 linear's output is float32)"
    return why


def _gr_compile(linear, y, out, gate, residual, *, scale_op, **_) -> None:
    """Plan-time warm-up of the epilogue (CUDA only)."""
    if y.device.type != "cuda":
        return
    grid, args, block_r, block_c = _grk._plan(
        tuple(y.shape), tuple(gate.shape), tuple(gate.stride), tuple(residual.shape),
        tuple(residual.stride), tuple(out.stride))
    if grid[0] == 0 or grid[1] == 0:
        return
    b = bias_dtype(linear)
    _warmup_on(y.device, _gr_kernel, (torch.int32, torch.float32, torch.float32,
                                      torch.int32 if b is None else b, gate.dtype,
                                      residual.dtype, out.dtype, *args, 1.0),
               dict(HAS_BIAS=b is not None, HAS_SCALE=scale_op is not None, BLOCK_R=block_r,
                    BLOCK_C=block_c, num_warps=_grk.NUM_WARPS, enable_fp_fusion=False,
                    grid=grid))


def _gr_run(acc, xs, ws, bias, out, gate, residual, *, y_shape, scale_op, scale, **_) -> None:
    _gr_launch(_gr_plan(y_shape, gate, residual, out), acc, xs, ws, bias, gate, residual, out,
               scale_op, scale)


@_errors_as_reasons
def _actq_why_not(y, out, *, act, group, **_) -> str | None:
    n = y.shape[-1]
    if act not in PRE_ACTS:
        return f"activation {act!r} (one of {PRE_ACTS})"
    _actq_plan(y.numel // n, n, group)
    return _why_not_cuda((out,)) or _why_not_out(out, y.numel // n, n)


def _actq_compile(linear, y, out, *, act, group, **_) -> None:
    """Plan-time warm-up of the pass (CUDA only)."""
    if y.device.type != "cuda":
        return
    n = y.shape[-1]
    m = y.numel // n
    grid, blk, nw = _actq_plan(m, n, group)
    b = bias_dtype(linear)
    nst = hadamard_stages(group)
    _warmup_on(y.device, _actq, (torch.int32, torch.float32, torch.float32,
                                 torch.int32 if b is None else b, torch.int8, torch.float32,
                                 m, n, 2.0 ** -nst),
               dict(ACT=ACT_IDS[act], HAS_BIAS=b is not None, NST=nst, BLOCK=blk,
                    ONE_PASS=n <= blk, num_warps=nw, enable_fp_fusion=False, grid=grid))


def _actq_run(acc, xs, ws, bias, out, *, act, group, **_) -> None:
    _actq_launch(acc, xs, ws, bias, out, act, group)


@_errors_as_reasons
def _gluq_why_not(y, out, *, act, gate, group, **_) -> str | None:
    n = y.shape[-1]
    if act not in PRE_ACTS:
        return f"activation {act!r} (one of {PRE_ACTS})"
    _gluq_plan(y.numel // n, n, gate, group)
    return _why_not_cuda((out,)) or _why_not_out(out, y.numel // n, n // 2)


def _gluq_compile(linear, y, out, *, act, gate, group, **_) -> None:
    """Plan-time warm-up of the pass (CUDA only)."""
    if y.device.type != "cuda":
        return
    n = y.shape[-1]
    m = y.numel // n
    grid, blk, nw = _gluq_plan(m, n, gate, group)
    b = bias_dtype(linear)
    nst = hadamard_stages(group)
    _warmup_on(y.device, _gluq, (torch.int32, torch.float32, torch.float32,
                                 torch.int32 if b is None else b, torch.int8, torch.float32,
                                 m, n, n // 2, gate * (n // 2), 2.0 ** -nst),
               dict(ACT=ACT_IDS[act], HAS_BIAS=b is not None, NST=nst, BLOCK=blk,
                    ONE_PASS=n // 2 <= blk, num_warps=nw, enable_fp_fusion=False, grid=grid))


def _gluq_run(acc, xs, ws, bias, out, *, act, gate, group, **_) -> None:
    _gluq_launch(acc, xs, ws, bias, out, act, gate, group)


def _cast_why_not(y, out, **_) -> str | None:
    if out.dtype not in (torch.bfloat16, torch.float16):
        return f"output dtype {out.dtype} (bfloat16 or float16)"
    return _why_not_cuda((out,))


def _cast_run(acc, xs, ws, bias, out, **_) -> None:
    _i8.epilogue_triton(acc, out, xs, ws, bias)


def _modq_compile(x, scale, shift, out, *, norm, add_c, group, **_) -> None:
    if x.device.type != "cuda":
        return
    p = _modq_plan(tuple(x.shape), tuple(x.stride), tuple(scale.stride), tuple(shift.stride),
                   group)
    _warm_packed(p, _modq, x, group, (x.dtype,) * 3, (1e-6, 1.0), IS_RMS=norm == "rms",
                 HAS_ADD=add_c is not None, BLOCK_D=p.block)


def _modq_run(x, scale, shift, out, *, norm, eps, add_c, group) -> None:
    p = _modq_plan(tuple(x.shape), tuple(x.stride()), tuple(scale.stride()),
                   tuple(shift.stride()), group)
    _modq_launch(p, x, scale, shift, out, norm, eps, add_c, group)


def _rmsq_compile(x, w, out, *, norm_dtype, group, **_) -> None:
    if x.device.type != "cuda":
        return
    p = _rmsq_plan(tuple(x.shape), tuple(x.stride), int(w.stride[0]) if w is not None else 0,
                   group)
    _warm_packed(p, _rmsq, x, group, (x.dtype, x.dtype if w is None else w.dtype), (1e-6,),
                 HAS_WEIGHT=w is not None, OUT_DT=_DT_ID[norm_dtype], BLOCK_D=p.block)


def _rmsq_run(x, w, out, *, eps, norm_dtype, weight_in_float, group) -> None:
    if weight_in_float and w is not None and (x.dtype != torch.float32 or
                                              w.dtype != torch.float32):
        raise ValueError("rms_norm_quantize_triton: weight_in_float with 16-bit operands "
                         "(declined at plan time)")
    _rmsq_launch(x, w, out, eps, norm_dtype, group)


def _preq_compile(x, other, out, *, act, scale_op, group, **_) -> None:
    if x.device.type != "cuda":
        return
    p = _preq_plan(tuple(x.shape), tuple(x.stride),
                   tuple(x.stride if other is None else other.stride), group)
    _warm_packed(p, _preq, x, group, (x.dtype, x.dtype), (1.0,), ACT=ACT_IDS[act],
                 HAS_O=other is not None, OP=SCALE_OPS[scale_op], BLOCK=p.block,
                 ONE_PASS=x.shape[-1] <= p.block)


def _preq_run(x, other, out, *, act, scale_op, scale, group) -> None:
    _preq_launch(x, other, out, act, scale_op, scale, group)


#: ``act_quantize`` and ``scale_quantize``: one kernel; launches only (no allocation, no host
#: synchronisation), as the other quantize-feeding kernels: CUDA graphs may capture them
_PROLOGUE = FusedKernel("prologue_quantize_triton", _preq_why_not, _preq_run, _preq_compile,
                        capture_safe=True)
#: CUDA's kernel of each rule of ``patterns/int8_fusions.py`` (no ``int8_linear_act`` yet).  The
#: rules after a linear run ``torch._int_mm`` (``cuda_kernels/int8.DEVICE``) and are not
#: capture-safe: with a float weight (what the quantize option produces) the step decides on
#: the host, per call, whether the weight changed (``patterns/int8.WeightState``), which a
#: captured CUDA graph would not repeat
KERNELS = {
    "int8_gated_residual": FusedKernel("int8_gated_residual_triton", _gr_why_not, _gr_run,
                                       _gr_compile, capture_safe=False),
    "int8_linear_act_quantize": FusedKernel("int8_linear_act_quantize_triton", _actq_why_not,
                                            _actq_run, _actq_compile, capture_safe=False),
    "int8_linear_glu_quantize": FusedKernel("int8_linear_glu_quantize_triton", _gluq_why_not,
                                            _gluq_run, _gluq_compile, capture_safe=False),
    # sd.linear_i8.v1's Triton epilogue storing the 16-bit output
    "int8_linear_cast": FusedKernel("int8_linear_cast_triton", _cast_why_not, _cast_run,
                                    capture_safe=False),
    "modulation_quantize": FusedKernel("modulation_quantize_triton", _modq_why_not, _modq_run,
                                       _modq_compile, capture_safe=True),
    "rms_norm_quantize": FusedKernel("rms_norm_quantize_triton", _rmsq_why_not, _rmsq_run,
                                     _rmsq_compile, capture_safe=True),
    "act_quantize": _PROLOGUE,
    "scale_quantize": _PROLOGUE,
}

register_int8_fusions("cuda", _i8.DEVICE, KERNELS)
