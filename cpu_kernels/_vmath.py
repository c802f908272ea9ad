"""Float32 transcendental functions for the numba kernels, written in plain arithmetic so that
LLVM vectorises the loops that call them (numba has no vector math library without Intel
SVML; a scalar libm call per element made a pass several times slower than torch's Sleef code).

Every polynomial is evaluated in Horner form with explicit fused multiply-adds (``_fma``: LLVM's
``llvm.fma.f32``, one rounding; an FMA instruction on every x86-64 CPU with AVX2), as torch's
``Vectorized<float>`` code does: half the instructions of separate multiplies and adds and a
shorter dependency chain (the SiLU and GELU passes ran about 1.5x faster than without).  The
placement of the FMAs is fixed here, not left to the compiler, so a kernel gives the same bits
on every run and thread count.

- :func:`_expf`: Cephes ``expf`` (range reduction by ln 2 in two parts, a degree-6 polynomial,
  2^n applied as two factors so that overflow rounds as IEEE does), within 2 ulp of torch's
  Sleef ``exp``; 0 instead of a result under exp(-87) (1.6e-38): no step here works on
  subnormal floats, which x86 CPUs handle in microcode, per lane, tens of times slower
  (``exp`` feeds ``1 + e``, ``1 - e * ...`` or ``x / (1 + e)``, where such an ``e`` does not
  change the float32 result); NaN gives NaN;
- :func:`_exp_normal`: the same ``expf`` for arguments in [-87, 88] only (erf's ``-x * x``,
  tanh's ``2|u|`` clamped at 88): no clamps, no select and 2^n as one factor (always a normal
  float there), the same bits as :func:`_expf` on that range (erf and tanh GELU passes ran
  1.1-1.2x faster than with :func:`_expf`);
- :func:`_tanhf`: Cephes ``tanhf``, an odd polynomial below |u| = 0.625 and
  ``1 - 2 / (exp(2|u|) + 1)`` above, both computed and selected so a loop has no branch;
  about 1-2 ulp;
- :func:`_erff`: Abramowitz-Stegun 7.1.26 with the constants of torch's
  ``Vectorized<float>::erf`` (absolute error about 1.5e-7 against the true erf);
- :func:`_silu`: ``y / (1 + exp(-y))`` as torch's CPU kernel writes it.

Sources: S. Moshier, Cephes ``expf.c`` / ``tanhf.c``; Abramowitz & Stegun 7.1.26; torch
``aten/src/ATen/cpu/vec/vec512/vec512_float.h`` and ``native/cpu/Activation.cpp``.

These are jit-only helpers: a kernel module lists :data:`register` among the ``requires`` of its
``_numba.once`` getter and calls them from its kernels.
"""
from __future__ import annotations

import numpy as np

from . import _numba

__all__ = ["register", "_fma", "_expf", "_exp_normal", "_tanhf", "_erff", "_silu"]


def _fma(a, b, c):
    """``a * b + c`` with one rounding (float32): jit only."""
    raise NotImplementedError("_fma is a numba helper: call it from a jitted kernel")


_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
#: below this, exp gives 0 instead of a subnormal: arithmetic on subnormals takes a microcode
#: assist per vector lane on x86 (an erf GELU pass over values beyond |x| = 9.3 ran 8x slower)
_EXP_MIN = np.float32(-87.0)


def _exp_poly(c):
    """``(p, n)`` with exp(c) = p * 2^n for float32 ``c`` in [-87, 89] (Cephes expf: n the
    nearest integer to c / ln 2, ``p`` the degree-6 polynomial of the rest)."""
    fx = np.floor(c * _LOG2E + np.float32(0.5))
    r = c - fx * _LN2_HI
    r = r - fx * _LN2_LO
    p = _fma(_P0, r, _P1)
    p = _fma(p, r, _P2)
    p = _fma(p, r, _P3)
    p = _fma(p, r, _P4)
    p = _fma(p, r, _P5)
    return _fma(p, r * r, r) + np.float32(1.0), np.int32(fx)


def _expf(a):
    """exp(a) for float32 ``a`` (Cephes expf, FMA Horner); 0 below ``_EXP_MIN`` (where the
    true result is under 1.7e-38, near the smallest normal float), inf above 88.72; NaN gives
    NaN."""
    p, n = _exp_poly(min(max(a, _EXP_MIN), np.float32(89.0)))  # above 88.72: inf after scaling
    h = n >> np.int32(1)  # 2^n as 2^h * 2^(n-h): both factors are normal floats
    s1 = np.uint32((h + np.int32(127)) << np.int32(23)).view(np.float32)
    s2 = np.uint32((n - h + np.int32(127)) << np.int32(23)).view(np.float32)
    e = p * s1 * s2
    return np.float32(0.0) if a < _EXP_MIN else e


def _exp_normal(a):
    """exp(a) for float32 ``a`` in [-87, 88] only (outside it, a wrong number; NaN gives NaN):
    :func:`_expf`'s bits there without its clamps and select; 2^n, n in [-126, 127], is one
    normal float."""
    p, n = _exp_poly(a)
    return p * np.uint32((n + np.int32(127)) << np.int32(23)).view(np.float32)


def _tanhf(u):
    """tanh(u) for float32 ``u`` (Cephes tanhf, branch-free)."""
    a = abs(u)
    z = u * u
    p = _fma(np.float32(-5.70498872745e-3), z, np.float32(2.06390887954e-2))
    p = _fma(p, z, np.float32(-5.37397155531e-2))
    p = _fma(p, z, np.float32(1.33314422036e-1))
    p = _fma(p, z, np.float32(-3.33332819422e-1))
    small = _fma(p * z, u, u)
    e = _exp_normal(min(a + a, np.float32(88.0)))
    big = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    big = big if u >= np.float32(0.0) else -big
    return small if a <= np.float32(0.625) else big


def _erff(x):
    """erf(x) for float32 ``x`` (Abramowitz-Stegun 7.1.26, torch's constants)."""
    a = min(abs(x), np.float32(9.0))  # erf(9) is 1 in float32; beyond, no subnormal steps
    t = np.float32(1.0) / _fma(np.float32(0.3275911), a, np.float32(1.0))
    r = _fma(np.float32(1.061405429), t, np.float32(-1.453152027))
    r = _fma(r, t, np.float32(1.421413741))
    r = _fma(r, t, np.float32(-0.284496736))
    r = _fma(r, t, np.float32(0.254829592))
    e = _exp_normal(-(a * a))  # -81 <= -a * a <= 0
    v = _fma(-(e * t), r, np.float32(1.0))
    return v if x >= np.float32(0.0) else -v


def _silu(y):
    """y * sigmoid(y), written as torch's CPU kernel does: ``y / (1 + exp(-y))``."""
    return y / (np.float32(1.0) + _expf(-y))


def _build(numba) -> None:
    from numba import types
    from numba.extending import intrinsic, overload, register_jitable

    @intrinsic
    def fma32(typingctx, a, b, c):
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            return builder.fma(*args)  # llvm.fma.f32: one rounding
        return sig, codegen

    overload(_fma, strict=False)(
        lambda a, b, c: lambda a, b, c: fma32(np.float32(a), np.float32(b), np.float32(c)))
    # functions of their own, which LLVM inlines: inlined into numba's IR instead, a tanh GELU
    # kernel took seconds longer to compile and ran no faster.  So does erf now (inlined in
    # numba's IR it was 8% faster with the clamped exp; with _exp_normal it is level, and the
    # GLU kernel with its two inner loops compiled in 2.5 s instead of 0.9)
    for fn in (_exp_poly, _expf, _exp_normal, _tanhf, _silu):
        register_jitable(fn)
    register_jitable(_erff)


#: registers the helpers with numba once (a ``requires`` entry of the kernels' getters)
register = _numba.once(globals(), _build)
