"""Scale -> cast to fp16/bf16 on CUDA: a Triton kernel computing ``scale_cast_reference``
(``patterns/scale_cast.py``), registered at the end as the kernel of the ``scale_cast`` fusion
rule for "cuda" (:class:`ScaleCastCUDA`).

Maths (per element; T = x's dtype, O = out's half dtype)::

    out[i] = round_O(round_T(float32(x[i]) * float32(c)))        (bit-exact)

x and out are dense with the same strides: both are flat arrays over ``numel`` elements from
their storage offsets.  One program per BLOCK elements.  Importing this module does not import
Triton (``rope.lazy_kernel``).
"""
from __future__ import annotations

from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels.rope import DTYPES, _cdiv, _launch_on, lazy_kernel
from fxbackend.patterns.scale_cast import ScaleCastFusion, is_dense

__all__ = ["scale_cast_triton", "ScaleCastCUDA", "why_not"]

BLOCK = 4096
NUM_WARPS = 8
tl: Any = None


def _scale_cast_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    y = (x * c).to(x_ptr.dtype.element_ty)  # round to T (a no-op for float32 x)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


_kernel = lazy_kernel(_scale_cast_kernel)


def why_not(x: Any, out: Any) -> str | None:
    """None when :func:`scale_cast_triton` takes these metadata; else a reason.  Never raises."""
    try:
        if not all(isinstance(m, TensorMeta) for m in (x, out)):
            return "inputs are not tensors"
        if x.device.type != "cuda" or out.device != x.device:
            return "not on one CUDA device"
        if x.dtype not in DTYPES or out.dtype not in (torch.bfloat16, torch.float16):
            return f"dtypes {x.dtype} -> {out.dtype}"
        if x.is_symbolic or tuple(x.shape) != tuple(out.shape) or \
                tuple(x.stride) != tuple(out.stride) or not is_dense(x.shape, x.stride):
            return "x and out must be dense with the same strides"
        return None
    except Exception as exc:  # never raise
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _flat(t: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(t, (t.numel(),), (1,))


def scale_cast_triton(x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor:
    """``out = (x * c).to(out.dtype)`` with the Triton kernel (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``); ValueError for what it does not take."""
    mx, mo = TensorMeta.of(x), TensorMeta.of(out)
    why = why_not(mx, mo) if x.device.type == "cuda" else why_not(
        *(TensorMeta(m.shape, m.stride, m.dtype, torch.device("cuda")) for m in (mx, mo)))
    if why is not None:
        raise ValueError(f"scale_cast_triton: unsupported input: {why}")
    n = x.numel()
    if n:
        _launch_on(x.device, _kernel()[(_cdiv(n, BLOCK),)], (_flat(x), _flat(out), n,
                   float(c)), dict(BLOCK=BLOCK, num_warps=NUM_WARPS))
    return out


class ScaleCastCUDA:
    """The Triton kernel behind the ``scale_cast`` rule on CUDA."""

    name = "scale_cast_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, x, out):
        return why_not(x, out)

    def run(self, x, out, *, c):
        scale_cast_triton(x, c, out)


fxbackend.register_fusion("cuda", ScaleCastFusion(ScaleCastCUDA()))
