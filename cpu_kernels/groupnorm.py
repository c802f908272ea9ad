"""GroupNorm [-> SiLU] on the CPU in one pass: a numba kernel computing
``group_norm_silu_reference`` (``patterns/groupnorm.py``), registered at the end as the kernel of
the ``group_norm_silu`` fusion rule for "cpu" (:class:`GroupNormSiluCPU`) and, without the SiLU,
as the kernel of the op ``sd.group_norm.v1`` (:class:`GroupNormCPU`; its output is contiguous, so
it takes dense NCHW x only and declines channels-last x, which then runs the op's reference).

Maths per (sample n, group g) over its m = (C/G) * HxW elements (``round`` = round to nearest
even to x's dtype, the identity for float32; ``fma`` a fused multiply-add, one rounding)::

    x0    = float(x[first element of the group])
    s1    = sum(float64(x) - x0),  s2 = sum((float64(x) - x0)^2)       float64, any order
    mean  = float32(x0 + s1 / m)
    var   = max(s2 / m - (s1 / m)^2, 0)                                 float64
    rstd  = float32(1 / sqrt(var + eps))
    per channel c:  scale = rstd * w[c],  bias = fma(-scale, mean, b[c])            float32
    y     = round(fma(x, scale, bias))                                  = native_group_norm
    out   = round(y / (1 + exp(-y)))                                    with SiLU

The scale/bias/fma form is torch's CPU kernel's (``group_norm_kernel.cpp``): given torch's own
mean and rstd it reproduces torch's float32 output bit for bit (checked on SD1.5 shapes,
NCHW and channels-last, when this kernel was written).  The
moments are not torch's (a vectorised float32 Welford cascade whose order depends on the CPU's
vector width): a shifted float64 sum is used instead, which is within about one float32 ulp of the
exact mean and variance, as torch's are; so float32 outputs differ from torch by a few ulp of
|x - mean| * rstd * w (measured in the tests and the benchmark).  ``exp`` is the vectorisable
Cephes ``expf`` of ``cpu_kernels/_vmath.py``, within 2 ulp of torch's Sleef ``exp``.  Sources:
Wu and He, "Group Normalization" (arXiv 1803.08494); S. Moshier, Cephes ``expf.c``; torch
``group_norm_kernel.cpp``.

Layout.  x and out are dense NCHW (any number of spatial dims) or dense channels-last, the same
for both (``memory_format_of``); other strides are declined.  A task is one (n, g) (``prange``):
NCHW groups are one contiguous run of m elements, read once from memory for the moments and a
second time from L2 (a group of SD1.5's UNet is at most 160 KB) for the output; channels-last
groups are runs of C/G channels at stride C, accumulated per channel so the inner loop has no
reduction.  The weight and bias are contiguous ``[C]`` vectors (float32 or x's dtype).
bf16/fp16 pass as int16/uint16 bits converted in registers (``cpu_kernels/rope.py``); the
kernel compiles at plan time and is cached on disk (``cpu_kernels/_numba.py``: keyed on this
file alone).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.groupnorm import (GROUP_NORM_CL_OP, GroupNormOpKernel,
                                          GroupNormSiluFusion, channels_first,
                                          channels_first_meta,
                                          group_norm_silu_reference, layout_why_not,
                                          memory_format_of)

from . import _numba, _vmath
from ._workers import compiles
from . import rmsnorm as _rms
from . import rope as _rope
from ._vmath import _fma, _silu
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store
from .rmsnorm import _round_as

__all__ = ["why_not", "group_norm_silu_cpu", "compile_kernels", "GroupNormSiluCPU",
           "GroupNormCPU", "GroupNormChannelsLastCPU"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range


def _build(numba):
    from numba.extending import register_jitable
    for fn in (_finish, _channel_scale_bias, _scale_bias):
        register_jitable(fn)
    _numba.reassoc(_moments_run)  # the sums alone may be reordered (vectorised partial sums)
    return _numba.njit(_gn_nchw_kernel), _numba.njit(_gn_nhwc_kernel)


#: the jitted kernels ``(nchw, nhwc)`` (created once; each compiles per dtype combination when
#: first called); they call rope's ``_load``/``_store`` and rmsnorm's ``_round_as``
_jit = _numba.once(globals(), _build,
                   requires=(_rope._register, _rms._register, _vmath.register))


# -- jitted helpers (float32 maths unless stated) -----------------------------------------------

#: elements (NCHW) summed in float32 before the partial sums go to float64
_BLOCK = 512
#: spatial positions per task of the channels-last kernel
_ROWS = 64


def _moments_run(x, base, m, x0):
    """``(s1, s2)``: sums of ``x[base:base+m] - x0`` and of its squares; float32 within blocks
    of ``_BLOCK`` elements, float64 across them.  Compiled with ``reassoc`` so that LLVM
    vectorises the float32 sums into partial sums."""
    s1 = 0.0
    s2 = 0.0
    for k0 in range(0, m, _BLOCK):
        xr = x[base + k0:base + min(m, k0 + _BLOCK)]
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for i in range(xr.shape[0]):
            v = _load(xr, i) - x0
            a1 += v
            a2 += v * v
        s1 += np.float64(a1)
        s2 += np.float64(a2)
    return s1, s2


def _finish(x0, s1, s2, m, eps):
    """``(mean, rstd)`` as float32 from the sums shifted by ``x0`` (float64 maths)."""
    d1 = s1 / m
    var = max(s2 / m - d1 * d1, 0.0)
    return np.float32(np.float64(x0) + d1), np.float32(1.0 / math.sqrt(var + eps))


def _channel_scale_bias(w, b, ch, mean, rstd):
    """Channel ``ch``'s ``(scale, bias)``: ``scale = rstd * w``, ``bias = fma(-scale, mean,
    b)`` (torch's form)."""
    sc = rstd * _load(w, ch)
    return sc, _fma(-sc, mean, _load(b, ch))


def _scale_bias(w, b, c0, d, mean, rstd, scale, bias, s0):
    """:func:`_channel_scale_bias` of channels ``c0 + j`` (j < d) into ``scale[s0 + j]``,
    ``bias[s0 + j]``."""
    for j in range(d):
        scale[s0 + j], bias[s0 + j] = _channel_scale_bias(w, b, c0 + j, mean, rstd)


def _gn_nchw_kernel(x, w, b, out, nb, c, hw, groups, eps, silu):
    """Dense NCHW: one (n, g) per iteration of the parallel loop; the group is the contiguous
    run ``x[t*m:(t+1)*m]``, read once for the moments and again (from L2) for the output."""
    d = c // groups
    m = d * hw
    for task in prange(nb * groups):
        t = np.int64(task)  # prange indices may be unsigned
        c0 = (t % groups) * d
        base = t * m
        x0 = _load(x, base)
        s1, s2 = _moments_run(x, base, m, x0)
        mean, rstd = _finish(x0, s1, s2, m, eps)
        for j in range(d):
            o = base + j * hw
            xr = x[o:o + hw]
            orow = out[o:o + hw]
            sc, bi = _channel_scale_bias(w, b, c0 + j, mean, rstd)  # no arrays per task
            if silu:
                for k in range(hw):
                    _store(orow, k, _silu(_round_as(xr, _fma(_load(xr, k), sc, bi))))
            else:
                for k in range(hw):
                    _store(orow, k, _fma(_load(xr, k), sc, bi))


def _gn_nhwc_kernel(x, w, b, out, nb, c, hw, groups, eps, silu):
    """Dense channels-last ([N, HxW, C] in memory): three parallel phases over (n, tile of
    ``_ROWS`` positions) with whole rows of C contiguous channels (vectorised across channels):
    per-channel shifted sums (float32 within a tile, four positions added before they reach the
    accumulators; float64 across tiles), per-(n, g) moments
    and per-(n, c) scale/bias, then the output."""
    d = c // groups
    m = d * hw
    ntile = (hw + _ROWS - 1) // _ROWS
    part = np.zeros((nb * ntile, 2, c), np.float64)
    shift = np.empty((nb, c), np.float32)  # the first element of each (n, g), per channel
    for n in range(nb):
        for j in range(c):
            shift[n, j] = _load(x, n * hw * c + (j // d) * d)
    for task in prange(nb * ntile):
        t = np.int64(task)
        n = t // ntile
        p0 = (t % ntile) * _ROWS
        a1 = np.zeros(c, np.float32)
        a2 = np.zeros(c, np.float32)
        sh = shift[n]
        p1 = min(hw, p0 + _ROWS)
        p = p0
        while p + 4 <= p1:  # four positions per pass over the accumulators: a quarter of
            o = (n * hw + p) * c  # their loads and stores
            x0 = x[o:o + c]
            x1 = x[o + c:o + 2 * c]
            x2 = x[o + 2 * c:o + 3 * c]
            x3 = x[o + 3 * c:o + 4 * c]
            for j in range(c):
                s = sh[j]
                v0 = _load(x0, j) - s
                v1 = _load(x1, j) - s
                v2 = _load(x2, j) - s
                v3 = _load(x3, j) - s
                a1[j] += (v0 + v1) + (v2 + v3)
                a2[j] += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)
            p += 4
        for p in range(p, p1):
            o = (n * hw + p) * c
            xr = x[o:o + c]
            for j in range(c):
                v = _load(xr, j) - sh[j]
                a1[j] += v
                a2[j] += v * v
        for j in range(c):
            part[t, 0, j] = a1[j]
            part[t, 1, j] = a2[j]
    scale = np.empty((nb, c), np.float32)
    bias = np.empty((nb, c), np.float32)
    for task in prange(nb * groups):
        t = np.int64(task)
        n = t // groups
        c0 = (t % groups) * d
        s1 = 0.0
        s2 = 0.0
        for k in range(n * ntile, (n + 1) * ntile):
            for j in range(c0, c0 + d):
                s1 += part[k, 0, j]
                s2 += part[k, 1, j]
        mean, rstd = _finish(shift[n, c0], s1, s2, m, eps)
        _scale_bias(w, b, c0, d, mean, rstd, scale[n], bias[n], c0)
    for task in prange(nb * ntile):
        t = np.int64(task)
        n = t // ntile
        p0 = (t % ntile) * _ROWS
        sc = scale[n]
        bi = bias[n]
        for p in range(p0, min(hw, p0 + _ROWS)):
            o = (n * hw + p) * c
            xr = x[o:o + c]
            orow = out[o:o + c]
            if silu:
                for j in range(c):
                    _store(orow, j, _silu(_round_as(xr, _fma(_load(xr, j), sc[j], bi[j]))))
            else:
                for j in range(c):
                    _store(orow, j, _fma(_load(xr, j), sc[j], bi[j]))


# -- launcher -----------------------------------------------------------------------------------

def why_not(x: Any, w: Any, b: Any, out: Any, groups: Any, eps: Any) -> str | None:
    """None when the kernel computes ``group_norm_silu_reference(x, w, b, groups, eps)`` into a
    tensor with ``out``'s metadata (``fxbackend.TensorMeta``), else a short reason.  Never
    raises.  Handled: x float32/bf16/fp16 on the CPU, dense NCHW or dense channels-last (out the
    same); contiguous 1-D ``[C]`` weight and bias of float32 or x's dtype; C divisible by the
    groups; a finite eps >= 0."""
    try:
        metas = (("x", x), ("weight", w), ("bias", b), ("out", out))
        for name, mt in metas:
            if not isinstance(mt, fxbackend.TensorMeta):
                return f"{name} is not a tensor"
            if getattr(mt.device, "type", None) != "cpu":
                return f"{name} is on {mt.device}, not the CPU"
            if mt.is_symbolic:
                return "symbolic metadata"
        if x.dtype not in _NP_OF:
            return f"x dtype {x.dtype} (float32, bfloat16 or float16)"
        return layout_why_not(x, w, b, out, groups, eps)
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _layout(x: torch.Tensor) -> str | None:
    """``memory_format_of(x)``, with torch's own contiguity flags first (a call costs about
    4 us of Python; the flags 0.1 us)."""
    if x.is_contiguous():
        return "nchw"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    return memory_format_of(x.shape, x.stride())


def _launch(x, w, b, out, groups: int, eps: float, silu: bool) -> None:
    n, c = int(x.shape[0]), int(x.shape[1])
    numel = x.numel()
    if numel == 0:
        return
    hw = numel // (n * c)
    cl = _layout(x) == "nhwc"
    fn = _jit()[1 if cl else 0]
    _set_threads()
    fn(_flat(x, numel), _flat(w, c), _flat(b, c), _flat(out, numel), n, c, hw, groups,
       float(eps), bool(silu))


def group_norm_silu_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        out: torch.Tensor, *, groups: int, eps: float,
                        silu: bool = True) -> torch.Tensor:
    """``out = group_norm_silu_reference(x, weight, bias, groups, eps, silu)`` (returned):
    ``out`` a CPU tensor of x's shape, dtype and memory format that does not overlap the inputs
    (not checked).  Raises ValueError naming the problem for inputs the kernel does not take
    (see :func:`why_not`)."""
    ts = {"x": x, "weight": weight, "bias": bias, "out": out}
    for label, t in ts.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"group_norm_silu_cpu: {label} must be a tensor, got "
                             f"{type(t).__name__}")
    why = why_not(*(fxbackend.TensorMeta.of(t) for t in ts.values()), groups, eps)
    if why is not None:
        raise ValueError(f"group_norm_silu_cpu: unsupported input: {why}")
    _launch(x, weight, bias, out, groups, eps, silu)
    return out


def compile_kernels(x_dtype: torch.dtype, w_dtype: torch.dtype, b_dtype: torch.dtype) -> None:
    """Compile (or load from the disk cache) the kernels of both layouts for these dtypes (SiLU
    is a run-time argument), each by a call with no groups.  Thread-safe."""
    for layout in range(len(_jit())):
        _compile_layout(layout, x_dtype, w_dtype, b_dtype)


@compiles
def _compile_layout(layout: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
                    b_dtype: torch.dtype) -> None:
    """:func:`compile_kernels` for one layout (the index of its kernel in ``_jit()``): one
    kernel per call, so that a plan's threads compile the two side by side."""
    fn = _jit()[layout]
    with _compile_lock:  # see rope's compile_kernels
        fn(np.zeros(1, _NP_OF[x_dtype]), np.zeros(1, _NP_OF[w_dtype]),
           np.zeros(1, _NP_OF[b_dtype]), np.zeros(1, _NP_OF[x_dtype]), 0, 1, 1, 1, 1e-5, True)


class GroupNormSiluCPU:
    """The numba kernel behind the ``group_norm_silu`` fusion rule on the CPU (interface:
    ``fxbackend.patterns.groupnorm.GroupNormSiluFusion``)."""

    name = "group_norm_silu_cpu"

    def why_not(self, x, w, b, out, groups, eps):
        return why_not(x, w, b, out, groups, eps)

    def compile(self, x, w, b, out, groups, silu):
        compile_kernels(x.dtype, w.dtype, b.dtype)

    def run(self, x, w, b, out, *, groups, eps, silu):
        _launch(x, w, b, out, groups, eps, silu)


class GroupNormCPU(GroupNormOpKernel):
    """The numba kernel (no SiLU) for the op ``sd.group_norm.v1``: what :func:`why_not` takes
    with the node's contiguous output, i.e. dense NCHW x (channels-last x is declined: its
    output would need the other layout).  Workspace: none."""

    name = "group_norm_cpu"
    why_not = staticmethod(why_not)

    def compile(self, node) -> None:
        compile_kernels(*(s.meta.dtype for s in node.srcs))

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x, w, b = inputs
        if _layout(x) != "nchw":
            # strides other than planned (behind Dynamo's guards): never write the wrong layout
            out.copy_(group_norm_silu_reference(x, w, b, node.params["groups"],
                                                node.params["eps"], silu=False))
            return
        _launch(x, w, b, out, node.params["groups"], node.params["eps"], False)


class GroupNormChannelsLastCPU:
    """The channels-last numba kernel (no SiLU) for the op ``sd.group_norm_channels_last.v1``:
    x ``[N, *spatial, C]`` contiguous, seen as the dense channels-last ``[N, C, *spatial]``
    image it is, its contiguous output likewise.  Workspace: none."""

    op = GROUP_NORM_CL_OP
    name = "group_norm_channels_last_cpu"

    def supports(self, node) -> bool:
        try:
            if len(node.srcs) != 3:
                return False
            x, w, b = (s.meta for s in node.srcs)
            if not x.is_contiguous or len(x.shape) < 3:
                return False
            moved = channels_first_meta(x)
            return why_not(moved, w, b, moved, node.params.get("groups"),
                           node.params.get("eps")) is None
        except Exception:  # never raise from supports: decline instead
            return False

    def compile(self, node) -> None:
        compile_kernels(*(s.meta.dtype for s in node.srcs))

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x, w, b = inputs
        xc, oc = channels_first(x), channels_first(out)
        lx = _layout(xc)
        if lx is None or lx != _layout(oc):
            # strides other than planned (behind Dynamo's guards): never write the wrong layout
            oc.copy_(group_norm_silu_reference(xc, w, b, node.params["groups"],
                                               node.params["eps"], silu=False))
            return
        _launch(xc, w, b, oc, node.params["groups"], node.params["eps"], False)


fxbackend.register_fusion("cpu", GroupNormSiluFusion(GroupNormSiluCPU()))
fxbackend.register_kernel("cpu", GroupNormCPU)
fxbackend.register_kernel("cpu", GroupNormChannelsLastCPU)
