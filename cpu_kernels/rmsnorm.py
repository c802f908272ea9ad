"""RMSNorm on the CPU: a numba kernel for ``sd.rms_norm.v1`` (see ``patterns/rmsnorm.py``).

Maths (per row of ``x`` viewed as ``[rows, D]``; float32, as ``rms_norm_reference``)::

    r   = 1 / sqrt(sum(float(x)^2) / D + float32(eps))
    n   = float(x) * r
    out = round_x(n)                              no weight (x's dtype)
    out = round_w(round_w(n) * float(w))          weight bf16/fp16 (w's dtype)
    out = n * w                                   weight float32 (float32)

``round_t`` rounds to the nearest even value of dtype t (c10's conversions).  The mean is the
float32 sum divided by D and ``rsqrt`` is ``1 / sqrt`` (what torch's CPU kernels compute), so
results differ from the reference only by the order of the float32 sum of squares.  That sum
alone is compiled with LLVM's ``reassoc`` flag (no contraction, nothing else relaxed), so it
is vectorised into partial sums, as torch's own reduction is: 2-3x faster than a serial sum
(Flux q/k rows, one thread), about as accurate (within ~2.4e-7 relative of torch's on those
rows).  A float64 sum measured 1.3-1.7x slower than the float32 one, so it is not used.  The
rest is strict IEEE float32 (``fastmath=False``: no FMA contraction).  Source:
Zhang and Sennrich, "Root Mean Square Layer Normalization" (arXiv 1910.07467); diffusers
``RMSNorm`` (``models/normalization.py``).

Layout, bf16/fp16 and compilation are those of the RoPE kernel (``cpu_kernels/rope.py``),
whose helpers this file reuses: ``x`` and ``out`` reach the kernel as flat arrays over the
storage they span, rows find their offsets from rope's small table of x's leading dims (every
dim a "broadcast" dim: there are no cos/sin rows here), so strided rows (a head slice of a
fused QKV output, a transposed ``[B, S, H, D]``) need no copy; bf16/fp16 pass as int16/uint16
bits converted in registers; the kernel compiles at plan time (``compile``) and is cached on
disk under rope's cache dir.  The weight must be a contiguous ``[D]`` vector.  Rows run in
parallel (``prange``), in x's memory order.

Note on numba's disk cache: it is keyed on this file alone, so a change to the rope helpers
this kernel inlines (the conversions) needs a change here, or a cleared cache, to take effect.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype

from . import _numba
from ._workers import compiles
from . import rope as _rope
from .rope import (_NP_OF, _bcast_offsets, _compile_lock, _flat, _load, _round_as,
                   _set_threads, _store, _why_not_metas)

__all__ = ["RmsNormCPU", "rms_norm_cpu", "compile_kernels"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range


def _register_helpers(numba) -> None:
    from numba.extending import register_jitable

    for fn in (_inv_rms, _normed):
        register_jitable(fn)
    _numba.reassoc(_sum_squares)  # the sum alone (see the module docstring)


#: registers this file's jitted helpers (and rope's) with numba, once.  Required by the other
#: kernel modules, whose kernels call rms_rope's ``_inv_rms``, ``_normed`` (``_round_as``, which
#: several kernels import from here, is rope's)
_register = _numba.once(globals(), _register_helpers, requires=(_rope._register,))
#: the jitted kernel (it compiles per dtype combination when first called)
_jit = _numba.once(globals(), lambda numba: _numba.njit(_rms_norm_kernel), requires=(_register,))


# -- jitted helpers (float32 maths) ---------------------------------------------------------------

def _sum_squares(xr, d):
    """sum(float(x)^2) over a row, float32; compiled on its own with ``reassoc`` (see the module
    docstring), so LLVM vectorises the sum."""
    a = np.float32(0.0)
    for i in range(d):
        v = _load(xr, i)
        a += v * v
    return a


def _inv_rms(xr, d, eps):
    """``1 / sqrt(mean(float(x)^2) + eps)`` of one row, float32 (``eps`` is a float32)."""
    return np.float32(1.0) / np.sqrt(_sum_squares(xr, d) / np.float32(d) + eps)


def _normed(xr, w, r, e):
    """Feature ``e`` of the row times the weight, before the output rounding:
    ``round_w(float(x[e]) * r) * float(w[e])`` (``round_w`` is the identity for float32 w)."""
    return _round_as(w, _load(xr, e) * r) * _load(w, e)


def _rms_norm_kernel(x, w, out, bt, d, eps, has_w):
    """One row per iteration of the parallel loop; row ``i``'s offsets in x and out come from
    the table ``bt`` (size, x stride, out stride per merged leading dim).  Without a weight
    ``w`` is an empty float32 array (``has_w`` False)."""
    nrows = 1
    for j in range(bt.shape[0]):
        nrows *= bt[j, 0]
    for row in prange(nrows):
        xo, oo = _bcast_offsets(np.int64(row), bt)  # prange indices may be unsigned
        xr, orow = x[xo:xo + d], out[oo:oo + d]
        r = _inv_rms(xr, d, eps)
        if has_w:
            for e in range(d):
                _store(orow, e, _normed(xr, w, r, e))
        else:
            for e in range(d):
                _store(orow, e, _load(xr, e) * r)


# -- launcher -----------------------------------------------------------------------------------

class _Rows(NamedTuple):
    """Where the rows of x and out are, for one x stride (module docstring)."""

    x_stride: tuple  # the table is valid for this stride of x
    bt: np.ndarray  # [k, 3]: per merged leading dim: size, x stride, out stride (elements)
    span: int  # elements x spans from its storage offset
    o_stride: tuple | None = None  # ... and this stride of out (None: contiguous)
    o_span: int | None = None  # elements out spans (None: its numel)


def _rows(x_shape, x_stride, o_stride=None) -> _Rows:
    """``o_stride``: out's strides when it is not contiguous (a part of a concatenation the
    plan places in a strided slice: ``strided_out``); unit feature stride either way."""
    d = int(x_shape[-1])
    if o_stride is not None and _is_contiguous(x_shape, o_stride):
        o_stride = None
    # rope's layout with cos/sin of a single row: every leading dim is then a broadcast dim,
    # merged where contiguous in x and out
    lay = _rope._layout(x_shape, x_stride, (d,), (1,), 4, (d,), (1,), 4, max(d, 1), o_stride)
    # rows in x's memory order (innermost: the smallest x stride): a transposed [B, S, H, D]
    # then streams through x (and strides through out), 1.7x faster than out's order
    bt = lay.bt[np.argsort(-lay.bt[:, 1], kind="stable")].copy()
    return _Rows(tuple(x_stride), bt, lay.spans[0],
                 None if o_stride is None else tuple(int(v) for v in o_stride),
                 None if o_stride is None else _rope._span(x_shape, o_stride))


def _is_contiguous(shape, stride) -> bool:
    acc = 1
    for n, st in zip(reversed(tuple(shape)), reversed(tuple(stride))):
        if n != 1 and st != acc:
            return False
        acc *= n
    return True


def _why_not(x: Any, w: Any, eps: Any) -> str | None:
    """None when the kernel computes ``sd.rms_norm.v1`` on these inputs, else the reason."""
    return _why_not_eps(eps) or _why_not_tensors(x, w)


def _why_not_eps(eps: Any) -> str | None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or \
            not math.isfinite(eps):
        return f"eps {eps!r} (a finite float >= 0)"
    return None


def _why_not_tensors(x: Any, w: Any) -> str | None:
    """The checks of x and the weight (None: no weight) on metadata alone."""
    why = _why_not_metas((x,) if w is None else (x, w))
    if why is not None:
        return why
    if x.dtype not in _NP_OF:
        return f"x dtype {x.dtype} (float32, bfloat16 or float16)"
    if not x.shape:
        return "x is a scalar"
    if x.stride[-1] != 1:
        return "x's features are strided"
    if w is not None:
        if w.dtype not in _NP_OF:
            return f"weight dtype {w.dtype} (float32, bfloat16 or float16)"
        if tuple(w.shape) != (x.shape[-1],):
            return f"weight shape {tuple(w.shape)} (want ({x.shape[-1]},))"
        if x.shape[-1] > 1 and w.stride[-1] != 1:
            return "weight is strided"
    return None


def _launch(rows: _Rows, x, w, out, eps) -> None:
    if rows.span == 0 or out.numel() == 0:
        return
    fn = _jit()
    _set_threads()
    has_w = w is not None
    wf = _flat(w, w.shape[0]) if has_w else np.zeros(0, np.float32)
    fn(_flat(x, rows.span), wf, _flat(out, out.numel() if rows.o_span is None else rows.o_span),
       rows.bt, x.shape[-1], np.float32(eps), has_w)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``sd.rms_norm.v1`` on CPU tensors with the numba kernel (the launcher; for direct calls
    and benchmarks).  ``out``: a contiguous tensor of x's shape and the op's output dtype
    (``rms_norm_out_dtype``), or None (allocated).  Raises ValueError for inputs the kernel
    does not handle (see ``RmsNormCPU.supports``)."""
    for label, t, optional in (("x", x, False), ("weight", weight, True), ("out", out, True)):
        if not isinstance(t, torch.Tensor) and not (optional and t is None):
            raise ValueError(f"rms_norm_cpu: {label} must be a tensor, got {type(t).__name__}")
    why = _why_not(fxbackend.TensorMeta.of(x),
                   None if weight is None else fxbackend.TensorMeta.of(weight), eps)
    if why is not None:
        raise ValueError(f"rms_norm_cpu: unsupported input: {why}")
    dtype = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype)
    elif out.shape != x.shape or out.dtype != dtype or not out.is_contiguous() or \
            out.device.type != "cpu":
        raise ValueError(f"rms_norm_cpu: out must be a contiguous CPU tensor of shape "
                         f"{tuple(x.shape)} and dtype {dtype}")
    _launch(_rows(x.shape, x.stride()), x, weight, out, eps)
    return out


@compiles
def compile_kernels(x_dtype: torch.dtype, w_dtype: torch.dtype | None,
                    out_dtype: torch.dtype | None = None) -> None:
    """Compile (or load from the disk cache) the kernel for these dtypes (``w_dtype`` None: no
    weight; ``out_dtype`` None: the op's), by a call with no rows on exactly the types a launch
    passes."""
    fn = _jit()
    out_np = _NP_OF[out_dtype or rms_norm_out_dtype(x_dtype, w_dtype)]
    w_np = np.float32 if w_dtype is None else _NP_OF[w_dtype]
    # rope's lock: numba launches from several plan-compiling threads at once must not overlap
    # on threading layers that are not thread-safe (see cpu_kernels/rope.py)
    with _compile_lock:
        fn(np.zeros(0, _NP_OF[x_dtype]), np.zeros(0, w_np), np.zeros(0, out_np),
           np.zeros((0, 3), np.int64), 2, np.float32(1e-6), w_dtype is not None)


class RmsNormCPU:
    """The numba CPU kernel for ``sd.rms_norm.v1``: float32/bf16/fp16 ``x`` with any leading
    strides and unit feature stride, no weight or a contiguous float32/bf16/fp16 ``[D]``
    weight.  Workspace: none (bf16/fp16 convert in registers)."""

    name = "rms_norm_cpu"
    op = "sd.rms_norm.v1"
    #: writes through any output strides with unit feature stride (a plan may place the result
    #: in a strided slice of a concatenation, fxbackend.concat)
    strided_out = True

    def supports(self, node) -> bool:
        try:
            if len(node.srcs) not in (1, 2):
                return False
            x = node.srcs[0].meta
            w = node.srcs[1].meta if len(node.srcs) == 2 else None
            if _why_not(x, w, node.params.get("eps")) is not None:
                return False
            m = node.meta
            wif = node.params.get("weight_in_float", False)
            return isinstance(m, fxbackend.TensorMeta) and \
                m.dtype == rms_norm_out_dtype(x.dtype, None if w is None else w.dtype, wif) and \
                tuple(m.shape) == tuple(x.shape) and m.is_contiguous
        except Exception:  # never raise from supports: decline instead
            return False

    def compile(self, node) -> None:
        w = node.srcs[1].meta.dtype if len(node.srcs) == 2 else None
        if node.params.get("weight_in_float", False):
            # the launch passes the weight as float32 (below) and out has x's dtype
            compile_kernels(node.srcs[0].meta.dtype, torch.float32, node.meta.dtype)
        else:
            compile_kernels(node.srcs[0].meta.dtype, w)

    def prepare(self, node):
        x = node.srcs[0].meta
        return _rows(x.shape, x.stride, node.meta.stride), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x = inputs[0]
        w = inputs[1] if len(inputs) == 2 else None
        rows = state
        if x.stride() != rows.x_stride or (rows.o_stride is not None and
                                           out.stride() != rows.o_stride):
            # the caller passed other strides than the plan's metadata: never read out of bounds
            rows = _rows(x.shape, x.stride(), out.stride())
        if node.params.get("weight_in_float", False):
            # (x * r * float(w)) rounded once to out's (x's) dtype: the kernel with a float32
            # weight computes exactly that (no rounding to the weight's dtype in between)
            w = w.float()
        _launch(rows, x, w, out, node.params["eps"])


fxbackend.register_kernel("cpu", RmsNormCPU)
