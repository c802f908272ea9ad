"""Gated residual epilogue on the CPU: a numba kernel computing ``gated_residual_reference``
(``patterns/gated_residual.py``) over the GEMM result of the fused ``gated_residual`` step,
registered at the end as the epilogue of that rule for "cpu" (:class:`GatedResidualCPU`).

Maths per element (T the common dtype; ``round`` to T with round-to-nearest-even, the
identity for float32; float32 arithmetic, no FMA contraction: ``fastmath=False``)::

    t   = round(y * float32(s))   or   round(y / float32(s))   or   y      (mul / div / none)
    g   = round(gate * t)
    out = round(residual + g)

which is the unfused chain's ``mul``/``div`` by a Python scalar (the scalar taken as float32,
as ATen's CPU kernels take it, true division), ``mul(gate, _)`` and ``add(residual, _)`` with
each op's own rounding, so float32 and 16-bit results are bit-exact.  Sources: ATen
``BinaryOpsKernel.cpp`` (``mul_kernel``, ``div_true_kernel``: scalar operands in opmath type);
the bf16/fp16 conversions of ``cpu_kernels/rope.py``.

Layout.  ``y`` is the contiguous GEMM result (viewed in the output's shape); the gate and the
residual are read through their strides broadcast to the output's shape (a broadcast dim has
stride 0: the gate ``[B, 1, C]`` is read once per token from the same row), ``out`` through its
own strides.  Leading dims contiguous in every operand are merged; at most two leading dims
remain (``[B, S]``: the gate moves along B and is broadcast over S), else ``why_not`` declines.
Rows run in parallel (``prange`` over tasks of whole rows); a row with unit feature stride in
every operand runs on slices, so LLVM vectorises it.  ``out`` may be ``y`` itself (the fused
step writes the GEMM into its output and runs this pass in place): every element is read before
it is written, by the same iteration.

Memory traffic per element: read y, read the residual, write out (the gate row stays in L1),
against the unfused chain's read y, write g, read g, read the residual, write out (plus a read
and a write for Flux's/SD3's clone and PixArt's clone + div).

bf16/fp16 are passed as bits (int16 / uint16) and converted in registers; the kernel compiles
at plan time (:func:`compile_kernels`) and is cached on disk (rope's cache dir).  The disk
cache is keyed on this file: a change to the rope/rmsnorm helpers it inlines needs a change
here or a cleared cache.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.gated_residual import (DTYPES, EpilogueLayout, GatedResidualFusion,
                                               epilogue_layout, epilogue_why_not)

from . import _numba
from . import rmsnorm as _rms
from .rmsnorm import _round_as
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store

__all__ = ["why_not", "compile_kernels", "gated_residual_cpu", "GatedResidualCPU"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
_OPS = {None: 0, "mul": 1, "div": 2}
#: elements per parallel task at least (numba's per-task cost is ~1 us)
_MIN_TASK_ELEMS = 16384


def _build(numba):
    _numba.inline(_row_unit, _row_strided)  # LLVM sees the row slices' bounds (as rope's rows)
    return _numba.njit(_gated_residual_kernel)


#: the jitted kernel (created once; it compiles per dtype when first called)
_jit = _numba.once(globals(), _build, requires=(_rms._register,))


def _row_unit(yr, gr, rr, orow, c, scale, op):
    """One row, every operand with unit feature stride (slices of ``c`` elements)."""
    if op == 0:
        for e in range(c):
            _store(orow, e, _load(rr, e) + _round_as(yr, _load(gr, e) * _load(yr, e)))
    elif op == 1:
        for e in range(c):
            t = _round_as(yr, _load(yr, e) * scale)
            _store(orow, e, _load(rr, e) + _round_as(yr, _load(gr, e) * t))
    else:
        for e in range(c):
            t = _round_as(yr, _load(yr, e) / scale)
            _store(orow, e, _load(rr, e) + _round_as(yr, _load(gr, e) * t))


def _row_strided(yr, gate, res, out, go, ro, oo, gsc, rsc, osc, c, scale, op):
    """One row, gate/residual/out read and written through their feature strides."""
    for e in range(c):
        t = _load(yr, e)
        if op == 1:
            t = _round_as(yr, t * scale)
        elif op == 2:
            t = _round_as(yr, t / scale)
        g = _round_as(yr, _load(gate, go + e * gsc) * t)
        _store(out, oo + e * osc, _load(res, ro + e * rsc) + g)


def _gated_residual_kernel(y, gate, res, out, nb, ns, c, gsb, gss, gsc, rsb, rss, rsc, osb,
                           oss, osc, scale, op, rows_per_task):
    """Rows r = (b, s) of ``nb * ns``; y row r at ``r * c``; tasks of ``rows_per_task`` rows."""
    nrows = nb * ns
    ntasks = (nrows + rows_per_task - 1) // rows_per_task
    unit = gsc == 1 and rsc == 1 and osc == 1
    for task in prange(ntasks):
        r0 = np.int64(task) * rows_per_task  # prange indices may be unsigned
        r1 = min(nrows, r0 + rows_per_task)
        for r in range(r0, r1):
            b = r // ns
            s = r - b * ns
            go = b * gsb + s * gss
            ro = b * rsb + s * rss
            oo = b * osb + s * oss
            yr = y[r * c:r * c + c]
            if unit:
                _row_unit(yr, gate[go:go + c], res[ro:ro + c], out[oo:oo + c], c, scale, op)
            else:
                _row_strided(yr, gate, res, out, go, ro, oo, gsc, rsc, osc, c, scale, op)


# -- launch layout (pure metadata) ---------------------------------------------------------------

def why_not(y: Any, gate: Any, residual: Any, out: Any) -> str | None:
    """None when the kernel computes the epilogue for tensors with these metadata
    (``fxbackend.TensorMeta``), else a short reason.  Never raises.  Handled: one dtype
    (float32/bf16/fp16) for all four, all on the CPU, y contiguous, gate and residual
    broadcastable to y's shape with any non-negative strides, out of y's shape with any
    non-negative strides, at most two leading dims after merging (``epilogue_why_not``)."""
    return epilogue_why_not(y, gate, residual, out, "cpu")


def _threads_rows(lay: EpilogueLayout, threads: int) -> int:
    nrows = lay.nb * lay.ns
    per = max(-(-nrows // (4 * threads)), -(-_MIN_TASK_ELEMS // max(lay.c, 1)))
    return max(1, min(per, nrows))


def _launch(lay: EpilogueLayout, y, gate, res, out, scale_op, scale) -> None:
    if lay.spans[0] == 0:
        return
    fn = _jit()
    rows = _threads_rows(lay, _set_threads())
    yf = _flat(y, lay.spans[0])
    of = yf if out.data_ptr() == y.data_ptr() and out.stride() == y.stride() \
        else _flat(out, lay.spans[3])
    fn(yf, _flat(gate, lay.spans[1]), _flat(res, lay.spans[2]), of, lay.nb, lay.ns, lay.c,
       *lay.g, *lay.r, *lay.o, np.float32(1.0 if scale is None else scale), _OPS[scale_op],
       rows)


def _layout_of(y, gate, res, out) -> EpilogueLayout:
    return epilogue_layout(tuple(y.shape), tuple(gate.shape), tuple(gate.stride()), tuple(res.shape),
                   tuple(res.stride()), tuple(out.stride()))


def gated_residual_cpu(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                       out: torch.Tensor, *, scale_op: str | None = None,
                       scale: float | None = None) -> torch.Tensor:
    """``out = gated_residual_reference(y, gate, residual, scale_op, scale)`` (returned).
    ``y`` contiguous; gate and residual broadcastable to y's shape (any strides); ``out`` of
    y's shape, any strides, either y itself or overlapping no input (the caller's guarantee;
    not checked).  Raises ValueError naming the problem for inputs the kernel does not take."""
    ts = {"y": y, "gate": gate, "residual": residual, "out": out}
    for label, t in ts.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"gated_residual_cpu: {label} must be a tensor")
    why = why_not(*(fxbackend.TensorMeta.of(t) for t in ts.values()))
    if why is None and not y.is_contiguous():
        why = "y must be contiguous"
    if why is None and scale_op not in _OPS:
        why = f"scale_op {scale_op!r} (None, 'mul' or 'div')"
    if why is None and scale_op is not None and (not isinstance(scale, (int, float))
                                                 or isinstance(scale, bool)):
        why = f"scale {scale!r} (a Python number with a scale_op)"
    if why is not None:
        raise ValueError(f"gated_residual_cpu: unsupported input: {why}")
    _launch(_layout_of(y, gate, residual, out), y, gate, residual, out, scale_op, scale)
    return out


def compile_kernels(dtype: torch.dtype) -> None:
    """Compile (or load from the disk cache) the kernel for ``dtype`` (every scale op: a
    run-time argument) by a call with no rows on exactly the types a launch passes.
    Thread-safe (plans compile their nodes in parallel)."""
    fn = _jit()
    z = np.zeros(0, _NP_OF[dtype])
    with _compile_lock:  # see rope's compile_kernels
        fn(z, z, z, z, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, np.float32(1.0), 0, 1)


class GatedResidualCPU:
    """The numba epilogue behind the ``gated_residual`` fusion rule on the CPU (see
    ``fxbackend.patterns.gated_residual.GatedResidualFusion`` for the interface).  The launch
    layout is cached per shape/stride signature."""

    name = "gated_residual_cpu"

    def why_not(self, y, gate, residual, out):
        return why_not(y, gate, residual, out)

    def compile(self, y, gate, residual, out, scale_op):
        compile_kernels(y.dtype)

    def run(self, y, gate, residual, out, *, scale_op, scale):
        _launch(_layout_of(y, gate, residual, out), y, gate, residual, out, scale_op, scale)


assert set(_NP_OF) == set(DTYPES)
fxbackend.register_fusion("cpu", GatedResidualFusion(GatedResidualCPU()))
