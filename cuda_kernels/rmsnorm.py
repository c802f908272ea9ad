"""RMSNorm on CUDA: a Triton kernel for ``sd.rms_norm.v1`` (see ``patterns/rmsnorm.py``).

Maths (per row of x, D features; float32 arithmetic, as ``rms_norm_reference``)::

    r   = 1 / sqrt(sum(float(x)^2) / D + eps)        (IEEE-rounded sqrt and divisions)
    n   = float(x) * r
    out = n                      rounded to x's dtype     no weight
    out = round_w(n) * w         rounded to w's dtype     weight bf16/fp16
    out = n * w                  float32                  weight float32

``round_w`` is the conversion to the weight's dtype (round-to-nearest-even, as ``Tensor.to``).
The output dtype is ``rms_norm_out_dtype(x.dtype, w.dtype)``; it is contiguous.  The sum of
squares is a tree reduction, so it differs from torch's by float32 rounding of the mean (about
1e-7 relative), which may move a 16-bit result by one unit in the last place.  Sources: Zhang and
Sennrich, "Root Mean Square Layer Normalization" (arXiv 1910.07467); diffusers ``RMSNorm``;
Liger-Kernel ``ops/rms_norm.py`` (one program per row block, the row held in registers).

Layout.  One program handles BLOCK_R rows by BLOCK_D (>= D, a power of two) features: each row
of x is read once and each row of out written once.  x's leading dims may be strided (last stride
1); they are merged as in ``cuda_kernels/rope.py`` (:func:`~fxbackend.cuda_kernels.rope.
_merge_lead_dims`, at most MAX_LEAD_DIMS after merging, recovered in the kernel with div/mod).
The weight is read with its own stride.  D is at most MAX_D; rows wider than the rope kernel's
TILE get one program each and more warps.

Launches pass ``enable_fp_fusion=False``: the reference rounds every product before it is summed
(no fused multiply-add), and so does the kernel, on a GPU as in the interpreter.

Importing this module does not import Triton: ``tl`` is bound and the kernel jitted on first use
(``rope.lazy_kernel``); the row multi-index and offset are rope's ``@triton.jit`` helpers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cuda_kernels import rope as _rope
from fxbackend.cuda_kernels.rope import (DTYPES, MAX_LEAD_DIMS, TILE, _launch_on,
                                         _merge_lead_dims, _next_pow2, _warmup_on, lazy_kernel)
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype

__all__ = ["rms_norm_triton", "RmsNormCUDA", "MAX_D"]

#: the widest row the kernel takes: one program holds BLOCK_D >= D features of a row in registers
#: (8192 float32 at 16 warps: 16 per thread)
MAX_D = 8192

#: triton.language, bound by :func:`~fxbackend.cuda_kernels.rope.lazy_kernel` on first use
tl: Any = None


def num_warps(block_r: int, block_d: int) -> int:
    """4 warps up to the rope kernel's TILE elements per program, then one more per 512
    elements (16 at most).  Not tuned on a GPU yet."""
    return max(4, min(16, block_r * block_d // 512))


def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, size1, size2, size3,
                     xs0, xs1, xs2, xs3, w_sf, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, i0, i1, i2, i3 = _rope._lead_index(n_rows, size1, size2, size3, BLOCK_R)
    x_row = _rope._lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)

    f = tl.arange(0, BLOCK_D)
    n, m = _normed(x_ptr, w_ptr, x_row, row_ok, f, D, w_sf, eps, HAS_WEIGHT)
    tl.store(out_ptr + rows[:, None] * D + f[None, :], n.to(out_ptr.dtype.element_ty), mask=m)


def _normed(x_ptr, w_ptr, x_row, row_ok, f, D, w_sf, eps, HAS_WEIGHT: tl.constexpr):
    """``@triton.jit`` helper (jitted by :func:`_kernel`; ``int8_fusions.py``'s
    rms_norm_quantize kernel calls it too): ``(n, mask)``, the float32 normalised rows at
    element offsets ``x_row`` (features ``f``, unit stride) times the weight, before the
    rounding to the output dtype that the caller does."""
    f_ok = f < D
    m = row_ok[:, None] & f_ok[None, :]
    x = tl.load(x_ptr + x_row[:, None] + f[None, :], mask=m, other=0.0).to(tl.float32)
    # D + 0.0: a float whether D comes as an int or (D == 1) as a constexpr
    mean = tl.div_rn(tl.sum(x * x, axis=1), D + 0.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    n = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + f * w_sf, mask=f_ok, other=0.0).to(tl.float32)
        # 16-bit weight: round n to the weight's dtype first (a no-op for a float32 weight)
        n = n.to(w_ptr.dtype.element_ty).to(tl.float32) * w
    return n, m


#: the jitted kernel (``rope.lazy_kernel``; :func:`_normed` jitted in this module first)
_kernel = lazy_kernel(_rms_norm_kernel, helpers=("_normed",))


# -- launch parameters (pure Python, metadata only) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Launch:
    """Everything a launch needs besides the pointers and eps."""

    grid: tuple
    args: tuple  # n_rows, D, the three inner leading sizes, four x strides, weight stride
    has_weight: bool
    block_r: int
    block_d: int
    num_warps: int


def _plan(x_shape, x_stride, w_shape, w_stride) -> _Launch:
    """Launch parameters for these shapes and strides (``w_shape`` None: no weight); ValueError
    for arguments the kernel does not take."""
    w_shape = None if w_shape is None else tuple(w_shape)
    w_stride = () if w_stride is None else tuple(w_stride)
    for v in (*x_shape, *x_stride, *(w_shape or ()), *w_stride):
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")
    if not x_shape:
        raise ValueError("x must have a feature dimension, got a scalar")
    d = x_shape[-1]
    if d > MAX_D:
        raise ValueError(f"row size {d} is over the kernel's MAX_D={MAX_D}")
    if x_stride[-1] != 1 and d > 1:
        raise ValueError(f"x's last stride must be 1, got strides {tuple(x_stride)}")
    if w_shape is not None and (w_shape != (d,) or len(w_stride) != 1):
        raise ValueError(f"weight must be 1-D of x's last dim ({d},), got shape {w_shape}")
    lead = tuple(x_shape[:-1])
    dims = _merge_lead_dims(lead, x_stride[:-1])
    if len(dims) > MAX_LEAD_DIMS:
        raise ValueError(f"x's leading dims {lead} with strides {tuple(x_stride[:-1])} merge to "
                         f"{len(dims)} dims; the kernel takes at most {MAX_LEAD_DIMS}")
    dims = [(1, 0)] * (MAX_LEAD_DIMS - len(dims)) + dims
    n_rows = 1
    for n in lead:
        n_rows *= n
    block_d = max(_next_pow2(d), 2)
    block_r = max(1, min(TILE // block_d, _next_pow2(max(n_rows, 1))))
    args = (n_rows, d, dims[1][0], dims[2][0], dims[3][0], *(t[1] for t in dims),
            w_stride[0] if w_stride else 0)
    grid = ((n_rows + block_r - 1) // block_r if d else 0,)
    return _Launch(grid, args, w_shape is not None, block_r, block_d, num_warps(block_r, block_d))


def _plan_of_tensors(x, weight) -> _Launch:
    return _plan(tuple(x.shape), tuple(x.stride()),
                 None if weight is None else tuple(weight.shape),
                 None if weight is None else tuple(weight.stride()))


def _launch(p: _Launch, device: torch.device, x, weight, out, eps: float) -> None:
    if p.grid[0] == 0:
        return
    kernel = _kernel()[p.grid]
    w = x if weight is None else weight  # any pointer: not read without a weight
    args = (x, w, out, *p.args, float(eps))
    kw = dict(HAS_WEIGHT=p.has_weight, BLOCK_R=p.block_r, BLOCK_D=p.block_d,
              num_warps=p.num_warps, enable_fp_fusion=False)
    _launch_on(device, kernel, args, kw)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``sd.rms_norm.v1(x[, weight]) {eps}`` with the Triton kernel; returns ``out`` (allocated
    when None).

    ``x``: ``[..., D]`` float32/bfloat16/float16, last stride 1, other strides arbitrary;
    ``weight``: None or 1-D ``[D]`` float32/bfloat16/float16, any stride; ``out``: contiguous,
    x's shape, dtype ``rms_norm_out_dtype(x.dtype, weight.dtype)``, not overlapping the inputs.
    All on one CUDA device (launched on its current stream), or on the CPU under
    ``TRITON_INTERPRET=1``.  Raises ValueError for arguments the kernel does not take.
    """
    for name, t in (("x", x), ("weight", weight)):
        if t is None:
            continue
        if t.dtype not in DTYPES:
            raise ValueError(f"rms_norm_triton: {name} has dtype {t.dtype}; the kernel takes "
                             f"{[str(d) for d in DTYPES]}")
        if t.device != x.device:
            raise ValueError(f"rms_norm_triton: {name} is on {t.device}, x on {x.device}")
    if not eps >= 0:
        raise ValueError(f"rms_norm_triton: eps must be >= 0, got {eps}")
    dtype = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.dtype != dtype or out.shape != x.shape or not out.is_contiguous() or \
            out.device != x.device:
        raise ValueError(f"rms_norm_triton: out must be contiguous on {x.device} with x's shape "
                         f"{tuple(x.shape)} and dtype {dtype}, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()} on {out.device}")
    try:
        p = _plan_of_tensors(x, weight)
    except ValueError as e:
        raise ValueError(f"rms_norm_triton: {e}") from None
    _launch(p, x.device, x, weight, out, eps)
    return out


# -- the registry kernel ---------------------------------------------------------------------

class _State:
    """Launch parameters per input layout.  Filled from metadata by ``prepare``; ``execute``
    re-plans when the tensors it gets have other shapes or strides than the metadata said."""

    __slots__ = ("launches",)

    def __init__(self) -> None:
        self.launches: dict = {}

    def get(self, x, weight) -> _Launch:
        key = (x.shape, x.stride(), None if weight is None else weight.stride())
        p = self.launches.get(key)
        if p is None:
            p = self.launches[key] = _plan_of_tensors(x, weight)
        return p


def _metas(node) -> tuple:
    x = node.srcs[0].meta
    w = node.srcs[1].meta if len(node.srcs) == 2 else None
    return x, w


def _plan_of_metas(x: TensorMeta, w: TensorMeta | None) -> _Launch:
    return _plan(tuple(x.shape), tuple(x.stride), None if w is None else tuple(w.shape),
                 None if w is None else tuple(w.stride))


class RmsNormCUDA:
    """``sd.rms_norm.v1`` on CUDA with the Triton kernel above."""

    name = "rms_norm_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True
    op = "sd.rms_norm.v1"
    priority = 10

    def supports(self, node) -> bool:
        """CUDA tensors of float32/bfloat16/float16 on one device, concrete shapes, x's last
        stride 1, D <= MAX_D, at most MAX_LEAD_DIMS leading dims after merging.  Metadata only."""
        try:
            if len(node.srcs) not in (1, 2) or node.params.get("weight_in_float", False):
                return False  # torch.nn.RMSNorm's rounding order: not this kernel's yet
            x, w = _metas(node)
            out = node.meta
            metas = [x, out] + ([w] if len(node.srcs) == 2 else [])
            if not all(isinstance(m, TensorMeta) for m in metas):
                return False
            if x.device.type != "cuda" or any(m.device != x.device for m in metas):
                return False
            if any(m.dtype not in DTYPES for m in metas):
                return False
            if out.dtype != rms_norm_out_dtype(x.dtype, None if w is None else w.dtype):
                return False
            if tuple(out.shape) != tuple(x.shape):
                return False
            eps = node.params.get("eps")
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
                return False
            _plan_of_metas(x, w)
            return True
        except (ValueError, TypeError, AttributeError, KeyError, IndexError):
            return False

    def prepare(self, node) -> tuple:
        state = _State()
        x, w = _metas(node)
        key = (tuple(x.shape), tuple(x.stride), None if w is None else tuple(w.stride))
        state.launches[key] = _plan_of_metas(x, w)
        return state, 0

    def compile(self, node) -> None:
        """Plan-time warm-up: compile the kernel for this node's dtypes, block sizes and integer
        specialisation (Triton keeps it in its in-process and on-disk caches).  Only on CUDA."""
        x, w = _metas(node)
        if x.device.type != "cuda":
            return
        p = _plan_of_metas(x, w)
        _warmup_on(x.device, _kernel, (x.dtype, x.dtype if w is None else w.dtype,
                                       node.meta.dtype, *p.args, float(node.params["eps"])),
                   dict(HAS_WEIGHT=p.has_weight, BLOCK_R=p.block_r, BLOCK_D=p.block_d,
                        num_warps=p.num_warps, enable_fp_fusion=False, grid=p.grid))

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        # _launch makes ctx.device current; Triton launches on its current stream (ctx.stream)
        x = inputs[0]
        w = inputs[1] if len(inputs) == 2 else None
        _launch(state.get(x, w), ctx.device, x, w, out, node.params["eps"])


fxbackend.register_kernel("cuda", RmsNormCUDA)
