"""Scale -> cast to fp16/bf16 on the CPU: a numba kernel computing ``scale_cast_reference``
(``patterns/scale_cast.py``) in one pass, registered at the end as the kernel of the
``scale_cast`` fusion rule for "cpu" (:class:`ScaleCastCPU`).

Maths (per element; T = x's dtype, O = out's half dtype; round = to nearest even)::

    out[i] = round_O(round_T(float32(x[i]) * float32(c)))

which is torch's ``mul`` by a scalar (float32 maths, rounded to T; the identity for float32 x)
then the cast: bit-exact.  x and out are dense with the same strides, so both are flat arrays
in the same element order; bf16/fp16 pass as int16/uint16 bits converted in registers
(``cpu_kernels/rope.py``); chunks of elements run in parallel (``prange``).  Compiled at plan
time, cached on disk in rope's cache dir.
"""
from __future__ import annotations

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.scale_cast import ScaleCastFusion, is_dense

from . import _numba
from ._workers import compiles
from . import rmsnorm as _rms
from .rmsnorm import _round_as
from .rope import _NP_OF, _compile_lock, _flat, _load, _set_threads, _store

__all__ = ["ScaleCastCPU", "scale_cast_cpu", "why_not", "compile_kernels"]

#: ``numba.prange`` once numba is imported (see ``cpu_kernels/_numba.py``); ``range`` until then
prange = range
_CHUNK = 16384  # elements per task: 64 KB of float32 input
#: the jitted kernel (created once; it compiles per dtype combination when first called)
_jit = _numba.once(globals(), lambda numba: _numba.njit(_scale_cast_kernel),
                   requires=(_rms._register,))  # _load/_store/_round_as registered


def _scale_cast_kernel(x, out, c, chunk):
    n = x.shape[0]
    for task in prange((n + chunk - 1) // chunk):
        i0 = np.int64(task) * chunk
        i1 = min(n, i0 + chunk)
        xr = x[i0:i1]
        orow = out[i0:i1]
        for e in range(i1 - i0):
            _store(orow, e, _round_as(xr, _load(xr, e) * c))


def why_not(x, out) -> str | None:
    """None when the kernel computes ``scale_cast_reference`` from x into out (metadata), else
    a short reason.  Never raises."""
    try:
        if not all(isinstance(m, fxbackend.TensorMeta) for m in (x, out)):
            return "inputs are not tensors"
        if x.device.type != "cpu" or out.device.type != "cpu":
            return "not on the CPU"
        if x.dtype not in _NP_OF or out.dtype not in (torch.bfloat16, torch.float16):
            return f"dtypes {x.dtype} -> {out.dtype}"
        if tuple(x.shape) != tuple(out.shape) or tuple(x.stride) != tuple(out.stride) or \
                not is_dense(x.shape, x.stride):
            return "x and out must be dense with the same strides"
        return None
    except Exception as exc:  # never raise
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _launch(x, out, c: float) -> None:
    n = out.numel()
    if n == 0:
        return
    fn = _jit()
    threads = _set_threads()
    chunk = max(1024, min(_CHUNK, -(-n // threads)))
    fn(_flat(x, n), _flat(out, n), np.float32(c), chunk)


def scale_cast_cpu(x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor:
    """``out = (x * c).to(out.dtype)`` with the numba kernel; ValueError for what it does not
    handle (:func:`why_not`)."""
    why = why_not(fxbackend.TensorMeta.of(x), fxbackend.TensorMeta.of(out))
    if why is not None:
        raise ValueError(f"scale_cast_cpu: unsupported input: {why}")
    _launch(x, out, c)
    return out


@compiles
def compile_kernels(x_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    fn = _jit()
    with _compile_lock:
        fn(np.zeros(0, _NP_OF[x_dtype]), np.zeros(0, _NP_OF[out_dtype]), np.float32(1.0), 1024)


class ScaleCastCPU:
    """The numba kernel behind the ``scale_cast`` rule on the CPU (interface:
    ``fxbackend.patterns.scale_cast.ScaleCastFusion``)."""

    name = "scale_cast_cpu"

    def why_not(self, x, out):
        return why_not(x, out)

    def compile(self, x, out):
        compile_kernels(x.dtype, out.dtype)

    def run(self, x, out, *, c):
        _launch(x, out, c)


fxbackend.register_fusion("cpu", ScaleCastFusion(ScaleCastCPU()))
