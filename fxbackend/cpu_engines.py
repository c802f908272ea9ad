"""torch's CPU GEMM engines that the CPU profile (``fxbackend.cpu``) chooses between: each
one's availability and exactness check on this machine, and its call.

- ``torch._int_mm``: :func:`int_mm_exact` (its int8 kernels saturate without VNNI);
- fbgemm's quantized linear with a prepacked per-channel int8 weight (``quantized_linear_*``):
  float codes in, the int32 product's float32 values out;
- oneDNN's quantized linear (``onednn_linear_*``): activation codes shifted to unsigned bytes,
  the int32 product's float32 values out;
- oneDNN's float32 linear (``onednn_float32_linear*``): the ``float32_gemm: onednn`` path.

The prepacked engines' AVX2 kernels add two u8 x s8 products in saturating 16 bits, so the
weights they take have 7-bit codes (``fxbackend.cpu.int8_weight_max``).  Which engine runs is
the profile's decision, never this module's.
"""
from __future__ import annotations

import functools
import threading

import torch

__all__ = ["int_mm_exact", "quantized_linear_available", "quantized_linear_pack",
           "quantized_linear_gemm", "onednn_float32_linear_available", "onednn_float32_linear",
           "onednn_linear_available", "onednn_linear_pack", "onednn_linear_gemm"]

@functools.lru_cache(maxsize=None)
def int_mm_exact() -> bool:
    """True when ``torch._int_mm`` on this CPU gives the exact int32 product: a small product
    at the extremes of int8, checked once per process (torch reads its ISA limits at start).
    oneDNN's int8 kernels without VNNI (``ONEDNN_MAX_CPU_ISA=AVX2`` on a CPU with VNNI) add
    pairs of u8 x s8 products in saturating 16 bits and are off by up to ~10^5 there; the INT8
    kernels then take an exact path instead (a prepacked engine with 7-bit weights, or
    float64), under an ``FXB_CPU_PROFILE`` override too."""
    g = torch.Generator().manual_seed(0)
    qx = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    qw = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    qx[0], qw[0] = 127, 127  # pair sums of 2 * 127 * 127 (+ the u8 shift) overflow 16 bits
    qx[1], qw[1] = -128, -128
    try:
        got = torch._int_mm(qx, qw.t())
    except RuntimeError:
        return False
    return torch.equal(got.long(), qx.long() @ qw.long().t())


def quantized_linear_available() -> bool:
    """True when torch has the fbgemm quantized-linear engine (x86-64 builds do)."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines
    except Exception:
        return False


def quantized_linear_pack(qw: torch.Tensor):
    """The int8 weight ``qw`` ``[N, K]`` prepacked for :func:`quantized_linear_gemm` (the
    fbgemm engine, per-channel scales 1.0 and zero points 0: the product stays in integers)."""
    import warnings
    n = qw.shape[0]
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao;
        warnings.simplefilter("ignore")  # the engine still takes them in this torch
        q = torch._make_per_channel_quantized_tensor(
            qw.contiguous(), torch.ones(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.int64), 0)
        with _engine_lock:
            before = torch.backends.quantized.engine
            torch.backends.quantized.engine = "fbgemm"
            try:
                return torch.ops.quantized.linear_prepack(q, None)
            finally:
                torch.backends.quantized.engine = before


_engine_lock = threading.Lock()


def quantized_linear_gemm(qx: torch.Tensor, packed) -> torch.Tensor:
    """``qx @ qw.T`` through the prepacked ``qw``, as a new float32 ``[M, N]`` tensor holding
    the int32 sums' float32 values (the int32 accumulator rounded to float32, as the epilogue
    would round it): the codes as floats, quantized by the engine with scale 1 and zero point
    128 (exact: every code is an integer in [-128, 127]), and the engine's float32 output
    taken as it is (no copy)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        qx.to(torch.float32), 1.0, 128, packed)


@functools.lru_cache(maxsize=None)
def onednn_float32_linear_available() -> bool:
    """True when torch has oneDNN's float32 linear (``torch.ops.mkldnn._linear_pointwise``) and
    it agrees with ``torch.addmm`` here to float32 rounding (a small product, checked once per
    process)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((33, 64), (40, 64), (40,)))
    try:
        got = op(x, w, b, "none", [], "")
    except RuntimeError:
        return False
    return torch.allclose(got, torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-5)


def onednn_float32_linear(x: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` (float32 ``x [M, K]``, contiguous ``w [N, K]``, ``bias [N]`` or None)
    by oneDNN's linear, a new tensor: the ``float32_gemm: onednn`` path."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def onednn_linear_available() -> bool:
    """True when torch has oneDNN's quantized linear (``torch.ops.onednn.qlinear_pointwise``,
    x86-64 builds with oneDNN) and :func:`onednn_linear_gemm` gives the exact product here: a
    small product at the extremes of the codes (int8 activations, 7-bit weights), checked once
    per process."""
    try:
        torch.ops.onednn.qlinear_prepack, torch.ops.onednn.qlinear_pointwise.binary
    except (AttributeError, RuntimeError):
        return False
    g = torch.Generator().manual_seed(0)
    qx = torch.randint(-128, 128, (16, 64), dtype=torch.int8, generator=g)
    qw = torch.randint(-63, 64, (8, 64), dtype=torch.int8, generator=g)
    qx[0], qw[0] = 127, 63  # u8 255 (the shifted 127) times 63, in pairs: the 16-bit edge
    qx[1], qw[1] = -128, -63
    try:
        dst = onednn_linear_gemm(qx, onednn_linear_pack(qw))
    except RuntimeError:
        return False
    return torch.equal(dst, (qx.long() @ qw.long().t()).float())


def onednn_linear_pack(qw: torch.Tensor) -> tuple:
    """The int8 weight ``qw`` ``[N, K]`` prepacked for :func:`onednn_linear_gemm` (oneDNN's
    layout for any number of rows), with its unit per-channel scales and zero points."""
    n = qw.shape[0]
    return (torch.ops.onednn.qlinear_prepack(qw.contiguous(), None), torch.ones(n),
            torch.zeros(n, dtype=torch.int64))


def onednn_linear_gemm(qx: torch.Tensor, packed: tuple) -> torch.Tensor:
    """``qx @ qw.T`` through the prepacked ``qw``, as a new float32 ``[M, N]`` tensor holding
    the int32 sums' float32 values (the int32 accumulator rounded to float32, as the epilogue
    would round it): the codes shifted to unsigned bytes (``qx ^ 0x80`` is ``qx + 128``) with
    zero point 128, accumulated in int32 by oneDNN.  A new tensor rather than a destination
    given: oneDNN's plain output is faster than its sum post-op onto a zeroed destination
    (which reads the destination back), by 2-13% at small Flux's shapes on an AVX2-only
    EPYC."""
    wq, scales, zeros = packed
    u8 = torch.bitwise_xor(qx, -128).view(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(
        u8, 1.0, 128, wq, scales, zeros, None, 1.0, 0, torch.float32, "none", [], "")
