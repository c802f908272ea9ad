"""adaLN modulation on the CPU: a numba kernel computing ``modulation_reference``
(``patterns/modulation.py``) in one pass, registered at the end as the kernel of the
``modulation`` fusion rule for "cpu" (:class:`ModulationCPU`).

Maths (per row of x viewed as ``[rows, C]``; float32; ``round`` = round to nearest even to the
chain's dtype T, the identity for float32; T is the scale's and shift's dtype, x's unless a
16-bit x was widened with ``x.float()`` in the step; the last ``round`` is to out's dtype, T's
unless the float32 result is narrowed to bf16/fp16 in the step)::

    mean = sum(x) / C                              LayerNorm (rms: mean = 0)
    var  = sum((x - mean)^2) / C                   biased; rms: mean(x^2)
    r    = 1 / sqrt(var + float32(eps))
    n    = round((x - mean) * r)                   torch's CPU LayerNorm: (x - mean) * rstd
    s1   = round(s + float32(c))                   when the ``c + scale`` add is in the step
    out  = round(round(n * s1) + shift)

Each product and sum is rounded where the unfused chain rounds it (no FMA: ``fastmath=False``),
so the output equals the chain given the same mean and r; those come from float32 sums in this
kernel's order (two passes: mean, then squared deviations), while torch's LayerNorm uses a
Welford-style reduction: the difference is about one float32 rounding of mean/rstd (measured
~2e-7 of max|out| at C = 3072).  The two sums alone are compiled with LLVM's ``reassoc`` flag (as
``cpu_kernels/rmsnorm.py`` does for its sum of squares) so they vectorise into partial sums.
Sources: Ba et al., "Layer Normalization" (arXiv 1607.06450); Peebles and Xie (arXiv
2212.09748), adaLN; torch ``aten/src/ATen/native/cpu/layer_norm_kernel.cpp``.

Memory: every row of x is read once from memory (into a per-task float32 scratch row: its later
passes hit L1) and every output row written once; scale and shift rows (``[B, 1, C]`` broadcast
over tokens) stay in cache.  Layout: x may have any strides (PixArt's first block normalises a
transposed patch embedding, feature stride != 1), scale and shift are expanded views (stride 0
where broadcast); their leading dims are merged where contiguous in all three and each row finds
its offsets from a small table (size, x stride, scale stride, shift stride per merged dim).
Unit feature strides take a contiguous loop.  bf16/fp16 pass as int16/uint16 bits converted in
registers (``cpu_kernels/rope.py``); the kernel compiles at plan time (``compile``) and is cached
on disk in rope's cache dir (keyed on this file: a change to the rope/rmsnorm helpers it inlines
needs a change here or a cleared cache).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.modulation import NORMS, ModulationFusion, dtypes_why_not

from . import _numba
from ._workers import compiles
from . import rmsnorm as _rms
from .rmsnorm import _round_as
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store, _why_not_metas

__all__ = ["ModulationCPU", "modulation_cpu", "why_not", "compile_kernels"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range


def _build(numba):
    from numba.extending import register_jitable
    for fn in (_row_offsets, _modulate):
        register_jitable(fn)
    _numba.inline(_load_row, _row_stats)
    _numba.reassoc(_sum, _sum_dev_sq)  # the sums alone (see the module docstring)
    return _numba.njit(_modulation_kernel)


#: the jitted kernel (created once; it compiles per dtype when first called)
_jit = _numba.once(globals(), _build, requires=(_rms._register,))


# -- jitted helpers -------------------------------------------------------------------------------

def _sum(xv, d):
    a = np.float32(0.0)
    for i in range(d):
        a += xv[i]
    return a


def _sum_dev_sq(xv, d, mean):
    a = np.float32(0.0)
    for i in range(d):
        v = xv[i] - mean
        a += v * v
    return a


def _row_offsets(row, bt):
    """Offsets in x, scale and shift of row ``row`` (row-major over the table's dims)."""
    xo = 0
    so = 0
    ho = 0
    for j in range(bt.shape[0] - 1, -1, -1):
        n = bt[j, 0]
        i = row % n
        row = row // n
        xo += i * bt[j, 1]
        so += i * bt[j, 2]
        ho += i * bt[j, 3]
    return xo, so, ho


def _load_row(x, xv, xo, xfs, d):
    """The row of x at element offset ``xo`` (feature stride ``xfs``) into the float32 scratch
    row ``xv`` (``d`` values)."""
    if xfs == 1:
        xr = x[xo:xo + d]
        for e in range(d):
            xv[e] = _load(xr, e)
    else:
        for e in range(d):
            xv[e] = _load(x, xo + e * xfs)


def _row_stats(xv, d, is_rms, eps):
    """``(mean, rstd)`` of the scratch row ``xv``: the two-pass statistics (mean 0.0 for the RMS
    norm), each step rounded to float32."""
    mean = np.float32(0.0)
    if not is_rms:
        mean = _sum(xv, d) / np.float32(d)
    r = np.float32(1.0) / np.sqrt(_sum_dev_sq(xv, d, mean) / np.float32(d) + eps)
    return mean, r


def _modulate(t, v, mean, r, sv, hv, has_add, c):
    """One output value before its final rounding (module docstring); the array ``t`` gives
    the dtype T the chain rounds to (the scale's: x's unless x was widened to float32)."""
    n = _round_as(t, (v - mean) * r)
    if has_add:
        sv = _round_as(t, sv + c)
    return _round_as(t, n * sv) + hv


def _modulation_kernel(x, s, h, out, bt, d, xfs, sfs, hfs, eps, is_rms, has_add, c, chunk):
    """Tasks of ``chunk`` rows in parallel; per row: x into the float32 scratch ``xv``, the
    statistics, then the modulated output."""
    nrows = 1
    for j in range(bt.shape[0]):
        nrows *= bt[j, 0]
    ntasks = (nrows + chunk - 1) // chunk
    for task in prange(ntasks):
        xv = np.empty(d, np.float32)
        r0 = np.int64(task) * chunk  # prange indices may be unsigned
        r1 = min(nrows, r0 + chunk)
        for row in range(r0, r1):
            xo, so, ho = _row_offsets(row, bt)
            _load_row(x, xv, xo, xfs, d)
            mean, r = _row_stats(xv, d, is_rms, eps)
            oo = row * d
            orow = out[oo:oo + d]
            if sfs == 1 and hfs == 1:
                sr = s[so:so + d]
                hr = h[ho:ho + d]
                for e in range(d):
                    _store(orow, e, _modulate(s, xv[e], mean, r, _load(sr, e), _load(hr, e),
                                              has_add, c))
            else:
                for e in range(d):
                    _store(orow, e, _modulate(s, xv[e], mean, r, _load(s, so + e * sfs),
                                              _load(h, ho + e * hfs), has_add, c))


# -- launcher -----------------------------------------------------------------------------------

class _Rows(NamedTuple):
    """Where the rows of x, scale and shift are (module docstring)."""

    key: tuple  # the strides this layout is valid for
    bt: np.ndarray  # [k, 4]: per merged leading dim: size, x/scale/shift strides (elements)
    spans: tuple  # elements x, scale, shift span from their storage offsets
    fs: tuple  # feature strides of x, scale, shift


def _span(shape, stride) -> int:
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _rows(shape, xs, ss, hs) -> _Rows:
    dims: list = []
    for n, *st in zip(shape[:-1], xs[:-1], ss[:-1], hs[:-1]):
        if n == 1:
            continue
        if dims and all(a == b * n for a, b in zip(dims[-1][1:], st)):
            dims[-1] = (dims[-1][0] * n, *st)  # contiguous with the dim outside: merged
            continue
        dims.append((n, *st))
    bt = np.array(dims or [(1, 0, 0, 0)], dtype=np.int64).reshape(-1, 4)
    return _Rows((tuple(xs), tuple(ss), tuple(hs)), bt,
                 tuple(_span(shape, st) for st in (xs, ss, hs)), (xs[-1], ss[-1], hs[-1]))


def why_not(x: Any, scale: Any, shift: Any, out: Any, norm: Any) -> str | None:
    """None when the kernel computes ``modulation_reference`` for tensors with these metadata
    (``scale``/``shift`` expanded to x's shape; ``out`` the output), else a short reason.  Never
    raises.  Handled: float32/bf16/fp16 on the CPU, one dtype for all or (a widened x, a
    narrowed result) bf16/fp16 x or out around float32 scale and shift, any strides of x, scale
    and shift, a contiguous out of x's shape, at least one feature, norm ``layer``/``rms``."""
    try:
        metas = (x, scale, shift, out)
        why = _why_not_metas(metas)
        if why is not None:
            return why
        why = dtypes_why_not(x.dtype, scale.dtype, shift.dtype, out.dtype)
        if why is not None:
            return why
        if norm not in NORMS:
            return f"norm {norm!r} (one of {NORMS})"
        if not x.shape or x.shape[-1] < 1:
            return "x has no features"
        shape = tuple(x.shape)
        if tuple(scale.shape) != shape or tuple(shift.shape) != shape or \
                tuple(out.shape) != shape:
            return "scale, shift and out must have x's shape (expanded)"
        acc = 1
        for n, st in zip(reversed(shape), reversed(tuple(out.stride))):
            if n != 1 and st != acc:
                return "out is not contiguous"
            acc *= n
        return None
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _launch(rows: _Rows, x, scale, shift, out, norm: str, eps: float,
            add_c: float | None) -> None:
    if out.numel() == 0:
        return
    fn = _jit()
    threads = _set_threads()
    nrows = out.numel() // x.shape[-1]
    chunk = max(1, -(-nrows // (4 * threads)))
    fn(_flat(x, rows.spans[0]), _flat(scale, rows.spans[1]), _flat(shift, rows.spans[2]),
       _flat(out, out.numel()), rows.bt, x.shape[-1], *rows.fs, np.float32(eps),
       norm == "rms", add_c is not None, np.float32(0.0 if add_c is None else add_c), chunk)


def modulation_cpu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                   out: torch.Tensor | None = None, *, norm: str = "layer", eps: float = 1e-6,
                   add_c: float | None = 1.0) -> torch.Tensor:
    """``modulation_reference(x, scale, shift, eps, norm, add_c)`` into ``out`` (allocated when
    None; else a contiguous CPU tensor of x's shape not overlapping the inputs, of x's dtype or,
    around float32 scale and shift, bf16/fp16: the float32 result rounded once) with the numba
    kernel.  ``scale``/``shift`` broadcast to x; a bf16/fp16 x with float32 scale and shift is
    widened exactly (``x.float()``).  Raises ValueError for inputs the kernel does not handle
    (see :func:`why_not`)."""
    for label, t in (("x", x), ("scale", scale), ("shift", shift)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"modulation_cpu: {label} must be a tensor, got {type(t).__name__}")
    try:
        scale, shift = scale.expand(x.shape), shift.expand(x.shape)
    except RuntimeError as e:
        raise ValueError(f"modulation_cpu: scale/shift do not broadcast to x: {e}") from None
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    TM = fxbackend.TensorMeta.of
    if out.shape != x.shape:
        raise ValueError(f"modulation_cpu: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    why = why_not(TM(x), TM(scale), TM(shift), TM(out), norm)
    if why is None and (not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0):
        why = f"eps {eps!r}"
    if why is not None:
        raise ValueError(f"modulation_cpu: unsupported input: {why}")
    _launch(_rows(tuple(x.shape), x.stride(), scale.stride(), shift.stride()), x, scale, shift,
            out, norm, eps, add_c)
    return out


@compiles
def compile_kernels(dtype: torch.dtype, scale_dtype: torch.dtype | None = None,
                    out_dtype: torch.dtype | None = None) -> None:
    """Compile (or load from the disk cache) the kernel for x of ``dtype``, scale and shift of
    ``scale_dtype`` and out of ``out_dtype`` (both default to ``dtype``; every variant: norm,
    ``c + scale`` and strides are run-time arguments), by a call with no rows on exactly the
    types a launch passes.  Thread-safe."""
    fn = _jit()
    a = np.zeros(0, _NP_OF[dtype])
    s = np.zeros(0, _NP_OF[scale_dtype or dtype])
    o = np.zeros(0, _NP_OF[out_dtype or dtype])
    with _compile_lock:  # see rope's compile_kernels
        fn(a, s, s, o, np.zeros((1, 4), np.int64), 1, 1, 1, 1, np.float32(1e-6), False, True,
           np.float32(1.0), 1)


class ModulationCPU:
    """The numba kernel behind the ``modulation`` fusion rule on the CPU (see
    ``fxbackend.patterns.modulation.ModulationFusion`` for the interface).  The row table is
    built per call from the tensors' strides (microseconds) and cached by strides."""

    name = "modulation_cpu"

    def __init__(self) -> None:
        self._rows: dict = {}

    def why_not(self, x, scale, shift, out, norm):
        return why_not(x, scale, shift, out, norm)

    def compile(self, x, scale, shift, out, norm, has_add):
        compile_kernels(x.dtype, scale.dtype, out.dtype)

    def run(self, x, scale, shift, out, *, norm, eps, add_c):
        key = (tuple(x.shape), x.stride(), scale.stride(), shift.stride())
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) > 64:
                self._rows.clear()
            rows = self._rows[key] = _rows(tuple(x.shape), x.stride(), scale.stride(),
                                           shift.stride())
        _launch(rows, x, scale, shift, out, norm, eps, add_c)


fxbackend.register_fusion("cpu", ModulationFusion(ModulationCPU()))
