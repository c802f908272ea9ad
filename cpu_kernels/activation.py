"""Activations after a linear on the CPU: the GEMM through torch (``addmm``/``mm`` with ``out=``)
and one numba pass over its result, registered at the end as the kernels of the ``linear_act``
and ``linear_glu`` fusion rules for "cpu" (:class:`LinearActCPU`, see
``patterns/activation.py``).

Maths (float32 arithmetic; constants as torch's CPU kernels in
``aten/src/ATen/native/cpu/Activation.cpp`` / ``vec512_float.h`` use them; ``fma`` one
rounding)::

    gelu_tanh(x) = x / (1 + exp(-2 z))                       float32 results
                 = (0.5 * x) * (1 + tanh(z))                   16-bit results (torch's form)
                   z = kBeta * fma(0.044715 * (x * x), x, x)
                   kBeta = float32(sqrt(2) * (2 / sqrt(pi)) * 0.5)
    gelu(x)      = (x * 0.5) * (1 + erf(x * float32(1 / sqrt(2))))
    silu(x)      = x / (1 + exp(-x))
    gated:  out  = round(round(act(y[gate half])) * y[other half])    (the chain's roundings)

``exp``, ``tanh`` and ``erf`` are the written-out, vectorisable float32 functions of
``cpu_kernels/_vmath.py`` (Cephes ``expf``/``tanhf``, Abramowitz-Stegun 7.1.26 erf with the
constants of torch's ``Vectorized<float>::erf``, so it tracks torch's result for the strided
gate of GEGLU, which is not oneDNN's path), polynomials in FMA Horner form.

The two tanh GELU forms are the same function: 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2z)).  A
float32 result takes the second, one exp and one division instead of tanh's two branches (the
in-place pass over 1024 x 1536 float32, 2 threads: 0.93-0.95 ms against 1.24-1.43 ms), and
without the cancellation of 1 + tanh(z) below x = -3, where torch's float32 result drops to 0
and this one keeps its relative accuracy.  A 16-bit result keeps torch's form: the two round
differently in the negative tail often enough (bf16: a third of the values on [-9, -2] alike)
that a 16-bit model would no longer match eager bit for bit.  The kernels pick the form from
the element type of the array the value is stored to (``_gelu_tanh_as``).

torch's own results are not reproducible bit for bit (Sleef on full vectors, libm on the tail
of each row); the differences are a few float32 ulp (measured by tests/test_activation.py,
reported by scripts/bench_activation.py).  Sources: Hendrycks & Gimpel, "GELUs" (arXiv
1606.08415);
diffusers ``GELU``/``GEGLU`` (``models/activations.py``).

Layout: the GEMM result ``y`` is a contiguous ``[M, N]`` (``linear_act``: the output itself,
activated in place in flat chunks; or ``[M, N]`` rows at a larger stride, whole rows per task,
when the plan places the output in a strided slice of a concatenation, as Flux's single-stream
``cat([attn, mlp], -1)``) or ``[M, 2N]`` workspace (``linear_glu``: rows in parallel,
each reading its two halves with unit stride and writing one contiguous output row).  bf16/fp16
pass as bits and convert in registers (rope's ``_load``/``_store``, rmsnorm's ``_round_as``);
kernels compile at plan time and are cached on disk (rope's cache dir).

Bias.  A float32 chain whose GEMM is ``addmm(bias, x, w)`` with a ``[N]`` bias and beta = alpha
= 1 runs ``mm(x, w)`` instead and the pass adds the bias (``act(y + bias)``; GLU: each half
plus its half of the bias), as Inductor does with an addmm that only pointwise ops read:
addmm first copies the bias into every row of its output and the GEMM then reads it back
(beta = 1), a write and a read of the whole result.  The float32 sum is the same operation;
only where the GEMM adds the bias differs (MKL adds its partial products to the copied bias),
within a few ulp.  SD1.5 GEGLU sizes, one thread: 0.93-0.96x Inductor before, 1.00-1.04x
after; SD3's feed-forward 1.00x eager before, 1.09x after (``scripts/bench_activation.py``).
16-bit chains keep the addmm: a 16-bit GEMM rounds ``acc + bias`` once.

Rounded chains.  Where a 16-bit model computes its GEMMs in float32 (``compute_in_float32``,
``patterns/upcast.py``) the chain is ``addmm(float32) -> _to_copy(16-bit) -> act``: the GEMM
(``mm``, its ``[N]`` float32 bias moved into the pass as above) writes float32 workspace and
one pass writes ``round(act(round(y + bias)))`` into the 16-bit output (:func:`cast_activate_cpu`):
the cast's own rounding, then the activation of the rounded value, so the values are the
unfused chain's, without its 16-bit intermediate (written by the cast, read by the activation).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.activation import (ACTS, LinearActFusion, LinearGluFusion, gemm_into,
                                           movable_bias)

from . import _numba, _vmath
from ._workers import compiles
from . import rmsnorm as _rms
from ._vmath import (_erff, _exp_normal, _expf, _fma, _silu,  # noqa: F401 (_expf: int8 kernels)
                     _tanhf)
from .rmsnorm import _round_as
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store

__all__ = ["why_not", "compile_kernels", "activate_cpu", "cast_activate_cpu", "glu_cpu",
           "LinearActCPU"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
_ACT_ID = {a: k for k, a in enumerate(ACTS)}
#: elements per parallel task of the in-place pass (64 KiB of float32: stays in L2)
_CHUNK = 16384

# float32 constants (as torch's kernels compute them: in double, then rounded)
_K_BETA = np.float32(2.0 ** 0.5 * (2.0 / np.pi ** 0.5) * 0.5)
_K_KAPPA = np.float32(0.044715)
_K_ALPHA = np.float32(2.0 ** -0.5)


# -- element functions (float32 in, float32 out; exp, tanh, erf and SiLU from ``_vmath``) -----

def _gelu_tanh(x):
    inner = _K_BETA * _fma(_K_KAPPA * (x * x), x, x)
    return (np.float32(0.5) * x) * (np.float32(1.0) + _tanhf(inner))


def _gelu_tanh_exp(x):
    """The tanh GELU as ``x / (1 + exp(-2z))`` (module docstring): float32 results only."""
    z = _K_BETA * _fma(_K_KAPPA * (x * x), x, x)
    # -2z clamped to _exp_normal's range: below -87, 1 + exp is 1 in float32; above 80 (x below
    # about -9.4) the result is under 2e-34 |x|, a normal float where 88 could give subnormals
    e = _exp_normal(min(max(np.float32(-2.0) * z, np.float32(-87.0)), np.float32(80.0)))
    return x / (np.float32(1.0) + e)


def _gelu_erf(x):
    return (x * np.float32(0.5)) * (np.float32(1.0) + _erff(x * _K_ALPHA))


def _gelu_tanh_as(a, x):
    """The tanh GELU of float32 ``x`` for a result of ``a``'s element type: jit only
    (:func:`_gelu_tanh_exp` for float32, :func:`_gelu_tanh`, torch's form, for 16-bit)."""
    raise NotImplementedError("_gelu_tanh_as is a numba helper: call it from a jitted kernel")


def _gelu_erf_by_type(a, x):
    """:func:`_gelu_erf` as an element function of :func:`_row_loops` (one form for every
    type)."""
    return _gelu_erf(x)


def _silu_by_type(a, x):
    """:func:`_vmath._silu` as an element function of :func:`_row_loops`."""
    return _silu(x)


# -- kernels (one pair per activation, so that the loops have no dispatch; module-level
# functions, not closures, so that numba can cache them on disk).  The inner loops run over
# slices (unit stride, bounds known), which is what lets LLVM vectorise them ----------------------

def _task_rows(t, total, chunk, n, ld):
    """The rows task ``t`` covers: ``(first, stop, offset, length, stride)``.  ``ld == 0``: one
    flat run of up to ``chunk`` elements; else rows of ``n`` at stride ``ld``, whole rows per
    task (``chunk`` a multiple of ``n``)."""
    if ld == 0:
        return 0, 1, t * chunk, min(chunk, total - t * chunk), 0
    return t * chunk // n, min(t * chunk + chunk, total) // n, 0, n, ld


def _row_loops(act):
    """``(run, cast_run, glu_row)`` for the element function ``act(a, v)`` (the activation of
    float32 ``v`` for a result stored to an array of ``a``'s element type), inlined into the
    kernels in numba's IR: ``run(b, bias)`` activates the slice ``b`` in place (plus ``bias``,
    or the empty bias); ``cast_run(y, bias, o)`` writes ``act`` of the float32 slice ``y`` (plus
    ``bias``) rounded to ``o``'s type into ``o``;
    ``glu_row(g, h, bg, bh, o, out)`` writes the GLU row ``o`` of ``out`` from the gate half
    ``g`` and the other half ``h`` (plus their bias halves ``bg``/``bh``, or empty ones).  The
    bias test is made once per row and picks one of two inner loops: as a conditional per
    element (even one LLVM could move out of the loop), the biased GEGLU pass ran 10% slower."""
    def run(b, bias):
        if bias.size:
            for e in range(b.size):
                _store(b, e, act(b, _load(b, e) + _load(bias, e)))
        else:
            for e in range(b.size):
                _store(b, e, act(b, _load(b, e)))

    def cast_run(y, bias, o):
        if bias.size:
            for e in range(o.size):
                _store(o, e, act(o, _round_as(o, _load(y, e) + _load(bias, e))))
        else:
            for e in range(o.size):
                _store(o, e, act(o, _round_as(o, _load(y, e))))

    def glu_row(g, h, bg, bh, o, out):
        if bg.size:
            for j in range(o.size):
                _store(o, j, _round_as(out, act(out, _load(g, j) + _load(bg, j)))
                       * (_load(h, j) + _load(bh, j)))
        else:
            for j in range(o.size):
                _store(o, j, _round_as(out, act(out, _load(g, j))) * _load(h, j))
    return run, cast_run, glu_row


_gelu_tanh_run, _cast_gelu_tanh_run, _glu_gelu_tanh_row = _row_loops(_gelu_tanh_as)
_gelu_run, _cast_gelu_run, _glu_gelu_row = _row_loops(_gelu_erf_by_type)
_silu_run, _cast_silu_run, _glu_silu_row = _row_loops(_silu_by_type)


def _inplace_gelu_tanh(buf, bias, total, chunk, n, ld):
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _gelu_tanh_run(buf[off + r * step:off + r * step + size], bias)


def _inplace_gelu(buf, bias, total, chunk, n, ld):
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _gelu_run(buf[off + r * step:off + r * step + size], bias)


def _inplace_silu(buf, bias, total, chunk, n, ld):
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _silu_run(buf[off + r * step:off + r * step + size], bias)


def _cast_gelu_tanh(y, bias, out, total, chunk, n, ld):
    # y: float32, contiguous: flat runs (r is 0 there) or rows of n; out: the same flat runs,
    # or rows at stride ld
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _cast_gelu_tanh_run(y[off + r * n:off + r * n + size],
                                bias, out[off + r * step:off + r * step + size])


def _cast_gelu(y, bias, out, total, chunk, n, ld):
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _cast_gelu_run(y[off + r * n:off + r * n + size], bias,
                           out[off + r * step:off + r * step + size])


def _cast_silu(y, bias, out, total, chunk, n, ld):
    for t in prange((total + chunk - 1) // chunk):
        r0, r1, off, size, step = _task_rows(t, total, chunk, n, ld)
        for r in range(r0, r1):
            _cast_silu_run(y[off + r * n:off + r * n + size], bias,
                           out[off + r * step:off + r * step + size])


def _glu_gelu_tanh(y, bias, out, rows, n, gate_off, other_off):
    bg, bh = bias[gate_off:gate_off + n], bias[other_off:other_off + n]  # empty stays empty
    for r in prange(rows):
        _glu_gelu_tanh_row(y[r * 2 * n + gate_off:r * 2 * n + gate_off + n],
                           y[r * 2 * n + other_off:r * 2 * n + other_off + n], bg, bh,
                           out[r * n:r * n + n], out)


def _glu_gelu(y, bias, out, rows, n, gate_off, other_off):
    bg, bh = bias[gate_off:gate_off + n], bias[other_off:other_off + n]
    for r in prange(rows):
        _glu_gelu_row(y[r * 2 * n + gate_off:r * 2 * n + gate_off + n],
                      y[r * 2 * n + other_off:r * 2 * n + other_off + n], bg, bh,
                      out[r * n:r * n + n], out)


def _glu_silu(y, bias, out, rows, n, gate_off, other_off):
    bg, bh = bias[gate_off:gate_off + n], bias[other_off:other_off + n]
    for r in prange(rows):
        _glu_silu_row(y[r * 2 * n + gate_off:r * 2 * n + gate_off + n],
                      y[r * 2 * n + other_off:r * 2 * n + other_off + n], bg, bh,
                      out[r * n:r * n + n], out)


_PY_KERNELS = {"gelu_tanh": (_inplace_gelu_tanh, _glu_gelu_tanh, _cast_gelu_tanh),
               "gelu": (_inplace_gelu, _glu_gelu, _cast_gelu),
               "silu": (_inplace_silu, _glu_silu, _cast_silu)}


def _register_helpers(numba) -> None:
    from numba.extending import register_jitable
    # the activations' maths as functions of their own, which LLVM inlines: inlined into
    # numba's IR, the in-place tanh GELU took 6.5 s to compile cold (1.1 s now) and ran no
    # faster (see _vmath for erf); the loops over rows are inlined there, so that LLVM sees the
    # slices' bounds
    from numba import types
    from numba.extending import overload
    register_jitable(_gelu_tanh)
    register_jitable(_gelu_tanh_exp)
    register_jitable(_gelu_erf)

    @overload(_gelu_tanh_as)
    def _gelu_tanh_as_impl(a, x):
        if a.dtype == types.float32:
            return lambda a, x: _gelu_tanh_exp(x)
        return lambda a, x: _gelu_tanh(x)

    for fn in (_gelu_erf_by_type, _silu_by_type):
        register_jitable(fn)
    for fn in (_task_rows, _gelu_tanh_run, _gelu_run, _silu_run, _glu_gelu_tanh_row,
               _glu_gelu_row, _glu_silu_row, _cast_gelu_tanh_run, _cast_gelu_run,
               _cast_silu_run):
        register_jitable(inline="always")(fn)


_register = _numba.once(globals(), _register_helpers,
                        requires=(_rms._register, _vmath.register))
# (the kernel options' error_model="numpy": no ZeroDivisionError check on the divisions, without
# which LLVM does not vectorise these loops: 5-10x slower)
_KERNELS = {act: _numba.once(globals(), lambda numba, fns=fns: tuple(
                _numba.njit(f) for f in fns), requires=(_register,))
            for act, fns in _PY_KERNELS.items()}


def _jit(act: str):
    """(in-place kernel, gated kernel, rounding kernel) for ``act`` (each compiles per dtype when
    first called)."""
    return _KERNELS[act]()


# -- launchers ----------------------------------------------------------------------------------

def _np(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor (16-bit floats as their bits; kept per
    tensor by :func:`rope._flat`)."""
    return _flat(t, t.numel())


def _bias_np(bias: torch.Tensor | None, like: np.ndarray, n: int, who: str) -> np.ndarray:
    """The bias as the kernels take it: a contiguous ``[n]`` array of the buffer's element
    type, or an empty one for none."""
    if bias is None:
        return _no_bias(like.dtype)
    b = _np(bias) if bias.dim() == 1 and bias.is_contiguous() else None
    if b is None or bias.shape[0] != n or b.dtype != like.dtype:
        raise ValueError(f"{who}: bias must be a contiguous [{n}] tensor of the buffer's dtype, "
                         f"got {tuple(bias.shape)} {bias.dtype} strides {bias.stride()}")
    return b


_EMPTY: dict = {}


def _no_bias(dtype) -> np.ndarray:
    """The empty bias array of a numpy element type (one per type, made once)."""
    e = _EMPTY.get(dtype)
    if e is None:
        e = _EMPTY[dtype] = np.zeros(0, dtype)
    return e


def activate_cpu(buf: torch.Tensor, act: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``buf = act(buf)`` in place (CPU float32/bf16/fp16), or ``act(buf + bias)`` with a
    ``[N]`` bias broadcast over the rows of a 2-D ``buf`` (float32 sum, then the activation);
    returns ``buf``.  ``buf`` is contiguous, or 2-D with unit column stride and rows at any
    stride (a part of a concatenation that the plan placed in a strided slice:
    ``strided_out``)."""
    inplace = _jit(act)[0]
    _set_threads()
    total = buf.numel()
    if not total:
        return buf
    if buf.is_contiguous() and bias is None:
        flat = _np(buf)
        inplace(flat, _no_bias(flat.dtype), total, _CHUNK, 1, 0)
        return buf
    if buf.dim() != 2 or buf.stride(1) != 1 or buf.stride(0) < buf.shape[1]:
        raise ValueError(f"activate_cpu: a strided buffer (or one with a bias) must be 2-D with "
                         f"unit column stride and rows apart by at least a row, got shape "
                         f"{tuple(buf.shape)} strides {buf.stride()}")
    m, n = buf.shape
    ld = buf.stride(0)
    flat = _flat(buf, (m - 1) * ld + n)
    inplace(flat, _bias_np(bias, flat, n, "activate_cpu"), total, max(1, _CHUNK // n) * n, n,
            ld)
    return buf


def glu_cpu(y: torch.Tensor, out: torch.Tensor, act: str, gate: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = round(act(y[:, gate half])) * y[:, other half]`` for contiguous ``y`` ``[M, 2N]``
    and ``out`` ``[M, N]`` of one dtype that do not overlap, with ``y + bias`` instead of ``y``
    when a ``[2N]`` bias is given (float32 sums); returns ``out``."""
    glu = _jit(act)[1]
    _set_threads()
    m, n = out.shape
    if out.numel():
        yf = _np(y)
        glu(yf, _bias_np(bias, yf, 2 * n, "glu_cpu"), _np(out), m, n, gate * n, (1 - gate) * n)
    return out


def cast_activate_cpu(y: torch.Tensor, out: torch.Tensor, act: str,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = act(round(y))`` (``act(round(y + bias))`` with a ``[N]`` float32 bias over the
    columns): ``y`` a contiguous float32 ``[M, N]``, ``round`` to ``out``'s 16-bit dtype, the
    activation of the rounded value in float32, rounded again.  ``out`` is ``[M, N]``,
    contiguous or with rows at any stride (unit column stride), overlapping no input; returns
    ``out``."""
    cast = _jit(act)[2]
    _set_threads()
    if y.dtype != torch.float32 or not y.is_contiguous() or y.dim() != 2 or \
            out.dtype not in (torch.bfloat16, torch.float16) or out.shape != y.shape or \
            out.stride(-1) != 1 or out.stride(0) < out.shape[1]:
        raise ValueError(f"cast_activate_cpu: y must be a contiguous 2-D float32 tensor and out "
                         f"a 16-bit one of its shape with unit column stride, got y "
                         f"{tuple(y.shape)} {y.dtype} strides {y.stride()}, out "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    m, n = y.shape
    if not y.numel():
        return out
    yf = _np(y)
    if out.is_contiguous() and bias is None:
        cast(yf, _no_bias(yf.dtype), _np(out), m * n, _CHUNK, 1, 0)
        return out
    ld = out.stride(0)
    cast(yf, _bias_np(bias, yf, n, "cast_activate_cpu"), _flat(out, (m - 1) * ld + n), m * n,
         max(1, _CHUNK // n) * n, n, ld)
    return out


def why_not(x: Any, w: Any, bias: Any, out_dtype: Any, act: Any, gated: Any) -> str | None:
    """None when the fused step computes the chain for tensors with these metadata
    (``fxbackend.TensorMeta``), else a short reason.  Never raises.  Handled: 2-D x and w on
    the CPU of one dtype float32/bf16/fp16 (any strides: the GEMM is torch's), any bias torch's
    addmm takes, the activations of ``ACTS``; not gated, float32 x, w and bias with a 16-bit
    output (the GEMM's result rounded: ``cast_activate_cpu``)."""
    try:
        if act not in _ACT_ID:
            return f"activation {act!r} (one of {ACTS})"
        rounded = isinstance(x, fxbackend.TensorMeta) and x.dtype == torch.float32 and \
            out_dtype in (torch.bfloat16, torch.float16)
        if rounded and gated:
            return "a gated chain rounding its float32 GEMM result (no kernel for it)"
        gemm_dtype = torch.float32 if rounded else out_dtype
        for label, m in (("x", x), ("w", w), ("bias", bias)):
            if m is None and label == "bias":
                continue
            if not isinstance(m, fxbackend.TensorMeta):
                return f"{label} is not a tensor"
            if m.device.type != "cpu":
                return f"{label} on {m.device} (the CPU kernel)"
            if m.dtype != gemm_dtype:
                return f"{label} dtype {m.dtype} differs from the GEMM's {gemm_dtype}"
        if out_dtype not in _NP_OF:
            return f"dtype {out_dtype} (float32, bfloat16 or float16)"
        if len(x.shape) != 2 or len(w.shape) != 2:
            return "x and w must be 2-D"
        if act == "gelu" and not gated:
            # torch's erf GELU on a contiguous tensor (oneDNN's) is faster than this pass's
            # erf: 0.41 vs 0.82 ns per float at one thread (0.64 vs 0.77 with _exp_normal).
            # GEGLU's gate is a strided half, which torch runs through its vectorised erf:
            # there the pass is ahead of Inductor's and eager's (scripts/bench_activation.py)
            return "erf GELU: torch's erf GELU (oneDNN) is faster on the CPU than this kernel's"
        return None
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


@compiles
def compile_kernels(dtype: torch.dtype, act: str, gated: bool | None = None,
                    rounded: bool = False) -> None:
    """Compile (or load from the disk cache) the kernels for ``dtype`` and ``act`` by calls
    with no elements on exactly the types a launch passes: the in-place one (``gated``
    False), the gated one (True) or both (None); with ``rounded``, the one that rounds a
    float32 GEMM result to the 16-bit ``dtype`` instead.  A cold compile of one takes seconds
    (the in-place tanh GELU about 6 s here), so plans compile only what they launch.
    Thread-safe."""
    inplace, glu, cast = _jit(act)
    z = np.zeros(0, _NP_OF[dtype])
    with _compile_lock:
        if rounded:
            z32 = np.zeros(0, np.float32)
            cast(z32, z32, z, 0, _CHUNK, 1, 0)
            return
        if gated is not True:
            inplace(z, z, 0, _CHUNK, 1, 0)
        if gated is not False:
            glu(z, z, z, 0, 0, 0, 0)


class LinearActCPU:
    """The kernel behind ``linear_act`` / ``linear_glu`` on the CPU (interface:
    ``fxbackend.patterns.activation``): torch's GEMM into ``y``, then one numba pass."""

    name = "linear_act_cpu"
    #: ``linear_act`` writes through any row stride of its output (``activate_cpu``)
    strided_out = True

    def why_not(self, x, w, bias, out_dtype, act, gated):
        return why_not(x, w, bias, out_dtype, act, gated)

    def compile(self, x, w, bias, out_dtype, act, gated):
        compile_kernels(out_dtype, act, bool(gated), rounded=x.dtype != out_dtype)

    def run(self, x, w, bias, y, out, *, act, gate, beta, alpha):
        if y.dtype != out.dtype:  # a rounded chain: y float32 workspace, out 16-bit
            if _bias_in_pass(bias, y, beta, alpha):
                gemm_into(y, x, w, None)
                cast_activate_cpu(y, out, act, bias)
            else:
                gemm_into(y, x, w, bias, beta, alpha)
                cast_activate_cpu(y, out, act)
            return
        if _bias_in_pass(bias, y, beta, alpha):
            # mm, then the bias added in the pass (as Inductor does with an addmm whose result
            # only pointwise ops read): no copy of the bias into y before the GEMM, no read of
            # it by a beta=1 GEMM; float32 only (a 16-bit GEMM rounds acc + bias once)
            gemm_into(y, x, w, None)
            if gate is None:
                activate_cpu(out, act, bias)
            else:
                glu_cpu(y, out, act, gate, bias)
            return
        gemm_into(y, x, w, bias, beta, alpha)
        if gate is None:
            activate_cpu(out, act)
        else:
            glu_cpu(y, out, act, gate)


def _bias_in_pass(bias, y, beta, alpha) -> bool:
    """Whether the bias of ``addmm(bias, x, w)`` into ``y`` goes into the activation pass
    instead: float32, a contiguous ``[N]`` bias over the columns, beta = alpha = 1."""
    return bias is not None and y.dim() == 2 and \
        movable_bias(y.dtype, bias.dtype, bias.shape, bias.is_contiguous(), y.shape[1], beta,
                     alpha)


_IMPL = LinearActCPU()
fxbackend.register_fusion("cpu", LinearActFusion(_IMPL))
fxbackend.register_fusion("cpu", LinearGluFusion(_IMPL))
