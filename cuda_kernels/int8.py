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

Linear (:class:`LinearI8CUDA` for an int8 weight, capture-safe; :class:`LinearI8FloatWeightCUDA`
for a float weight, not capture-safe since it decides on the host, per call, whether the weight
changed): quantize x into the workspace (``x_kind="float"``) or read the
packed / int8 operand in place; ``torch._int_mm(q_x [M, K], q_w.T)`` into the output's storage
viewed as int32; then ``_epilogue_kernel`` in place, tiles of BLOCK_M x BLOCK_N::

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

from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels.rope import DTYPES, _cdiv, _launch_on, _next_pow2, _warmup_on, \
    lazy_kernel
from fxbackend.patterns.int8 import (quantize_node_why_not, REGULAR_HADAMARD_GROUPS, WeightState, check_linear,
                                     hadamard_stages, linear_node_operands, linear_srcs,
                                     packed_nbytes, padded_rows, unpack)

__all__ = ["quantize_i8_convrot_triton", "quantize_rows_triton", "epilogue_triton",
           "linear_i8_triton", "linear_why_not", "QuantizeI8ConvRotCUDA", "LinearI8CUDA",
           "LinearI8FloatWeightCUDA", "MAX_BLOCK", "MAX_DIM"]

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


def _quantize_packed(x, group, packed, m, k, block=None) -> None:
    mp = padded_rows(m)
    scales = packed[mp * k: mp * k + 4 * mp].view(torch.float32)
    quantize_rows_triton(x, group, packed[:mp * k], scales, m, mp, block)


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
    k = x.shape[-1]
    m = x.numel() // k
    nb = packed_nbytes(m, k)
    if out is None:
        out = torch.empty(nb, dtype=torch.int8, device=x.device)
    elif out.dtype != torch.int8 or tuple(out.shape) != (nb,) or not out.is_contiguous() or \
            out.storage_offset() % 4 or out.device != x.device:
        raise ValueError(f"quantize_i8_convrot_triton: out must be a contiguous 1-D int8 "
                         f"tensor of {nb} bytes on {x.device} at a storage offset divisible "
                         f"by 4")
    _quantize_packed(x, group, out, m, k, block)
    return out


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


def _linear(x_kind, group, M, K, N, x, x_scale, qw, ws, bias, out, workspace,
            block=None) -> None:
    """Quantize (x_kind float), ``torch._int_mm`` into ``out`` viewed as int32, epilogue."""
    if M == 0:
        return
    if x_kind == "float":
        nb = packed_nbytes(M, K)
        buf = (workspace[:nb].view(torch.int8) if workspace is not None and
               workspace.numel() >= nb else torch.empty(nb, dtype=torch.int8, device=x.device))
        _quantize_packed(x, group, buf, M, K, block)
        qx, xs = unpack(buf, M, K)
    elif x_kind == "packed":
        qx, xs = unpack(x, M, K)
    else:
        qx, xs = x.view(M, K), x_scale
    acc = out.view(torch.int32).view(M, N)
    if acc.device.type == "cuda":
        with torch.cuda.device(acc.device):  # the current stream of out's device
            torch._int_mm(qx, qw.t(), out=acc)
    else:  # the interpreter's CPU tensors
        torch._int_mm(qx, qw.t(), out=acc)
    epilogue_triton(acc, out, xs, ws, bias)


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
    _linear(x_kind, group, M, K, N, x, x_scale, w, w_scale, bias, out, None, block)
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


def _vector(t: Any, n: int) -> bool:
    return tuple(t.shape) == (n,) and t.is_contiguous


def linear_why_not(node, any_device: bool = False) -> str | None:
    """None when :class:`LinearI8CUDA` computes the ``sd.linear_i8.v1`` ``node``, else the
    reason.  Metadata only; never raises.  ``any_device``: skip the device check (the
    interpreter tests)."""
    try:
        s, M, K, N, why = linear_node_operands(node)
        if why is not None:
            return why
        p = node.params
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
        if p["x_kind"] == "float" and x.dtype not in DTYPES:
            return f"x dtype {x.dtype}"
        if s["w_scale"] is not None and (s["w_scale"].dtype != torch.float32 or
                                         not _vector(s["w_scale"], N)):
            return f"w_scale must be float32 [{N}] contiguous, got {s['w_scale'].short()}"
        if s["x_scale"] is not None and (s["x_scale"].dtype != torch.float32 or
                                         not _vector(s["x_scale"], M)):
            return f"x_scale must be float32 [{M}] contiguous, got {s['x_scale'].short()}"
        if s["bias"] is not None and (s["bias"].dtype not in DTYPES or
                                      not _vector(s["bias"], N)):
            return f"bias must be [{N}] contiguous, got {s['bias'].short()}"
        return None
    except Exception as exc:  # never raise: decline
        return f"node not understood ({type(exc).__name__}: {exc})"


# -- registry kernels -----------------------------------------------------------------------------

class QuantizeI8ConvRotCUDA:
    """``sd.quantize_i8_convrot.v1`` on CUDA with ``_quantize_kernel``: contiguous
    float32/bf16/fp16 x, any K divisible by the group.  Workspace: none."""

    name = "quantize_i8_convrot_triton"
    op = "sd.quantize_i8_convrot.v1"
    priority = 10
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True

    def why_not(self, node) -> str | None:
        """None when this kernel computes ``node``, else the reason (never raises)."""
        return quantize_node_why_not(node, _why_not_quantize)

    def supports(self, node) -> bool:
        return self.why_not(node) is None

    def compile(self, node) -> None:
        """Plan-time warm-up of the kernel for this node's dtype and block (CUDA only)."""
        x = node.srcs[0].meta
        k = x.shape[-1]
        nst = hadamard_stages(node.params["group"])
        blk = _block(k)
        _warmup_on(x.device, _quantize, (x.dtype, torch.int8, torch.float32,
                                         x.numel // k, k, 2.0 ** -nst),
                   dict(NST=nst, BLOCK=blk, ONE_PASS=k <= blk,
                        num_warps=4 if blk <= 1024 else 8, enable_fp_fusion=False,
                        grid=(padded_rows(x.numel // k),)))

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x = inputs[0]
        if not x.is_contiguous():  # other strides than planned (the Dynamo path): stay right
            x = x.contiguous()
        k = x.shape[-1]
        _quantize_packed(x, node.params["group"], out, x.numel() // k, k)


class _LinearState:
    """Per-step state: the shapes and, for ``w_kind="float"``, the weight this step quantized
    (a :class:`~fxbackend.patterns.int8.WeightState` on the step's device)."""

    __slots__ = ("M", "K", "N", "weight")

    def __init__(self, M: int, K: int, N: int, w_kind: str, device: torch.device) -> None:
        self.M, self.K, self.N = M, K, N
        self.weight = WeightState(N, K, device) if w_kind == "float" else None


def _quantize_weight(w, group, w_i8, w_scale) -> None:
    n = w.shape[0]
    quantize_rows_triton(w, group, w_i8, w_scale, n, n)


class _LinearI8CUDABase:
    """``sd.linear_i8.v1`` on CUDA: Triton quantize (x_kind float; w_kind float into the
    state), ``torch._int_mm`` (cuBLASLt) on the current stream, Triton epilogue (module
    docstring), for the weight kinds ``w_kinds``.  Workspace: the packed x
    (``packed_nbytes(M, K)`` bytes) for ``x_kind="float"``."""

    op = "sd.linear_i8.v1"
    priority = 10
    w_kinds: tuple = ()

    def why_not(self, node) -> str | None:
        """None when this kernel computes ``node``, else the reason (never raises)."""
        w_kind = getattr(node, "params", {}).get("w_kind")
        if w_kind not in self.w_kinds:
            return f"w_kind {w_kind!r} is not this kernel's ({', '.join(self.w_kinds)})"
        return linear_why_not(node)

    def supports(self, node) -> bool:
        return self.why_not(node) is None

    def compile(self, node) -> None:
        """Plan-time warm-up (CUDA only): the quantize kernel for each float operand and the
        epilogue, for this node's dtypes, sizes and blocks."""
        p = node.params
        s = linear_srcs([n.meta for n in node.srcs], p)
        M, K, N, _ = check_linear(**s, x_kind=p["x_kind"], w_kind=p["w_kind"],
                                  group=p["group"], m=p["m"], lead=p["lead"])
        dev = node.meta.device
        nst = hadamard_stages(p["group"])
        blk = _block(K)
        quantized = ([(s["x"], M, padded_rows(M))] if p["x_kind"] == "float" else []) + \
            ([(s["w"], N, N)] if p["w_kind"] == "float" else [])
        for t, rows, grid_rows in quantized:
            _warmup_on(dev, _quantize, (t.dtype, torch.int8, torch.float32, rows, K, 2.0 ** -nst),
                       dict(NST=nst, BLOCK=blk, ONE_PASS=K <= blk,
                            num_warps=4 if blk <= 1024 else 8, enable_fp_fusion=False,
                            grid=(grid_rows,)))
        b = s["bias"]
        _warmup_on(dev, _epilogue, (torch.int32, torch.float32, torch.float32, torch.float32,
                                    torch.int32 if b is None else b.dtype, M, N),
                   dict(HAS_BIAS=b is not None, BLOCK_M=EPI_BLOCK_M, BLOCK_N=EPI_BLOCK_N,
                        num_warps=4, enable_fp_fusion=False,
                        grid=(_cdiv(M, EPI_BLOCK_M), _cdiv(N, EPI_BLOCK_N))))

    def prepare(self, node) -> tuple:
        p = node.params
        s = linear_srcs([n.meta for n in node.srcs], p)
        M, K, N, _ = check_linear(**s, x_kind=p["x_kind"], w_kind=p["w_kind"],
                                  group=p["group"], m=p["m"], lead=p["lead"])
        ws = packed_nbytes(M, K) if p["x_kind"] == "float" else 0
        return _LinearState(M, K, N, p["w_kind"], node.meta.device), ws

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = node.params
        s = linear_srcs(inputs, p)
        x = s["x"]
        if not x.is_contiguous():  # other strides than planned (the Dynamo path): stay right
            x = x.contiguous()
        if p["w_kind"] == "float":
            qw, ws = state.weight.get(s["w"], p["group"], _quantize_weight)
        else:
            qw, ws = s["w"], s["w_scale"]
        _linear(p["x_kind"], p["group"], state.M, state.K, state.N, x, s["x_scale"], qw, ws,
                s["bias"], out, workspace)


class LinearI8CUDA(_LinearI8CUDABase):
    """``sd.linear_i8.v1 {w_kind="int8"}`` on CUDA (see :class:`_LinearI8CUDABase`)."""

    name = "linear_i8_triton"
    w_kinds = ("int8",)
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True


class LinearI8FloatWeightCUDA(_LinearI8CUDABase):
    """``sd.linear_i8.v1 {w_kind="float"}`` on CUDA (see :class:`_LinearI8CUDABase`).  Not
    capture-safe: whether the weight changed is decided on the host at every call (its address
    and version counter), which a captured CUDA graph would not repeat, and the first call
    allocates the quantized weight."""

    name = "linear_i8_triton_float_weight"
    w_kinds = ("float",)


fxbackend.register_kernel("cuda", QuantizeI8ConvRotCUDA)
fxbackend.register_kernel("cuda", LinearI8CUDA)
fxbackend.register_kernel("cuda", LinearI8FloatWeightCUDA)
