"""RMSNorm -> RoPE [-> * scale] on CUDA: one fused Triton kernel computing ``rms_rope_reference``
(``patterns/rope.py``), registered at the end as the kernel of the ``rms_rope`` fusion rule for
"cuda" (:class:`RmsRopeCUDA`).

Maths per row of x (D features, f the feature index, n = n_rot; float32 arithmetic; Tn is the
norm's dtype ``rms_norm_out_dtype(x.dtype, w.dtype)``, which with a weight is w's dtype, and
``round`` is the conversion to Tn, round-to-nearest-even as ``Tensor.to``; a no-op for float32)::

    r     = 1 / sqrt(sum(float(x)^2) / D + eps)                   as cuda_kernels/rmsnorm.py
    nv[f] = round(round(float(x[f]) * r) * w[f])                  = rms_norm_reference(x, w, eps)
    y[f]  = round(nv[f] * cos[f] + sign(f) * nv[p(f)] * sin[f])   f < n   (= rope_reference)
    y[f]  = nv[f]                                                  n <= f < D
    y[f]  = round(y[f] * scale)                                    only with a scale
    out   = y converted to out's dtype

with the pair partner ``p`` and sign of ``cuda_kernels/rope.py`` (interleaved: p(f) = f ^ 1;
split_half: p(f) = f +- n/2).  ``nv[p(f)]`` is computed from a second load of the partner's x
and weight with the same operations as ``nv[f]`` (multiplies and roundings only, no sums), so it
has the same bits.  Each rounding of the reference chain is kept; the one difference is the sum
of squares (a tree reduction: about 1e-7 relative in r, which may move a 16-bit result by one
unit in the last place).  Sources: those of ``cuda_kernels/rmsnorm.py`` and
``cuda_kernels/rope.py``; ggml's fused ``rms_norm -> mul -> rope`` (``test_rms_norm_mul_rope``).

Layout.  The launch layout is the RoPE kernel's (``rope._plan``: one program per tile of
BLOCK_R rows by BLOCK_D >= D features, x's leading dims strided with last stride 1, cos/sin read
through their broadcast strides, leading dims merged, at most four), so the whole row is in one
program for the reduction: each row of x is read once (plus the partner load, which hits the same
cache lines) and each row of out written once.  The weight is read with its own stride.  Limits
are the RoPE kernel's: even D <= rope.MAX_D, even n_rot <= D.

Launches pass ``enable_fp_fusion=False`` (no fused multiply-add: the reference rounds
``nv * cos`` before adding ``nv_p * sin``).  Importing this module does not import Triton
(``rope.lazy_kernel``); the row multi-index, offsets and pair partner are rope's
``@triton.jit`` helpers.  Plans are cached per shape/stride signature (pure metadata), so a
launch costs one dictionary look-up of planning.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels import rope as _rope
from fxbackend.cuda_kernels.rmsnorm import num_warps
from fxbackend.cuda_kernels.rope import DTYPES, _launch_on, _warmup_on, lazy_kernel
from fxbackend.patterns.rope import MODES, RmsRopeFusion

__all__ = ["why_not", "rms_rope_triton", "compile_kernels"]

#: triton.language, bound by ``rope.lazy_kernel`` on first use
tl: Any = None


def _rms_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, D, n_rot,
                     size1, size2, size3,
                     xs0, xs1, xs2, xs3, cs0, cs1, cs2, cs3, ss0, ss1, ss2, ss3,
                     cos_sf, sin_sf, w_sf, eps, scale,
                     INTERLEAVED: tl.constexpr, HAS_SCALE: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, i0, i1, i2, i3 = _rope._lead_index(n_rows, size1, size2, size3, BLOCK_R)
    x_row = _rope._lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)
    c_row = _rope._lead_offset(i0, i1, i2, i3, cs0, cs1, cs2, cs3)
    s_row = _rope._lead_offset(i0, i1, i2, i3, ss0, ss1, ss2, ss3)

    f = tl.arange(0, BLOCK_D)
    partner, sign = _rope._rope_partner(f, n_rot, INTERLEAVED)
    f_ok = f < D
    rot = f < n_rot
    m_all = row_ok[:, None] & f_ok[None, :]
    m_rot = row_ok[:, None] & rot[None, :]

    x_base = x_ptr + x_row[:, None]
    x = tl.load(x_base + f[None, :], mask=m_all, other=0.0).to(tl.float32)
    xp = tl.load(x_base + partner[None, :], mask=m_rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + f * w_sf, mask=f_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner * w_sf, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + c_row[:, None] + f[None, :] * cos_sf, mask=m_rot, other=0.0)
    s = tl.load(sin_ptr + s_row[:, None] + f[None, :] * sin_sf, mask=m_rot, other=0.0)

    mean = tl.div_rn(tl.sum(x * x, axis=1), D + 0.0)  # as in rmsnorm.py
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
    tn = w_ptr.dtype.element_ty  # Tn; every .to(tn).to(float32) below is a no-op for float32
    n = ((x * rstd).to(tn).to(tl.float32) * w).to(tn).to(tl.float32)
    n_p = ((xp * rstd).to(tn).to(tl.float32) * wp).to(tn).to(tl.float32)
    y = n * c.to(tl.float32) + sign[None, :] * n_p * s.to(tl.float32)
    y = tl.where(rot[None, :], y.to(tn).to(tl.float32), n)
    if HAS_SCALE:
        y = (y * scale).to(tn).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * D + f[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_all)


_kernel = lazy_kernel(_rms_rope_kernel)


# -- launch parameters (pure Python, metadata only) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Launch:
    rope: Any  # rope._Launch: grid, the x/cos/sin layout args, interleaved, block sizes
    w_stride: int
    num_warps: int


@functools.lru_cache(maxsize=512)
def _plan(x_shape: tuple, x_stride: tuple, w_shape: tuple, w_stride: tuple, cos_shape: tuple,
          cos_stride: tuple, sin_shape: tuple, sin_stride: tuple, mode: str,
          n_rot: int) -> _Launch:
    """Launch parameters; ValueError for arguments the kernel does not take.  Cached: every
    argument is a tuple of ints or a str/int (ValueErrors are not cached, and are cheap)."""
    p = _rope._plan(x_shape, x_stride, cos_shape, cos_stride, sin_shape, sin_stride, mode, n_rot)
    for v in (*w_shape, *w_stride):
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")
    if w_shape != (x_shape[-1],) or len(w_stride) != 1:
        raise ValueError(f"weight must be 1-D of x's last dim ({x_shape[-1]},), got shape "
                         f"{w_shape}")
    return _Launch(p, w_stride[0], num_warps(p.block_r, p.block_d))


def _plan_of_tensors(x, w, cos, sin, mode: str, n_rot: int) -> _Launch:
    return _plan(tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()),
                 tuple(cos.shape), tuple(cos.stride()), tuple(sin.shape), tuple(sin.stride()),
                 mode, n_rot)


def _plan_of_metas(x, w, cos, sin, mode: str, n_rot: int) -> _Launch:
    return _plan(tuple(x.shape), tuple(x.stride), tuple(w.shape), tuple(w.stride),
                 tuple(cos.shape), tuple(cos.stride), tuple(sin.shape), tuple(sin.stride),
                 mode, n_rot)


def why_not(x_meta, w_meta, cos_meta, sin_meta, out_dtype, mode, n_rot) -> str | None:
    """None when :func:`rms_rope_triton` takes these arguments on CUDA; otherwise a short reason.
    Metadata only; never raises.  Declines non-CUDA devices, dtypes other than float32/bfloat16/
    float16, symbolic shapes, and whatever the launch layout does not take (odd D or n_rot,
    D > rope.MAX_D, x's last stride not 1, more than four leading dims after merging, cos/sin
    that do not broadcast to x's rows by n_rot, a weight that is not 1-D of size D)."""
    try:
        metas = (("x", x_meta), ("weight", w_meta), ("cos", cos_meta), ("sin", sin_meta))
        for name, m in metas:
            if not isinstance(m, TensorMeta):
                return f"{name} is not a tensor"
        if x_meta.device.type != "cuda":
            return f"x is on {x_meta.device}, not a CUDA device"
        for name, m in metas[1:]:
            if m.device != x_meta.device:
                return f"{name} is on {m.device}, x on {x_meta.device}"
        for name, m in metas:
            if m.dtype not in DTYPES:
                return f"{name} has dtype {m.dtype}"
        if out_dtype not in DTYPES:
            return f"output dtype {out_dtype}"
        if not isinstance(mode, str) or mode not in MODES:
            return f"mode {mode!r} is not one of {MODES}"
        if not isinstance(n_rot, int) or isinstance(n_rot, bool):
            return f"n_rot {n_rot!r} is not an int"
        _plan_of_metas(x_meta, w_meta, cos_meta, sin_meta, mode, n_rot)
        return None
    except ValueError as e:
        return str(e)
    except Exception as e:  # malformed metadata: decline, never raise
        return f"unexpected {type(e).__name__}: {e}"


def _launch(p: _Launch, device: torch.device, x, w, cos, sin, out, eps: float,
            scale: float | None) -> None:
    r = p.rope
    if r.grid[0] == 0:
        return
    kernel = _kernel()[r.grid]
    args = (x, w, cos, sin, out, *r.args, p.w_stride, float(eps),
            1.0 if scale is None else float(scale))
    kw = dict(INTERLEAVED=r.interleaved, HAS_SCALE=scale is not None, BLOCK_R=r.block_r,
              BLOCK_D=r.block_d, num_warps=p.num_warps, enable_fp_fusion=False)
    _launch_on(device, kernel, args, kw)


def rms_rope_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    out: torch.Tensor, *, eps: float, mode: str, n_rot: int,
                    scale: float | None = None) -> torch.Tensor:
    """``out = rms_rope_reference(x, weight, cos, sin, eps, mode, n_rot, scale, out.dtype)`` with
    the fused Triton kernel; returns ``out``.

    ``x``: ``[..., D]`` float32/bfloat16/float16, last stride 1, other strides arbitrary;
    ``weight``: 1-D ``[D]`` float32/bfloat16/float16 (any stride; its dtype is the norm's Tn);
    ``cos``/``sin``: float32/bfloat16/float16, broadcastable to ``x.shape[:-1] + (n_rot,)``, any
    strides; ``out``: contiguous, x's shape, any of the three dtypes, not overlapping the inputs
    (the caller guarantees it; not checked).  ``scale``: None or a Python number (multiplied in
    float32, rounded to Tn).  All on one CUDA device (launched on its current stream), or on the
    CPU under ``TRITON_INTERPRET=1``.  Raises ValueError naming the problem for arguments the
    kernel does not take.
    """
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"rms_rope_triton: {name} is not a tensor")
        if t.dtype not in DTYPES:
            raise ValueError(f"rms_rope_triton: {name} has dtype {t.dtype}; the kernel takes "
                             f"{[str(d) for d in DTYPES]}")
        if t.device != x.device:
            raise ValueError(f"rms_rope_triton: {name} is on {t.device}, x on {x.device}")
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"rms_rope_triton: out must be contiguous with x's shape "
                         f"{tuple(x.shape)}, got {tuple(out.shape)} strides {out.stride()}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"rms_rope_triton: eps must be a number >= 0, got {eps!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise ValueError(f"rms_rope_triton: scale must be None or a Python number, got {scale!r}")
    if not isinstance(n_rot, int) or isinstance(n_rot, bool):
        raise ValueError(f"rms_rope_triton: n_rot must be an int, got {n_rot!r}")
    try:
        p = _plan_of_tensors(x, weight, cos, sin, mode, n_rot)
    except (ValueError, TypeError) as e:  # TypeError: an unhashable mode
        raise ValueError(f"rms_rope_triton: {e}") from None
    _launch(p, x.device, x, weight, cos, sin, out, eps, scale)
    return out


def compile_kernels(x_meta, w_meta, cos_meta, sin_meta, out_dtype, mode, n_rot,
                    scale: float | None = None) -> None:
    """Plan-time warm-up: compile the kernel for these metadata (dtypes, block sizes, integer
    specialisation, with or without a scale) into Triton's in-process and on-disk caches.  A
    no-op off CUDA or without a GPU; call it only when :func:`why_not` returned None (raises
    ValueError otherwise).  Safe to call from several threads."""
    if x_meta.device.type != "cuda":
        return
    p = _plan_of_metas(x_meta, w_meta, cos_meta, sin_meta, mode, n_rot)
    r = p.rope
    if r.grid[0] == 0:
        return
    _warmup_on(x_meta.device, _kernel,
               (x_meta.dtype, w_meta.dtype, cos_meta.dtype, sin_meta.dtype, out_dtype, *r.args,
                p.w_stride, 1e-6, 1.0 if scale is None else float(scale)),
               dict(INTERLEAVED=r.interleaved, HAS_SCALE=scale is not None, BLOCK_R=r.block_r,
                    BLOCK_D=r.block_d, num_warps=p.num_warps, enable_fp_fusion=False,
                    grid=r.grid))


class RmsRopeCUDA:
    """The Triton kernel behind the ``rms_rope`` fusion rule on CUDA (see
    ``fxbackend.patterns.rope.RmsRopeFusion`` for the interface)."""

    name = "rms_rope_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, x, w, cos, sin, out_dtype, mode, n_rot):
        return why_not(x, w, cos, sin, out_dtype, mode, n_rot)

    def compile(self, x, w, cos, sin, out_dtype, mode, n_rot, scale):
        compile_kernels(x, w, cos, sin, out_dtype, mode, n_rot, scale)

    def run(self, x, w, cos, sin, out, *, eps, mode, n_rot, scale):
        rms_rope_triton(x, w, cos, sin, out, eps=eps, mode=mode, n_rot=n_rot, scale=scale)


fxbackend.register_fusion("cuda", RmsRopeFusion(RmsRopeCUDA()))
