"""The INT8 fusions on the CPU (``patterns/int8_fusions.py``): numba kernels registered at the
bottom as the implementations of ``int8_gated_residual``, ``int8_linear_act_quantize``,
``int8_linear_glu_quantize``, ``int8_linear_act``, ``int8_linear_cast``, ``modulation_quantize``, ``rms_norm_quantize``,
``act_quantize`` and ``scale_quantize`` for "cpu".

Every kernel reuses the jitted helpers of the kernels whose chain it fuses, so that each value
is computed by the same code in the same order (strict IEEE float32, ``fastmath=False``: no
FMA contraction, no reassociation except the norm sums that the norm kernels themselves
compile with ``reassoc``):

- the quantize step: ``cpu_kernels/int8.py``'s ``_quantize_row`` (the rotation's butterfly
  stages, the integer-bits amax, the true division and round-half-even of the codes);
- ``modulation_quantize``: ``cpu_kernels/modulation.py``'s ``_row_offsets``, ``_load_row``,
  ``_row_stats`` and ``_modulate`` (its two-pass statistics over a float32 scratch row);
- ``rms_norm_quantize``: ``cpu_kernels/rmsnorm.py``'s ``_inv_rms`` and ``_normed``;
- ``int8_gated_residual``: ``cpu_kernels/int8.py``'s epilogue formula and
  ``cpu_kernels/gated_residual.py``'s ``_row_unit``/``_row_strided``;
- ``act_quantize``: ``cpu_kernels/activation.py``'s ``_gelu_tanh_as``, ``_gelu_erf``, ``_silu`` and
  ``_expf`` (sigmoid here: ``1 / (1 + exp(-x))`` with that ``_expf``).

Maths.  ``int8_gated_residual``, per output row r (b, s) and feature n, after
the GEMM wrote the accumulator (``torch._int_mm``'s int32, into the output's own storage
when the output is contiguous, else into workspace; or a prepacked engine's new tensor of the
int32 sums' float32 values: ``cpu_kernels/int8.accumulator_dtype``)::

    y[n]   = (float32(acc[r, n]) * x_scale[r]) * w_scale[n] + float32(bias[n])   -> scratch row
    t      = y * float32(s) | y / float32(s) | y
    out    = residual + gate * t                          (each op rounded to float32)

``int8_linear_act_quantize`` computes the same ``y`` row from an accumulator in workspace, then
``round(act(y))`` and the quantize step below, so the float [M, N] hidden of a feed-forward is
never written (measured 1.12x over ``sd.linear_i8.v1`` + ``fused.act_quantize`` at Flux's and
SD3's FF-up sizes, 1024 rows, 2 threads).  ``int8_linear_glu_quantize`` does the same for a
GEGLU: the ``y`` row of all N columns, then ``round(round(act(y[gate half])) * y[other
half])`` over N/2 features and the quantize step (``act_quantize``'s maths with the other half
as its multiplier), so the [M, N] GEMM result is not written and read back.  ``int8_linear_act``
stops after ``round(act(y))``,
storing the row into its output (rows of any stride: Flux's single-stream MLP activation lands
in its slice of the concatenation with the attention output), so the float linear output is
not written and read back by a separate activation pass.

The first line is one pass over the accumulator row into a per-task float32 scratch row (L1),
the rest ``gated_residual``'s row functions over that scratch, so the accumulator row is read
completely before any output of the row is written (in place is safe).  Traffic per element:
read the int32, read the residual (the gate row stays in cache), write the output, against the
unfused chain's write + read of the float linear output per native op.

The quantize-feeding kernels compute, per row of the quantized tensor, the float32 values of the
chain into a scratch row (each value rounded to the chain's dtype T where the chain rounds it:
the identity for float32), then quantize that row::

    modulation_quantize:  v = round_T(round_T(n * round_T(s [+ c])) + shift),
                          n = round_T((x - mean) * rstd)
    rms_norm_quantize:    v = round_out(round_w(x * r) * w)  |  round_T(x * r)
    act_quantize:         v = round_T(act(x)) [; v = round_T(v * b)]
    scale_quantize:       v = round_T(x * float32(s))  |  round_T(x / float32(s))
    codes, scale:         _quantize_row(v)  (rotation by the regular Hadamard matrix, amax/127)

so the packed output equals the unfused kernels' (the norm or activation kernel's T output,
then ``quantize_i8_convrot_cpu``) bit for bit.  Rows ``M .. Mp-1`` of the packed layout are zeros
with scale 0.0.  The float [rows, C] tensor is never written: per element the fused step reads
x (and the multiplier) and writes one int8 code, where the unfused pair also writes the float
value and reads it back (4 + 4 bytes per element for float32, 2 + 2 for a 16-bit T).

Layout: x (and scale/shift, or the multiplier) through a row table of their merged leading
dims (``modulation._rows``: any strides, broadcast dims stride 0), features through their own
stride; rms_norm_quantize through ``rmsnorm._rows`` (unit feature stride, as its kernel).
Rows run in parallel in tasks of whole rows (``prange``), each task with its own scratch rows.
bf16/fp16 pass as bits (int16/uint16) and convert in registers (``cpu_kernels/rope.py``).

Compilation at plan time (``compile``), cached on disk (``cpu_kernels/_numba.py``): the cache is
keyed on this file, so a change to a helper it inlines from another file (int8's
``_quantize_row``, modulation's or rmsnorm's statistics, the activations, rope's conversions)
needs a change here or a cleared cache.  Compile time: the quantize step (``_quantize_row``,
through ``_quantize_into``) and ``_activate`` are functions of their own, not inlined into
numba's IR: each is then typed and compiled once per process and signature, where inlined
each kernel typed its own copy again.  With an empty cache that took the first call of small
Flux with W8A8 from 38.2 to 30.4 s and small UNet's from 29.8 to 23.0 s (2 threads of an AMD
EPYC with AVX-512; ``scripts/bench_first_call.py --cache empty --families flux,unet
--dtypes float32 --w8a8``), and the kernels ran as fast as before (``scripts/
bench_int8_fusions.py``: every fused step level or faster).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from fxbackend import TensorMeta
from fxbackend.patterns.gated_residual import epilogue_layout, epilogue_why_not
from fxbackend.patterns.int8 import (FLOATS, REGULAR_HADAMARD_GROUPS, check_linear,
                                     hadamard_stages, packed_nbytes, padded_rows)
from fxbackend.patterns.int8_fusions import (ACT_IDS, PRE_ACTS, SCALE_OPS, FusedKernel,
                                             bias_dtype, direct_gemm, expand_scale_shift,
                                             never_raises, packed_out, register_int8_fusions)
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype

from . import _numba
from ._workers import compiles
from . import activation as _act
from . import gated_residual as _gr
from . import int8 as _i8
from . import modulation as _mod
from . import rmsnorm as _rms
from ._vmath import _expf, _silu
from .activation import _gelu_erf, _gelu_tanh_as
from .gated_residual import _row_strided, _row_unit
from .int8 import _quantize_row
from .modulation import _load_row, _modulate, _row_offsets, _row_stats
from .rmsnorm import _inv_rms, _normed, _round_as
from .rope import (_NP_OF, _bcast_offsets, _compile_lock, _flat, _load, _set_threads,
                   _store, _why_not_metas)

__all__ = ["int8_gated_residual_cpu", "int8_linear_act_quantize_cpu",
           "int8_linear_glu_quantize_cpu", "int8_linear_act_cpu",
           "modulation_quantize_cpu", "rms_norm_quantize_cpu", "act_quantize_cpu",
           "compile_kernels", "KERNELS"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
#: elements per parallel task at least (numba's per-task cost is ~1 us)
_MIN_TASK_ELEMS = 16384


# -- jitted helpers --------------------------------------------------------------------------------

def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + _expf(-x))


def _zero_row(q, scales, ru, ku):
    """A padding row of the packed layout: codes 0, scale 0.0."""
    qr = q[ru * ku:(ru + np.uint64(1)) * ku]
    for i in range(ku):
        qr[i] = 0
    scales[ru] = np.float32(0.0)


def _epilogue_row(yv, ar, sx, ws, b, has_b, c):
    """linear_i8's epilogue of accumulator row ``ar`` (x scale ``sx``) into the scratch row
    ``yv``: ``(float32(acc) * sx) * ws[e] [+ float32(b[e])]``, rounded to yv's element type
    (float32, or a 16-bit chain's bits)."""
    if has_b:
        for e in range(c):
            _store(yv, e, (np.float32(ar[e]) * sx) * ws[e] + _load(b, e))
    else:
        for e in range(c):
            _store(yv, e, (np.float32(ar[e]) * sx) * ws[e])


def _quantize_into(xv, rb, q, scales, ru, ku, nst, inv):
    """Packed row ``ru`` (``ku`` codes) and its scale from the float32 row ``xv`` (``rb``: the
    rotation's scratch row)."""
    scales[ru] = _quantize_row(xv, rb, q[ru * ku:(ru + np.uint64(1)) * ku], ku, nst, inv)


def _activate(x, xv, d, act):
    """``xv = round_T(act(xv))`` in place (T: x's element type); one loop per activation."""
    if act == 1:
        for e in range(d):
            xv[e] = _round_as(x, _gelu_tanh_as(x, xv[e]))
    elif act == 2:
        for e in range(d):
            xv[e] = _round_as(x, _gelu_erf(xv[e]))
    elif act == 3:
        for e in range(d):
            xv[e] = _round_as(x, _silu(xv[e]))
    elif act == 4:
        for e in range(d):
            xv[e] = _round_as(x, _sigmoid(xv[e]))


def _tasks(nrows, threads_rows):
    """How many parallel tasks of ``threads_rows`` rows cover ``nrows`` rows."""
    return (nrows + threads_rows - 1) // threads_rows


def _task_rows(task, chunk, nrows):
    """Rows ``r0 .. r1-1`` of parallel task ``task`` (``chunk`` rows a task, ``nrows`` in all;
    int64, as ``prange`` indices may be unsigned)."""
    r0 = np.int64(task) * chunk
    return r0, min(nrows, r0 + chunk)


def _scratch_rows(d):
    """A task's float32 scratch rows of ``d`` values: the row itself and the rotation's."""
    return np.empty(d, np.float32), np.empty(d, np.float32)


# -- kernels ---------------------------------------------------------------------------------------

def _i8_gr_kernel(acc, xs, ws, b, has_b, gate, res, out, nb, ns, c, gsb, gss, gsc, rsb, rss,
                  rsc, osb, oss, osc, scale, op, rows_per_task, t, zb):
    """Rows r = (b, s) of ``nb * ns``: the linear_i8 epilogue of accumulator row r into a
    scratch row of t's element type (float32, or a 16-bit chain's: the value rounded as the
    cast does, and gated_residual's roundings to it), then gated_residual's row function into
    out (module docstring) with ``zb``, c negative zeros, as its bias (none: the linear_i8
    epilogue added the bias)."""
    nrows = nb * ns
    unit = gsc == 1 and rsc == 1 and osc == 1
    for task in prange(_tasks(nrows, rows_per_task)):
        yv = np.empty(c, t.dtype)
        r0, r1 = _task_rows(task, rows_per_task, nrows)
        for r in range(r0, r1):
            ar = acc[r * c:r * c + c]
            sx = xs[r]
            _epilogue_row(yv, ar, sx, ws, b, has_b, c)
            bi = r // ns
            si = r - bi * ns
            go = bi * gsb + si * gss
            ro = bi * rsb + si * rss
            oo = bi * osb + si * oss
            if unit:
                _row_unit(yv, gate[go:go + c], res[ro:ro + c], out[oo:oo + c], zb, c, scale,
                          op)
            else:
                _row_strided(yv, gate, res, out, zb, go, ro, oo, gsc, rsc, osc, c, scale, op)


def _i8_actq_kernel(acc, xs, ws, b, has_b, q, scales, m, mp, n, act, nst, inv, chunk, t):
    """Packed rows 0 .. mp-1 in tasks of ``chunk``: rows below m through linear_i8's epilogue
    (into the scratch ``yv``), rounded to t's element type T (a 16-bit layer's cast; nothing
    for float32), the activation (rounded to T), then quantized; the rest padding."""
    ku = np.uint64(n)
    for task in prange(_tasks(mp, chunk)):
        yv, rb = _scratch_rows(n)
        r0, r1 = _task_rows(task, chunk, mp)
        for row in range(r0, r1):
            ru = np.uint64(row)
            if row >= m:
                _zero_row(q, scales, ru, ku)
                continue
            ar = acc[row * n:row * n + n]
            sx = xs[row]
            _epilogue_row(yv, ar, sx, ws, b, has_b, n)
            for e in range(n):
                yv[e] = _round_as(t, yv[e])
            _activate(t, yv, n, act)
            _quantize_into(yv, rb, q, scales, ru, ku, nst, inv)


def _i8_gluq_kernel(acc, xs, ws, b, has_b, q, scales, m, mp, n, gate, act, nst, inv, chunk, t):
    """Packed rows 0 .. mp-1 of ``h = n // 2`` features in tasks of ``chunk``: rows below m
    through linear_i8's epilogue over all n columns (into the scratch ``yv``), rounded to t's
    element type T, the activation of half ``gate`` (rounded to T) times the other half
    (rounded to T), then quantized; the rest padding."""
    h = n // 2
    ku = np.uint64(h)
    g0 = gate * h
    o0 = h - g0
    for task in prange(_tasks(mp, chunk)):
        yv = np.empty(n, np.float32)
        xv, rb = _scratch_rows(h)
        r0, r1 = _task_rows(task, chunk, mp)
        for row in range(r0, r1):
            ru = np.uint64(row)
            if row >= m:
                _zero_row(q, scales, ru, ku)
                continue
            ar = acc[row * n:row * n + n]
            _epilogue_row(yv, ar, xs[row], ws, b, has_b, n)
            for e in range(h):
                xv[e] = _round_as(t, yv[g0 + e])
            _activate(t, xv, h, act)
            for e in range(h):
                xv[e] = _round_as(t, xv[e] * _round_as(t, yv[o0 + e]))
            _quantize_into(xv, rb, q, scales, ru, ku, nst, inv)


def _i8_act_kernel(acc, xs, ws, b, has_b, out, m, n, osr, act, chunk, t):
    """Rows 0 .. m-1 in tasks of ``chunk``: linear_i8's epilogue of accumulator row r (into the
    scratch ``yv``), rounded to t's element type T (a 16-bit layer's cast; nothing for
    float32), the activation (rounded to T), stored into ``out[r * osr:r * osr + n]`` (T's
    element type; ``osr``: the output's row stride, e.g. a slice of a concatenation)."""
    for task in prange(_tasks(m, chunk)):
        yv = np.empty(n, np.float32)
        r0, r1 = _task_rows(task, chunk, m)
        for row in range(r0, r1):
            ar = acc[row * n:row * n + n]
            _epilogue_row(yv, ar, xs[row], ws, b, has_b, n)
            for e in range(n):
                yv[e] = _round_as(t, yv[e])
            _activate(t, yv, n, act)
            orow = out[row * osr:row * osr + n]
            for e in range(n):
                _store(orow, e, yv[e])


def _modq_kernel(x, s, h, q, scales, bt, d, xfs, sfs, hfs, eps, is_rms, has_add, c, m, mp,
                 nst, inv, chunk):
    """Packed rows 0 .. mp-1 in tasks of ``chunk``: rows below m modulated exactly as
    ``cpu_kernels/modulation.py``'s kernel does (into the scratch ``xv``), then quantized."""
    ku = np.uint64(d)
    for task in prange(_tasks(mp, chunk)):
        xv, rb = _scratch_rows(d)
        r0, r1 = _task_rows(task, chunk, mp)
        for row in range(r0, r1):
            ru = np.uint64(row)
            if row >= m:
                _zero_row(q, scales, ru, ku)
                continue
            xo, so, ho = _row_offsets(row, bt)
            _load_row(x, xv, xo, xfs, d)
            mean, r = _row_stats(xv, d, is_rms, eps)
            if sfs == 1 and hfs == 1:
                sr = s[so:so + d]
                hr = h[ho:ho + d]
                for e in range(d):
                    xv[e] = _round_as(x, _modulate(x, xv[e], mean, r, _load(sr, e),
                                                   _load(hr, e), has_add, c))
            else:
                for e in range(d):
                    xv[e] = _round_as(x, _modulate(x, xv[e], mean, r, _load(s, so + e * sfs),
                                                   _load(h, ho + e * hfs), has_add, c))
            _quantize_into(xv, rb, q, scales, ru, ku, nst, inv)


def _rmsq_kernel(x, w, like, q, scales, bt, d, eps, has_w, m, mp, nst, inv, chunk):
    """Packed rows: rows below m normalised as ``cpu_kernels/rmsnorm.py``'s kernel does
    (rounded to ``like``'s element type, the norm's output dtype), then quantized.  ``bt``:
    rmsnorm's row table; the second offset is the row's offset in the (contiguous) norm output,
    so ``oo // d`` is its packed row."""
    ku = np.uint64(d)
    for task in prange(_tasks(mp, chunk)):
        xv, rb = _scratch_rows(d)
        r0, r1 = _task_rows(task, chunk, mp)
        for i in range(r0, r1):
            if i >= m:
                _zero_row(q, scales, np.uint64(i), ku)
                continue
            xo, oo = _bcast_offsets(i, bt)
            xr = x[xo:xo + d]
            r = _inv_rms(xr, d, eps)
            if has_w:
                for e in range(d):
                    xv[e] = _round_as(like, _normed(xr, w, r, e))
            else:
                for e in range(d):
                    xv[e] = _round_as(like, _load(xr, e) * r)
            ru = np.uint64(oo // d)
            _quantize_into(xv, rb, q, scales, ru, ku, nst, inv)


def _preq_kernel(x, o, q, scales, bt, d, xfs, ofs, act, has_o, scale, op, m, mp, nst, inv,
                 chunk):
    """Packed rows: rows below m through the prologue (x loaded, activated, times the
    multiplier, scaled; each step rounded to x's type), then quantized."""
    ku = np.uint64(d)
    for task in prange(_tasks(mp, chunk)):
        xv, rb = _scratch_rows(d)
        r0, r1 = _task_rows(task, chunk, mp)
        for row in range(r0, r1):
            ru = np.uint64(row)
            if row >= m:
                _zero_row(q, scales, ru, ku)
                continue
            xo, oo, _ = _row_offsets(row, bt)
            _load_row(x, xv, xo, xfs, d)
            _activate(x, xv, d, act)
            if has_o:
                if ofs == 1:
                    orow = o[oo:oo + d]
                    for e in range(d):
                        xv[e] = _round_as(x, xv[e] * _load(orow, e))
                else:
                    for e in range(d):
                        xv[e] = _round_as(x, xv[e] * _load(o, oo + e * ofs))
            if op == 1:
                for e in range(d):
                    xv[e] = _round_as(x, xv[e] * scale)
            elif op == 2:
                for e in range(d):
                    xv[e] = _round_as(x, xv[e] / scale)
            _quantize_into(xv, rb, q, scales, ru, ku, nst, inv)


def _build(numba) -> dict:
    from numba.extending import register_jitable
    for fn in (_sigmoid, _zero_row, _tasks, _activate, _quantize_into):
        register_jitable(fn)
    _numba.inline(_epilogue_row, _task_rows, _scratch_rows)
    return dict(gr=_numba.njit(_i8_gr_kernel), mod=_numba.njit(_modq_kernel),
                actq=_numba.njit(_i8_actq_kernel), gluq=_numba.njit(_i8_gluq_kernel),
                act=_numba.njit(_i8_act_kernel), rms=_numba.njit(_rmsq_kernel),
                pre=_numba.njit(_preq_kernel))


#: the jitted kernels (created once; each compiles per dtype when first called).  The helper
#: registrations of the kernels this file reuses come first
_jit = _numba.once(globals(), _build, requires=(_rms._register, _act._register, _i8._jit,
                                                _mod._jit, _gr._jit))


def _chunk(rows: int, d: int, threads: int) -> int:
    per = max(-(-rows // (4 * threads)), -(-_MIN_TASK_ELEMS // max(d, 1)))
    return max(1, min(per, max(rows, 1)))


def _packed_views(out: torch.Tensor, m: int, k: int) -> tuple:
    """The codes (int8, ``mp * k``) and scales (float32, ``mp``) of a packed ``out`` as numpy."""
    mp = padded_rows(m)
    return (_flat(out, mp * k), _flat(out[mp * k:mp * k + 4 * mp].view(torch.float32), mp),
            mp)


# -- int8_gated_residual ---------------------------------------------------------------------------

def _gr_launch(acc, xs, ws, bias, gate, res, out, y_shape, scale_op, scale,
               dtype=torch.float32) -> None:
    """The epilogue of ``int8_gated_residual`` (module docstring) from the accumulator ``acc``
    (int32, or float32: ``cpu_kernels/int8.accumulator_dtype``)."""
    lay = epilogue_layout(tuple(y_shape), tuple(gate.shape), tuple(gate.stride()),
                          tuple(res.shape), tuple(res.stride()), tuple(out.stride()))
    if lay.spans[0] == 0:
        return
    k = _jit()["gr"]
    threads = _set_threads()
    rows = _gr._threads_rows(lay, threads)
    n = lay.c
    b = _flat(bias, n) if bias is not None else np.zeros(0, np.float32)
    k(_flat(acc, lay.spans[0]), _flat(xs, lay.nb * lay.ns), _flat(ws, n), b, bias is not None,
      _flat(gate, lay.spans[1]), _flat(res, lay.spans[2]), _flat(out, lay.spans[3]), lay.nb,
      lay.ns, n, *lay.g, *lay.r, *lay.o, np.float32(1.0 if scale is None else scale),
      SCALE_OPS[scale_op], rows, np.zeros(0, _NP_OF[dtype]), _gr._no_bias(dtype, n))


def int8_gated_residual_cpu(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            x_scale: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None, *, gate: torch.Tensor,
                            residual: torch.Tensor, x_kind: str, group: int = 1, m: int = -1,
                            lead: tuple = (), y_shape: tuple | None = None,
                            scale_op: str | None = None, scale: float | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_gated_residual_reference`` with an int8 weight (``w``, ``w_scale`` from
    ``quantize_weight_i8_reference``) through this file's kernels (direct calls, tests,
    benchmarks): ``torch._int_mm``, then the fused epilogue.  ``y_shape``: the linear output's
    shape as the gate sees it (None: ``lead + (N,)``); gate and residual broadcast to it; out
    (allocated when None, contiguous then) any strides of that shape.  ValueError for inputs
    the kernels do not take."""
    metas = [None if t is None else TensorMeta.of(t) for t in (x, w, w_scale, x_scale, bias)]
    M, K, N, lead_out = check_linear(*metas, x_kind=x_kind, w_kind="int8", group=group, m=m,
                                     lead=lead, who="int8_gated_residual_cpu")
    why = _i8._why_not_operands(dict(zip(_i8._LINEAR_ARGS, metas)), M, K, N, x_kind)
    y_shape = tuple(lead_out) + (N,) if y_shape is None else tuple(y_shape)
    if why is None and (len(y_shape) < 1 or y_shape[-1] != N or
                        int(np.prod(y_shape)) != M * N):
        why = f"y_shape {y_shape} is not [..., {N}] with {M * N} elements"
    if out is None:
        out = torch.empty(y_shape, dtype=torch.float32)
    if why is None:
        why = epilogue_why_not(TensorMeta.contiguous(y_shape, torch.float32, out.device),
                               TensorMeta.of(gate), TensorMeta.of(residual), TensorMeta.of(out),
                               "cpu")
    if why is None and scale_op not in SCALE_OPS:
        why = f"scale_op {scale_op!r} (None, 'mul' or 'div')"
    if why is not None:
        raise ValueError(f"int8_gated_residual_cpu: unsupported input: {why}")
    acc, xs = direct_gemm(_i8.DEVICE, x_kind, group, M, K, N, x, x_scale, w, out)
    _gr_launch(acc, xs, w_scale, bias, gate, residual, out, y_shape, scale_op, scale)
    return out


# -- int8_linear_act_quantize ----------------------------------------------------------------------

def _int8_call_metas(who, qx, x_scale, w, w_scale, bias) -> tuple:
    """``(metas, M, N)`` of a public fused call's int8 operands (``check_linear``'s errors
    name ``who``)."""
    metas = [TensorMeta.of(t) for t in (qx, w, w_scale, x_scale)] + \
        [None if bias is None else TensorMeta.of(bias)]
    M, K, N, _ = check_linear(*metas, x_kind="int8", w_kind="int8", group=1, m=-1, lead=(),
                              who=who)
    return (metas, M, K, N), M, N


def _int8_call_check(who, metas, why_out) -> None:
    """ValueError naming ``who`` where the kernels do not take the linear (``metas`` from
    :func:`_int8_call_metas`) or the output (``why_out``)."""
    (m, M, K, N) = metas
    why = _i8._why_not_operands(dict(zip(_i8._LINEAR_ARGS, m)), M, K, N, "int8") or why_out
    if why is not None:
        raise ValueError(f"{who}: unsupported input: {why}")


def _actq_launch(acc, xs, ws, bias, out, act, group, dtype=torch.float32) -> None:
    m, n = acc.shape
    q, sc, mp = _packed_views(out, m, n)
    if mp == 0:
        return
    nst = hadamard_stages(group)
    k = _jit()["actq"]
    chunk = _chunk(mp, n, _set_threads())
    b = _flat(bias, n) if bias is not None else np.zeros(0, np.float32)
    k(_flat(acc, m * n), _flat(xs, m), _flat(ws, n), b, bias is not None, q, sc, m, mp, n,
      ACT_IDS[act], nst, np.float32(2.0 ** -nst), chunk, np.zeros(0, _NP_OF[dtype]))


def int8_linear_act_quantize_cpu(qx: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                                 w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                                 act: str, group: int = 1,
                                 out: torch.Tensor | None = None,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``quantize(act(linear_i8(qx, w)), group)`` for int8 rows ``qx [M, K]`` with their
    float32 scales and an int8 weight ``w [N, K]`` with ``w_scale [N]``: ``torch._int_mm``
    into a temporary accumulator, then one pass per row (module docstring); the packed layout
    (into ``out`` when given).  ``dtype`` bfloat16/float16: a 16-bit layer's chain (the
    linear's value cast to it, the activation computed on that and rounded to it).  ValueError
    for inputs the kernels do not take."""
    if dtype not in FLOATS:
        raise ValueError(f"int8_linear_act_quantize_cpu: dtype {dtype} (float32, bfloat16 or "
                         f"float16)")
    who = "int8_linear_act_quantize_cpu"
    metas, M, N = _int8_call_metas(who, qx, x_scale, w, w_scale, bias)
    if out is None:
        out = torch.empty(packed_nbytes(M, N), dtype=torch.int8)
    _int8_call_check(who, metas, _why_not_act(M, N, TensorMeta.of(out), act, group))
    acc = _i8._gemm(qx, w, torch.empty(M, N, dtype=torch.int32))
    _actq_launch(acc, x_scale, w_scale, bias, out, act, group, dtype)
    return out


def _why_not_act(m, n, out, act, group, **_) -> str | None:
    if act not in PRE_ACTS:
        return f"activation {act!r} (one of {PRE_ACTS})"
    return _why_not_group(n, group) or _why_not_out(out, m, n)


# -- int8_linear_glu_quantize ----------------------------------------------------------------------

def _gluq_launch(acc, xs, ws, bias, out, act, gate, group, dtype=torch.float32) -> None:
    m, n = acc.shape
    q, sc, mp = _packed_views(out, m, n // 2)
    if mp == 0:
        return
    nst = hadamard_stages(group)
    k = _jit()["gluq"]
    chunk = _chunk(mp, n, _set_threads())
    b = _flat(bias, n) if bias is not None else np.zeros(0, np.float32)
    k(_flat(acc, m * n), _flat(xs, m), _flat(ws, n), b, bias is not None, q, sc, m, mp, n,
      gate, ACT_IDS[act], nst, np.float32(2.0 ** -nst), chunk, np.zeros(0, _NP_OF[dtype]))


def int8_linear_glu_quantize_cpu(qx: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                                 w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                                 act: str, gate: int, group: int = 1,
                                 out: torch.Tensor | None = None,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``quantize(act(y[..., gate half]) * y[..., other half], group)`` of ``y =
    linear_i8(qx, w)`` for int8 rows ``qx [M, K]`` with their float32 scales and an int8
    weight ``w [N, K]`` (N even) with ``w_scale [N]``: ``torch._int_mm`` into a temporary
    accumulator, then one pass per row (module docstring); the packed layout of ``[M, N/2]``
    (into ``out`` when given).  ``gate`` 0 activates the first half, 1 the second (diffusers'
    GEGLU: ``hidden, gate = y.chunk(2, -1)``, so 1).  ``dtype`` bfloat16/float16: a 16-bit
    layer's chain.  ValueError for inputs the kernels do not take."""
    who = "int8_linear_glu_quantize_cpu"
    if dtype not in FLOATS:
        raise ValueError(f"{who}: dtype {dtype} (float32, bfloat16 or float16)")
    metas, M, N = _int8_call_metas(who, qx, x_scale, w, w_scale, bias)
    if out is None:
        out = torch.empty(packed_nbytes(M, N // 2), dtype=torch.int8)
    _int8_call_check(who, metas, _why_not_glu(M, N, TensorMeta.of(out), act, gate, group))
    acc = _i8._gemm(qx, w, torch.empty(M, N, dtype=torch.int32))
    _gluq_launch(acc, x_scale, w_scale, bias, out, act, gate, group, dtype)
    return out


def _why_not_glu(m, n, out, act, gate, group, **_) -> str | None:
    if act not in PRE_ACTS:
        return f"activation {act!r} (one of {PRE_ACTS})"
    if isinstance(gate, bool) or gate not in (0, 1):
        return f"gate {gate!r} (0 or 1: the half the activation takes)"
    if n % 2:
        return f"{n} output features do not split into two halves"
    return _why_not_group(n // 2, group) or _why_not_out(out, m, n // 2)


# -- int8_linear_act -------------------------------------------------------------------------------

def _act_launch(acc, xs, ws, bias, out, act, dtype=torch.float32) -> None:
    m, n = acc.shape
    if m == 0:
        return
    try:
        rows = out.view(m, n)  # the leading dims collapse to rows of one stride
    except RuntimeError:
        rows = None
    if rows is None or rows.stride(1) != 1:  # never written wrongly: through a temporary
        tmp = torch.empty(m, n, dtype=out.dtype)
        _act_launch(acc, xs, ws, bias, tmp, act, dtype)
        out.copy_(tmp.view(out.shape))
        return
    osr = rows.stride(0) if m > 1 else n
    k = _jit()["act"]
    chunk = _chunk(m, n, _set_threads())
    b = _flat(bias, n) if bias is not None else np.zeros(0, np.float32)
    k(_flat(acc, m * n), _flat(xs, m), _flat(ws, n), b, bias is not None,
      _flat(rows, (m - 1) * osr + n), m, n, osr, ACT_IDS[act], chunk,
      np.zeros(0, _NP_OF[dtype]))


def int8_linear_act_cpu(qx: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None = None, *, act: str,
                        out: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``act(linear_i8(qx, w))`` for int8 rows ``qx [M, K]`` with their float32 scales and an
    int8 weight ``w [N, K]`` with ``w_scale [N]``: ``torch._int_mm`` into a temporary
    accumulator, then one pass per row into ``out`` (``[M, N]`` of ``dtype``, rows of any
    stride; a new tensor when None).  ``dtype`` bfloat16/float16: a 16-bit layer's chain (the
    linear's value cast to it, the activation computed on that and rounded to it).  ValueError
    for inputs the kernels do not take."""
    if dtype not in FLOATS:
        raise ValueError(f"int8_linear_act_cpu: dtype {dtype} (float32, bfloat16 or float16)")
    who = "int8_linear_act_cpu"
    metas, M, N = _int8_call_metas(who, qx, x_scale, w, w_scale, bias)
    if out is None:
        out = torch.empty(M, N, dtype=dtype)
    _int8_call_check(who, metas, _why_not_act_out(M, N, TensorMeta.of(out), act, dtype))
    acc = _i8._gemm(qx, w, torch.empty(M, N, dtype=torch.int32))
    _act_launch(acc, x_scale, w_scale, bias, out, act, dtype)
    return out


def _why_not_act_out(m, n, out, act, dtype, **_) -> str | None:
    if act not in PRE_ACTS:
        return f"activation {act!r} (one of {PRE_ACTS})"
    if out.dtype != dtype or out.device.type != "cpu":
        return f"the output is {out.dtype} on {out.device}, not {dtype} on the CPU"
    if out.numel != m * n or (out.shape and out.shape[-1] != n):
        return f"the output {out.short()} does not hold [{m}, {n}] rows"
    return None


# -- the quantize-feeding kernels: launchers -------------------------------------------------------

def _why_not_group(k, group) -> str | None:
    if isinstance(group, bool) or group not in REGULAR_HADAMARD_GROUPS:
        return f"group {group!r} (one of {REGULAR_HADAMARD_GROUPS})"
    if k == 0 or k % group:
        return f"{k} features is not a positive multiple of group={group}"
    return None


def _why_not_out(out, m, k) -> str | None:
    if not isinstance(out, TensorMeta) or out.dtype != torch.int8 or \
            tuple(out.shape) != (packed_nbytes(m, k),) or not out.is_contiguous:
        return f"out must be the packed int8 vector of {packed_nbytes(m, k)} bytes"
    if out.device.type != "cpu":
        return f"out is on {out.device}"
    if out.storage_offset % 4:
        return "out's storage offset is not a multiple of 4 (the float32 scales)"
    return None


def _modq_why_not(x, scale, shift, out, norm, group, **_) -> str | None:
    why = _mod.why_not(x, scale, shift, TensorMeta.contiguous(tuple(x.shape), x.dtype,
                                                              x.device), norm) \
        if isinstance(x, TensorMeta) else "x is not a tensor"
    if why is None:
        k = int(x.shape[-1])
        why = _why_not_group(k, group) or _why_not_out(out, x.numel // k, k)
    return why


def _modq_launch(rows, x, scale, shift, out, norm, eps, add_c, group) -> None:
    d = x.shape[-1]
    m = x.numel() // d
    q, sc, mp = _packed_views(out, m, d)
    if mp == 0:
        return
    nst = hadamard_stages(group)
    fn = _jit()["mod"]
    chunk = _chunk(mp, d, _set_threads())
    fn(_flat(x, rows.spans[0]), _flat(scale, rows.spans[1]), _flat(shift, rows.spans[2]), q, sc,
       rows.bt, d, *rows.fs, np.float32(eps), norm == "rms", add_c is not None,
       np.float32(0.0 if add_c is None else add_c), m, mp, nst, np.float32(2.0 ** -nst), chunk)


def modulation_quantize_cpu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                            out: torch.Tensor | None = None, *, norm: str = "layer",
                            eps: float = 1e-6, add_c: float | None = 1.0,
                            group: int = 1) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(modulation_cpu(x, scale, shift, ...)) {group}`` in one
    kernel: the packed layout (into ``out`` when given: contiguous 1-D int8 of
    ``packed_nbytes(M, C)`` bytes).  ``scale``/``shift`` broadcast to x.  ValueError for inputs
    the kernel does not take."""
    scale, shift = expand_scale_shift("modulation_quantize_cpu", x, scale, shift,
                                      "must be a tensor")
    out = packed_out(x, out)
    TM = TensorMeta.of
    why = _modq_why_not(TM(x), TM(scale), TM(shift), TM(out), norm, group)
    if why is not None:
        raise ValueError(f"modulation_quantize_cpu: unsupported input: {why}")
    _modq_launch(_mod._rows(tuple(x.shape), x.stride(), scale.stride(), shift.stride()), x,
                 scale, shift, out, norm, eps, add_c, group)
    return out


def _rmsq_why_not(x, w, out, norm_dtype, group, **_) -> str | None:
    why = _rms._why_not_tensors(x, w) if isinstance(x, TensorMeta) else "x is not a tensor"
    if why is None and norm_dtype not in _NP_OF:
        why = "the norm's output metadata"
    if why is None:
        k = int(x.shape[-1])
        why = _why_not_group(k, group) or _why_not_out(out, x.numel // k, k)
    return why


def _rmsq_launch(rows, x, w, out, eps, norm_dtype, group) -> None:
    d = x.shape[-1]
    m = x.numel() // d
    q, sc, mp = _packed_views(out, m, d)
    if mp == 0:
        return
    nst = hadamard_stages(group)
    fn = _jit()["rms"]
    chunk = _chunk(mp, d, _set_threads())
    wf = _flat(w, w.shape[0]) if w is not None else np.zeros(0, np.float32)
    fn(_flat(x, rows.span), wf, np.zeros(0, _NP_OF[norm_dtype]), q, sc, rows.bt, d,
       np.float32(eps), w is not None, m, mp, nst, np.float32(2.0 ** -nst), chunk)


def rms_norm_quantize_cpu(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          group: int = 1, out: torch.Tensor | None = None,
                          weight_in_float: bool = False) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(sd.rms_norm.v1(x[, weight]) {eps, weight_in_float}) {group}``
    in one kernel (the packed layout; ``out`` as for :func:`modulation_quantize_cpu`).
    ValueError for inputs the kernel does not take."""
    if not isinstance(x, torch.Tensor) or (weight is not None and
                                           not isinstance(weight, torch.Tensor)):
        raise ValueError("rms_norm_quantize_cpu: x (and weight) must be tensors")
    out = packed_out(x, out)
    nd = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, weight_in_float)
    TM = TensorMeta.of
    why = _rmsq_why_not(TM(x), None if weight is None else TM(weight), TM(out), nd, group)
    if why is None and (not isinstance(eps, (int, float)) or not eps >= 0):
        why = f"eps {eps!r}"
    if why is not None:
        raise ValueError(f"rms_norm_quantize_cpu: unsupported input: {why}")
    if weight is not None and weight_in_float:
        weight = weight.float()
    _rmsq_launch(_rms._rows(x.shape, x.stride()), x, weight, out, eps, nd, group)
    return out


def _preq_why_not(x, other, out, act, scale_op, group, **_) -> str | None:
    metas = (x,) if other is None else (x, other)
    why = _why_not_metas(metas)
    if why is not None:
        return why
    if x.dtype not in _NP_OF or (other is not None and other.dtype != x.dtype):
        return "dtypes (one of float32, bfloat16, float16 for x and the multiplier)"
    if act not in ACT_IDS or scale_op not in SCALE_OPS:
        return f"activation {act!r} / scale {scale_op!r}"
    if not x.shape:
        return "x is a scalar"
    if other is not None and tuple(other.shape) != tuple(x.shape):
        return "the multiplier must be expanded to x's shape"
    k = int(x.shape[-1])
    return _why_not_group(k, group) or _why_not_out(out, x.numel // k, k)


def _preq_launch(rows, x, other, out, act, scale_op, scale, group) -> None:
    d = x.shape[-1]
    m = x.numel() // d
    q, sc, mp = _packed_views(out, m, d)
    if mp == 0:
        return
    nst = hadamard_stages(group)
    fn = _jit()["pre"]
    chunk = _chunk(mp, d, _set_threads())
    o = _flat(other, rows.spans[1]) if other is not None else np.zeros(0, _NP_OF[x.dtype])
    fn(_flat(x, rows.spans[0]), o, q, sc, rows.bt, d, rows.fs[0],
       rows.fs[1] if other is not None else 1, ACT_IDS[act], other is not None,
       np.float32(1.0 if scale is None else scale), SCALE_OPS[scale_op], m, mp, nst,
       np.float32(2.0 ** -nst), chunk)


def _preq_rows(x, other):
    os_ = x.stride() if other is None else other.stride()
    return _mod._rows(tuple(x.shape), x.stride(), os_, x.stride())


def act_quantize_cpu(x: torch.Tensor, other: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, *, act: str | None = None,
                     scale_op: str | None = None, scale: float | None = None,
                     group: int = 1) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(v) {group}`` of ``v = [act](x) [* other] [* | / scale]``
    (each step rounded to x's dtype; the activation is ``cpu_kernels/activation.py``'s) in one
    kernel: the packed layout (``out`` as for :func:`modulation_quantize_cpu`).  ``other``
    broadcasts to x.  ValueError for inputs the kernel does not take."""
    if not isinstance(x, torch.Tensor) or (other is not None and
                                           not isinstance(other, torch.Tensor)):
        raise ValueError("act_quantize_cpu: x (and other) must be tensors")
    if other is not None:
        try:
            other = other.expand(x.shape)
        except RuntimeError as e:
            raise ValueError(f"act_quantize_cpu: other does not broadcast to x: {e}") from None
    out = packed_out(x, out)
    TM = TensorMeta.of
    why = _preq_why_not(TM(x), None if other is None else TM(other), TM(out), act, scale_op,
                        group)
    if why is None and scale_op is not None and (not isinstance(scale, (int, float))
                                                 or isinstance(scale, bool)):
        why = f"scale {scale!r} (a Python number with a scale_op)"
    if why is not None:
        raise ValueError(f"act_quantize_cpu: unsupported input: {why}")
    _preq_launch(_preq_rows(x, other), x, other, out, act, scale_op, scale, group)
    return out


@compiles
def compile_kernels(kind: str, dtype: torch.dtype | None, other_dtype=None,
                    acc_dtype: torch.dtype = torch.int32) -> None:
    """Compile (or load from the disk cache) one kernel of this file by a call with no rows on
    exactly the types a launch passes: ``kind`` "gr" / "actq" / "gluq" / "act" (``dtype``: the
    bias's, None: no bias; ``other_dtype``: the chain's dtype, None: float32; ``acc_dtype``:
    the accumulator's, ``cpu_kernels/int8.accumulator_dtype``),
    "mod" / "pre" (x's dtype), "rms" (x's dtype; ``other_dtype``: ``(weight dtype or None,
    the norm's output dtype)``).  Thread-safe."""
    k = _jit()[kind]
    z32 = np.zeros(0, np.float32)
    q = np.zeros(0, np.int8)
    bt = np.zeros((1, 4), np.int64)
    acc = np.zeros(0, _i8._NP_ACC[acc_dtype])
    with _compile_lock:  # see rope's compile_kernels
        if kind == "gr":
            b = np.zeros(0, _NP_OF[dtype or torch.float32])
            y = np.zeros(0, _NP_OF[other_dtype or torch.float32])
            k(acc, z32, z32, b, dtype is not None, y, y, y, 0, 1, 1,
              0, 0, 1, 0, 0, 1, 0, 0, 1, np.float32(1.0), 0, 1, y, y)
        elif kind == "actq":
            b = np.zeros(0, _NP_OF[dtype or torch.float32])
            k(acc, z32, z32, b, dtype is not None, q, z32, 0, 0, 4, 1, 1,
              np.float32(0.5), 1, np.zeros(0, _NP_OF[other_dtype or torch.float32]))
        elif kind == "gluq":
            b = np.zeros(0, _NP_OF[dtype or torch.float32])
            k(acc, z32, z32, b, dtype is not None, q, z32, 0, 0, 4, 1, 1, 1,
              np.float32(0.5), 1, np.zeros(0, _NP_OF[other_dtype or torch.float32]))
        elif kind == "act":
            b = np.zeros(0, _NP_OF[dtype or torch.float32])
            y = np.zeros(0, _NP_OF[other_dtype or torch.float32])
            k(acc, z32, z32, b, dtype is not None, y, 0, 4, 4, 1, 1, y)
        elif kind == "mod":
            a = np.zeros(0, _NP_OF[dtype])
            k(a, a, a, q, z32, bt, 4, 1, 1, 1, np.float32(1e-6), False, True, np.float32(1.0),
              0, 0, 1, np.float32(0.5), 1)
        elif kind == "pre":
            a = np.zeros(0, _NP_OF[dtype])
            k(a, a, q, z32, bt, 4, 1, 1, 0, False, np.float32(1.0), 0, 0, 0, 1, np.float32(0.5),
              1)
        elif kind == "rms":
            w_dtype, out_dtype = other_dtype
            w = np.zeros(0, np.float32 if w_dtype is None else _NP_OF[w_dtype])
            k(np.zeros(0, _NP_OF[dtype]), w, np.zeros(0, _NP_OF[out_dtype]), q, z32,
              np.zeros((1, 3), np.int64), 4, np.float32(1e-6), w_dtype is not None, 0, 0, 1,
              np.float32(0.5), 1)
        else:
            raise ValueError(f"compile_kernels: kind {kind!r} (gr, actq, gluq, act, mod, pre, "
                             f"rms)")


# -- the kernels of the rules (patterns/int8_fusions.FusedKernel) ----------------------------------

def _gr_why_not(y, out, gate, residual, **_) -> str | None:
    return epilogue_why_not(y, gate, residual, out, "cpu")


def _gr_run(acc, xs, ws, bias, out, gate, residual, *, y_shape, scale_op, scale,
            dtype=torch.float32) -> None:
    _gr_launch(acc, xs, ws, bias, gate, residual, out, y_shape, scale_op, scale, dtype)


def _rows_why_not(why_not):
    """A check on ``(m, n, out, ...)`` as a rule's ``why_not(y, out, ...)`` (rows of y)."""
    def on_y(y, out, **kw) -> str | None:
        n = y.shape[-1]
        return why_not(y.numel // n, n, out, **kw)
    return never_raises(on_y)


def _cast_why_not(y, out, **_) -> str | None:
    if out.dtype not in (torch.bfloat16, torch.float16):
        return f"output dtype {out.dtype} (bfloat16 or float16)"
    if out.device.type != "cpu":
        return f"the output is on {out.device}"
    return None


def _compile_epilogue(kind: str):
    """A rule's ``compile(linear, y, out, ...)`` of the epilogue kernel ``kind`` for the
    linear's bias and accumulator and the chain's dtype."""
    def compile_(linear, y, out, *operands, dtype=torch.float32, **_) -> None:
        compile_kernels(kind, bias_dtype(linear), dtype,
                        _i8.accumulator_dtype(linear.params["w_kind"]))
    return compile_


def _cast_compile(linear, y, out, **_) -> None:
    _i8.compile_kernels(None, bias_dtype(linear), out_dtype=out.dtype,
                        acc_dtype=_i8.accumulator_dtype(linear.params["w_kind"]))


def _cast_run(acc, xs, ws, bias, out, **_) -> None:
    _i8._epilogue(acc, out, xs, ws, bias, *acc.shape)


@functools.lru_cache(maxsize=64)
def _mod_rows(shape, xst, sst, hst):
    return _mod._rows(shape, xst, sst, hst)


def _modq_run(x, scale, shift, out, *, norm, eps, add_c, group) -> None:
    rows = _mod_rows(tuple(x.shape), x.stride(), scale.stride(), shift.stride())
    _modq_launch(rows, x, scale, shift, out, norm, eps, add_c, group)


def _modq_compile(x, scale, shift, out, **_) -> None:
    compile_kernels("mod", x.dtype)


def _rmsq_run(x, w, out, *, eps, norm_dtype, weight_in_float, group) -> None:
    if w is not None and weight_in_float:
        w = w.float()
    _rmsq_launch(_rms._rows(x.shape, x.stride()), x, w, out, eps, norm_dtype, group)


def _rmsq_compile(x, w, out, *, norm_dtype, **_) -> None:
    compile_kernels("rms", x.dtype, (None if w is None else w.dtype, norm_dtype))
    if w is not None and w.dtype != torch.float32:  # weight_in_float passes it as float32
        compile_kernels("rms", x.dtype, (torch.float32, norm_dtype))


def _preq_run(x, other, out, *, act, scale_op, scale, group) -> None:
    _preq_launch(_preq_rows(x, other), x, other, out, act, scale_op, scale, group)


def _preq_compile(x, other, out, **_) -> None:
    compile_kernels("pre", x.dtype)


#: ``act_quantize`` and ``scale_quantize``: one kernel
_PROLOGUE = FusedKernel("prologue_quantize_cpu", never_raises(_preq_why_not), _preq_run,
                        _preq_compile)
#: the CPU's kernel of each rule of ``patterns/int8_fusions.py``; the rules after a linear
#: run ``torch._int_mm`` (``cpu_kernels/int8.DEVICE``) with the plan's cancellation checked
#: before and after it
KERNELS = {
    "int8_gated_residual": FusedKernel("int8_gated_residual_cpu", _gr_why_not, _gr_run,
                                       _compile_epilogue("gr"), dtypes=FLOATS),
    "int8_linear_act_quantize": FusedKernel(
        "int8_linear_act_quantize_cpu", _rows_why_not(_why_not_act), _actq_launch,
        _compile_epilogue("actq"), dtypes=FLOATS),
    "int8_linear_glu_quantize": FusedKernel(
        "int8_linear_glu_quantize_cpu", _rows_why_not(_why_not_glu), _gluq_launch,
        _compile_epilogue("gluq"), dtypes=FLOATS),
    # writes rows of any stride (Flux's single-stream MLP: a slice of a concatenation)
    "int8_linear_act": FusedKernel("int8_linear_act_cpu", _rows_why_not(_why_not_act_out),
                                   _act_launch, _compile_epilogue("act"), dtypes=FLOATS,
                                   strided_out=True),
    # sd.linear_i8.v1's own epilogue (cpu_kernels/int8.py) storing the 16-bit output
    "int8_linear_cast": FusedKernel("int8_linear_cast_cpu", _cast_why_not, _cast_run,
                                    _cast_compile),
    "modulation_quantize": FusedKernel("modulation_quantize_cpu", never_raises(_modq_why_not),
                                       _modq_run, _modq_compile),
    "rms_norm_quantize": FusedKernel("rms_norm_quantize_cpu", never_raises(_rmsq_why_not),
                                     _rmsq_run, _rmsq_compile),
    "act_quantize": _PROLOGUE,
    "scale_quantize": _PROLOGUE,
}

register_int8_fusions("cpu", _i8.DEVICE, KERNELS)
