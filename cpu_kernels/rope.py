"""RoPE on the CPU: a numba kernel for ``sd.rope_apply.v1`` (see ``patterns/rope.py``).

Maths (per row ``r`` of ``x`` viewed as ``[rows, D]``, all in float32, pairs as in the op)::

    interleaved, p < n_rot/2:   out[2p]   = x[2p]   * cos[2p]   - x[2p+1] * sin[2p]
                                out[2p+1] = x[2p+1] * cos[2p+1] + x[2p]   * sin[2p+1]
    split_half,  p < h=n_rot/2: out[p]    = x[p]    * cos[p]    - x[p+h]  * sin[p]
                                out[p+h]  = x[p+h]  * cos[p+h]  + x[p]    * sin[p+h]
    both:                       out[n_rot:] = x[n_rot:]              (copied bit for bit)

which is ``x * cos + rotate(x) * sin`` with the products and the sum rounded in the same order
as the torch reference (no FMA contraction: ``fastmath=False``), so float32 results match it
bit for bit.  Sources: Su et al., "RoFormer" (arXiv 2104.09864), section 3.4.2; diffusers
``apply_rotary_emb`` (``models/embeddings.py``); the bf16/fp16 conversions follow c10's
``BFloat16.h`` (round to nearest even) and F. Giesen's ``float_to_half_fast3_rtne``.

``sd.rope_apply_f64.v1`` is the same kernel given float64 ``cos``/``sin``: each product of a
float32 value of x (exact in float64) and a float64 table value is float64, and so are the
difference and the sum, as in the complex128 product ``(ac - bd) + i(ad + bc)`` Lumina 2's
eager computes; the store rounds the float64 result to float32 and then, for bf16/fp16, to the
16-bit type, which is how torch converts a float64 tensor to them (c10 goes through float).

Layout.  ``x``, ``cos`` and ``sin`` reach the kernel as flat 1-D arrays over the storage their
elements span, and every row finds its offsets from two tiny tables of x's leading dims (size
and element strides; a broadcast dim has stride 0): ``offset = sum_j idx_j * stride_j``.  So
any strided ``x`` (a head slice of a fused QKV output, ``[B, S, H, D]`` seen as ``[B, H, S, D]``)
and any broadcast ``cos``/``sin`` (``[S, n_rot]`` against ``[B, H, S, D]``, ``[S, 1, n_rot]``
against ``[B, S, H, D]``) run without materialising a ``[rows, n_rot]`` copy or an O(rows)
index array.  Dims contiguous in every operand are merged (Flux: one dim of S cos rows, one of
B*H heads).  The tables split the dims in two: those cos/sin move along (``v``: which cos row)
and those they are broadcast over (``b``: the heads).  The parallel loop (``prange``) runs over
tasks of a tile of v (cos/sin rows worth ``_TILE_BYTES``) by a chunk of b, b outer and v inner,
so each cos/sin row is read from memory once per tile rather than once per head.  The features
(last dim) of ``x``, ``cos`` and ``sin`` must have stride 1; ``supports`` declines otherwise.
The mode is a run-time argument selecting one of two row functions (one compiled kernel per
dtype combination serves both modes).

bf16/fp16.  numba has no bf16 (nor CPU fp16) type, so such tensors are passed as their bit
patterns (bf16 as int16, fp16 as uint16: the element type selects the conversion) and converted
to and from float32 inside the kernel with round-to-nearest-even.  This keeps one pass over
memory and needs no workspace (converting in torch would cost a full extra read and write of
``x`` and ``out`` plus a float32 workspace of twice their size).

Compilation.  numba is imported and the kernel is compiled lazily, for the dtypes a plan
needs, in the ``compile(node)`` capability (plan time, never the first call), and cached on
disk, with the set-up every CPU kernel module shares (``cpu_kernels/_numba.py``).  Unless the
user set ``NUMBA_CACHE_DIR``, it defaults (before numba is imported) to
``$XDG_CACHE_HOME/fxbackend/numba`` or ``~/.cache/fxbackend/numba`` (not site-packages, which
may be read-only), falling back to a per-user temporary folder when that cannot be created.
Threads: numba runs with ``min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)``, set
per Python thread when torch's count differs from the one it was last set from (a
``numba.set_num_threads`` call elsewhere in that thread stands until then).
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

import fxbackend
from fxbackend.patterns.rope import ROUNDINGS

from . import _numba
from ._workers import compiles
from ._numba import numba_cache_dir

__all__ = ["RopeApplyCPU", "rope_apply_cpu", "numba_cache_dir", "compile_kernels"]

_MODES = ("interleaved", "split_half")
# numpy element type the kernel sees for each torch dtype (bits for the 16-bit floats)
_NP_OF = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}
#: and for cos/sin, which are float64 for ``sd.rope_apply_f64.v1``
_NP_TABLE = {**_NP_OF, torch.float64: np.float64}
_BITS_OF = {torch.bfloat16: torch.int16, torch.float16: torch.uint16}


# -- numba: lazy import and jit (cpu_kernels/_numba.py) --------------------------------------------

#: ``numba.prange`` once numba is imported (numba recognises it by identity; ``_numba.once``
#: swaps it in before the first compile); plain ``range`` until then
prange = range
_compile_lock = threading.Lock()


def _register_helpers(numba) -> None:
    """Register the helpers the kernels below call (and those of the other kernel modules:
    ``_load``, ``_store``, the conversions, the task loop).  The kernel bodies are plain
    module-level Python (so that importing this module stays cheap and numba can cache them
    by file)."""
    from numba import types
    from numba.extending import overload, register_jitable

    for fn in (_var_offsets, _bcast_offsets, _tasks, _task, _bf16_to_f32, _f32_to_bf16):
        register_jitable(fn)
    if _hardware_half():  # one instruction each (F16C), vectorised: same bits (IEEE RNE)
        global _half_bits, _half_value
        _half_bits, _half_value = _half_intrinsics()
        overload(_f32_to_f16)(lambda f: lambda f: _half_bits(np.float32(f)))
        overload(_f16_to_f32)(lambda h: lambda h: _half_value(np.uint16(h)))
    else:
        register_jitable(_f16_to_f32)
        register_jitable(_f32_to_f16)
    _numba.inline(_row_views, _row_interleaved, _row_split_half, _row_interleaved_rounded,
                  _row_split_half_rounded)

    @overload(_load)
    def _load_impl(a, i):
        dt = a.dtype
        if dt in (types.float32, types.float64):  # float64: sd.rope_apply_f64.v1's tables
            return lambda a, i: a[i]
        if dt == types.int16:
            return lambda a, i: _bf16_to_f32(a[i])
        if dt == types.uint16:
            return lambda a, i: _f16_to_f32(a[i])
        return None

    @overload(_store)
    def _store_impl(a, i, v):
        dt = a.dtype
        if dt == types.float32:
            def st(a, i, v):
                a[i] = v
        elif dt == types.int16:
            def st(a, i, v):
                a[i] = _f32_to_bf16(v)
        elif dt == types.uint16:
            def st(a, i, v):
                a[i] = _f32_to_f16(v)
        else:
            return None
        return st

    @overload(_round_as)
    def _round_as_impl(a, v):
        dt = a.dtype
        if dt == types.float32:
            return lambda a, v: v
        if dt == types.int16:
            return lambda a, v: _bf16_to_f32(_f32_to_bf16(v))
        if dt == types.uint16:
            return lambda a, v: _f16_to_f32(_f32_to_f16(v))
        return None


def _hardware_half() -> bool:
    """Whether the CPU numba compiles for converts float32 <-> float16 in hardware (x86 F16C;
    numba's ``CPU_FEATURES`` setting if given, else the host's).  Without it LLVM would call a
    runtime library function that numba may not link, so the bit-level conversions are used."""
    try:
        from numba.core import codegen, config
        feats = config.CPU_FEATURES
        if feats is None:
            feats = codegen.get_host_cpu_features()
        return "+f16c" in str(feats).split(",")
    except Exception:
        return False


def _half_intrinsics():
    """numba intrinsics ``(float32 -> fp16 bits, fp16 bits -> float32)``: LLVM's ``fptrunc``
    to ``half`` (round to nearest even, IEEE subnormals, overflow to inf; a NaN keeps its sign
    and top payload bits and stays a NaN, as torch's vectorised conversion does) and
    ``fpext`` (exact)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def half_bits(typingctx, f):
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    @intrinsic
    def half_value(typingctx, h):
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    return half_bits, half_value


#: the hardware conversions once registered (``_half_intrinsics``), else None
_half_bits = _half_value = None


#: numba imported and the helpers registered, once (``_register()``; other modules require it)
_register = _numba.once(globals(), _register_helpers)
#: the jitted kernel (``_jit()``; it compiles per dtype combination when first called)
_jit = _numba.once(globals(), lambda numba: _numba.njit(_rope_kernel), requires=(_register,))


#: per Python thread (numba's thread count is per thread): the torch thread count numba's was
#: last set from, and the count set
_threads_set = threading.local()


def _set_threads() -> int:
    """numba's thread count for the next kernel launch in this thread: torch's, at most
    ``NUMBA_NUM_THREADS`` (module docstring); returned.  Set again only when torch's count
    changed since this thread last set it: ``numba.get_num_threads`` costs 8-18 us a call
    (2 threads of an AVX2-only EPYC, after another op), paid by every kernel step."""
    t = torch.get_num_threads()
    if getattr(_threads_set, "torch", None) == t:
        return _threads_set.numba
    numba = sys.modules["numba"]
    n = max(1, min(t, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    _threads_set.torch, _threads_set.numba = t, n
    return n


# -- element conversions (jitted; float32 maths) --------------------------------------------------

def _load(a, i):
    """``a[i]`` as float32 (float32, bf16 bits as int16, fp16 bits as uint16), or float64 for a
    float64 array: jit only."""
    raise NotImplementedError("_load is a numba helper: call it from a jitted kernel")


def _store(a, i, v):
    """``a[i] = v`` rounded to a's element type (to nearest even): jit only."""
    raise NotImplementedError("_store is a numba helper: call it from a jitted kernel")


def _round_as(a, v):
    """float32 ``v`` rounded to a's element type (to nearest even) and back: jit only."""
    raise NotImplementedError("_round_as is a numba helper: call it from a jitted kernel")


def _bf16_to_f32(b):
    return np.uint32((np.uint32(b) & np.uint32(0xFFFF)) << np.uint32(16)).view(np.float32)


# The conversions compute every case and select one (no branches), so that LLVM vectorises the
# loops that call them: with an ``if`` per case a loop storing fp16 ran scalar (scale -> fp16 at
# 0.6x Inductor's speed).  Every case is computed exactly as before; only the unused ones are
# thrown away (their arithmetic on other inputs wraps or makes NaNs, harmlessly).  Where the CPU
# converts fp16 in hardware (``_hardware_half``), ``_f32_to_f16`` and ``_f16_to_f32`` compile to
# that instead (the same bits for every non-NaN value; 16% faster on scale -> fp16).

def _f32_to_bf16(f):
    u = np.float32(f).view(np.uint32)
    r = np.uint32(u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(np.uint32(0x7FC0) if nan else r).view(np.int16)  # NaN as c10::BFloat16


def _f16_to_f32(h):
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    special = np.uint32(0x7F800000) | (mant << np.uint32(13))  # inf, nan
    # zero, subnormal: mant * 2**-24, exact in float32
    sub = np.float32(np.float32(mant) * np.float32(5.9604644775390625e-08)).view(np.uint32)
    normal = ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
    mag = special if exp == np.uint32(0x1F) else (sub if exp == np.uint32(0) else normal)
    return np.uint32(sign | mag).view(np.float32)


def _f32_to_f16(f):
    u = np.float32(f).view(np.uint32)
    sign = np.uint32(u & np.uint32(0x80000000))
    u = np.uint32(u ^ sign)
    # >= 65536 (after rounding: inf), inf or nan
    big = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    # below the smallest normal half: let the FPU round (0.5's ulp is the half subnormal step)
    magic = np.uint32(0x3F000000)
    tiny = np.float32(u.view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic
    # normal: rebias the exponent (-112 << 23) + rounding bias, round half to even
    odd = (u >> np.uint32(13)) & np.uint32(1)
    normal = np.uint32(u + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)
    o = big if u >= np.uint32(0x47800000) else (tiny if u < np.uint32(0x38800000) else normal)
    return np.uint16((o | (sign >> np.uint32(16))) & np.uint32(0xFFFF))


# -- the kernels ---------------------------------------------------------------------------------

def _var_offsets(v, vt):
    """Offsets in x, out, cos, sin of cos-row index ``v`` (row-major over the table's dims)."""
    xo = 0
    oo = 0
    co = 0
    so = 0
    for j in range(vt.shape[0] - 1, -1, -1):
        n = vt[j, 0]
        i = v % n
        v = v // n
        xo += i * vt[j, 1]
        oo += i * vt[j, 2]
        co += i * vt[j, 3]
        so += i * vt[j, 4]
    return xo, oo, co, so


def _bcast_offsets(b, bt):
    """Offsets in x and out of broadcast index ``b`` (cos/sin do not move along these dims)."""
    xo = 0
    oo = 0
    for j in range(bt.shape[0] - 1, -1, -1):
        n = bt[j, 0]
        i = b % n
        b = b // n
        xo += i * bt[j, 1]
        oo += i * bt[j, 2]
    return xo, oo


def _row_interleaved(xr, cr, sr, orow, n_rot):
    for p in range(n_rot // 2):
        e = 2 * p
        a = _load(xr, e)
        b = _load(xr, e + 1)
        _store(orow, e, a * _load(cr, e) - b * _load(sr, e))
        _store(orow, e + 1, b * _load(cr, e + 1) + a * _load(sr, e + 1))


def _row_split_half(xr, cr, sr, orow, n_rot):
    h = n_rot // 2
    for p in range(h):
        a = _load(xr, p)
        b = _load(xr, p + h)
        _store(orow, p, a * _load(cr, p) - b * _load(sr, p))
        _store(orow, p + h, b * _load(cr, p + h) + a * _load(sr, p + h))


def _row_interleaved_rounded(xr, cr, sr, orow, n_rot):
    """``_row_interleaved`` with each product rounded to out's dtype (the sum rounds in the
    store): ``sd.rope_apply_rounded.v1``."""
    for p in range(n_rot // 2):
        e = 2 * p
        a = _load(xr, e)
        b = _load(xr, e + 1)
        _store(orow, e, _round_as(orow, a * _load(cr, e)) - _round_as(orow, b * _load(sr, e)))
        _store(orow, e + 1, _round_as(orow, b * _load(cr, e + 1)) +
               _round_as(orow, a * _load(sr, e + 1)))


def _row_split_half_rounded(xr, cr, sr, orow, n_rot):
    """``_row_split_half`` with each product rounded to out's dtype."""
    h = n_rot // 2
    for p in range(h):
        a = _load(xr, p)
        b = _load(xr, p + h)
        _store(orow, p, _round_as(orow, a * _load(cr, p)) - _round_as(orow, b * _load(sr, p)))
        _store(orow, p + h, _round_as(orow, b * _load(cr, p + h)) +
               _round_as(orow, a * _load(sr, p + h)))


def _tasks(vt, bt, tile, bchunk):
    """``(tasks, nv, nb, nbc)``: a kernel's parallel tasks are tiles of ``tile`` of the ``nv``
    cos rows (table ``vt``) by chunks of ``bchunk`` of the ``nb`` broadcast indices (table
    ``bt``; ``nbc`` chunks).  The task loop of this file's and ``cpu_kernels/rms_rope.py``'s
    kernels: ``_tasks``, then per task ``_task``, then per row ``_row_views``."""
    nv = 1
    for j in range(vt.shape[0]):
        nv *= vt[j, 0]
    nb = 1
    for j in range(bt.shape[0]):
        nb *= bt[j, 0]
    nbc = (nb + bchunk - 1) // bchunk
    return ((nv + tile - 1) // tile) * nbc, nv, nb, nbc


def _task(task, vt, nv, nb, nbc, tile, bchunk):
    """``(voff, b0, b1)`` of task ``task``: ``voff[j]`` the offsets in x, out, cos, sin of its
    ``j``-th cos row (``[nt, 4]``), ``b0 .. b1 - 1`` its broadcast indices."""
    tk = np.int64(task)  # prange indices may be unsigned: int64 + uint64 would be float64
    v0 = (tk // nbc) * tile
    nt = min(nv - v0, tile)
    b0 = (tk % nbc) * bchunk
    voff = np.empty((nt, 4), np.int64)
    for j in range(nt):
        o0, o1, o2, o3 = _var_offsets(v0 + j, vt)
        voff[j, 0] = o0
        voff[j, 1] = o1
        voff[j, 2] = o2
        voff[j, 3] = o3
    return voff, b0, min(nb, b0 + bchunk)


def _row_views(x, out, cos, sin, voff, j, bx, bo, d, n_rot):
    """The task's row ``j`` at broadcast offsets ``bx``/``bo`` (``_bcast_offsets``): slices of x
    and out (``d`` features) and of cos and sin (``n_rot``).  Slices rather than offsets into
    the flat arrays: indices LLVM sees as in range and non-negative, so the row loops vectorize
    (about 1.5x faster)."""
    xo = voff[j, 0] + bx
    oo = voff[j, 1] + bo
    return (x[xo:xo + d], out[oo:oo + d], cos[voff[j, 2]:voff[j, 2] + n_rot],
            sin[voff[j, 3]:voff[j, 3] + n_rot])


def _rope_kernel(x, cos, sin, out, vt, bt, d, n_rot, tile, bchunk, interleaved, each_op):
    """Rows are pairs (v, b): v indexes the rows of cos/sin (table ``vt``), b the dims they are
    broadcast over (table ``bt``).  A task is a tile of ``tile`` values of v by a chunk of b, and
    runs b outer, v inner: the tile's cos/sin rows stay in L1 while every head reuses them
    (Flux, 2 threads: about 1.3-1.6x faster than plain row order, where each head re-streams
    all of cos/sin through the caches)."""
    ntasks, nv, nb, nbc = _tasks(vt, bt, tile, bchunk)
    for task in prange(ntasks):
        voff, b0, b1 = _task(task, vt, nv, nb, nbc, tile, bchunk)
        for b in range(b0, b1):
            bx, bo = _bcast_offsets(b, bt)
            for j in range(voff.shape[0]):
                xr, orow, cr, sr = _row_views(x, out, cos, sin, voff, j, bx, bo, d, n_rot)
                if each_op:
                    if interleaved:
                        _row_interleaved_rounded(xr, cr, sr, orow, n_rot)
                    else:
                        _row_split_half_rounded(xr, cr, sr, orow, n_rot)
                elif interleaved:
                    _row_interleaved(xr, cr, sr, orow, n_rot)
                else:
                    _row_split_half(xr, cr, sr, orow, n_rot)
                for e in range(n_rot, d):
                    orow[e] = xr[e]


# -- launcher -----------------------------------------------------------------------------------

#: bytes of cos + sin rows a task keeps hot while the heads reuse them (well inside L1)
_TILE_BYTES = 16 * 1024


class _Layout(NamedTuple):
    """How rows map to x/out/cos/sin elements for one set of strides (module docstring)."""

    strides: tuple  # (x.stride(), cos.stride(), sin.stride()): the layout is valid for these
    vt: np.ndarray  # [kv, 5]: per dim cos/sin move along: size, x, out, cos, sin strides
    bt: np.ndarray  # [kb, 3]: per dim cos/sin are broadcast over: size, x, out strides
    nv: int
    nb: int
    tile: int
    spans: tuple  # elements spanned by x, cos, sin from their storage offsets


def _span(shape, stride) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _layout(x_shape, x_stride, c_shape, c_stride, c_item, s_shape, s_stride, s_item,
            n_rot, o_stride=None) -> _Layout:
    """``o_stride``: out's strides (None: contiguous; rmsnorm writes strided outputs)."""
    lead = tuple(int(v) for v in x_shape[:-1])
    k = len(lead)
    d = int(x_shape[-1])

    def bstrides(shape, stride):  # strides of a broadcast operand over x's leading dims
        pad = k - (len(shape) - 1)
        full_shape = (1,) * pad + tuple(shape[:-1])
        full_stride = (0,) * pad + tuple(stride[:-1])
        return [0 if sz == 1 else int(st) for sz, st in zip(full_shape, full_stride)]

    if o_stride is None:
        o_stride, acc = [], d  # out is contiguous
        for n in reversed(lead):
            o_stride.append(acc)
            acc *= n
        o_stride.reverse()
    else:
        o_stride = [int(v) for v in o_stride[:-1]]
    dims = [[n, int(xs), os_, cs, ss] for n, xs, os_, cs, ss in
            zip(lead, x_stride[:-1], o_stride, bstrides(c_shape, c_stride),
                bstrides(s_shape, s_stride)) if n != 1]
    merged: list = []
    for dim in dims:  # merge a dim into the previous one when contiguous in every operand
        if merged and all(merged[-1][t] == dim[t] * dim[0] for t in (1, 2, 3, 4)):
            merged[-1] = [merged[-1][0] * dim[0]] + dim[1:]
        else:
            merged.append(dim)
    var = [m for m in merged if m[3] or m[4]]
    bc = [m[:3] for m in merged if not (m[3] or m[4])]
    vt = np.array(var, dtype=np.int64).reshape(-1, 5)
    bt = np.array(bc, dtype=np.int64).reshape(-1, 3)
    tile = max(1, _TILE_BYTES // (n_rot * (c_item + s_item)))
    return _Layout((tuple(x_stride), tuple(c_stride), tuple(s_stride)), vt, bt,
                   int(np.prod(vt[:, 0])), int(np.prod(bt[:, 0])), tile,
                   (_span(x_shape, x_stride), _span(c_shape, c_stride), _span(s_shape, s_stride)))


def _layout_of(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> _Layout:
    return _layout(x.shape, x.stride(), cos.shape, cos.stride(), cos.element_size(), sin.shape,
                   sin.stride(), sin.element_size(), n_rot)


#: ``id(tensor) -> (weakref to it, span, data_ptr, array)``: :func:`_flat`'s arrays of the
#: tensors it saw, dropped when the tensor goes (the weakref's callback)
_FLAT_CACHE: dict = {}


def _flat(t: torch.Tensor, span: int) -> np.ndarray:
    """The storage ``t`` spans, from its offset, as a 1-D numpy array (bits for bf16/fp16).

    A plan passes the same tensor objects every call (its arena's buffers, the weights), so
    the array is kept per tensor while the tensor lives: a lookup instead of ``view`` +
    ``numpy`` (0.4 against ~4 us: a kernel step reads three to six tensors).  The array is
    made from a view of its own, never from ``t`` itself, so that it does not keep ``t``
    alive; the tensor's ``data_ptr`` is compared, so storage swapped in (``.data =``,
    ``set_``) gets a new array."""
    key = id(t)
    got = _FLAT_CACHE.get(key)
    if got is not None and got[0]() is t and got[1] == span and got[2] == t.data_ptr():
        return got[3]
    v = t.view(_BITS_OF.get(t.dtype, t.dtype))  # a new tensor object either way
    if span == v.numel() and v.is_contiguous():  # the common case, at half the cost
        arr = v.numpy().ravel()
    else:
        arr = torch.as_strided(v, (span,), (1,)).numpy()
    try:
        ref = weakref.ref(t, lambda _, key=key: _FLAT_CACHE.pop(key, None))
    except TypeError:  # not weak-referenceable: no caching
        return arr
    _FLAT_CACHE[key] = (ref, span, t.data_ptr(), arr)
    return arr


def _bchunk(lay: _Layout, threads: int) -> int:
    """Broadcast indices per task: enough tasks to balance the threads (the broadcast dims are
    split when there are few tiles).  Also used by ``cpu_kernels/rms_rope.py``."""
    ntiles = -(-lay.nv // lay.tile)
    nbc = min(lay.nb, max(1, -(-4 * threads // ntiles)))
    return -(-lay.nb // nbc)


def _launch(mode: str, n_rot: int, lay: _Layout, x, cos, sin, out,
            each_op: bool = False) -> None:
    if lay.spans[0] == 0:
        return
    fn = _jit()
    bchunk = _bchunk(lay, _set_threads())
    fn(_flat(x, lay.spans[0]), _flat(cos, lay.spans[1]), _flat(sin, lay.spans[2]),
       _flat(out, out.numel()), lay.vt, lay.bt, x.shape[-1], n_rot, lay.tile, bchunk,
       mode == "interleaved", each_op)


def _why_not_metas(metas: tuple) -> str | None:
    """The checks every CPU kernel's ``why_not`` starts with: ``fxbackend.TensorMeta``s on the
    CPU with concrete metadata (used by rmsnorm's and modulation's)."""
    if not all(isinstance(m, fxbackend.TensorMeta) for m in metas):
        return "inputs are not tensors"
    if any(getattr(m.device, "type", None) != "cpu" for m in metas):
        return "not on the CPU"
    if any(m.is_symbolic for m in metas):
        return "symbolic metadata"
    return None


def _why_not(x_meta: Any, cos_meta: Any, sin_meta: Any, mode: Any, n_rot: Any,
             f64: bool = False) -> str | None:
    """None when the kernel computes the node correctly, else the reason (metadata only);
    ``f64``: the node is ``sd.rope_apply_f64.v1``, whose float64 maths need float64 tables (and
    float64 tables would give any other op float64 maths)."""
    if mode not in _MODES or type(n_rot) is not int:
        return f"mode {mode!r} / n_rot {n_rot!r}"
    metas = (x_meta, cos_meta, sin_meta)
    if not all(isinstance(m, fxbackend.TensorMeta) for m in metas):
        return "inputs are not tensors"
    if any(getattr(m.device, "type", None) != "cpu" for m in metas):
        return "not on the CPU"
    if x_meta.dtype not in _NP_OF:
        return f"x dtype {x_meta.dtype}"
    for m in (cos_meta, sin_meta):
        if f64 and m.dtype != torch.float64:
            return f"cos/sin dtype {m.dtype} (float64 for sd.rope_apply_f64.v1)"
        if not f64 and m.dtype not in (torch.float32, x_meta.dtype):
            return f"cos/sin dtype {m.dtype} (float32 or x's dtype)"
    for m in metas:
        if not m.shape or m.is_symbolic:
            return "symbolic or scalar metadata"
    if x_meta.stride[-1] != 1:
        return "x's features are strided"
    d = x_meta.shape[-1]
    if d % 2 or not (0 < n_rot <= d) or n_rot % 2:
        return "bad head size / n_rot"
    for m in (cos_meta, sin_meta):
        if m.shape[-1] != n_rot or m.stride[-1] != 1 or len(m.shape) > len(x_meta.shape):
            return "cos/sin features are not n_rot contiguous values"
        for a, b in zip(reversed(m.shape[:-1]), reversed(x_meta.shape[:-1])):
            if a != 1 and a != b:
                return "cos/sin do not broadcast"
    return None


def rope_apply_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, n_rot: int,
                   out: torch.Tensor | None = None, rounding: str = "once") -> torch.Tensor:
    """``sd.rope_apply.v1`` (``rounding="once"``) or ``sd.rope_apply_rounded.v1``
    (``"each_op"``) on CPU tensors with the numba kernel (the launcher; for direct calls and
    benchmarks), or ``sd.rope_apply_f64.v1`` when cos and sin are float64 (``"once"``).
    ``out``: a contiguous tensor of x's shape and dtype, or None (allocated).  Raises
    ValueError for inputs the kernel does not handle (see ``RopeApplyCPU.supports``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rope_apply_cpu: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    f64 = cos.dtype == torch.float64 and rounding == "once"
    why = _why_not(fxbackend.TensorMeta.of(x), fxbackend.TensorMeta.of(cos),
                   fxbackend.TensorMeta.of(sin), mode, n_rot, f64)
    if why is not None:
        raise ValueError(f"rope_apply_cpu: unsupported input: {why}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("rope_apply_cpu: out must be contiguous with x's shape and dtype")
    _launch(mode, n_rot, _layout_of(x, cos, sin, n_rot), x, cos, sin, out, rounding == "each_op")
    return out


@compiles
def compile_kernels(x_dtype: torch.dtype, cos_dtype: torch.dtype,
                    sin_dtype: torch.dtype) -> None:
    """Compile (or load from the disk cache) the kernel for these dtypes (both modes: the mode
    is a run-time argument), by a call with no rows on exactly the types a launch passes."""
    fn = _jit()
    t = np.zeros((0, 5), dtype=np.int64)
    # plans compile their nodes in parallel; numba serialises compilation itself, and the lock
    # keeps these (empty) launches off threading layers that are not thread-safe (workqueue)
    with _compile_lock:
        fn(np.zeros(0, _NP_OF[x_dtype]), np.zeros(0, _NP_TABLE[cos_dtype]),
           np.zeros(0, _NP_TABLE[sin_dtype]), np.zeros(0, _NP_OF[x_dtype]), t, t[:, :3].copy(),
           2, 2, 1, 1, True, False)


class RopeApplyCPU:
    """The numba CPU kernel for ``sd.rope_apply.v1``: float32/bf16/fp16 ``x``, float32 or
    x-dtype ``cos``/``sin`` broadcast to x's rows, any leading strides of every operand, unit
    feature stride.  Workspace: none (bf16/fp16 convert in registers)."""

    name = "rope_apply_cpu"
    op = "sd.rope_apply.v1"
    each_op = False  # RopeApplyRoundedCPU: each product rounded to x's dtype
    f64 = False  # RopeApplyF64CPU: float64 tables, float64 maths

    def supports(self, node) -> bool:
        try:
            if len(node.srcs) != 3:
                return False
            x, cos, sin = (s.meta for s in node.srcs)
            return _why_not(x, cos, sin, node.params.get("mode"), node.params.get("n_rot"),
                            self.f64) is None
        except Exception:  # never raise from supports: decline instead
            return False

    def compile(self, node) -> None:
        x, cos, sin = (s.meta for s in node.srcs)
        compile_kernels(x.dtype, cos.dtype, sin.dtype)

    def prepare(self, node):
        x, cos, sin = (s.meta for s in node.srcs)
        return _layout(x.shape, x.stride, cos.shape, cos.stride, cos.itemsize, sin.shape,
                       sin.stride, sin.itemsize, node.params["n_rot"]), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x, cos, sin = inputs
        lay = state
        if (x.stride(), cos.stride(), sin.stride()) != lay.strides:
            # the caller passed other strides than the plan's metadata: never read out of bounds
            lay = _layout_of(x, cos, sin, node.params["n_rot"])
        _launch(node.params["mode"], node.params["n_rot"], lay, x, cos, sin, out, self.each_op)


class RopeApplyRoundedCPU(RopeApplyCPU):
    """The same kernel for ``sd.rope_apply_rounded.v1``: each product rounded to x's dtype
    before the sum (run-time flag; the same compiled kernel)."""

    name = "rope_apply_rounded_cpu"
    op = "sd.rope_apply_rounded.v1"
    each_op = True


class RopeApplyF64CPU(RopeApplyCPU):
    """The same kernel for ``sd.rope_apply_f64.v1``: float64 cos/sin, so the products and the
    sum are float64, rounded once in the store (module docstring; the same compiled kernel for
    float64 table types)."""

    name = "rope_apply_f64_cpu"
    op = "sd.rope_apply_f64.v1"
    f64 = True


fxbackend.register_kernel("cpu", RopeApplyCPU)
fxbackend.register_kernel("cpu", RopeApplyRoundedCPU)
fxbackend.register_kernel("cpu", RopeApplyF64CPU)
