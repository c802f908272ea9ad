"""RoPE on CUDA: a Triton kernel for ``sd.rope_apply.v1`` (see ``patterns/rope.py``).

Maths (per row of x, i.e. per (batch, head, position); f is the feature index, n = n_rot):

    out[f] = x[f] * cos[f] + sign(f) * x[p(f)] * sin[f]     for f < n   (float32 arithmetic)
    out[f] = x[f]                                          for n <= f < D

with the pair partner ``p`` and sign:
- interleaved (pairs (2i, 2i+1); Flux, CogVideoX, HunyuanDiT): p(f) = f ^ 1, sign = -1 for even f;
- split_half (pairs (i, i + n/2); GPT-NeoX style ``cat(-x2, x1)``): p(f) = f + n/2 with sign -1
  for f < n/2, p(f) = f - n/2 with sign +1 otherwise.
The result is rounded once to x's dtype (round-to-nearest-even, as ``Tensor.to``); for
``sd.rope_apply_rounded.v1`` (``EACH_OP``) each of the two products is rounded to it first.
Sources: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(arXiv 2104.09864); diffusers ``apply_rotary_emb`` (both pairings); Liger-Kernel ``ops/rope.py``
and vLLM ``rotary_embedding`` kernels for the row-tiled, partner-load layout.

Layout.  One program handles a tile of BLOCK_R rows by BLOCK_D (>= D, a power of two) features.
x's leading dims may be strided (a slice of a fused QKV output, a [B,S,H,D] tensor seen as
[B,H,S,D]); its last stride must be 1.  cos and sin are read through the strides they have
after ``expand(x.shape[:-1] + (n_rot,))`` (broadcast dims have stride 0), so a [S, n_rot] table
is never materialised per head.  The launcher drops size-1 leading dims and merges adjacent dims
that are contiguous with each other in x, cos and sin alike (a contiguous x with a [S, n_rot]
table becomes [B*H, S]; a fully contiguous x with per-row cos becomes one dim), and passes at
most four leading dims with their strides; the kernel recovers each row's multi-index with
div/mod.  More than four non-mergeable leading dims is declined (``supports`` is False).
The partner of each feature is loaded a second time rather than permuted in registers: it lies
in the same cache lines as the tile, and the load keeps to long-stable Triton features
(``tl.load``/``tl.store`` with masks, ``tl.arange``, ``program_id``, constexpr block sizes,
calls to ``@triton.jit`` functions), so the same source compiles with Triton 3.6 and 3.9 and runs
in Triton's interpreter.

Importing this module does not import Triton (``fxbackend`` imports every kernel module at import
time, GPU or not): ``tl`` is bound and the kernel jitted on first use by :func:`lazy_kernel`,
which every kernel of this package uses; it also jits the ``@triton.jit`` helpers below (row
multi-index and offsets, pair partner) that the kernels of ``rmsnorm.py`` and ``rms_rope.py``
call too.  Compiled kernels are cached on disk by Triton itself (``TRITON_CACHE_DIR``, default
``~/.triton/cache``); the ``compile`` capability warms the kernel for a node at plan time.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.patterns.rope import MODES, ROUNDINGS

__all__ = ["rope_apply_triton", "RopeApplyCUDA", "MAX_D", "MAX_LEAD_DIMS", "lazy_kernel"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the widest head the kernel takes: one program holds BLOCK_D >= D features of a row
MAX_D = 2048
#: leading dims the kernel indexes after merging
MAX_LEAD_DIMS = 4
#: elements per program (BLOCK_R * BLOCK_D): 16 per thread at 4 warps.  Not tuned on a GPU yet.
TILE = 2048
NUM_WARPS = 4

#: triton.language, bound by :func:`lazy_kernel` on first use (module import must not import
#: triton).  The kernels' ``tl.constexpr`` annotations are strings (``from __future__ import
#: annotations``), read by Triton when it jits the function, so they need no ``tl`` at import.
tl: Any = None
_jit_lock = threading.Lock()
#: the ``@triton.jit`` helpers below, shared with the kernels of ``rmsnorm.py`` and
#: ``rms_rope.py`` (which call them as ``rope.<name>``): plain functions until the first
#: :func:`lazy_kernel` getter call replaces each, in this module, with its jitted form
_HELPERS = ("_lead_index", "_lead_offset", "_rope_partner")


#: (module name, helper name) of every ``@triton.jit`` helper :func:`lazy_kernel` jitted
_helpers_jitted: set = set()


def lazy_kernel(fn: Callable, helpers: tuple = (), requires: tuple = ()) -> Callable[[], Any]:
    """A getter for ``triton.jit(fn)`` that on its first call imports Triton, binds ``tl`` in
    ``fn``'s module (and, once, in this one, jitting :data:`_HELPERS`) and jits ``fn`` (module
    import must not import Triton; honours TRITON_INTERPRET).  Used by every kernel of this
    package.  ``helpers``: names of plain functions in ``fn``'s module that its kernels call as
    ``@triton.jit`` helpers, replaced there by their jitted form once per module;
    ``requires``: getters of other modules whose helpers ``fn`` calls, run first.  Do not call
    it while holding ``_jit_lock``."""
    jitted: list = []

    def get() -> Any:
        if not jitted:
            for other in requires:
                other()
            with _jit_lock:
                if not jitted:
                    import triton
                    import triton.language as language
                    g = globals()
                    if g["tl"] is None:
                        for name in _HELPERS:
                            g[name] = triton.jit(g[name])
                        g["tl"] = language
                    mod = fn.__globals__
                    mod["tl"] = language
                    for name in helpers:
                        if (mod["__name__"], name) not in _helpers_jitted:
                            mod[name] = triton.jit(mod[name])
                            _helpers_jitted.add((mod["__name__"], name))
                    jitted.append(triton.jit(fn))
        return jitted[0]

    return get


def _lead_index(n_rows, size1, size2, size3, BLOCK_R: tl.constexpr):
    """``(rows, row_ok, i0, i1, i2, i3)``: the program's BLOCK_R row numbers (int64), which of
    them are below ``n_rows``, and each row's multi-index over the four leading dims of sizes
    ``(n_rows / (size1 * size2 * size3), size1, size2, size3)``, innermost last."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i3 = rows % size3
    r = rows // size3
    i2 = r % size2
    r = r // size2
    i1 = r % size1
    return rows, rows < n_rows, r // size1, i1, i2, i3


def _lead_offset(i0, i1, i2, i3, s0, s1, s2, s3):
    """The element offset of the multi-index ``(i0, i1, i2, i3)`` with strides ``s0 .. s3``."""
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


def _rope_partner(f, n_rot, INTERLEAVED: tl.constexpr):
    """``(p(f), sign(f))`` of features ``f``: the pair partner and sign of the module docstring
    (meaningful for f < n_rot)."""
    if INTERLEAVED:
        partner = f ^ 1
        sign = tl.where((f & 1) == 0, -1.0, 1.0)
    else:
        half = n_rot // 2
        partner = tl.where(f < half, f + half, f - half)
        sign = tl.where(f < half, -1.0, 1.0)
    return partner, sign


def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, D, n_rot,
                 size1, size2, size3,
                 xs0, xs1, xs2, xs3, cs0, cs1, cs2, cs3, ss0, ss1, ss2, ss3,
                 cos_sf, sin_sf,
                 INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 EACH_OP: tl.constexpr):
    rows, row_ok, i0, i1, i2, i3 = _lead_index(n_rows, size1, size2, size3, BLOCK_R)
    x_row = _lead_offset(i0, i1, i2, i3, xs0, xs1, xs2, xs3)
    c_row = _lead_offset(i0, i1, i2, i3, cs0, cs1, cs2, cs3)
    s_row = _lead_offset(i0, i1, i2, i3, ss0, ss1, ss2, ss3)

    f = tl.arange(0, BLOCK_D)
    partner, sign = _rope_partner(f, n_rot, INTERLEAVED)
    rot = f < n_rot
    m_all = row_ok[:, None] & (f < D)[None, :]
    m_rot = row_ok[:, None] & rot[None, :]

    x_base = x_ptr + x_row[:, None]
    x = tl.load(x_base + f[None, :], mask=m_all, other=0.0).to(tl.float32)
    xp = tl.load(x_base + partner[None, :], mask=m_rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + c_row[:, None] + f[None, :] * cos_sf, mask=m_rot, other=0.0)
    s = tl.load(sin_ptr + s_row[:, None] + f[None, :] * sin_sf, mask=m_rot, other=0.0)
    if EACH_OP:  # sd.rope_apply_rounded.v1: each product rounded to out's dtype (the sum in
        t = out_ptr.dtype.element_ty  # the store)
        y = (x * c.to(tl.float32)).to(t).to(tl.float32) + \
            (sign[None, :] * xp * s.to(tl.float32)).to(t).to(tl.float32)
    else:
        y = x * c.to(tl.float32) + sign[None, :] * xp * s.to(tl.float32)
    y = tl.where(rot[None, :], y, x)
    tl.store(out_ptr + rows[:, None] * D + f[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_all)


_kernel = lazy_kernel(_rope_kernel)


# -- launch parameters (pure Python, metadata only) ------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Launch:
    """Everything a launch needs besides the four pointers."""

    grid: tuple
    args: tuple  # n_rows, D, n_rot, the leading sizes and strides, cos/sin feature strides
    interleaved: bool
    block_r: int
    block_d: int


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _expanded_strides(shape: tuple, stride: tuple, target: tuple) -> list:
    """Strides of ``t.expand(target)`` for a tensor ``t`` of this shape and stride (broadcast
    dims get stride 0).  ValueError when ``shape`` does not broadcast to ``target``."""
    if len(shape) > len(target) or len(stride) != len(shape):
        raise ValueError(f"shape {tuple(shape)} does not broadcast to {tuple(target)}")
    lead = len(target) - len(shape)
    out = []
    for i, t in enumerate(target):
        j = i - lead
        if j < 0 or shape[j] == 1:
            out.append(0)
        elif shape[j] == t:
            out.append(int(stride[j]))
        else:
            raise ValueError(f"shape {tuple(shape)} does not broadcast to {tuple(target)}")
    return out


def _merge_lead_dims(lead: tuple, *strides: tuple) -> list:
    """``(size, stride of each tensor...)`` per leading dim after merging, outermost first: size-1
    dims dropped, dim k+1 folded into dim k where every tensor steps contiguously from one to the
    other.  Not padded and not limited to MAX_LEAD_DIMS (the caller checks).  Also used by
    ``rmsnorm.py`` and ``rms_rope.py``."""
    dims: list = []
    for n, *st in zip(lead, *strides):
        if n == 1:
            continue
        if dims and all(s1 == s * n for s1, s in zip(dims[-1][1:], st)):
            dims[-1] = (dims[-1][0] * n, *st)
            continue
        dims.append((n, *st))
    return dims


def _plan(x_shape, x_stride, cos_shape, cos_stride, sin_shape, sin_stride, mode: str,
          n_rot: int) -> _Launch:
    """Launch parameters for these shapes and strides; ValueError for arguments the kernel
    does not take (``supports`` turns it into a decline)."""
    for v in (*x_shape, *x_stride, *cos_shape, *cos_stride, *sin_shape, *sin_stride, n_rot):
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not x_shape:
        raise ValueError("x must have a feature dimension, got a scalar")
    d = x_shape[-1]
    if d % 2 or not (0 < n_rot <= d) or n_rot % 2:
        raise ValueError(f"need an even head size and an even n_rot in 1..D, got D={d}, "
                         f"n_rot={n_rot}")
    if d > MAX_D:
        raise ValueError(f"head size {d} is over the kernel's MAX_D={MAX_D}")
    if x_stride[-1] != 1:
        raise ValueError(f"x's last stride must be 1, got strides {tuple(x_stride)}")
    lead = tuple(x_shape[:-1])
    target = lead + (n_rot,)
    cs = _expanded_strides(tuple(cos_shape), tuple(cos_stride), target)
    ss = _expanded_strides(tuple(sin_shape), tuple(sin_stride), target)
    dims = _merge_lead_dims(lead, x_stride[:-1], cs[:-1], ss[:-1])
    if len(dims) > MAX_LEAD_DIMS:
        raise ValueError(f"x's leading dims {lead} with strides {tuple(x_stride[:-1])} (and "
                         f"cos/sin's) merge to {len(dims)} dims; the kernel takes at most "
                         f"{MAX_LEAD_DIMS}")
    dims = [(1, 0, 0, 0)] * (MAX_LEAD_DIMS - len(dims)) + dims
    n_rows = 1
    for n in lead:
        n_rows *= n
    block_d = max(_next_pow2(d), 2)
    block_r = max(1, min(TILE // block_d, _next_pow2(max(n_rows, 1))))
    args = (n_rows, d, n_rot, dims[1][0], dims[2][0], dims[3][0],
            *(t[1] for t in dims), *(t[2] for t in dims), *(t[3] for t in dims),
            cs[-1], ss[-1])
    return _Launch(((n_rows + block_r - 1) // block_r,), args, mode == "interleaved",
                   block_r, block_d)


def _plan_of_tensors(x, cos, sin, mode: str, n_rot: int) -> _Launch:
    return _plan(tuple(x.shape), tuple(x.stride()), tuple(cos.shape), tuple(cos.stride()),
                 tuple(sin.shape), tuple(sin.stride()), mode, n_rot)


def _launch_on(device: torch.device, kernel, args: tuple, kw: dict) -> None:
    """``kernel(*args, **kw)`` (a gridded jitted kernel) on ``device``: a CUDA device, made
    current for the call (Triton launches on torch's current device, on that device's current
    stream), or the CPU under Triton's interpreter (TRITON_INTERPRET=1).  Used by every
    launcher of this package."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel(*args, **kw)
    else:
        kernel(*args, **kw)


def _warmup_on(device: torch.device, get_kernel: Callable[[], Any], args: tuple, kw: dict) -> None:
    """Plan-time warm-up: ``get_kernel().warmup(*args, **kw)`` (argument dtypes and values,
    constexprs, ``grid``) on ``device``, compiling the kernel into Triton's in-process and
    on-disk caches.  A no-op off CUDA (the interpreter) or without a GPU.  Thread-safe: plans
    compile their nodes in parallel.  Used by every ``compile`` of this package."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    kernel = get_kernel()  # before taking the lock: the first call takes it to jit
    with _jit_lock, torch.cuda.device(device):
        kernel.warmup(*args, **kw)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _launch(p: _Launch, device: torch.device, x, cos, sin, out, each_op: bool = False) -> None:
    if p.grid[0] == 0:
        return
    _launch_on(device, _kernel()[p.grid], (x, cos, sin, out, *p.args),
               dict(INTERLEAVED=p.interleaved, BLOCK_R=p.block_r, BLOCK_D=p.block_d,
                    EACH_OP=each_op, num_warps=NUM_WARPS))


def rope_apply_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str,
                      n_rot: int, out: torch.Tensor, rounding: str = "once") -> torch.Tensor:
    """``out = sd.rope_apply.v1(x, cos, sin) {mode, n_rot}`` (``rounding="once"``) or
    ``sd.rope_apply_rounded.v1`` (``"each_op"``) with the Triton kernel; returns ``out``.

    ``x``: ``[..., D]`` float32/bfloat16/float16, last stride 1, other strides arbitrary;
    ``cos``/``sin``: float32/bfloat16/float16, broadcastable to ``x.shape[:-1] + (n_rot,)``, any
    strides; ``out``: contiguous, x's shape and dtype, not overlapping the inputs.  All on one
    CUDA device (launched on its current stream), or on the CPU under ``TRITON_INTERPRET=1``.
    Raises ValueError for arguments the kernel does not take.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rope_apply_triton: rounding must be one of {ROUNDINGS}, got "
                         f"{rounding!r}")
    for name, t in (("x", x), ("cos", cos), ("sin", sin), ("out", out)):
        if t.dtype not in DTYPES:
            raise ValueError(f"rope_apply_triton: {name} has dtype {t.dtype}; the kernel takes "
                             f"{[str(d) for d in DTYPES]}")
        if t.device != x.device:
            raise ValueError(f"rope_apply_triton: {name} is on {t.device}, x on {x.device}")
    if out.dtype != x.dtype or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"rope_apply_triton: out must be contiguous with x's shape and dtype "
                         f"{tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype} "
                         f"strides {out.stride()}")
    try:
        p = _plan_of_tensors(x, cos, sin, mode, n_rot)
    except ValueError as e:
        raise ValueError(f"rope_apply_triton: {e}") from None
    _launch(p, x.device, x, cos, sin, out, rounding == "each_op")
    return out


# -- the registry kernel ---------------------------------------------------------------------

class _State:
    """Launch parameters per input layout.  Filled from metadata by ``prepare``; ``execute``
    re-plans when the tensors it gets have other shapes or strides than the metadata said
    (graph inputs are not stride-checked outside Dynamo's guards)."""

    __slots__ = ("launches",)

    def __init__(self) -> None:
        self.launches: dict = {}

    def get(self, x, cos, sin, mode: str, n_rot: int) -> _Launch:
        key = (x.shape, x.stride(), cos.shape, cos.stride(), sin.shape, sin.stride())
        p = self.launches.get(key)
        if p is None:
            p = self.launches[key] = _plan_of_tensors(x, cos, sin, mode, n_rot)
        return p


def _metas(node) -> tuple:
    x, cos, sin = (s.meta for s in node.srcs)
    return x, cos, sin


class RopeApplyCUDA:
    """``sd.rope_apply.v1`` on CUDA with the Triton kernel above."""

    name = "rope_apply_triton"
    #: launches only (no allocation, no host synchronisation): CUDA graphs may capture it
    capture_safe = True
    op = "sd.rope_apply.v1"
    priority = 10
    each_op = False  # RopeApplyRoundedCUDA: each product rounded to x's dtype

    def supports(self, node) -> bool:
        """CUDA tensors of float32/bfloat16/float16, concrete shapes, x's last stride 1,
        D <= MAX_D, at most MAX_LEAD_DIMS leading dims after merging.  Metadata only."""
        try:
            if len(node.srcs) != 3:
                return False
            x, cos, sin = _metas(node)
            out = node.meta
            if not all(isinstance(m, TensorMeta) for m in (x, cos, sin, out)):
                return False
            if x.device.type != "cuda" or any(m.device != x.device for m in (cos, sin, out)):
                return False
            if any(m.dtype not in DTYPES for m in (x, cos, sin)) or out.dtype != x.dtype:
                return False
            if tuple(out.shape) != tuple(x.shape):
                return False
            mode, n_rot = node.params.get("mode"), node.params.get("n_rot")
            if type(n_rot) is not int:
                return False
            _plan(tuple(x.shape), tuple(x.stride), tuple(cos.shape), tuple(cos.stride),
                  tuple(sin.shape), tuple(sin.stride), mode, n_rot)
            return True
        except (ValueError, TypeError, AttributeError, KeyError, IndexError):
            return False

    def prepare(self, node) -> tuple:
        state = _State()
        x, cos, sin = _metas(node)
        key = (tuple(x.shape), tuple(x.stride), tuple(cos.shape), tuple(cos.stride),
               tuple(sin.shape), tuple(sin.stride))  # torch.Size hashes and compares as a tuple
        state.launches[key] = _plan(tuple(x.shape), tuple(x.stride), tuple(cos.shape),
                                    tuple(cos.stride), tuple(sin.shape), tuple(sin.stride),
                                    node.params["mode"], node.params["n_rot"])
        return state, 0

    def compile(self, node) -> None:
        """Plan-time warm-up: compile the kernel for this node's dtypes, block sizes and integer
        specialisation (Triton keeps it in its in-process and on-disk caches).  Only on CUDA."""
        x, cos, sin = _metas(node)
        if x.device.type != "cuda":
            return
        p = _plan(tuple(x.shape), tuple(x.stride), tuple(cos.shape), tuple(cos.stride),
                  tuple(sin.shape), tuple(sin.stride), node.params["mode"], node.params["n_rot"])
        _warmup_on(x.device, _kernel, (x.dtype, cos.dtype, sin.dtype, node.meta.dtype, *p.args),
                   dict(INTERLEAVED=p.interleaved, BLOCK_R=p.block_r, BLOCK_D=p.block_d,
                        EACH_OP=self.each_op, num_warps=NUM_WARPS, grid=p.grid))

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        # _launch makes ctx.device current; Triton launches on its current stream (ctx.stream)
        x, cos, sin = inputs
        _launch(state.get(x, cos, sin, node.params["mode"], node.params["n_rot"]), ctx.device,
                x, cos, sin, out, self.each_op)


class RopeApplyRoundedCUDA(RopeApplyCUDA):
    """The same kernel for ``sd.rope_apply_rounded.v1`` (``EACH_OP``: each product rounded to
    x's dtype before the sum)."""

    name = "rope_apply_rounded_triton"
    op = "sd.rope_apply_rounded.v1"
    each_op = True


fxbackend.register_kernel("cuda", RopeApplyCUDA)
fxbackend.register_kernel("cuda", RopeApplyRoundedCUDA)
