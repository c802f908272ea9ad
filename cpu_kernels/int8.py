"""INT8 W8A8 with ConvRot on the CPU: numba kernels for ``sd.quantize_i8_convrot.v1`` and
``sd.linear_i8.v1`` (see ``patterns/int8.py`` for the maths, the evaluation order and the packed
layout), with the integer GEMM through ``torch._int_mm``.

Rotate + quantize (:func:`quantize_i8_convrot_cpu`, one parallel loop over tasks of whole rows,
``prange``, each task with one float32 scratch row allocated once): stage 0 of the rotation
(stride 1) reads x (bf16/fp16 bits converted in registers) into the scratch row, which LLVM
vectorises as interleaved loads and stores; the later stages of ``rotate_reference`` (stride
4^j, blocks of 4^(j+1) features, which never cross a group because the group is a power of 4
dividing K) run in place through a numba intrinsic that does the butterfly on four
``<4 x float>`` (stride 4) or ``<8 x float>`` (stride >= 16) vectors: numba disables LLVM's
SLP vectoriser and its loop vectoriser left the stride-4 stage scalar (an inner loop of 4
iterations; 0.3 ns an element, half of the rotation's time at group 256).  Group 1 skips the
scratch row: amax and codes read x directly.  Then ``amax`` and the codes: true float32
division ``(r * 2^-k) / scale`` (``vdivps``: the bound of that loop), round-half-to-even as
``(v + 1.5 * 2^23) - 1.5 * 2^23`` (exact for ``|v| < 2^22``; here ``|v| <= 127``), clamp,
convert.  ``amax`` is the integer maximum of the bit patterns with the sign cleared (the float
order for non-NaN values; an integer max reduction vectorises, a float one does not under
strict IEEE), taken before the exact 2^-k scaling and scaled after (rounding is monotone, so
it is the max of the scaled values).  Hot loops index with unsigned ints: numba then emits no
negative-index wrap-around and LLVM vectorises them.  Measured single-threaded on the kernel
compiled serially (1024-1101 rows, K 384-3072, float32, shared 2-core Rocket Lake box): group
256 0.8-0.9 -> 1.3-1.5 Gelem/s, group 64 0.7-0.9 -> 1.3-1.5, group 1 1.3-1.8 -> 2.0-2.5.  Any K
divisible by the group works: the scratch row holds one row whatever its length.  Padding rows
of the packed layout are written as zeros with scale 0.0.  Strict IEEE float32 throughout
(``fastmath=False``: no reassociation, no FMA contraction; the intrinsic's vector
fadd/fsub carry no fast-math flags), so codes and scales are bit-equal to
``quantize_i8_convrot_reference``.

Linear (``linear_kernel``: ``patterns/int8.LinearKernel`` over this file's ``DEVICE``), three
phases, each a whole pass over its data:
1. ``x_kind="float"``: quantize x into the workspace, in the packed layout
   (``packed_nbytes(M, K)`` bytes); ``packed``/``int8`` operands are read in place.
   ``w_kind="float"``: the weight is quantized by the same kernel, once per model, and again
   when its weight key (address, layout, fingerprint) changes (``patterns/int8.WeightState``).
2. ``torch._int_mm(q_x [M, K], q_w.T [K, N])`` (int8 x int8 -> int32, oneDNN/AMX or VNNI
   here), written into the output's own storage reinterpreted as int32 (``out`` is float32
   ``[M, N]``: the same bytes), so the accumulator needs no workspace.  Measured on a shared
   2-core Xeon with AMX-INT8 and AVX512-VNNI (``scripts/bench_int8.py``, Flux/SD3 projections
   at 1024 rows): ``torch._int_mm`` alone 5.5-8x faster than float32 ``F.linear``, the whole
   step (quantize + GEMM + epilogue) 3.8-5.5x.  It is exact here: the tests check it against
   a float64 product at the extremes of int8 (some int8 paths of older CPUs accumulate pairs
   in saturating int16).  Without VNNI or AMX-INT8 ``torch._int_mm`` crawls (~100x float32
   on an AVX2-only CPU), so where the CPU profile's ``int8_gemm`` decision names a prepacked
   engine the GEMM runs through torch's quantized linear instead: the weight is quantized
   with 7-bit codes (the engines' AVX2 kernels add two u8 x s8 products in saturating 16 bits;
   2 * 255 * 63 < 2^15) and prepacked once.  ``onednn_linear``: the activation codes shifted
   to unsigned bytes with zero point 128 (``fxbackend.cpu.onednn_linear_gemm``);
   ``quantized_linear`` (fbgemm): the codes go in as floats with scale 1 and zero point 128
   (exact; ``fxbackend.cpu.quantized_linear_gemm``).  Either engine returns a new float32
   tensor holding the int32 sums' float32 values, the accumulator the kernels after the GEMM
   then read (``accumulator_dtype``; each reads both int32 and float32): the epilogue sees the
   same values as with ``torch._int_mm``, float32 of the exact int32 sum.
3. the epilogue, one parallel pass over rows, in place where the accumulator is the output's
   storage (each accumulator element read before the float32 is written to the same address,
   by the same iteration)::

       out[m, n] = float32(acc[m, n]) * x_scale[m] * w_scale[n] + float32(bias[n])

   left to right, each operation rounded (bit-exact to ``linear_i8_reference``).

Cancellation: between the phases the step checks the running plan's cancel token
(:func:`fxbackend.services.current_token`) and raises :class:`~fxbackend.services.Cancelled`,
so ``Plan.cancel()`` stops a long layer after quantization or after the GEMM.

``supports`` declines (the op's reference then runs natively, with the same result): K or N not
divisible by 4, non-contiguous operands, scales that are not 1-D contiguous float32 of exactly
M / N elements, a bias that is not 1-D contiguous ``[N]``, devices other than the CPU; the
reason is :func:`linear_why_not`.  Kernels compile at plan time (``compile``) and are
cached on disk (``cpu_kernels/_numba.py``); the disk cache is keyed on this file (a change to
rope's ``_load`` needs a change here or a cleared cache).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend import TensorMeta, services
from fxbackend.cpu import (int8_weight_max, int_mm_exact, onednn_linear_gemm,
                           onednn_linear_pack, quantized_linear_gemm, quantized_linear_pack)
from fxbackend.patterns.int8 import (FLOATS, QMAX, REGULAR_HADAMARD_GROUPS, Int8Device,
                                     LinearKernel, QuantizeKernel, check_linear, hadamard_stages,
                                     int_dot, linear_node_why_not, quantize_direct,
                                     quantize_weight_i8_reference, run_linear, scales_why_not)

from . import _numba
from ._workers import compiles
from . import rope as _rope
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store

__all__ = ["quantize_i8_convrot_cpu", "quantize_rows_cpu", "linear_i8_cpu", "compile_kernels",
           "linear_why_not", "DEVICE", "quantize_kernel", "linear_kernel", "accumulator_dtype"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
#: 1.5 * 2^23: ``(v + _MAGIC) - _MAGIC`` rounds a float32 |v| < 2^22 to the nearest integer,
#: ties to even (the float32 addition itself rounds so)
_MAGIC = np.float32(12582912.0)
_QMAX = np.float32(127.0)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_U0, _U1, _U2, _U3, _U4, _U8, _U16 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 8, 16))
#: elements per parallel task of the quantize kernel at least (numba's per-task cost is ~1 us)
_MIN_TASK_ELEMS = 16384
_ABS_BITS = np.uint32(0x7FFFFFFF)
#: the accumulator dtypes the kernels after the GEMM read (``accumulator_dtype``)
_NP_ACC = {torch.int32: np.int32, torch.float32: np.float32}
#: the operands of ``sd.linear_i8.v1`` in the order of ``check_linear``'s arguments
_LINEAR_ARGS = ("x", "w", "w_scale", "x_scale", "bias")


# -- numba kernels (plain Python, jitted lazily) --------------------------------------------------

def _butterfly(a, b, c, d):
    """``(a b c d) @ A`` in the fixed order of ``rotate_reference``."""
    p = a + b
    q = a - b
    w = c + d
    u = c - d
    return p + u, p - u, q + w, w - q


def _butterflies_x4(b, i, s):
    """jit only: ``_butterfly`` in place on ``b[j], b[j+s], b[j+2s], b[j+3s]`` for the 4
    consecutive ``j = i .. i+3``, as <4 x float> vector operations (:func:`_vector_butterflies`)."""
    raise NotImplementedError("_butterflies_x4 is a numba helper: call it from a jitted kernel")


def _butterflies_x8(b, i, s):
    """jit only: as :func:`_butterflies_x4` for the 8 consecutive ``j = i .. i+7``."""
    raise NotImplementedError("_butterflies_x8 is a numba helper: call it from a jitted kernel")


def _vector_butterflies(width: int):
    """A numba intrinsic ``(b, i, s)``: ``_butterfly`` on the four ``<width x float>`` vectors at
    ``b[i]``, ``b[i+s]``, ``b[i+2s]``, ``b[i+3s]`` (``b`` a contiguous 1-D float32 array),
    written back to the same places.  Each lane is the scalar butterfly (the same fadd/fsub,
    no fast-math flags), and every load of a call precedes its stores, so in place is exact.
    Why an intrinsic: numba disables LLVM's SLP vectoriser, and its loop vectoriser leaves the
    stride-4 stage scalar (an inner loop of 4 iterations; 0.3 ns an element, half the rotation
    at group 256)."""
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def butterflies(typingctx, b, i, s):
        if not (isinstance(b, types.Array) and b.dtype == types.float32 and b.ndim == 1 and
                b.layout == "C" and isinstance(i, types.Integer) and
                isinstance(s, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            at = context.cast(builder, args[1], sig.args[1], types.intp)
            step = context.cast(builder, args[2], sig.args[2], types.intp)
            vec = ir.VectorType(ir.FloatType(), width).as_pointer()
            ptrs = []
            for _ in range(4):
                ptrs.append(builder.bitcast(builder.gep(data, [at], inbounds=True), vec))
                at = builder.add(at, step)
            a, b_, c, d = (builder.load(p, align=4) for p in ptrs)
            p, q = builder.fadd(a, b_), builder.fsub(a, b_)
            w, u = builder.fadd(c, d), builder.fsub(c, d)
            outs = (builder.fadd(p, u), builder.fsub(p, u), builder.fadd(q, w), builder.fsub(w, q))
            for ptr, v in zip(ptrs, outs):
                builder.store(v, ptr, align=4)
            return context.get_dummy_value()

        return types.void(b, i, s), codegen

    return butterflies


def _register_butterflies(numba) -> None:
    from numba.extending import overload
    for fn, width in ((_butterflies_x4, 4), (_butterflies_x8, 8)):
        vector = _vector_butterflies(width)
        overload(fn, inline="always", strict=False)(
            (lambda v: lambda b, i, s: lambda b, i, s: v(b, i, s))(vector))


def _stage_1(x, dst, k):
    """Stage 0 (stride 1) of the rotation: ``x`` (float32, or bf16/fp16 bits) -> ``dst`` (LLVM
    vectorises it as interleaved loads and stores)."""
    for i in range(_U0, k, _U4):
        dst[i], dst[i + _U1], dst[i + _U2], dst[i + _U3] = _butterfly(
            _load(x, i), _load(x, i + _U1), _load(x, i + _U2), _load(x, i + _U3))


def _stage_4(b, k):
    """Stage 1 (stride 4) in place: blocks of 16, one <4 x float> butterfly each."""
    for i in range(_U0, k, _U16):
        _butterflies_x4(b, i, _U4)


def _stage(b, k, s):
    """A stage of stride ``s`` >= 16 (a multiple of 8) in place, 8 butterflies a call."""
    for base in range(_U0, k, _U4 * s):
        for j in range(base, base + s, _U8):
            _butterflies_x8(b, j, s)


def _abs_max(x, k):
    """``max |x[:k]|`` (float32, or bf16/fp16 bits), as the integer maximum of the float32 bit
    patterns with the sign cleared: for non-NaN floats that order is the float order (a max is
    exact in any order), and LLVM vectorises an integer max reduction but not a float one."""
    m = np.uint32(0)
    for i in range(k):
        m = max(m, np.float32(_load(x, i)).view(np.uint32) & _ABS_BITS)
    return np.uint32(m).view(np.float32)


def _codes(x, qr, k, inv, scale):
    """``qr[i] = clamp(round_half_even((x[i] * inv) / scale), -127, 127)``: the true float32
    division (vectorised: ``vdivps``, the bound of this loop)."""
    for i in range(k):
        v = ((_load(x, i) * inv) / scale + _MAGIC) - _MAGIC
        qr[i] = np.int8(min(max(v, -_QMAX), _QMAX))


def _quantize_row(xr, b, qr, k, nst, inv):
    """Rotate row ``xr`` (stage 0 into the float32 scratch ``b``, the others in place; no
    rotation and no copy for ``nst == 0``), quantize it into ``qr``; returns its scale.
    ``amax`` is taken before the exact 2^-k scaling and scaled after: rounding is monotone,
    so ``max|round(r * inv)| == round(max|r| * inv)``."""
    if nst == 0:
        scale = (_abs_max(xr, k) * inv) / _QMAX
        if scale == _ZERO:
            scale = _ONE
        _codes(xr, qr, k, inv, scale)
        return scale
    _stage_1(xr, b, k)
    if nst > 1:
        _stage_4(b, k)
    s = _U16
    for _ in range(2, nst):
        _stage(b, k, s)
        s = s * _U4
    scale = (_abs_max(b, k) * inv) / _QMAX
    if scale == _ZERO:
        scale = _ONE
    _codes(b, qr, k, inv, scale)
    return scale


def _quantize_kernel(x, q, scales, m, mp, k, nst, inv, chunk):
    """Rows ``0 .. mp-1`` in parallel tasks of ``chunk`` rows, each task with one scratch row:
    rows below ``m`` quantized from ``x`` (flat, row-major ``[m, k]``), the rest zeros with
    scale 0.0.  Unsigned indices throughout: numba then emits no negative-index wrap-around,
    and LLVM vectorises the loops."""
    ku = np.uint64(k)
    cu = np.uint64(chunk)
    mpu = np.uint64(mp)
    for task in prange((mp + chunk - 1) // chunk):
        b = np.empty(k, np.float32)
        r0 = np.uint64(task) * cu
        for r in range(r0, min(r0 + cu, mpu)):
            qr = q[r * ku:(r + _U1) * ku]
            if r < m:
                scales[r] = _quantize_row(x[r * ku:(r + _U1) * ku], b, qr, ku, nst, inv)
            else:
                for i in range(ku):
                    qr[i] = 0
                scales[r] = _ZERO


def _epilogue_kernel(acc, out, xs, ws, b, m, n, has_b):
    """``out = float32(acc) * xs[row] * ws + b`` row by row in parallel, rounded once to out's
    dtype (float32, or 16-bit bits: ``int8_linear_cast``); ``acc`` (int32, or float32 holding
    the int32 sums' float32 values) and a float32 ``out`` may be the same memory."""
    nu = np.uint64(n)
    for row in prange(m):
        r = np.uint64(row)
        a = acc[r * nu:(r + _U1) * nu]
        o = out[r * nu:(r + _U1) * nu]
        sx = xs[r]
        if has_b:
            for j in range(nu):
                _store(o, j, (np.float32(a[j]) * sx) * ws[j] + _load(b, j))
        else:
            for j in range(nu):
                _store(o, j, (np.float32(a[j]) * sx) * ws[j])


def _build(numba) -> tuple:
    from numba.extending import register_jitable
    _register_butterflies(numba)
    # _abs_max and _codes as functions: each has two call sites in _quantize_row, and numba's
    # IR inliner trips over a loop variable inlined twice (NumbaIRAssumptionWarning)
    for fn in (_abs_max, _codes):
        register_jitable(fn)
    # _quantize_row as a function of its own (the stages inlined into it): compiled once per
    # process and shared by every kernel that quantizes a row, instead of typed again inside
    # each of them (see the compile-time note of cpu_kernels/int8_fusions.py)
    register_jitable(_quantize_row)
    _numba.inline(_butterfly, _stage_1, _stage_4, _stage)
    return _numba.njit(_quantize_kernel), _numba.njit(_epilogue_kernel)


#: ``(quantize kernel, epilogue kernel)``, jitted once (each compiles per dtype on first call)
_jit = _numba.once(globals(), _build, requires=(_rope._register,))


@compiles
def compile_kernels(x_dtype: torch.dtype | None = torch.float32,
                    bias_dtype: torch.dtype | None = None, epilogue: bool = True,
                    out_dtype: torch.dtype = torch.float32,
                    acc_dtype: torch.dtype = torch.int32) -> None:
    """Compile (or load from the disk cache) the quantize kernel for ``x_dtype`` (None: not
    needed) and the epilogue for ``bias_dtype`` (None: no bias), ``out_dtype`` and the
    accumulator's ``acc_dtype`` (int32, or float32: :func:`accumulator_dtype`), by calls with no rows
    on exactly the types a launch passes.  Thread-safe (plans compile nodes in parallel)."""
    quant, epi = _jit()
    with _compile_lock:  # see rope's compile_kernels
        if x_dtype is not None:
            quant(np.zeros(0, _NP_OF[x_dtype]), np.zeros(0, np.int8), np.zeros(0, np.float32),
                  0, 0, 4, 1, np.float32(0.5), 1)
        if epilogue:
            b = np.zeros(0, _NP_OF[bias_dtype or torch.float32])
            epi(np.zeros(0, _NP_ACC[acc_dtype]), np.zeros(0, _NP_OF[out_dtype]),
                np.zeros(0, np.float32), np.zeros(0, np.float32), b, 0, 4,
                bias_dtype is not None)


# -- launchers ----------------------------------------------------------------------------------

def quantize_rows_cpu(x: torch.Tensor, group: int, q: torch.Tensor, scales: torch.Tensor,
                      m: int, mp: int) -> None:
    """Quantize the ``m`` rows of the contiguous float ``x`` (``[..., K]``) into ``q`` (int8,
    ``mp * K`` elements, contiguous) and ``scales`` (float32, ``mp``): the numba kernel, no
    checks (the callers check)."""
    k = x.shape[-1]
    if mp == 0:
        return
    nst = hadamard_stages(group)
    quant, _ = _jit()
    chunk = rows_per_task(mp, k, _set_threads())
    quant(_flat(x, m * k), _flat(q, mp * k), _flat(scales, mp), m, mp, k, nst,
          np.float32(2.0 ** -nst), chunk)


def rows_per_task(rows: int, k: int, threads: int) -> int:
    """Rows a parallel task of a row kernel takes: about 4 tasks a thread, each at least
    :data:`_MIN_TASK_ELEMS` elements (so that the per-task cost and the scratch row
    allocation stay small)."""
    per = max(-(-rows // (4 * threads)), -(-_MIN_TASK_ELEMS // max(k, 1)))
    return max(1, min(per, max(rows, 1)))


def quantize_i8_convrot_cpu(x: torch.Tensor, group: int = 1,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(x) {group}`` with the numba kernel: the packed layout (in
    ``out`` when given: a contiguous 1-D int8 tensor of ``packed_nbytes(M, K)`` bytes whose
    storage offset is a multiple of 4).  ``x``: contiguous float32/bf16/fp16 CPU tensor.
    ValueError for inputs the kernel does not take."""
    why = _why_not_quantize(TensorMeta.of(x), group) if isinstance(x, torch.Tensor) else \
        "x is not a tensor"
    if why is not None:
        raise ValueError(f"quantize_i8_convrot_cpu: unsupported input: {why}")
    return quantize_direct(DEVICE, "quantize_i8_convrot_cpu", x, group, out)


def _check_cancelled() -> None:
    """Raise Cancelled when the running plan was cancelled (between the phases of a step)."""
    token = services.current_token()
    if token is not None and token.cancelled:
        raise services.Cancelled("the plan was cancelled")


def _epilogue(acc: torch.Tensor, out: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
              bias: torch.Tensor | None, m: int, n: int) -> None:
    if m == 0 or n == 0:
        return
    _, epi = _jit()
    _set_threads()
    b = _flat(bias, n) if bias is not None else np.zeros(0, np.float32)
    epi(_flat(acc, m * n), _flat(out, m * n), _flat(xs, m), _flat(ws, n), b, m, n,
        bias is not None)


def linear_i8_cpu(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                  x_kind: str, group: int = 1, m: int = -1, lead: tuple = (),
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``sd.linear_i8.v1 {w_kind="int8"}`` with this file's kernels (direct calls and
    benchmarks): returns ``out`` (float32 ``lead + (N,)``, allocated when None).  A float
    weight is quantized ahead of time with ``quantize_weight_i8_reference``.  ValueError for
    inputs the kernels do not take (the reasons of :func:`linear_why_not`)."""
    metas = [None if t is None else TensorMeta.of(t) for t in (x, w, w_scale, x_scale, bias)]
    try:
        M, K, N, lead_out = check_linear(*metas, x_kind=x_kind, w_kind="int8", group=group,
                                         m=m, lead=lead, who="linear_i8_cpu")
    except ValueError as e:
        raise ValueError(str(e)) from None
    why = _why_not_operands(dict(zip(_LINEAR_ARGS, metas)), M, K, N, x_kind)
    if why is not None:
        raise ValueError(f"linear_i8_cpu: unsupported input: {why}")
    shape = tuple(lead_out) + (N,)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"linear_i8_cpu: out must be a contiguous float32 tensor of shape "
                         f"{shape}")
    run_linear(DEVICE, x_kind, group, M, K, N, x, x_scale, w, w_scale, bias, out, None)
    return out


# -- support checks (metadata only, never raise) --------------------------------------------------

def _why_not_quantize(x: Any, group: Any) -> str | None:
    if not isinstance(x, TensorMeta) or x.is_symbolic:
        return "x is not a concrete tensor"
    if x.device.type != "cpu":
        return f"x is on {x.device}"
    if x.dtype not in FLOATS:
        return f"x dtype {x.dtype} (float32, bfloat16 or float16)"
    if group not in REGULAR_HADAMARD_GROUPS or isinstance(group, bool):
        return f"group {group!r}"
    if not x.shape or x.shape[-1] == 0 or x.shape[-1] % group:
        return f"x shape {tuple(x.shape)} (last dim a positive multiple of {group})"
    if not x.is_contiguous:
        return "x is not contiguous"
    return None


def _why_not_operands(s: dict, M: int, K: int, N: int, x_kind: str) -> str | None:
    """Reasons of :func:`linear_why_not` on checked operands (metadata by name; None:
    supported)."""
    for name, t in s.items():
        if t is None:
            continue
        if not isinstance(t, TensorMeta) or t.is_symbolic:
            return f"{name} is not a concrete tensor"
        if t.device.type != "cpu":
            return f"{name} is on {t.device}"
    if K % 4 or N % 4:
        return f"K={K} and N={N} must be multiples of 4"
    if not s["x"].is_contiguous or not s["w"].is_contiguous:
        return "x and w must be contiguous"
    why = scales_why_not(s, M, N)
    if why is None and x_kind == "packed" and s["x"].storage_offset % 4:
        why = "packed x's storage offset is not a multiple of 4"
    return why


def linear_why_not(node) -> str | None:
    """None when the CPU's linear kernel computes ``node`` (an ``sd.linear_i8.v1`` node), else
    the reason.  Metadata only; never raises."""
    return linear_node_why_not(
        node, lambda s, M, K, N, n: _why_not_operands(s, M, K, N, n.params["x_kind"]))


# -- registry kernels -----------------------------------------------------------------------------

def _epilogue_rows(acc, out, xs, ws, bias) -> None:
    _epilogue(acc, out, xs, ws, bias, *acc.shape)


#: profile -> the int8 GEMM path its ``int8_gemm`` decision names (profiles are cached
#: objects, so this is a lookup per call)
_engines: dict = {}
#: int8 weights this file quantized for a prepacked engine -> that engine and the prepacked
#: form (held while the weight is: a weight state replaces its tensors when the weight changes)
_packed: dict = {}  # id(weight) -> (weakref to it, engine, packed); dropped with the weight
_pack_lock = threading.Lock()
#: the prepacked engines: ``(pack, gemm)``; each gemm returns a new float32 tensor holding the
#: int32 sums' float32 values (``fxbackend.cpu.onednn_linear_gemm``)
_PREPACKED = {"quantized_linear": (quantized_linear_pack, quantized_linear_gemm),
              "onednn_linear": (onednn_linear_pack, onednn_linear_gemm)}


def _engine() -> tuple[str, int]:
    """``(int8 GEMM path, largest weight code)`` for this process's CPU profile
    (``fxbackend.cpu``: ``int_mm``, ``onednn_linear`` or ``quantized_linear``; ``float32``
    plans have no INT8 step, and a step run anyway takes ``int_mm``, exact everywhere)."""
    p = fxbackend.cpu_profile()
    got = _engines.get(p)
    if got is None:
        choice = p.decide("int8_gemm").choice
        got = _engines[p] = (choice if choice in _PREPACKED else "int_mm", int8_weight_max(p))
    return got


def accumulator_dtype(w_kind: str) -> torch.dtype:
    """The dtype of the accumulator :func:`_gemm` gives a linear with a weight of ``w_kind``
    under this process's profile: float32 (the int32 sums' float32 values) for a float weight
    the plan prepacks for a prepacked engine, else int32.  The kernels after the GEMM read
    either; plans compile the one they will get."""
    engine = _engine()[0]
    return torch.float32 if w_kind == "float" and engine in _PREPACKED else torch.int32


def _gemm(qx: torch.Tensor, qw: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    """``qx @ qw.T``, returned as the accumulator it wrote: ``acc`` (int32 ``[M, N]``; a new one
    where None), or a prepacked engine's new float32 tensor holding the int32 sums' float32
    values.  Through the prepacked engine where this file quantized and packed ``qw`` for it
    (only where the profile chose that engine: its codes then fit the engine's 16-bit pair
    sums; a lookup, no profile read per call), else ``torch._int_mm`` where it is exact
    (``fxbackend.cpu.int_mm_exact``), else a float64 product (exact; an int8 weight the plan
    did not quantize on a CPU whose int8 kernels saturate)."""
    held = _packed.get(id(qw))
    if held is not None and held[0]() is qw:
        return _PREPACKED[held[1]][1](qx, held[2])
    if acc is None:  # a step planned for a prepacked engine (``_gemm_writes_acc``)
        acc = torch.empty(qx.shape[0], qw.shape[0], dtype=torch.int32, device=qx.device)
    if int_mm_exact():
        torch._int_mm(qx, qw.t(), out=acc)
    else:  # saturating int8 kernels (no VNNI): the references' exact product, slowly
        acc.copy_(int_dot(qx, qw))
    return acc


def _gemm_writes_acc(w_kind: str) -> bool:
    """Whether :func:`_gemm` writes the int32 accumulator it is given for a weight of
    ``w_kind`` under this process's profile: not for a float weight the plan prepacks for a
    prepacked engine (a new float32 tensor comes back), so fused steps reserve no space for
    it (6.45 MB of workspace in the small W8A8 Flux on an AVX2-only EPYC)."""
    return accumulator_dtype(w_kind) == torch.int32


def _quantize_weight(w: torch.Tensor, group: int, w_i8: torch.Tensor,
                     w_scale: torch.Tensor) -> None:
    """A float weight into its int8 rows and scales: the numba kernel (8-bit codes), or for
    a prepacked engine on a CPU without VNNI the reference with 7-bit codes
    (``int8_weight_max``), prepacked once for the engine."""
    n = w.shape[0]
    engine, qmax = _engine()
    if engine in _PREPACKED and qmax < QMAX:
        q, scale = quantize_weight_i8_reference(w, group, qmax)
        w_i8.copy_(q)
        w_scale.copy_(scale)
    else:
        quantize_rows_cpu(w, group, w_i8, w_scale, n, n)
    if engine in _PREPACKED:
        packed = _PREPACKED[engine][0](w_i8)
        with _pack_lock:
            _packed[id(w_i8)] = (weakref.ref(w_i8), engine, packed)
        weakref.finalize(w_i8, _packed.pop, id(w_i8), None)


#: the weight state keys its held value by the code range too (``patterns/int8.WeightState``)
_quantize_weight.variant = lambda: _engine()


def _compile_quantize(x, m, mp, group, device) -> None:
    compile_kernels(x.dtype, None, epilogue=False)


def _compile_epilogue(m, n, bias_dtype, out_dtype, device, w_kind="int8") -> None:
    compile_kernels(None, bias_dtype, out_dtype=out_dtype, acc_dtype=accumulator_dtype(w_kind))


#: the CPU's INT8 building blocks (``patterns/int8.Int8Device``): the registry kernels below and
#: the fused steps of ``cpu_kernels/int8_fusions.py``; cancellation checked between the phases
DEVICE = Int8Device(quantize_rows=quantize_rows_cpu, gemm=_gemm, epilogue=_epilogue_rows,
                    why_not_quantize=_why_not_quantize, why_not_linear=linear_why_not,
                    compile_quantize=_compile_quantize, compile_epilogue=_compile_epilogue,
                    quantize_weight=_quantize_weight, between=_check_cancelled,
                    gemm_writes_acc=_gemm_writes_acc)
#: ``sd.quantize_i8_convrot.v1``: the numba kernel (contiguous x, any K divisible by the group)
quantize_kernel = fxbackend.register_kernel("cpu", QuantizeKernel(DEVICE,
                                                                  "quantize_i8_convrot_cpu"))
#: ``sd.linear_i8.v1``, both weight kinds: numba quantize, ``torch._int_mm``, numba epilogue
linear_kernel = fxbackend.register_kernel("cpu", LinearKernel(DEVICE, "linear_i8_cpu"))
