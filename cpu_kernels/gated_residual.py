"""Gated residual epilogue on the CPU: a numba kernel computing ``gated_residual_reference``
(``patterns/gated_residual.py``) over the GEMM result of the fused ``gated_residual`` step,
registered at the end as the epilogue of that rule for "cpu" (:class:`GatedResidualCPU`).

Maths per element (T the common dtype; ``round`` to T with round-to-nearest-even, the
identity for float32; float32 arithmetic, no FMA contraction: ``fastmath=False``)::

    t   = round(y * float32(s))   or   round(y / float32(s))   or   y      (mul / div / none)
    g   = round(gate * t)
    out = round(residual + g)

Around a float32 gate the others may each be bf16/fp16 (Wan's float32 gated residual on a
bf16 stream, the rule's widening and narrowing casts): every load widens exactly, ``t``
rounds to y's dtype, ``g`` to the gate's (float32), and the store rounds the float32 sum to
out's dtype once.

with ``y`` standing for ``round(y + bias[c])`` when the fused step moved a float32 addmm's
bias here (``bias_in_epilogue`` in the rule; the GEMM then runs as ``mm``).  Without a bias the
kernel adds a row of negative zeros, ``y + -0.0`` being ``y`` for every y (signed zeros and
NaNs included), so one compiled kernel serves both.  The rest is the unfused chain's
``mul``/``div`` by a Python scalar (the scalar taken as float32, as ATen's CPU kernels take
it, true division), ``mul(gate, _)`` and ``add(residual, _)`` with each op's own rounding, so
results are bit-exact to the chain (with a moved bias: to the chain whose bias is added after
the GEMM, which differs from addmm's by float32 rounding).  Sources: ATen
``BinaryOpsKernel.cpp`` (``mul_kernel``, ``div_true_kernel``: scalar operands in opmath type);
the bf16/fp16 conversions of ``cpu_kernels/rope.py``.

Layout.  ``y`` is the contiguous GEMM result (viewed in the output's shape); the gate and the
residual are read through their strides broadcast to the output's shape (a broadcast dim has
stride 0: the gate ``[B, 1, C]`` is read once per token from the same row), ``out`` through its
own strides.  Leading dims contiguous in every operand are merged; at most two leading dims
remain (``[B, S]``: the gate moves along B and is broadcast over S), else ``why_not`` declines.
Rows run in parallel (``prange`` over tasks of whole rows); a row with unit feature stride in
every operand runs on slices (see "Vectors").  ``out`` may be ``y`` itself (the fused step
writes the GEMM into its output and runs this pass in place): every element is read before it
is written, by the same iteration (the same vector step).

Vectors.  A row with unit feature strides runs in steps of 16 lanes (512 bits of float32)
written as LLVM vector IR by an intrinsic per scale op (:func:`_register_vectors`; bf16/fp16
converted inside the vectors by rope's conversions, their branches as selects), then the
scalar loop over the last ``c % 16``.  Two reasons, both measured on one thread at SD3's FF and
PixArt's attention shapes.  In place (``out`` is ``y``: the fused step's case) LLVM's
auto-vectorised loop fails its run-time overlap check and runs scalar; the vector steps need
no check (each loads its lanes before it stores them): 2-2.6x faster in place for float32, 5x
for bf16, 3-4x for fp16 (whose scalar loop ran at 2 GB/s out of place too).  And LLVM's loop
vectoriser picks 256-bit vectors on AVX-512 CPUs (its ``prefer-256-bit`` tuning): the
512-bit steps ran 20-30% faster out of place while the tensors stayed in the L3 cache, a few
per cent when they came from memory.  Vector types of 512 bits written in the IR are legal to
the backend (numba's functions carry no ``min-legal-vector-width`` cap), so the steps compile
to zmm loads and stores without touching numba's process-wide CPU features; CPUs without
AVX-512 split them into native vectors.  The IR has plain ``fmul``/``fdiv``/``fadd`` without
fast-math flags: no contraction, each op rounded, the scalar loop's bits (ATen's ``addcmul``,
one pass too, is not: it contracts ``residual + gate * y`` into an FMA).

Memory traffic per element: read y, read the residual, write out (the gate and bias rows stay
in L1),
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
from ._workers import compiles
from . import rmsnorm as _rms
from .rmsnorm import _round_as
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store

__all__ = ["why_not", "compile_kernels", "gated_residual_cpu", "GatedResidualCPU"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
_OPS = {None: 0, "mul": 1, "div": 2}
#: elements per parallel task at least (numba's per-task cost is ~1 us)
_MIN_TASK_ELEMS = 16384
#: float32 lanes of one vector step: 512 bits (see "Vectors" in the module docstring)
_LANES = 16


def _build(numba):
    _register_vectors()
    _numba.inline(_row_unit, _row_strided)  # LLVM sees the row slices' bounds (as rope's rows)
    return _numba.njit(_gated_residual_kernel)


def _register_vectors() -> None:
    """Implement :func:`_row_vectors` (see "Vectors" in the module docstring): one intrinsic
    per scale op, each one 16-lane step written as LLVM vector IR, for float32, bf16 and fp16
    (as int16/uint16 bits, converted as rope's ``_bf16_to_f32`` ... ``_f32_to_f16``, their
    branches as selects: integer ops and float32 arithmetic only, no libcalls)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
    vf, vi = ir.VectorType(f32, _LANES), ir.VectorType(i32, _LANES)

    def splat(c):
        return ir.Constant(vi, [c] * _LANES)

    def to_bf16(b, x):  # round to nearest even; NaN -> 0x7FC0 (c10::BFloat16)
        u = b.bitcast(x, vi)
        nan = b.icmp_unsigned(">", b.and_(u, splat(0x7FFFFFFF)), splat(0x7F800000))
        u = b.add(b.add(u, splat(0x7FFF)), b.and_(b.lshr(u, splat(16)), splat(1)))
        return b.select(nan, splat(0x7FC0), b.lshr(u, splat(16)))  # bits in the low half

    def from_bf16(b, u):
        return b.bitcast(b.shl(u, splat(16)), vf)

    def to_f16(b, x):  # rope's _f32_to_f16, its three cases selected
        u = b.bitcast(x, vi)
        sign = b.and_(u, splat(0x80000000))
        u = b.xor(u, sign)
        big = b.select(b.icmp_unsigned(">", u, splat(0x7F800000)), splat(0x7E00), splat(0x7C00))
        half = ir.Constant(vf, [0.5] * _LANES)  # its ulp is the half subnormal step 2**-24
        tiny = b.sub(b.bitcast(b.fadd(b.bitcast(u, vf), half), vi), splat(0x3F000000))
        odd = b.and_(b.lshr(u, splat(13)), splat(1))
        normal = b.lshr(b.add(b.add(u, splat(0xC8000FFF)), odd), splat(13))
        o = b.select(b.icmp_unsigned(">=", u, splat(0x47800000)), big,
                     b.select(b.icmp_unsigned("<", u, splat(0x38800000)), tiny, normal))
        return b.and_(b.or_(o, b.lshr(sign, splat(16))), splat(0xFFFF))

    def from_f16(b, h):  # rope's _f16_to_f32, its three cases selected
        sign = b.shl(b.and_(h, splat(0x8000)), splat(16))
        exp = b.and_(b.lshr(h, splat(10)), splat(0x1F))
        mant = b.shl(b.and_(h, splat(0x3FF)), splat(13))
        normal = b.or_(b.shl(b.add(exp, splat(112)), splat(23)), mant)
        special = b.or_(splat(0x7F800000), mant)
        step = ir.Constant(vf, [5.9604644775390625e-08] * _LANES)  # 2**-24: mant * step exact
        sub = b.bitcast(b.fmul(b.uitofp(b.lshr(mant, splat(13)), vf), step), vi)
        mag = b.select(b.icmp_unsigned("==", exp, splat(0x1F)), special,
                       b.select(b.icmp_unsigned("==", exp, splat(0)), sub, normal))
        return b.bitcast(b.or_(mag, sign), vf)

    def lanes(op: int):
        @intrinsic
        def step(typingctx, y, g, r, o, bias, e, scale):
            """``o[e:e+16] = round_o(r[e:] + round_g(g[e:] * t(round_y(y[e:] + bias[e:]))))``,
            float32 maths, unfused fmul/fdiv/fadd, each rounded to the dtype of the array
            named (y's for the bias and the scale, the gate's for the product: the chain's
            dtype; out's in the store), every load widened from its array's dtype."""
            kinds = (types.float32, types.int16, types.uint16)
            if not (isinstance(e, types.Integer) and scale == types.float32
                    and all(a.dtype in kinds for a in (y, g, r, o)) and bias.dtype == y.dtype):
                return None

            def codegen(context, builder, sig, args):
                def bits(k):  # the conversions of argument k's element type (None: float32)
                    return {types.int16: (to_bf16, from_bf16),
                            types.uint16: (to_f16, from_f16)}.get(sig.args[k].dtype)

                def at(k):
                    elem = ir.VectorType(i16 if bits(k) else f32, _LANES)
                    data = cgutils.create_struct_proxy(sig.args[k])(context, builder,
                                                                    value=args[k]).data
                    return builder.bitcast(builder.gep(data, [args[5]]), elem.as_pointer())

                def load(k):
                    v = builder.load(at(k), align=2 if bits(k) else 4)
                    return bits(k)[1](builder, builder.zext(v, vi)) if bits(k) else v

                def rnd(x, k):
                    return bits(k)[1](builder, bits(k)[0](builder, x)) if bits(k) else x

                yv, gv, rv = rnd(builder.fadd(load(0), load(4)), 0), load(1), load(2)
                if op:
                    sv = ir.Constant(vf, ir.Undefined)
                    for i in range(_LANES):
                        sv = builder.insert_element(sv, args[6], ir.Constant(i32, i))
                    yv = rnd(builder.fmul(yv, sv) if op == 1 else builder.fdiv(yv, sv), 0)
                v = builder.fadd(rv, rnd(builder.fmul(gv, yv), 1))
                if bits(3):
                    v = builder.trunc(bits(3)[0](builder, v), ir.VectorType(i16, _LANES))
                builder.store(v, at(3), align=2 if bits(3) else 4)
                return context.get_dummy_value()
            return types.void(y, g, r, o, bias, e, scale), codegen
        return step

    step0, step1, step2 = lanes(0), lanes(1), lanes(2)

    @overload(_row_vectors, inline="always", strict=False)
    def _row_vectors_impl(yr, gr, rr, orow, br, c, scale, op):
        if any(a.dtype not in (types.float32, types.int16, types.uint16)
               for a in (yr, gr, rr, orow)):
            return None

        def vectors(yr, gr, rr, orow, br, c, scale, op):
            n = c - c % _LANES
            if op == 0:
                for e in range(0, n, _LANES):
                    step0(yr, gr, rr, orow, br, e, scale)
            elif op == 1:
                for e in range(0, n, _LANES):
                    step1(yr, gr, rr, orow, br, e, scale)
            else:
                for e in range(0, n, _LANES):
                    step2(yr, gr, rr, orow, br, e, scale)
            return n
        return vectors


#: the jitted kernel (created once; it compiles per dtype when first called)
_jit = _numba.once(globals(), _build, requires=(_rms._register,))


def _row_vectors(yr, gr, rr, orow, br, c, scale, op):
    """The first elements of a unit-stride row in 16-lane vectors; returns how many (all but
    the last ``c % 16``).  jit only (:func:`_register_vectors`)."""
    raise NotImplementedError("_row_vectors is a numba helper: call it from a jitted kernel")


def _row_unit(yr, gr, rr, orow, br, c, scale, op):
    """One row, every operand with unit feature stride (slices of ``c`` elements)."""
    e0 = _row_vectors(yr, gr, rr, orow, br, c, scale, op)
    if op == 0:
        for e in range(e0, c):
            t = _round_as(yr, _load(yr, e) + _load(br, e))
            _store(orow, e, _load(rr, e) + _round_as(gr, _load(gr, e) * t))
    elif op == 1:
        for e in range(e0, c):
            t = _round_as(yr, _round_as(yr, _load(yr, e) + _load(br, e)) * scale)
            _store(orow, e, _load(rr, e) + _round_as(gr, _load(gr, e) * t))
    else:
        for e in range(e0, c):
            t = _round_as(yr, _round_as(yr, _load(yr, e) + _load(br, e)) / scale)
            _store(orow, e, _load(rr, e) + _round_as(gr, _load(gr, e) * t))


def _row_strided(yr, gate, res, out, bias, go, ro, oo, gsc, rsc, osc, c, scale, op):
    """One row, gate/residual/out read and written through their feature strides."""
    for e in range(c):
        t = _round_as(yr, _load(yr, e) + _load(bias, e))
        if op == 1:
            t = _round_as(yr, t * scale)
        elif op == 2:
            t = _round_as(yr, t / scale)
        g = _round_as(gate, _load(gate, go + e * gsc) * t)
        _store(out, oo + e * osc, _load(res, ro + e * rsc) + g)


def _gated_residual_kernel(y, gate, res, out, bias, nb, ns, c, gsb, gss, gsc, rsb, rss, rsc,
                           osb, oss, osc, scale, op, rows_per_task):
    """Rows r = (b, s) of ``nb * ns``; y row r at ``r * c``; tasks of ``rows_per_task`` rows;
    ``bias``: ``c`` elements added to every row of y (negative zeros for none)."""
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
                _row_unit(yr, gate[go:go + c], res[ro:ro + c], out[oo:oo + c], bias, c, scale,
                          op)
            else:
                _row_strided(yr, gate, res, out, bias, go, ro, oo, gsc, rsc, osc, c, scale, op)


# -- launch layout (pure metadata) ---------------------------------------------------------------

def why_not(y: Any, gate: Any, residual: Any, out: Any) -> str | None:
    """None when the kernel computes the epilogue for tensors with these metadata
    (``fxbackend.TensorMeta``), else a short reason.  Never raises.  Handled: one dtype
    (float32/bf16/fp16) for all four, or a float32 gate with each of the others any of the
    three, all on the CPU, y contiguous, gate and residual broadcastable to y's shape with any
    non-negative strides, out of y's shape with any non-negative strides, at most two leading
    dims after merging (``epilogue_why_not``)."""
    return epilogue_why_not(y, gate, residual, out, "cpu", mixed=True)


def _threads_rows(lay: EpilogueLayout, threads: int) -> int:
    nrows = lay.nb * lay.ns
    per = max(-(-nrows // (4 * threads)), -(-_MIN_TASK_ELEMS // max(lay.c, 1)))
    return max(1, min(per, nrows))


#: (dtype, c) -> c negative zeros: the bias of an epilogue without one (``y + -0.0`` is ``y``
#: for every y, signed zeros and NaNs included, so one kernel serves both)
_NO_BIAS: dict = {}


def _no_bias(dtype: torch.dtype, c: int) -> np.ndarray:
    b = _NO_BIAS.get((dtype, c))
    if b is None:
        b = _NO_BIAS[(dtype, c)] = _flat(torch.full((c,), -0.0, dtype=dtype), c)
    return b


def _launch(lay: EpilogueLayout, y, gate, res, out, scale_op, scale, bias=None) -> None:
    if lay.spans[0] == 0:
        return
    fn = _jit()
    rows = _threads_rows(lay, _set_threads())
    yf = _flat(y, lay.spans[0])
    of = yf if out.data_ptr() == y.data_ptr() and out.stride() == y.stride() and \
        out.dtype == y.dtype else _flat(out, lay.spans[3])
    bf = _no_bias(y.dtype, lay.c) if bias is None else _flat(bias, lay.c)
    fn(yf, _flat(gate, lay.spans[1]), _flat(res, lay.spans[2]), of, bf, lay.nb, lay.ns, lay.c,
       *lay.g, *lay.r, *lay.o, np.float32(1.0 if scale is None else scale), _OPS[scale_op],
       rows)


def _layout_of(y, gate, res, out) -> EpilogueLayout:
    return epilogue_layout(tuple(y.shape), tuple(gate.shape), tuple(gate.stride()), tuple(res.shape),
                   tuple(res.stride()), tuple(out.stride()))


def gated_residual_cpu(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                       out: torch.Tensor, *, scale_op: str | None = None,
                       scale: float | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = gated_residual_reference(y, gate, residual, scale_op, scale, bias=bias)``
    (returned).  ``y`` contiguous; gate and residual broadcastable to y's shape (any strides);
    ``bias`` None or a contiguous ``[C]`` tensor (C = y's last dim) of y's dtype; ``out`` of
    y's shape, any strides, either y itself or overlapping no input (the caller's guarantee;
    not checked).  Raises ValueError naming the problem for inputs the kernel does not take."""
    ts = {"y": y, "gate": gate, "residual": residual, "out": out}
    for label, t in ts.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"gated_residual_cpu: {label} must be a tensor")
    # concrete tensors have int sizes: built directly, the metadata costs ~7 us less per call
    # than through ``TensorMeta.of`` (its SymInt check per size; this call is ~50 us in all)
    why = why_not(*(fxbackend.TensorMeta(tuple(t.shape), t.stride(), t.dtype, t.device)
                    for t in ts.values()))
    if why is None and not y.is_contiguous():
        why = "y must be contiguous"
    if why is None and scale_op not in _OPS:
        why = f"scale_op {scale_op!r} (None, 'mul' or 'div')"
    if why is None and scale_op is not None and (not isinstance(scale, (int, float))
                                                 or isinstance(scale, bool)):
        why = f"scale {scale!r} (a Python number with a scale_op)"
    if why is None and bias is not None:
        why = _bias_why_not(bias, y)
    if why is not None:
        raise ValueError(f"gated_residual_cpu: unsupported input: {why}")
    _launch(_layout_of(y, gate, residual, out), y, gate, residual, out, scale_op, scale, bias)
    return out


def _bias_why_not(bias: Any, y: torch.Tensor) -> str | None:
    c = y.shape[-1] if y.dim() else 1
    if not isinstance(bias, torch.Tensor):
        return f"bias must be a tensor or None, got {type(bias).__name__}"
    if bias.dim() != 1 or bias.shape[0] != c or not bias.is_contiguous() or \
            bias.dtype != y.dtype or bias.device != y.device:
        return (f"bias must be a contiguous [{c}] {y.dtype} tensor on {y.device}, got "
                f"{tuple(bias.shape)} {bias.dtype} strides {bias.stride()} on {bias.device}")
    return None


@compiles
def compile_kernels(dtype: torch.dtype, gate: torch.dtype | None = None,
                    residual: torch.dtype | None = None, out: torch.dtype | None = None) -> None:
    """Compile (or load from the disk cache) the kernel for y of ``dtype`` and gate, residual
    and out of the dtypes given (default ``dtype``; every scale op: a run-time argument) by a
    call with no rows on exactly the types a launch passes.  Thread-safe (plans compile their
    nodes in parallel)."""
    fn = _jit()
    z = [np.zeros(0, _NP_OF[d or dtype]) for d in (dtype, gate, residual, out)]
    with _compile_lock:  # see rope's compile_kernels
        fn(z[0], z[1], z[2], z[3], z[0], 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, np.float32(1.0), 0,
           1)


class GatedResidualCPU:
    """The numba epilogue behind the ``gated_residual`` fusion rule on the CPU (see
    ``fxbackend.patterns.gated_residual.GatedResidualFusion`` for the interface).  The launch
    layout is cached per shape/stride signature."""

    name = "gated_residual_cpu"
    #: takes ``bias=``: the rule runs a float32 ``addmm`` as ``mm`` and the bias is added here
    adds_bias = True

    def why_not(self, y, gate, residual, out):
        return why_not(y, gate, residual, out)

    def compile(self, y, gate, residual, out, scale_op):
        compile_kernels(y.dtype, gate.dtype, residual.dtype, out.dtype)

    def run(self, y, gate, residual, out, *, scale_op, scale, bias=None):
        _launch(_layout_of(y, gate, residual, out), y, gate, residual, out, scale_op, scale,
                bias)


assert set(_NP_OF) == set(DTYPES)
fxbackend.register_fusion("cpu", GatedResidualFusion(GatedResidualCPU()))
