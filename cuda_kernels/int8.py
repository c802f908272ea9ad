"""INT8 W8A8 with ConvRot on CUDA: Triton kernels for ``sd.quantize_i8_convrot.v1`` and the
quantize/epilogue phases of ``sd.linear_i8.v1`` (see ``patterns/int8.py`` for the maths, the
evaluation order and the packed layout), with the integer GEMM through ``torch._int_mm``
(cuBLASLt) on the current stream.

Rotate + quantize (``_quantize_kernel``): one program per row of the packed layout (rows M ..
Mp-1 are written as zeros with scale 0.0).  The row is read in blocks of BLOCK features (a power
of two, a multiple of the group, at most MAX_BLOCK): a block is rotated in registers by the
butterfly stages of ``rotate_reference`` (stage j views the block as ``[BLOCK / 4^(j+1), 4,
4^j]``, takes the four slices of the middle axis, combines them as ``p = a + b, q = a - b,
w = c + d, u = c - d -> (p + u, p - u, q + w, w - q)`` and puts them back), multiplied by
2^-k, and reduced to ``amax``.  A row that fits one block stays in registers (one read of x);
a longer row takes two passes over its blocks (amax, then the codes; the rotation is computed
again in the second pass, bit-identically).  Masked tail features are zeros: they fill whole
groups (K and BLOCK are multiples of the group), which rotate to zeros.  The scale is
``div_rn(amax, 127)`` (1.0 when 0), codes ``div_rn(r, scale)`` rounded half to even as ``(v +
1.5 * 2^23) - 1.5 * 2^23`` and clamped to [-127, 127]: bit-exact to
``quantize_i8_convrot_reference`` (a middle-axis slice is taken as a masked sum of one value
and three zeros, exact but for the sign of a zero, which no code or scale can show).

Linear (``patterns/int8.LinearKernel`` over this file's ``DEVICE``: ``linear_kernel`` for an
int8 weight, capture-safe; ``float_weight_linear_kernel`` for a float weight, not capture-safe
since it decides on the host, per call, whether the weight changed): quantize x into the
workspace (``x_kind="float"``) or read the packed / int8 operand in place;
``torch._int_mm(q_x [M, K], q_w.T)`` into the output's storage viewed as int32; then
``_epilogue_kernel`` in place, tiles of BLOCK_M x BLOCK_N::

    out[m, n] = float32(acc[m, n]) * x_scale[m] * w_scale[n] + float32(bias[n])

left to right, each operation rounded (launches pass ``enable_fp_fusion=False``: no FMA).  A
float weight (``w_kind="float"``) is quantized by ``_quantize_kernel`` into the step's state
(``patterns/int8.WeightState``: once per model, again only when its weight key changes).

``supports`` declines what ``torch._int_mm`` on CUDA cannot run (``M <= 16``, K or N not a
multiple of 8, dimensions over MAX_DIM = 2^31 - 1, the 32-bit ints of cuBLAS's m/n/k and
leading dimensions: "too many rows") and the layouts of the CPU kernel's ``why_not`` (non
contiguous operands, malformed scales, int8 operands not 16-byte aligned); the node then runs
the op's reference (which computes small-M products exactly in float64).  Importing this module
does not import Triton (``rope.lazy_kernel``).  Untuned on a GPU: block sizes and warps are
first guesses.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels.rope import DTYPES, _cdiv, _launch_on, _next_pow2, _warmup_on, \
    lazy_kernel
from fxbackend.patterns.int8 import (REGULAR_HADAMARD_GROUPS, Int8Device, LinearKernel,
                                     QuantizeKernel, check_linear, hadamard_stages, int_dot,
                                     linear_node_why_not, quantize_direct, run_linear,
                                     scales_why_not)

__all__ = ["quantize_i8_convrot_triton", "quantize_rows_triton", "epilogue_triton",
           "linear_i8_triton", "linear_why_not", "int_mm", "DEVICE", "quantize_kernel",
           "linear_kernel", "float_weight_linear_kernel", "MAX_BLOCK", "MAX_DIM"]

#: the widest block of a row the quantize kernel holds in registers; longer rows take two passes
MAX_BLOCK = 4096
#: cuBLAS's m, n, k and leading dimensions are 32-bit ints
MAX_DIM = 2 ** 31 - 1
EPI_BLOCK_M = 32
EPI_BLOCK_N = 128
#: triton.language, bound on first use (``rope.lazy_kernel``)
tl: Any = None


def _rot_stage(t, BLOCK: tl.constexpr, S: tl.constexpr):
    """One butterfly stage (stride S) of the rotation on a block of BLOCK features."""
    t3 = tl.reshape(t, (BLOCK // (4 * S), 4, S))
    d = tl.arange(0, 4)[None, :, None]
    a = tl.sum(tl.where(d == 0, t3, 0.0), axis=1)
    b = tl.sum(tl.where(d == 1, t3, 0.0), axis=1)
    c = tl.sum(tl.where(d == 2, t3, 0.0), axis=1)
    e = tl.sum(tl.where(d == 3, t3, 0.0), axis=1)
    p = a + b
    q = a - b
    w = c + e
    u = c - e
    y = tl.where(d == 0, (p + u)[:, None, :],
                 tl.where(d == 1, (p - u)[:, None, :],
                          tl.where(d == 2, (q + w)[:, None, :], (w - q)[:, None, :])))
    return tl.reshape(y, (BLOCK,))


def _rotate(t, inv, NST: tl.constexpr, BLOCK: tl.constexpr):
    """The rotation of a block (NST stages, then the 2^-NST scaling ``inv``)."""
    if NST >= 1:
        t = _rot_stage(t, BLOCK, 1)
    if NST >= 2:
        t = _rot_stage(t, BLOCK, 4)
    if NST >= 3:
        t = _rot_stage(t, BLOCK, 16)
    if NST >= 4:
        t = _rot_stage(t, BLOCK, 64)
    if NST >= 1:
        t = t * inv
    return t


def _codes(r, scale):
    """``clamp(round_half_even(r / scale), -127, 127)`` as int8."""
    v = tl.div_rn(r, scale)
    v = (v + 12582912.0) - 12582912.0
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return v.to(tl.int8)


def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, inv, NST: tl.constexpr, BLOCK: tl.constexpr,
                     ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    q_row = q_ptr + row * K
    f = tl.arange(0, BLOCK)
    if row >= M:  # a padding row of the packed layout
        for start in range(0, K, BLOCK):
            tl.store(q_row + start + f, tl.zeros([BLOCK], dtype=tl.int8), mask=start + f < K)
        tl.store(s_ptr + row, 0.0)
    else:
        if ONE_PASS:
            r = _rotate(tl.load(x_row + f, mask=f < K, other=0.0).to(tl.float32), inv, NST,
                        BLOCK)
            scale = tl.div_rn(tl.max(tl.abs(r), axis=0), 127.0)
            scale = tl.where(scale == 0.0, 1.0, scale)
            tl.store(q_row + f, _codes(r, scale), mask=f < K)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                ok = start + f < K
                r = _rotate(tl.load(x_row + start + f, mask=ok, other=0.0).to(tl.float32),
                            inv, NST, BLOCK)
                amax = tl.maximum(amax, tl.abs(r))
            scale = tl.div_rn(tl.max(amax, axis=0), 127.0)
            scale = tl.where(scale == 0.0, 1.0, scale)
            for start in range(0, K, BLOCK):
                ok = start + f < K
                r = _rotate(tl.load(x_row + start + f, mask=ok, other=0.0).to(tl.float32),
                            inv, NST, BLOCK)
                tl.store(q_row + start + f, _codes(r, scale), mask=ok)
        tl.store(s_ptr + row, scale)


def _epilogue_kernel(acc_ptr, out_ptr, xs_ptr, ws_ptr, b_ptr, M, N, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    offs = rm[:, None] * N + rn[None, :]
    acc = tl.load(acc_ptr + offs, mask=ok, other=0)
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    v = acc.to(tl.float32) * xs[:, None]
    v = v * ws[None, :]
    if HAS_BIAS:
        v = v + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=ok)  # 16-bit: one rounding


#: the ``@triton.jit`` helpers of this module's kernels (jitted by ``rope.lazy_kernel``)
_HELPERS = ("_rot_stage", "_rotate", "_codes")


_quantize = lazy_kernel(_quantize_kernel, helpers=_HELPERS)
_epilogue = lazy_kernel(_epilogue_kernel, helpers=_HELPERS)


# -- launchers ----------------------------------------------------------------------------------

def _block(k: int, block: int | None = None) -> int:
    """The block of features per program step: ``block`` (tests: a power of two) or the
    smallest power of two >= K up to MAX_BLOCK (>= 4, a multiple of every group <= it)."""
    if block is not None:
        return block
    return max(4, min(_next_pow2(k), MAX_BLOCK))


def quantize_rows_triton(x: torch.Tensor, group: int, q: torch.Tensor, scales: torch.Tensor,
                         m: int, mp: int, block: int | None = None) -> None:
    """Quantize the ``m`` rows of the contiguous float ``x`` (``[..., K]``) into ``q`` (int8,
    ``mp * K`` elements) and ``scales`` (float32, ``mp``; rows ``m .. mp-1`` zeros / 0.0), with
    ``_quantize_kernel``; no checks (the callers check).  ``block``: the block size (a power of
    two, a multiple of ``group``; tests use small ones to exercise the two-pass path)."""
    k = x.shape[-1]
    if mp == 0:
        return
    nst = hadamard_stages(group)
    blk = _block(k, block)
    if blk % group or blk & (blk - 1):
        raise ValueError(f"block {blk} must be a power of two and a multiple of group={group}")
    _launch_on(x.device, _quantize()[(mp,)], (x, q, scales, m, k, 2.0 ** -nst),
               dict(NST=nst, BLOCK=blk, ONE_PASS=k <= blk, num_warps=4 if blk <= 1024 else 8,
                    enable_fp_fusion=False))


def _device(block: int | None) -> Int8Device:
    """:data:`DEVICE`, or (tests) one whose quantize kernel takes ``block`` features a step."""
    if block is None:
        return DEVICE
    return dataclasses.replace(DEVICE, quantize_rows=functools.partial(quantize_rows_triton,
                                                                       block=block))


def quantize_i8_convrot_triton(x: torch.Tensor, group: int = 1, out: torch.Tensor | None = None,
                               block: int | None = None) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(x) {group}`` with the Triton kernel: the packed layout (in
    ``out`` when given: contiguous 1-D int8 of ``packed_nbytes(M, K)`` bytes, storage offset a
    multiple of 4).  ``x`` contiguous float32/bf16/fp16 on a CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``).  ValueError for inputs the kernel does not take."""
    if not isinstance(x, torch.Tensor):
        raise ValueError("quantize_i8_convrot_triton: x must be a tensor")
    why = _why_not_quantize(TensorMeta.of(x), group, any_device=True)
    if why is not None:
        raise ValueError(f"quantize_i8_convrot_triton: unsupported input: {why}")
    return quantize_direct(_device(block), "quantize_i8_convrot_triton", x, group, out)


def epilogue_triton(acc: torch.Tensor, out: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
    """``out = float32(acc) * xs[:, None] * ws[None, :] (+ bias)`` with ``_epilogue_kernel``:
    ``acc`` int32 ``[M, N]`` contiguous, ``out`` with M * N contiguous elements, float32 (may be
    ``acc``'s own storage) or bfloat16/float16 (each value rounded once: ``int8_linear_cast``),
    ``xs`` ``[M]`` / ``ws`` ``[N]`` float32, ``bias`` None or ``[N]``; no checks."""
    m, n = acc.shape
    if m == 0 or n == 0:
        return
    grid = (_cdiv(m, EPI_BLOCK_M), _cdiv(n, EPI_BLOCK_N))
    _launch_on(acc.device, _epilogue()[grid],
               (acc, out, xs, ws, acc if bias is None else bias, m, n),
               dict(HAS_BIAS=bias is not None, BLOCK_M=EPI_BLOCK_M, BLOCK_N=EPI_BLOCK_N,
                    num_warps=4, enable_fp_fusion=False))


def int_mm(qx, qw, acc) -> torch.Tensor:
    """``acc = qx @ qw.T`` (int32) by ``torch._int_mm`` on the current stream of acc's device;
    on the CPU (the interpreter's tensors) the exact product of ``patterns/int8.int_dot``
    (``torch._int_mm`` where it is exact there, else float64); returns ``acc``."""
    if acc.device.type == "cuda":
        with torch.cuda.device(acc.device):
            torch._int_mm(qx, qw.t(), out=acc)
    else:
        acc.copy_(int_dot(qx, qw))
    return acc


def linear_i8_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                     x_kind: str, group: int = 1, m: int = -1, lead: tuple = (),
                     out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """``sd.linear_i8.v1 {w_kind="int8"}`` with this file's kernels and ``torch._int_mm``
    (direct calls, benchmarks, interpreter tests): returns ``out`` (float32 ``lead + (N,)``,
    allocated when None).  Checks the op's contract only: on a GPU, shapes ``torch._int_mm``
    rejects raise its error (the registry kernel declines them instead)."""
    M, K, N, lead_out = check_linear(*(None if t is None else TensorMeta.of(t)
                                       for t in (x, w, w_scale, x_scale, bias)),
                                     x_kind=x_kind, w_kind="int8", group=group, m=m,
                                     lead=lead, who="linear_i8_triton")
    shape = tuple(lead_out) + (N,)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"linear_i8_triton: out must be a contiguous float32 tensor of shape "
                         f"{shape}")
    if x_kind != "packed" and not x.is_contiguous():
        x = x.contiguous()
    run_linear(_device(block), x_kind, group, M, K, N, x, x_scale, w, w_scale, bias, out,
               None)
    return out


# -- support checks (metadata only, never raise) --------------------------------------------------

def _why_not_quantize(x: Any, group: Any, any_device: bool = False) -> str | None:
    if not isinstance(x, TensorMeta) or x.is_symbolic:
        return "x is not a concrete tensor"
    if x.device.type != "cuda" and not any_device:
        return f"x is on {x.device}"
    if x.dtype not in DTYPES:
        return f"x dtype {x.dtype} (float32, bfloat16 or float16)"
    if isinstance(group, bool) or group not in REGULAR_HADAMARD_GROUPS:
        return f"group {group!r}"
    if not x.shape or x.shape[-1] == 0 or x.shape[-1] % group:
        return f"x shape {tuple(x.shape)} (last dim a positive multiple of {group})"
    if not x.is_contiguous:
        return "x is not contiguous"
    if x.numel // x.shape[-1] > MAX_DIM:
        return f"more than {MAX_DIM} rows"
    return None


def _why_not_operands(s: dict, M: int, K: int, N: int, node, any_device: bool) -> str | None:
    out = node.meta
    metas = {k: v for k, v in s.items() if v is not None}
    for name, t in metas.items():
        if not isinstance(t, TensorMeta) or t.is_symbolic:
            return f"{name} is not a concrete tensor"
        if not any_device and (t.device.type != "cuda" or t.device != out.device):
            return f"{name} is on {t.device}, not the output's CUDA device"
    if M <= 16:
        return f"M={M} rows: torch._int_mm on CUDA needs more than 16"
    if K % 8 or N % 8:
        return f"K={K} and N={N} must be multiples of 8 (torch._int_mm on CUDA)"
    if max(M, N, K) > MAX_DIM:
        return f"M={M}, N={N}, K={K}: over cuBLAS's 32-bit dimensions ({MAX_DIM})"
    x, w = s["x"], s["w"]
    if not x.is_contiguous or not w.is_contiguous:
        return "x and w must be contiguous"
    for name in ("x", "w"):
        t = metas[name]
        if t.dtype == torch.int8 and t.storage_offset % 16:
            return f"int8 {name} is not 16-byte aligned in its storage (cuBLASLt)"
    if node.params["x_kind"] == "float" and x.dtype not in DTYPES:
        return f"x dtype {x.dtype}"
    return scales_why_not(s, M, N, DTYPES)


def linear_why_not(node, any_device: bool = False) -> str | None:
    """None when the CUDA linear kernels compute the ``sd.linear_i8.v1`` ``node``, else the
    reason.  Metadata only; never raises.  ``any_device``: skip the device check (the
    interpreter tests)."""
    return linear_node_why_not(node, functools.partial(_why_not_operands,
                                                       any_device=any_device))


# -- registry kernels -----------------------------------------------------------------------------

def _quantize_weight(w, group, w_i8, w_scale) -> None:
    n = w.shape[0]
    quantize_rows_triton(w, group, w_i8, w_scale, n, n)


def _compile_quantize(x, m, mp, group, device) -> None:
    """Plan-time warm-up of the quantize kernel for ``m`` rows of x (a grid of ``mp``)."""
    k = x.shape[-1]
    nst = hadamard_stages(group)
    blk = _block(k)
    _warmup_on(device, _quantize, (x.dtype, torch.int8, torch.float32, m, k, 2.0 ** -nst),
               dict(NST=nst, BLOCK=blk, ONE_PASS=k <= blk, num_warps=4 if blk <= 1024 else 8,
                    enable_fp_fusion=False, grid=(mp,)))


def _compile_epilogue(m, n, bias_dtype, out_dtype, device, w_kind="int8") -> None:
    _warmup_on(device, _epilogue, (torch.int32, out_dtype, torch.float32, torch.float32,
                                   torch.int32 if bias_dtype is None else bias_dtype, m, n),
               dict(HAS_BIAS=bias_dtype is not None, BLOCK_M=EPI_BLOCK_M, BLOCK_N=EPI_BLOCK_N,
                    num_warps=4, enable_fp_fusion=False,
                    grid=(_cdiv(m, EPI_BLOCK_M), _cdiv(n, EPI_BLOCK_N))))


#: CUDA's INT8 building blocks (``patterns/int8.Int8Device``): the registry kernels below and
#: the fused steps of ``cuda_kernels/int8_fusions.py``
DEVICE = Int8Device(quantize_rows=quantize_rows_triton, gemm=int_mm, epilogue=epilogue_triton,
                    why_not_quantize=_why_not_quantize, why_not_linear=linear_why_not,
                    compile_quantize=_compile_quantize, compile_epilogue=_compile_epilogue,
                    quantize_weight=_quantize_weight)
#: ``sd.quantize_i8_convrot.v1``; launches only (no allocation, no host synchronisation): CUDA
#: graphs may capture it
quantize_kernel = fxbackend.register_kernel(
    "cuda", QuantizeKernel(DEVICE, "quantize_i8_convrot_triton", priority=10, capture_safe=True))
#: ``sd.linear_i8.v1 {w_kind="int8"}``, capture-safe
linear_kernel = fxbackend.register_kernel(
    "cuda", LinearKernel(DEVICE, "linear_i8_triton", ("int8",), priority=10, capture_safe=True))
#: ``sd.linear_i8.v1 {w_kind="float"}``.  Not capture-safe: whether the weight changed is decided
#: on the host at every call (its weight key), which a captured CUDA graph would not repeat, and
#: the first call allocates the quantized weight
float_weight_linear_kernel = fxbackend.register_kernel(
    "cuda", LinearKernel(DEVICE, "linear_i8_triton_float_weight", ("float",), priority=10))
