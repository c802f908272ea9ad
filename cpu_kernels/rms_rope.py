"""RMSNorm -> RoPE [-> * scale] on the CPU in one pass: a numba kernel computing exactly
``rms_rope_reference`` (``patterns/rope.py``), registered at the end as the kernel of the
``rms_rope`` fusion rule for "cpu" (:class:`RmsRopeCPU`).

Maths (per row of ``x`` viewed as ``[rows, D]``; float32, ``Tn = rms_norm_out_dtype(x, w)``,
``round`` = round to nearest even to Tn, the identity when Tn is float32; ``round_w`` to the
weight's dtype; with the norm's ``weight_in_float`` the weight reaches the kernel as float32, so
``round_w`` vanishes, and Tn is x's dtype: ``n = round_x(float(x) * r * float(w))``)::

    r      = 1 / sqrt(sum(float(x)^2) / D + float32(eps))        as sd.rms_norm.v1
    n[e]   = round(round_w(float(x[e]) * r) * float(w[e]))        n: the norm, dtype Tn
    q      = n * cos + rotate(n) * sin   on the first n_rot        as sd.rope_apply.v1 on n
    q[e]   = n[e]                        for e >= n_rot
    out[e] = to_out(round(round(q[e]) * float32(scale)))          with a scale
    out[e] = to_out(round(q[e]))                                  without

Every rounding of the unfused chain (norm to the weight's dtype, the weight multiply, the rope,
the scale) happens in the same place here, in registers, so the result equals the chain up to
the order of the float32 sum of squares (see ``cpu_kernels/rmsnorm.py``); the RoPE products and
sums are rope's own row functions (same order, no FMA), so they are bit-exact.  Roundings that
change nothing are skipped (to Tn right before out's own dtype when they are the same; the
scale's, without a scale: a run-time flag): 20-30% of the bf16 kernel's time.
Sources: those of ``cpu_kernels/rmsnorm.py`` and ``cpu_kernels/rope.py``; ggml's fused
``rms_norm -> mul -> rope`` (``test_rms_norm_mul_rope`` in ``test-backend-ops.cpp``).

Memory: every row of x is read once from memory (its second pass hits L1) and every row of out
is written once; the normed row and its rotation live in two per-task float32 scratch rows of
D and n_rot values.  Layout, tasks and threads are the RoPE kernel's (``_layout``: x's leading
dims split into those cos/sin move along and those they are broadcast over, merged where
contiguous; a task is a tile of cos rows by a chunk of heads), so strided x (a head slice of a
fused QKV output, ``[B, S, H, D]`` seen as ``[B, H, S, D]``) and broadcast cos/sin
(``[S, n_rot]``, ``[1, S, 1, n_rot]``, ...) need no copy.  bf16/fp16 are passed as bits and
converted in registers; the kernel compiles at plan time (``compile_kernels``) and is cached
on disk (rope's cache dir).  Like rmsnorm's, the disk cache is keyed on this file alone: a
change to the rope/rmsnorm helpers this kernel inlines needs a change here or a cleared cache.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype
from fxbackend.patterns.rope import RmsRopeFusion

from . import _numba
from ._workers import compiles
from . import rmsnorm as _rms
from . import rope as _rope
from .rmsnorm import _inv_rms, _normed, _round_as
from .rope import (_NP_OF, _bcast_offsets, _compile_lock, _flat, _row_interleaved, _row_split_half,
                   _row_views, _set_threads, _store, _task, _tasks)

__all__ = ["why_not", "compile_kernels", "rms_rope_cpu"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range


def _build(numba):
    from numba import types
    from numba.extending import overload

    @overload(_store_tn)
    def _store_tn_impl(o, w, e, v):
        if o.dtype == w.dtype or w.dtype == types.float32:  # one rounding
            return lambda o, w, e, v: _store(o, e, v)
        return lambda o, w, e, v: _store(o, e, _round_as(w, v))
    return _numba.njit(_rms_rope_kernel)


#: the jitted kernel (created once; it compiles per dtype combination when first called)
_jit = _numba.once(globals(), _build, requires=(_rms._register,))


def _store_tn(o, w, e, v):
    """``o[e] = v`` rounded to Tn (w's element type), then to o's: one rounding when the two
    types are the same or Tn is float32.  jit only."""
    raise NotImplementedError("_store_tn is a numba helper: call it from a jitted kernel")


def _rms_rope_kernel(x, w, tn, cos, sin, out, vt, bt, d, n_rot, tile, bchunk, eps, scale,
                     has_scale, interleaved):
    """Tasks and rows as in rope's ``_rope_kernel`` (its ``_tasks``/``_task``/``_row_views``: a
    tile of cos rows by a chunk of the broadcast dims, b outer and v inner); per row: the norm
    into ``nrm`` (Tn values: ``tn`` is an empty array of Tn, which every rounding follows;
    Tn is the weight's dtype, or x's for ``weight_in_float`` with a float32 weight), the rotation of its first n_rot features into ``rot``, then the
    scale and the output."""
    ntasks, nv, nb, nbc = _tasks(vt, bt, tile, bchunk)
    for task in prange(ntasks):
        voff, b0, b1 = _task(task, vt, nv, nb, nbc, tile, bchunk)
        nrm = np.empty(d, np.float32)
        rot = np.empty(n_rot, np.float32)
        for b in range(b0, b1):
            bx, bo = _bcast_offsets(b, bt)
            for j in range(voff.shape[0]):
                xr, orow, cr, sr = _row_views(x, out, cos, sin, voff, j, bx, bo, d, n_rot)
                r = _inv_rms(xr, d, eps)
                for e in range(d):
                    nrm[e] = _round_as(tn, _normed(xr, w, r, e))
                if interleaved:
                    _row_interleaved(nrm, cr, sr, rot, n_rot)
                else:
                    _row_split_half(nrm, cr, sr, rot, n_rot)
                for e in range(n_rot):
                    v = rot[e]
                    if has_scale:
                        v = _round_as(tn, v) * scale
                    _store_tn(orow, tn, e, v)
                for e in range(n_rot, d):
                    v = nrm[e]  # a Tn value
                    if has_scale:
                        v = v * scale
                    _store_tn(orow, tn, e, v)


# -- launcher -----------------------------------------------------------------------------------

def why_not(x_meta: Any, w_meta: Any, cos_meta: Any, sin_meta: Any, out_dtype: Any, mode: Any,
            n_rot: Any) -> str | None:
    """None when the kernel computes ``rms_rope_reference(x, w, cos, sin, eps, mode, n_rot,
    scale, out_dtype)`` for tensors with these metadata (``fxbackend.TensorMeta``), else a
    short reason.  Never raises.  Handled: x float32/bf16/fp16 on the CPU, any leading
    strides, unit feature stride, even D; a contiguous 1-D ``[D]`` weight (float32/bf16/fp16);
    cos/sin of n_rot unit-stride features, float32 or the norm's dtype Tn, broadcast to x's
    leading dims as ``sd.rope_apply.v1`` allows; mode ``interleaved``/``split_half``; even
    ``n_rot`` in 2..D; out dtype float32/bf16/fp16."""
    try:
        if not isinstance(w_meta, fxbackend.TensorMeta):
            return "the weight is not a tensor (it is required)"
        why = _rms._why_not_tensors(x_meta, w_meta)
        if why is not None:
            return why
        if out_dtype not in _NP_OF:
            return f"out dtype {out_dtype} (float32, bfloat16 or float16)"
        tn = rms_norm_out_dtype(x_meta.dtype, w_meta.dtype)
        for m in (cos_meta, sin_meta):
            if isinstance(m, fxbackend.TensorMeta) and m.dtype not in (torch.float32, tn):
                return f"cos/sin dtype {m.dtype} (float32 or the norm's dtype {tn})"
        # the rope step is sd.rope_apply.v1 on the norm: x's layout with dtype Tn
        return _rope._why_not(dataclasses.replace(x_meta, dtype=tn), cos_meta, sin_meta, mode,
                              n_rot)
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _launch(lay, x, weight, cos, sin, out, eps: float, mode: str, n_rot: int,
            scale: float | None, tn_dtype: torch.dtype | None = None) -> None:
    """Run the kernel for a layout from ``rope._layout_of(x, cos, sin, n_rot)`` (valid for
    x's, cos's and sin's strides; a plan can build it once at prepare time).  No checks."""
    if lay.spans[0] == 0:
        return
    fn = _jit()
    bchunk = _rope._bchunk(lay, _set_threads())
    tn = np.zeros(0, _NP_OF[tn_dtype or rms_norm_out_dtype(x.dtype, weight.dtype)])
    fn(_flat(x, lay.spans[0]), _flat(weight, weight.shape[0]), tn, _flat(cos, lay.spans[1]),
       _flat(sin, lay.spans[2]), _flat(out, out.numel()), lay.vt, lay.bt, x.shape[-1], n_rot,
       lay.tile, bchunk, np.float32(eps), np.float32(1.0 if scale is None else scale),
       scale is not None, mode == "interleaved")


def rms_rope_cpu(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor, *, eps: float, mode: str, n_rot: int,
                 scale: float | None = None) -> torch.Tensor:
    """``rms_rope_reference(x, weight, cos, sin, eps, mode, n_rot, scale, out.dtype)`` into
    ``out`` (returned): a contiguous CPU tensor of x's shape, float32/bf16/fp16, that does not
    overlap the inputs (the caller's guarantee; not checked).  Raises ValueError naming the
    problem for inputs the kernel does not handle (see :func:`why_not`)."""
    ts = {"x": x, "weight": weight, "cos": cos, "sin": sin, "out": out}
    for label, t in ts.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"rms_rope_cpu: {label} must be a tensor, got {type(t).__name__}")
    why = why_not(fxbackend.TensorMeta.of(x), fxbackend.TensorMeta.of(weight),
                  fxbackend.TensorMeta.of(cos), fxbackend.TensorMeta.of(sin), out.dtype, mode,
                  n_rot) or _rms._why_not_eps(eps)
    if why is None and scale is not None and (not isinstance(scale, (int, float)) or
                                              isinstance(scale, bool)):
        why = f"scale {scale!r} (a Python float or None)"
    if why is not None:
        raise ValueError(f"rms_rope_cpu: unsupported input: {why}")
    if out.shape != x.shape or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"rms_rope_cpu: out must be a contiguous CPU tensor of x's shape "
                         f"{tuple(x.shape)}, got shape {tuple(out.shape)}, strides "
                         f"{out.stride()} on {out.device}")
    _launch(_rope._layout_of(x, cos, sin, n_rot), x, weight, cos, sin, out, eps, mode, n_rot,
            scale)
    return out


@compiles
def compile_kernels(x_dtype: torch.dtype, w_dtype: torch.dtype, cos_dtype: torch.dtype,
                    sin_dtype: torch.dtype, out_dtype: torch.dtype,
                    tn_dtype: torch.dtype | None = None) -> None:
    """Compile (or load from the disk cache) the kernel for these dtypes (both modes, with and
    without a scale: run-time arguments), by a call with no rows on exactly the types a launch
    passes.  Thread-safe (plans compile their nodes in parallel)."""
    fn = _jit()
    t = np.zeros((0, 5), dtype=np.int64)
    with _compile_lock:  # see rope's compile_kernels
        fn(np.zeros(0, _NP_OF[x_dtype]), np.zeros(0, _NP_OF[w_dtype]),
           np.zeros(0, _NP_OF[tn_dtype or rms_norm_out_dtype(x_dtype, w_dtype)]),
           np.zeros(0, _NP_OF[cos_dtype]), np.zeros(0, _NP_OF[sin_dtype]),
           np.zeros(0, _NP_OF[out_dtype]), t, t[:, :3].copy(), 2, 2, 1, 1, np.float32(1e-6),
           np.float32(1.0), True, True)


class RmsRopeCPU:
    """The numba kernel behind the ``rms_rope`` fusion rule on the CPU (see
    ``fxbackend.patterns.rope.RmsRopeFusion`` for the interface).  The launch layout is built
    per call from the tensors' strides (a few microseconds; the rule runs once per q/k)."""

    name = "rms_rope_cpu"
    #: handles the norm's ``weight_in_float`` (torch.nn.RMSNorm's order): the weight goes to
    #: the kernel as float32 and every rounding follows x's dtype
    weight_in_float = True

    def why_not(self, x, w, cos, sin, out_dtype, mode, n_rot):
        return why_not(x, w, cos, sin, out_dtype, mode, n_rot)

    def compile(self, x, w, cos, sin, out_dtype, mode, n_rot, scale, weight_in_float=False):
        if weight_in_float:
            compile_kernels(x.dtype, torch.float32, cos.dtype, sin.dtype, out_dtype, x.dtype)
        else:
            compile_kernels(x.dtype, w.dtype, cos.dtype, sin.dtype, out_dtype)

    def run(self, x, w, cos, sin, out, *, eps, mode, n_rot, scale, weight_in_float=False):
        tn = None
        if weight_in_float:
            w, tn = w.float(), x.dtype
        _launch(_rope._layout_of(x, cos, sin, n_rot), x, w, cos, sin, out, eps, mode, n_rot,
                scale, tn)


fxbackend.register_fusion("cpu", RmsRopeFusion(RmsRopeCPU()))
