"""Activations after a linear on CUDA: the GEMM through torch (``addmm``/``mm`` with ``out=``, on
the current stream) and one Triton pass over its result, registered at the end as the kernels
of the ``linear_act`` and ``linear_glu`` fusion rules for "cuda" (:class:`LinearActCUDA`, see
``patterns/activation.py``).

Maths (float32 arithmetic, no FMA contraction: launches pass ``enable_fp_fusion=False``)::

    gelu_tanh(x) = (0.5 * x) * (1 + tanh(kBeta * (x + 0.044715 * (x * x * x))))
    gelu(x)      = (x * 0.5) * (1 + erf(x * (1 / sqrt(2))))
    silu(x)      = x / (1 + exp(-x))
    gated:  out  = round(round(act(y[gate half])) * y[other half])

as torch's CUDA kernels (``aten/src/ATen/native/cuda/ActivationGeluKernel.cu``,
``ActivationSiluKernel.cu``) write them; ``erf`` is libdevice's through ``tl.math.erf``;
``tanh`` is written out as in ``cpu_kernels/activation.py`` (Cephes ``tanhf``: odd polynomial
below |u| = 0.625, ``1 - 2 / (exp(2|u|) + 1)`` above), since Triton has no portable ``tanh``
that its interpreter also runs.  Differences against torch are a few float32 ulp.

``torch._addmm_activation(bias, x, w, use_gelu=True)`` (cuBLASLt's GELU epilogue) would save
the pass entirely but rounds once (16-bit: the chain rounds the GEMM result and then the
activation) and uses cuBLASLt's own tanh; it is not used, so results keep the chain's meaning.

Layout: ``linear_act`` activates the contiguous GEMM result in place (flat blocks of BLOCK
elements); ``linear_glu`` reads a contiguous ``[M, 2N]`` workspace and writes ``[M, N]`` (a 2-D
grid of rows by BLOCK columns).  Importing this module does not import Triton
(``rope.lazy_kernel``).
"""
from __future__ import annotations

from typing import Any

import torch

import fxbackend
from fxbackend.cuda_kernels.rope import DTYPES, _cdiv, _launch_on, lazy_kernel
from fxbackend.patterns.activation import ACTS, LinearActFusion, LinearGluFusion, gemm_into

__all__ = ["why_not", "activate_triton", "glu_triton", "LinearActCUDA"]

#: triton.language, bound by ``rope.lazy_kernel`` on first use
tl: Any = None
BLOCK = 1024
NUM_WARPS = 4
_ACT_ID = {a: k for k, a in enumerate(ACTS)}


def _act_body(x, ACT: tl.constexpr):
    """float32 ``x`` -> act(x) (``ACT``: index in ``ACTS``), a ``@triton.jit`` helper of both
    kernels.  Constants are float32(sqrt(2) * 2 / sqrt(pi) * 0.5) and float32(1 / sqrt(2))."""
    if ACT == 0:
        u = 0.7978845834732056 * (x + 0.044715 * (x * x * x))
        a = tl.abs(u)
        z = u * u
        small = ((((-5.70498872745E-3 * z + 2.06390887954E-2) * z - 5.37397155531E-2) * z
                  + 1.33314422036E-1) * z - 3.33332819422E-1) * z * u + u
        e = tl.exp(tl.minimum(a + a, 88.0))
        big = 1.0 - 2.0 / (e + 1.0)
        big = tl.where(u >= 0.0, big, -big)
        t = tl.where(a <= 0.625, small, big)
        return (0.5 * x) * (1.0 + t)
    elif ACT == 1:
        return (x * 0.5) * (1.0 + tl.math.erf(x * 0.7071067690849304))
    else:
        return x / (1.0 + tl.exp(-x))


def _inplace_kernel(buf_ptr, total, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    x = tl.load(buf_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _act(x, ACT)
    tl.store(buf_ptr + offs, y.to(buf_ptr.dtype.element_ty), mask=mask)


def _glu_kernel(y_ptr, out_ptr, n, gate_off, other_off, ACT: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    base = y_ptr + row * 2 * n
    g = tl.load(base + gate_off + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(base + other_off + cols, mask=mask, other=0.0).to(tl.float32)
    a = _act(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)  # the activation's rounding
    tl.store(out_ptr + row * n + cols, (a * h).to(out_ptr.dtype.element_ty), mask=mask)


#: the activation helper the kernels call (jitted in this module by ``rope.lazy_kernel``)
_act = _act_body
_inplace = lazy_kernel(_inplace_kernel, helpers=("_act",))
_glu = lazy_kernel(_glu_kernel, helpers=("_act",))


def _kernels():
    """The jitted (in-place, gated) kernels."""
    return _inplace(), _glu()


def activate_triton(buf: torch.Tensor, act: str) -> torch.Tensor:
    """``buf = act(buf)`` in place (contiguous; CUDA, or CPU under TRITON_INTERPRET=1)."""
    inplace, _ = _kernels()
    total = buf.numel()
    if total:
        _launch_on(buf.device, inplace[(_cdiv(total, BLOCK),)],
                   (buf, total), dict(ACT=_ACT_ID[act], BLOCK=BLOCK, num_warps=NUM_WARPS,
                                      enable_fp_fusion=False))
    return buf


def glu_triton(y: torch.Tensor, out: torch.Tensor, act: str, gate: int) -> torch.Tensor:
    """``out = round(act(y[:, gate half])) * y[:, other half]`` (contiguous ``[M, 2N]`` and
    ``[M, N]`` of one dtype, not overlapping)."""
    _, glu = _kernels()
    m, n = out.shape
    if out.numel():
        _launch_on(out.device, glu[(m, _cdiv(n, BLOCK))],
                   (y, out, n, gate * n, (1 - gate) * n),
                   dict(ACT=_ACT_ID[act], BLOCK=BLOCK, num_warps=NUM_WARPS,
                        enable_fp_fusion=False))
    return out



def why_not(x: Any, w: Any, bias: Any, out_dtype: Any, act: Any, gated: Any) -> str | None:
    """None when the fused step computes the chain for these metadata, else a reason; never
    raises.  Handled: 2-D x and w on one CUDA device, one dtype float32/bf16/fp16, any bias
    torch's addmm takes, the activations of ``ACTS``."""
    try:
        if act not in _ACT_ID:
            return f"activation {act!r} (one of {ACTS})"
        if out_dtype not in DTYPES:
            return f"dtype {out_dtype} (float32, bfloat16 or float16)"
        for label, m in (("x", x), ("w", w), ("bias", bias)):
            if m is None and label == "bias":
                continue
            if not isinstance(m, fxbackend.TensorMeta):
                return f"{label} is not a tensor"
            if m.device.type != "cuda":
                return f"{label} on {m.device} (the CUDA kernel)"
            if m.dtype != out_dtype:
                return f"{label} dtype {m.dtype} differs from the output's {out_dtype}"
        if len(x.shape) != 2 or len(w.shape) != 2:
            return "x and w must be 2-D"
        return None
    except Exception as exc:  # never raise
        return f"metadata not understood ({type(exc).__name__}: {exc})"


class LinearActCUDA:
    """The kernel behind ``linear_act`` / ``linear_glu`` on CUDA (interface:
    ``fxbackend.patterns.activation``): torch's GEMM into ``y`` on the current stream, then one
    Triton pass."""

    name = "linear_act_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, x, w, bias, out_dtype, act, gated):
        return why_not(x, w, bias, out_dtype, act, gated)

    def run(self, x, w, bias, y, out, *, act, gate, beta, alpha):
        gemm_into(y, x, w, bias, beta, alpha)
        if gate is None:
            activate_triton(out, act)
        else:
            glu_triton(y, out, act, gate)


_IMPL = LinearActCUDA()
fxbackend.register_fusion("cuda", LinearActFusion(_IMPL))
fxbackend.register_fusion("cuda", LinearGluFusion(_IMPL))
