"""INT8 W8A8 with ConvRot: the ops ``sd.quantize_i8_convrot.v1`` and ``sd.linear_i8.v1``, their
torch references, the packed layout, and their ``torch.library`` twins.

ConvRot (Huang et al., "ConvRot: Rotation-Based Plug-and-Play 4-bit Quantization for Diffusion
Transformers", arXiv 2512.03673) rotates each row of an activation (and of a weight, along K) in
groups of ``group`` features by a normalised *regular* Hadamard matrix before quantizing it:
the rotation spreads an outlier channel over its group, so one scale per row wastes fewer
levels, and because the matrix is orthogonal, rotating both operands of a dot product along K
leaves the product unchanged (``(x H) . (w H) = x . w``).

Hadamard matrices (:func:`hadamard`).  Orders ``REGULAR_HADAMARD_GROUPS = (1, 4, 16, 64, 256)``.
Order 4 is the regular (constant row sum) Hadamard matrix

    A = [[ 1,  1,  1, -1],
         [ 1,  1, -1,  1],
         [ 1, -1,  1,  1],
         [-1,  1,  1,  1]]        (symmetric; every row and column sums to 2)

order ``4^k`` is its k-th Kronecker power ``A (x) A (x) ... (x) A`` (Kronecker products of
regular Hadamard matrices are regular: row sums multiply), order 1 is ``[[1]]``; each is
normalised by ``1 / sqrt(4^k) = 2^-k`` (entries ``+-2^-k``, exactly representable), so
``H H^T = I`` and every row and column of H sums to 1.  The choice of A: ConvRot rotates by
regular Hadamard matrices of orders 4^k; this A is the order-4 one with the -1s on the
anti-diagonal (any regular one would do; this one is symmetric).  A regular H maps a constant
vector onto itself, where Sylvester's matrices (powers of ``[[1, 1], [1, -1]]``, first column
all ones) would move a constant offset of a group into its first feature, making an outlier.

Rotation (:func:`rotate_reference`): every row ``[..., K]`` (``K % group == 0``) is split into
``K / group`` groups; each group ``v`` (a row vector) becomes ``v @ H``, in float32 with this
FIXED evaluation order, which every kernel reproduces (so the kernels are bit-exact):

    write a group index i in base 4: i = d_{k-1} 4^{k-1} + ... + d_1 4 + d_0.
    stage j = 0, 1, ..., k-1 (stride s = 4^j) combines the four entries a, b, c, d whose index
    differs only in d_j (d_j = 0, 1, 2, 3):
        p = a + b;  q = a - b;  w = c + d;  u = c - d
        a' = p + u;  b' = p - u;  c' = q + w;  d' = w - q       (= (a b c d) @ A)
    then every entry is multiplied by 2^-k (exact except for subnormal results).

Row quantization (symmetric, one scale per row), of the rotated row ``r`` (float32)::

    amax  = max_i |r_i|
    scale = amax / 127                 (float32 division);  1.0 when that is 0 (an all-zero
                                        row, or one so small that amax / 127 underflows)
    q_i   = clamp(round_half_even(r_i / scale), -127, 127)  as int8   (r_i / scale: a true
                                        IEEE float32 division, not a multiplication by 1/scale)

Inputs must be finite: a NaN or infinity gives unspecified (memory-safe) codes and scales.

``sd.quantize_i8_convrot.v1(x) {group}``: x float32 (bfloat16/float16 accepted: converted to
float32 first, exactly) ``[..., K]``, any layout; M = x.numel() // K rows.  The output is ONE
1-D int8 tensor, the packed layout (:func:`packed_nbytes`, :func:`unpack`)::

    Mp = M rounded up to a multiple of 4
    bytes [0, Mp*K)              the int8 rows, row-major; rows M .. Mp-1 are zeros
    bytes [Mp*K, Mp*K + 4*Mp)    the float32 row scales, native byte order (little-endian on
                                 every platform torch supports); padding rows' scale 0.0

Mp*K is a multiple of 4 for any K, so the scales are 4-byte aligned whenever the tensor is (a
fresh allocation always is) and :func:`unpack` returns views.

``sd.linear_i8.v1(x, w, [w_scale], [x_scale], [bias]) {x_kind, w_kind, group, m, lead,
has_bias}`` (sources in that order; ``w_scale`` present iff ``w_kind == "int8"``, ``x_scale``
iff ``x_kind == "int8"``, ``bias`` iff ``has_bias``)::

    out[m, n] = float32(int32_dot(q_x[m], q_w[n])) * x_scale[m] * w_scale[n] + bias[n]

evaluated left to right, each float32 product and the sum rounded (no fused multiply-add);
out is float32 ``lead + (N,)``.  The int32 dot product is exact: ``K <= MAX_K`` keeps it in
range.  Operands by kind:

- ``x_kind="float"``: x float32/bf16/fp16 ``[..., K]``, quantized as by
  ``sd.quantize_i8_convrot.v1 {group}`` (kernels do it into their workspace); lead = x's
  leading dims;
- ``x_kind="packed"``: x the packed output of ``sd.quantize_i8_convrot.v1`` with the SAME group
  as the weight's rotation; ``m`` (its rows, required) and ``lead`` (the leading output dims,
  ``prod(lead) == m``; ``()`` for a single row and an output of shape ``(N,)``) give the shape;
- ``x_kind="int8"``: x int8 ``[..., K]`` and ``x_scale`` float ``M`` elements (any shape);
- ``w_kind="int8"``: w int8 ``[N, K]``, already rotated (by ``group``) and quantized per output
  channel, and ``w_scale`` float ``N`` elements (:func:`quantize_weight_i8_reference` makes both
  ahead of time);
- ``w_kind="float"``: w the float weight ``[N, K]`` as the model has it (a graph input).  The
  reference re-quantizes it on every call; the kernels quantize it ONCE per model (every plan
  and step quantizing the same weight alike shares the value: ``WeightState``) and again only
  when the weight changes: they compare ``fxbackend.weights.weight_key(w)`` (address, layout
  and a fingerprint of the weight's bytes, computed every call) with the key of the value
  held, so in-place updates, ``.data`` writes (which keep the version counter), new storage
  and inference-mode tensors are all seen.

For ``x_kind`` float/int8, ``m`` is -1 or x's row count and ``lead`` is ``()`` or x's leading
dims.  ``group`` must divide K for every kind (for int8/packed operands it names the rotation
the producer applied).  Scales and bias: float32, bfloat16 or float16 (converted to float32,
exactly); the kernels take float32 1-D contiguous scales and 1-D contiguous biases (any float
dtype) and decline the rest (the reference then runs).

``torch.library`` ops (namespace ``fxbackend``), so model code can call them eagerly (they run
the references; a float weight on the CPU takes the codes the CPU's int8 kernels take, so eager
and compiled calls agree) and Dynamo traces each as one node; the rewrite rule ``int8_library_ops``
turns those nodes into the ``sd.*.v1`` ops above::

    torch.ops.fxbackend.quantize_i8_convrot(x, group)
    torch.ops.fxbackend.linear_i8(x, w, w_scale, x_scale, bias, x_kind, w_kind, group=1, m=-1,
                                  lead=None)

``m``/``lead`` may be symbolic sizes (``dynamic=True``): every plan rewrites with its concrete
values.  A plan whose graph holds these ``fxbackend::`` calls cannot be saved yet
(``fxbackend.save`` names only ATen ops and registered ``sd.*`` ops).

Kernels: ``cpu_kernels/int8.py`` (numba + ``torch._int_mm``), ``cuda_kernels/int8.py`` (Triton +
``torch._int_mm``); tests: ``tests/test_int8.py``; benchmark: ``scripts/bench_int8.py``.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.weights import cell as derived_cell, weight_key
from fxbackend.cpu import int8_weight_max, int_mm_exact

__all__ = ["REGULAR_HADAMARD_GROUPS", "MAX_K", "QMAX", "X_KINDS", "W_KINDS", "hadamard",
           "hadamard_stages", "rotate_reference", "quantize_rows_reference", "packed_nbytes",
           "padded_rows", "pack", "unpack", "quantize_i8_convrot_reference",
           "quantize_weight_i8_reference", "int_dot", "linear_i8_reference", "check_linear",
           "linear_node_operands", "linear_srcs", "linear_node_why_not", "scales_why_not",
           "WeightState", "FLOATS", "Int8Device", "QuantizeKernel", "LinearKernel",
           "quantize_packed", "quantize_direct", "x_operand", "run_linear", "float_operands",
           "compile_quantized_operands", "QuantizeI8ConvRot", "LinearI8", "Int8LibraryOps",
           "quantize_i8_convrot", "linear_i8"]

#: the orders of the normalised regular Hadamard matrices (4^k, k = 0..4); 1 = no rotation
REGULAR_HADAMARD_GROUPS = (1, 4, 16, 64, 256)
#: the largest K whose int32 dot products cannot overflow (|q| <= 128: 128 * 128 * K < 2^31)
MAX_K = (2 ** 31 - 1) // (128 * 128)
#: the largest code of the symmetric quantization
QMAX = 127
X_KINDS = ("float", "packed", "int8")
W_KINDS = ("int8", "float")
#: the float dtypes the ops and kernels take (x to quantize, float weights, scales, bias)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


# -- Hadamard matrices and the rotation ---------------------------------------------------------

def hadamard_stages(group: Any) -> int:
    """k with ``group == 4^k`` for a group of :data:`REGULAR_HADAMARD_GROUPS`; ValueError
    otherwise (naming the attribute and the allowed values)."""
    if isinstance(group, bool) or not isinstance(group, int) or \
            group not in REGULAR_HADAMARD_GROUPS:
        raise ValueError(f"group must be one of {REGULAR_HADAMARD_GROUPS} (the orders of the "
                         f"regular Hadamard matrices; 1 = no rotation), got {group!r}")
    return (group.bit_length() - 1) // 2


def hadamard(group: int) -> torch.Tensor:
    """The normalised regular Hadamard matrix of order ``group`` (float32 ``[group, group]``):
    ``2^-k (A (x) ... (x) A)`` (k factors, ``group = 4^k``) with ``A`` the order-4 regular
    Hadamard matrix of the module docstring; ``[[1.]]`` for group 1.  Orthogonal
    (``H @ H.T == I``), symmetric, every row and column summing to 1 (regular).  Source:
    ConvRot (Huang et al., arXiv 2512.03673), which rotates by regular Hadamard matrices."""
    k = hadamard_stages(group)
    a = torch.tensor(_H4, dtype=torch.float32)
    h = torch.ones(1, 1, dtype=torch.float32)
    for _ in range(k):
        h = torch.kron(h, a)
    return h * (2.0 ** -k)


def rotate_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` (float ``[..., K]``, ``K % group == 0``) rotated group-wise, ``v -> v @
    hadamard(group)`` for every group ``v`` of ``group`` consecutive features of a row, in
    float32 with the butterfly order of the module docstring (the kernels' order: bit-exact).
    Returns a new float32 tensor of x's shape."""
    k = hadamard_stages(group)
    if x.dtype not in FLOATS:
        raise ValueError(f"rotate_reference: x must be float32, bfloat16 or float16, got "
                         f"{x.dtype}")
    if x.dim() == 0 or x.shape[-1] % group:
        raise ValueError(f"rotate_reference: x's last dim must be a multiple of group={group}, "
                         f"got shape {tuple(x.shape)}")
    r = x.to(torch.float32).contiguous()
    if k == 0:
        return r.clone()
    K = r.shape[-1]
    t = r.reshape(-1, K)
    s = 1
    for _ in range(k):
        a, b, c, d = t.reshape(t.shape[0], K // (4 * s), 4, s).unbind(2)
        p, q, w, u = a + b, a - b, c + d, c - d
        t = torch.stack((p + u, p - u, q + w, w - q), dim=2)
        s *= 4
    return (t * (2.0 ** -k)).reshape(r.shape)


def quantize_rows_reference(r: torch.Tensor, qmax: int = QMAX) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """Symmetric per-row int8 quantization of float32 rows ``r [M, K]`` (module docstring):
    ``(q int8 [M, K], scale float32 [M])`` with ``scale = max|r| / qmax`` (1.0 where that is
    0) and ``q = clamp(round_half_even(r / scale), -qmax, qmax)``; ``qmax`` 127 (8-bit codes)
    unless a GEMM engine needs fewer bits (63: ``fxbackend.cpu.int8_weight_max``)."""
    if not isinstance(qmax, int) or not 1 <= qmax <= QMAX:
        raise ValueError(f"quantize_rows_reference: qmax must be an int in [1, {QMAX}], got "
                         f"{qmax!r}")
    r = r.to(torch.float32)
    if r.shape[-1] == 0:
        return torch.zeros(r.shape, dtype=torch.int8, device=r.device), \
            torch.ones(r.shape[:-1], dtype=torch.float32, device=r.device)
    scale = r.abs().amax(dim=-1) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(r / scale.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


# -- the packed layout -------------------------------------------------------------------------

def padded_rows(m: Any) -> Any:
    """``m`` rounded up to a multiple of 4 (the rows of the packed layout)."""
    return (m + 3) // 4 * 4


def packed_nbytes(m: Any, k: Any) -> Any:
    """Bytes of the packed layout of ``m`` rows of ``k`` features: ``Mp*k + 4*Mp`` with
    ``Mp = padded_rows(m)`` (int8 rows, then float32 scales; module docstring)."""
    mp = padded_rows(m)
    return mp * k + 4 * mp


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed layout of int8 rows ``q [M, K]`` and their float32 scales ``scale [M]``: a new
    1-D int8 tensor of :func:`packed_nbytes` bytes (padding rows zero, their scales 0.0)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack: q must be int8 [M, K], got {q.dtype} {tuple(q.shape)}")
    m, k = q.shape
    if scale.dtype != torch.float32 or scale.numel() != m:
        raise ValueError(f"pack: scale must be float32 with {m} elements, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    mp = padded_rows(m)
    out = torch.zeros(packed_nbytes(m, k), dtype=torch.int8, device=q.device)
    out[:m * k] = q.reshape(-1)
    out[mp * k: mp * k + 4 * m] = scale.reshape(-1).contiguous().view(torch.int8)
    return out


def unpack(packed: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [m, k], scale float32 [m])`` of a packed tensor (1-D int8 of
    ``packed_nbytes(m, k)`` bytes, contiguous): views of ``packed`` (no copy) when its scales
    are 4-byte aligned in its storage, which holds for any tensor whose storage offset is a
    multiple of 4; else the scales are a copy.  ValueError for a tensor of another size."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int8 or packed.dim() != 1:
        raise ValueError(f"unpack: packed must be a 1-D int8 tensor, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} "
                         f"{tuple(getattr(packed, 'shape', ()))}")
    if m < 0 or k < 0 or packed.numel() != packed_nbytes(m, k):
        raise ValueError(f"unpack: {m} rows of {k} features take {packed_nbytes(m, k)} bytes "
                         f"packed, got a tensor of {packed.numel()}")
    if not packed.is_contiguous():
        packed = packed.contiguous()
    mp = padded_rows(m)
    q = packed[:m * k].view(m, k)
    sb = packed[mp * k: mp * k + 4 * m]
    if sb.storage_offset() % 4:
        sb = sb.clone()
    return q, sb.view(torch.float32)


def quantize_node_why_not(node: Any, why_not_x: Callable[[Any, Any], "str | None"]) -> str | None:
    """Why a kernel does not compute the ``sd.quantize_i8_convrot.v1`` node ``node``, or None:
    one source, ``why_not_x(x_meta, group)`` (the kernel's own conditions on x), and the
    node's output being the packed int8 vector on x's device.  Never raises."""
    try:
        if len(node.srcs) != 1:
            return f"{len(node.srcs)} sources"
        x = node.srcs[0].meta
        why = why_not_x(x, node.params.get("group"))
        if why is None:
            k = x.shape[-1]
            if tuple(node.meta.shape) != (packed_nbytes(x.numel // k, k),) or \
                    node.meta.dtype != torch.int8 or node.meta.device != x.device:
                why = "output metadata"
        return why
    except Exception as exc:
        return f"node not understood ({type(exc).__name__}: {exc})"


def quantize_i8_convrot_reference(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """The meaning of ``sd.quantize_i8_convrot.v1(x) {group}``: rotate (:func:`rotate_reference`),
    quantize each row (:func:`quantize_rows_reference`), pack (:func:`pack`)."""
    _check_quantize_x(x, group, "quantize_i8_convrot_reference")
    K = x.shape[-1]
    r = rotate_reference(x, group).reshape(-1, K)
    return pack(*quantize_rows_reference(r))


def quantize_weight_i8_reference(w: torch.Tensor, group: int = 1,
                                 qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """An ahead-of-time weight for ``sd.linear_i8.v1 {w_kind="int8", group}``: ``w`` (float
    ``[N, K]``, ``K % group == 0``) rotated along K like the activations and quantized per
    output channel: ``(w_i8 int8 [N, K], w_scale float32 [N])`` with ``w_scale[n] =
    max|rotated row n| / qmax`` (127 by default) and the rounding of the module docstring.
    Save both and pass them as the ``w`` and ``w_scale`` sources."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"quantize_weight_i8_reference: w must be a 2-D [N, K] tensor, got "
                         f"{tuple(getattr(w, 'shape', ()))}")
    _check_quantize_x(w, group, "quantize_weight_i8_reference")
    return quantize_rows_reference(rotate_reference(w, group), qmax)


def int_dot(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """``qx [M, K] int8 @ qw [N, K].T`` exactly, as int32 ``[M, N]``: ``torch._int_mm`` where it
    runs and is exact (the CPU: any shape, where its kernels do not saturate:
    ``fxbackend.cpu.int_mm_exact``; CUDA: M > 16, K and N multiples of 8), else a float64
    matmul, which is exact here (every partial sum is an integer below 2^31 < 2^53)."""
    M, K = qx.shape
    N = qw.shape[0]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, dtype=torch.int32, device=qx.device)
    qx, qw = qx.contiguous(), qw.contiguous()
    if (qx.device.type == "cpu" and int_mm_exact()) or (
            qx.device.type == "cuda" and M > 16 and K % 8 == 0 and N % 8 == 0):
        return torch._int_mm(qx, qw.t())
    return (qx.double() @ qw.double().t()).to(torch.int32)


def linear_i8_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                        x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                        *, x_kind: str, w_kind: str, group: int = 1, m: int = -1,
                        lead: Sequence[int] = (), w_qmax: int = QMAX) -> torch.Tensor:
    """The meaning of ``sd.linear_i8.v1`` in plain torch (module docstring): float32
    ``lead + (N,)``.  ``w_kind="float"`` quantizes the weight on every call, with codes up to
    ``w_qmax`` (127; a CPU kernel on the quantized linear engine without VNNI uses 63:
    ``fxbackend.cpu.int8_weight_max``)."""
    M, K, N, lead = check_linear(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                                 group=group, m=m, lead=lead, who="linear_i8_reference")
    if x_kind == "float":
        qx, xs = unpack(quantize_i8_convrot_reference(x.reshape(M, K), group), M, K)
    elif x_kind == "packed":
        qx, xs = unpack(x, M, K)
    else:
        qx, xs = x.reshape(M, K), x_scale.reshape(M).to(torch.float32)
    if w_kind == "float":
        qw, ws = quantize_weight_i8_reference(w, group, w_qmax)
    else:
        qw, ws = w, w_scale.reshape(N).to(torch.float32)
    out = int_dot(qx, qw).to(torch.float32) * xs.unsqueeze(1) * ws.unsqueeze(0)
    if bias is not None:
        out = out + bias.reshape(N).to(torch.float32)
    return out.reshape(*lead, N)


class WeightState:
    """A float weight quantized by a kernel for ``sd.linear_i8.v1 {w_kind="float"}``: the
    model's value (``fxbackend.weights``: one per weight, group and quantizer, shared by every
    plan and step that quantizes that weight alike), re-derived only when the weight changes.

    ``get(w, group, quantize)`` returns ``(w_i8 [N, K] int8, w_scale [N] float32)``, calling
    ``quantize(w, group, w_i8, w_scale)`` (the kernel's own row quantizer, writing into the two
    tensors) when ``fxbackend.weights.weight_key(w)`` (address, layout and a fingerprint of the
    bytes, so ``.data`` writes are seen too) differs from the key of the value held.
    ``quantized`` counts the quantizations this state ran.  Thread-safe.

    The cell of the last call is kept with the weight object, group, quantizer and variant it
    was found for (``_last``): a plan passes the same weight every call, so the per-call cost
    is the weight key and that comparison, not a description and a cell lookup (about 50 us a
    step in a W8A8 Flux call on 2 threads of an AVX2-only EPYC, 20 steps a call)."""

    __slots__ = ("n", "k", "device", "quantized", "_held", "_last")

    #: serialises quantizations (rare: first use and weight changes), not the checks
    _lock = threading.Lock()

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        self.n, self.k, self.device = n, k, device
        self.quantized = 0
        self._held: dict = {}  # keeps the shared cells this state used alive
        #: (weakref to the weight, group, quantizer, variant, cell) of the last call
        self._last: tuple | None = None

    def get(self, w: torch.Tensor, group: int, quantize) -> tuple[torch.Tensor, torch.Tensor]:
        key = weight_key(w)
        variant = getattr(quantize, "variant", None)  # a quantizer with variants names the
        # one it runs now (the CPU's: the largest code its GEMM engine takes)
        variant = None if variant is None else variant()
        last = self._last
        if last is not None and last[0]() is w and last[1] == group and \
                last[2] is quantize and last[3] == variant:
            c = last[4]  # held by self._held while w lives: the cell a lookup would find
        else:
            what = ("sd.linear_i8.v1 weight", group, self.n, self.k, str(self.device),
                    getattr(quantize, "__module__", ""), getattr(quantize, "__qualname__", ""),
                    variant)
            c = derived_cell((w,), what, self._held)
            try:
                self._last = (weakref.ref(w), group, quantize, variant, c)
            except TypeError:  # a tensor without weak references: look it up every call
                self._last = None
        pair = c._pair
        if pair[0] != key:
            with self._lock:
                pair = c._pair
                if pair[0] != key:
                    w_i8 = torch.empty(self.n, self.k, dtype=torch.int8, device=self.device)
                    w_scale = torch.empty(self.n, dtype=torch.float32, device=self.device)
                    quantize(w if w.is_contiguous() else w.contiguous(), group, w_i8, w_scale)
                    pair = (key, (w_i8, w_scale))
                    c.set(*pair)
                    self.quantized += 1
        return pair[1]


# -- checks (graph-build time; shared by the ops, the references and the fake kernels) -------

def _shape(t: Any) -> tuple:
    return tuple(t.shape)


def _numel(t: Any) -> Any:
    n = 1
    for s in t.shape:
        n *= s
    return n


def _check_quantize_x(x: Any, group: Any, who: str) -> None:
    hadamard_stages(group)
    if x.dtype not in FLOATS:
        raise ValueError(f"{who}: x must be float32, bfloat16 or float16 (it is quantized), got "
                         f"{x.dtype}")
    if len(_shape(x)) == 0 or x.shape[-1] == 0:
        raise ValueError(f"{who}: x must have a non-empty feature (last) dim, got shape "
                         f"{_shape(x)}")
    if x.shape[-1] % group:
        raise ValueError(f"{who}: x's last dim K={x.shape[-1]} must be a multiple of "
                         f"group={group} (whole rotation groups)")


def check_linear(x: Any, w: Any, w_scale: Any, x_scale: Any, bias: Any, *, x_kind: Any,
                 w_kind: Any, group: Any, m: Any, lead: Any, who: str = "sd.linear_i8.v1"
                 ) -> tuple:
    """Check the operands (tensors or their metadata: ``.shape``/``.dtype``; None: absent) and
    attributes of ``sd.linear_i8.v1``; returns ``(M, K, N, lead)``.  ValueError naming the
    input or attribute and what was expected."""
    if x_kind not in X_KINDS:
        raise ValueError(f"{who}: x_kind must be one of {X_KINDS}, got {x_kind!r}")
    if w_kind not in W_KINDS:
        raise ValueError(f"{who}: w_kind must be one of {W_KINDS}, got {w_kind!r}")
    hadamard_stages(group)
    if len(_shape(w)) != 2:
        raise ValueError(f"{who}: w must be 2-D [N, K], got shape {_shape(w)}")
    N, K = w.shape
    if w_kind == "int8" and w.dtype != torch.int8:
        raise ValueError(f"{who}: w_kind='int8' needs an int8 w, got {w.dtype}")
    if w_kind == "float" and w.dtype not in FLOATS:
        raise ValueError(f"{who}: w_kind='float' needs a float32, bfloat16 or float16 w, got "
                         f"{w.dtype}")
    if K == 0 or K % group:
        raise ValueError(f"{who}: K={K} (w's and x's last dim) must be a positive multiple of "
                         f"group={group}")
    if K > MAX_K:
        raise ValueError(f"{who}: K={K} is over MAX_K={MAX_K} (an int32 dot product of int8 "
                         f"rows could overflow)")
    lead_attr = tuple(lead) if lead is not None else ()
    if x_kind == "packed":
        if x.dtype != torch.int8 or len(_shape(x)) != 1:
            raise ValueError(f"{who}: x_kind='packed' needs x as the 1-D int8 output of "
                             f"sd.quantize_i8_convrot.v1, got {x.dtype} {_shape(x)}")
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
            raise ValueError(f"{who}: x_kind='packed' needs the attribute m (x's rows, >= 0), "
                             f"got {m!r}")
        if math.prod(lead_attr) != m:
            raise ValueError(f"{who}: lead {lead_attr} must multiply to m={m} (the leading "
                             f"dims of the output)")
        if x.shape[0] != packed_nbytes(m, K):
            raise ValueError(f"{who}: packed x of m={m} rows of K={K} features has "
                             f"{packed_nbytes(m, K)} bytes, got {x.shape[0]}")
        M, lead_out = m, lead_attr
    else:
        want = "a float32, bfloat16 or float16" if x_kind == "float" else "an int8"
        if (x_kind == "float" and x.dtype not in FLOATS) or \
                (x_kind == "int8" and x.dtype != torch.int8):
            raise ValueError(f"{who}: x_kind={x_kind!r} needs {want} x, got {x.dtype}")
        if len(_shape(x)) == 0 or x.shape[-1] != K:
            raise ValueError(f"{who}: x must be [..., K] with K={K} (w's last dim), got shape "
                             f"{_shape(x)}")
        lead_out = _shape(x)[:-1]
        M = math.prod(lead_out)
        if m != -1 and m != M:
            raise ValueError(f"{who}: m={m!r} must be -1 or x's row count {M}")
        if lead_attr and lead_attr != lead_out:
            raise ValueError(f"{who}: lead {lead_attr} must be () or x's leading dims "
                             f"{lead_out}")
    for name, t, needed, n in (("w_scale", w_scale, w_kind == "int8", N),
                               ("x_scale", x_scale, x_kind == "int8", M)):
        why = "w_kind='int8'" if name == "w_scale" else "x_kind='int8'"
        if needed and t is None:
            raise ValueError(f"{who}: {why} needs the source {name} ({n} float32 scales)")
        if not needed and t is not None:
            raise ValueError(f"{who}: {name} is a source only with {why}")
        if t is not None:
            if t.dtype not in FLOATS:
                raise ValueError(f"{who}: {name} must be float32 (or bfloat16/float16), got "
                                 f"{t.dtype}")
            if _numel(t) != n:
                raise ValueError(f"{who}: {name} must have {n} elements (one per "
                                 f"{'output channel' if name == 'w_scale' else 'row of x'}), "
                                 f"got shape {_shape(t)}")
    if bias is not None:
        if bias.dtype not in FLOATS:
            raise ValueError(f"{who}: bias must be float32, bfloat16 or float16, got "
                             f"{bias.dtype}")
        if _numel(bias) != N:
            raise ValueError(f"{who}: bias must have N={N} elements, got shape {_shape(bias)}")
    return M, K, N, tuple(lead_out)


def linear_srcs(srcs: Sequence, attrs: dict) -> dict:
    """The sources of an ``sd.linear_i8.v1`` node by name (``w_scale``, ``x_scale``, ``bias``
    None when absent), from their order and the attributes; ValueError for a wrong count."""
    names = ["x", "w"]
    if attrs.get("w_kind") == "int8":
        names.append("w_scale")
    if attrs.get("x_kind") == "int8":
        names.append("x_scale")
    if attrs.get("has_bias", False):
        names.append("bias")
    if len(srcs) != len(names):
        raise ValueError(f"sd.linear_i8.v1: with x_kind={attrs.get('x_kind')!r}, "
                         f"w_kind={attrs.get('w_kind')!r}, has_bias={attrs.get('has_bias')} the "
                         f"sources are ({', '.join(names)}), got {len(srcs)} sources")
    got = dict(zip(names, srcs))
    return {k: got.get(k) for k in ("x", "w", "w_scale", "x_scale", "bias")}


def linear_node_operands(node) -> tuple[dict, int, int, int, str | None]:
    """``(operand metadata by name, M, K, N, why)`` of an ``sd.linear_i8.v1`` node, checked by
    :func:`check_linear`; ``why`` is "output metadata" when the node's output is not the
    contiguous float32 ``[*lead, N]`` it must be (else None).  Raises what ``check_linear``
    raises (the kernels' ``why_not`` turn it into a reason)."""
    p = node.params
    s = linear_srcs([n.meta for n in node.srcs], p)
    M, K, N, lead = check_linear(**s, x_kind=p["x_kind"], w_kind=p["w_kind"], group=p["group"],
                                 m=p["m"], lead=p["lead"])
    out = node.meta
    ok = isinstance(out, TensorMeta) and out.dtype == torch.float32 and \
        tuple(out.shape) == tuple(lead) + (N,) and out.is_contiguous
    return s, M, K, N, None if ok else "output metadata"



def linear_node_why_not(node, why_not_operands: Callable[..., "str | None"]) -> str | None:
    """Why a kernel does not compute the ``sd.linear_i8.v1`` node ``node``, or None:
    :func:`linear_node_operands` (its checks and the output's metadata), then
    ``why_not_operands(s, M, K, N, node)`` (the kernel's own conditions on the operand metadata
    ``s`` by name).  Never raises."""
    try:
        s, M, K, N, why = linear_node_operands(node)
        return why if why is not None else why_not_operands(s, M, K, N, node)
    except Exception as exc:  # never raise: decline
        return f"node not understood ({type(exc).__name__}: {exc})"


def _is_vector(t: Any, n: int) -> bool:
    return isinstance(t, TensorMeta) and tuple(t.shape) == (n,) and t.is_contiguous


def scales_why_not(s: dict, M: int, N: int, bias_dtypes: tuple = FLOATS) -> str | None:
    """What every linear kernel asks of the scales and the bias (operand metadata ``s`` by
    name): float32 1-D contiguous ``w_scale [N]`` / ``x_scale [M]``, a 1-D contiguous bias
    ``[N]`` of ``bias_dtypes``."""
    for name, n in (("w_scale", N), ("x_scale", M)):
        t = s[name]
        if t is not None and (t.dtype != torch.float32 or not _is_vector(t, n)):
            return f"{name} must be float32 [{n}] contiguous, got {t.short()}"
    b = s["bias"]
    if b is not None and (b.dtype not in bias_dtypes or not _is_vector(b, N)):
        return f"bias must be [{N}] contiguous, got {b.short()}"
    return None

# -- the ops ------------------------------------------------------------------------------------

class QuantizeI8ConvRot:
    """``sd.quantize_i8_convrot.v1(x) {group}``: module docstring."""

    name = "sd.quantize_i8_convrot.v1"
    attrs = {"group": (int, 1)}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) != 1:
            raise ValueError(f"{self.name}: takes one source (x), got {len(srcs)}")
        x = srcs[0]
        _check_quantize_x(x, attrs["group"], self.name)
        K = x.shape[-1]
        return TensorMeta.contiguous((packed_nbytes(_numel(x) // K, K),), torch.int8, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        out.copy_(quantize_i8_convrot_reference(inputs[0], node.params["group"]))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"group": int}``."""
        return {"group": node.params["group"]}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data (``infer_meta`` checks the value)."""
        return {"group": data["group"]}


class LinearI8:
    """``sd.linear_i8.v1(x, w, [w_scale], [x_scale], [bias]) {x_kind, w_kind, group, m, lead,
    has_bias}``: module docstring."""

    name = "sd.linear_i8.v1"
    attrs = {"x_kind": str, "w_kind": str, "group": (int, 1), "m": (int, -1),
             "lead": (tuple, ()), "has_bias": (bool, False)}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        s = linear_srcs(srcs, attrs)
        _, _, N, lead = check_linear(**s, x_kind=attrs["x_kind"], w_kind=attrs["w_kind"],
                                     group=attrs["group"], m=attrs["m"], lead=attrs["lead"],
                                     who=self.name)
        dev = s["x"].device
        for name, t in s.items():
            if t is not None and t.device != dev:
                raise ValueError(f"{self.name}: {name} is on {t.device}, x on {dev}")
        return TensorMeta.contiguous(lead + (N,), torch.float32, dev)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device; re-quantizes a float
        weight on every call)."""
        p = node.params
        s = linear_srcs(inputs, p)
        out.copy_(linear_i8_reference(**s, x_kind=p["x_kind"], w_kind=p["w_kind"],
                                      group=p["group"], m=p["m"], lead=p["lead"]))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"x_kind", "w_kind", "group", "m", "lead" (a list),
        "has_bias"}``."""
        p = node.params
        return {"x_kind": p["x_kind"], "w_kind": p["w_kind"], "group": p["group"],
                "m": p["m"], "lead": list(p["lead"]), "has_bias": p["has_bias"]}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data (``lead`` back to a tuple of ints)."""
        lead = data["lead"]
        if not isinstance(lead, list) or not all(type(v) is int for v in lead):
            raise ValueError(f"{self.name}: lead must be a list of ints, got {lead!r}")
        return {"x_kind": data["x_kind"], "w_kind": data["w_kind"], "group": data["group"],
                "m": data["m"], "lead": tuple(lead), "has_bias": data["has_bias"]}



# -- the registry kernels of one device: the skeleton the CPU and CUDA kernels share -------------

@dataclasses.dataclass
class Int8Device:
    """One device's INT8 building blocks (``cpu_kernels/int8.py``, ``cuda_kernels/int8.py``).
    :class:`QuantizeKernel` and :class:`LinearKernel` make the registry kernels of both ops from
    them, and ``patterns/int8_fusions.py`` every fused step that runs a linear, so the phases,
    the workspace layout, the weight state and the strides fix-up are written once.  The
    functions check nothing (the ``why_not_*`` do, and never raise)."""

    #: ``(x, group, q, scales, m, mp)``: the ``m`` rows of the contiguous float x (``[..., K]``)
    #: into ``q`` (int8, ``mp * K``) and ``scales`` (float32, ``mp``; rows ``m .. mp-1`` zeros
    #: and 0.0)
    quantize_rows: Callable
    #: ``(qx, qw, acc) -> accumulator``: ``qx @ qw.T`` into the storage of the int32 ``acc``
    #: (``torch._int_mm`` on the device's current stream), returned as the tensor it wrote:
    #: ``acc``, or a new float32 tensor holding the int32 sums' float32 values (the CPU's
    #: prepacked engines); the kernels after it take either
    gemm: Callable
    #: ``(acc, out, xs, ws, bias)``: linear_i8's epilogue of the ``[M, N]`` accumulator (int32
    #: or float32, as ``gemm`` returned it) into out (M * N contiguous elements, float32,
    #: possibly acc's own storage, or 16-bit)
    epilogue: Callable
    #: ``(x meta, group) -> reason | None``: the quantize kernel's conditions on x
    why_not_quantize: Callable
    #: ``(node) -> reason | None``: the linear kernels' conditions on an ``sd.linear_i8.v1`` node
    why_not_linear: Callable
    #: ``(x meta, m, mp, group, device)``: plan-time compile (or warm-up) of the quantize kernel
    #: for ``m`` rows of x written as ``mp``
    compile_quantize: Callable
    #: ``(m, n, bias dtype or None, out dtype, device, w_kind)``: the same for the epilogue
    #: of a linear whose weight is of ``w_kind`` (the accumulator's dtype may depend on it)
    compile_epilogue: Callable
    #: ``(w, group, w_i8, w_scale)``: a float weight ``[N, K]`` into its int8 rows and scales
    #: (``WeightState``'s quantizer: the held value is shared by the steps quantizing with the
    #: same function, so each device names its own)
    quantize_weight: Callable
    #: ``()``, called between the phases of a step (after the operands are quantized, after
    #: the GEMM): the CPU's raises ``services.Cancelled`` when the running plan was cancelled
    between: Callable = lambda: None
    #: ``(w_kind) -> bool``: plan time, whether ``gemm`` writes the int32 accumulator it is
    #: given for a weight of ``w_kind`` (False: it returns a new tensor, so a fused step
    #: reserves no accumulator space and passes ``acc=None``; the CPU's prepacked engines)
    gemm_writes_acc: Callable = lambda w_kind: True


def quantize_packed(dev: Int8Device, x, group: int, packed, m: int, k: int) -> None:
    """The ``m`` rows of the contiguous x into the packed layout ``packed`` (module docstring)."""
    mp = padded_rows(m)
    dev.quantize_rows(x, group, packed[:mp * k], packed[mp * k:mp * k + 4 * mp].view(torch.float32),
                      m, mp)


def quantize_direct(dev: Int8Device, who: str, x, group: int, out=None):
    """A direct call (tests, benchmarks) of ``dev``'s quantize kernel on an x it takes: the
    packed layout, into ``out`` when given (a contiguous 1-D int8 tensor of
    ``packed_nbytes(M, K)`` bytes on x's device at a storage offset divisible by 4: the float32
    scales must be aligned; ValueError naming ``who`` otherwise), else a new tensor."""
    k = x.shape[-1]
    m = x.numel() // k
    nb = packed_nbytes(m, k)
    if out is None:
        out = torch.empty(nb, dtype=torch.int8, device=x.device)
    elif out.dtype != torch.int8 or tuple(out.shape) != (nb,) or not out.is_contiguous() or \
            out.storage_offset() % 4 or out.device != x.device:
        raise ValueError(f"{who}: out must be a contiguous 1-D int8 tensor of {nb} bytes on "
                         f"{x.device} at a storage offset divisible by 4")
    quantize_packed(dev, x, group, out, m, k)
    return out


def x_operand(dev: Int8Device, x_kind: str, group: int, M: int, K: int, x, x_scale,
              buf) -> tuple:
    """``(q_x [M, K], x_scale [M])`` of a linear's x: quantized into ``buf`` (``x_kind="float"``:
    :func:`packed_nbytes` bytes of int8) or read in place (packed, int8)."""
    if x_kind == "float":
        quantize_packed(dev, x, group, buf, M, K)
        return unpack(buf, M, K)
    if x_kind == "packed":
        return unpack(x, M, K)
    return x.view(M, K), x_scale


def run_linear(dev: Int8Device, x_kind: str, group: int, M: int, K: int, N: int, x, x_scale,
               qw, ws, bias, out, workspace) -> None:
    """``sd.linear_i8.v1`` into ``out`` (float32, contiguous, M * N elements) with an int8
    weight ``qw``/``ws``: x quantized into the workspace (``x_kind="float"``; a temporary where
    the workspace is missing or short) or read in place, the GEMM into out's own storage (the
    accumulator, int32 or float32), then the epilogue in place."""
    if M == 0:
        return
    buf = None
    if x_kind == "float":
        nb = packed_nbytes(M, K)
        buf = (workspace[:nb].view(torch.int8) if workspace is not None and
               workspace.numel() >= nb else torch.empty(nb, dtype=torch.int8, device=x.device))
    qx, xs = x_operand(dev, x_kind, group, M, K, x, x_scale, buf)
    dev.between()
    acc = dev.gemm(qx, qw, out.view(torch.int32).view(M, N))
    dev.between()
    dev.epilogue(acc, out, xs, ws, bias)


def float_operands(node, s: dict, M: int, N: int) -> list:
    """``[(metadata, rows, padded rows)]`` of the float operands an ``sd.linear_i8.v1`` step
    quantizes (x into the packed layout, a float weight into its state)."""
    p = node.params
    return ([(s["x"], M, padded_rows(M))] if p["x_kind"] == "float" else []) + \
        ([(s["w"], N, N)] if p["w_kind"] == "float" else [])


def compile_quantized_operands(dev: Int8Device, node) -> tuple:
    """Plan time: compile the quantize kernel for the float operands of the ``sd.linear_i8.v1``
    node; returns ``(operand metadata by name, M, K, N)``."""
    p = node.params
    s = linear_srcs([n.meta for n in node.srcs], p)
    M, K, N, _ = check_linear(**s, x_kind=p["x_kind"], w_kind=p["w_kind"], group=p["group"],
                              m=p["m"], lead=p["lead"])
    for t, rows, mp in float_operands(node, s, M, N):
        dev.compile_quantize(t, rows, mp, p["group"], node.meta.device)
    return s, M, K, N


class QuantizeKernel:
    """The registry kernel of ``sd.quantize_i8_convrot.v1`` on one device (``dev``): contiguous
    float32/bf16/fp16 x, any K divisible by the group (``dev.why_not_quantize``).  Workspace:
    none."""

    op = "sd.quantize_i8_convrot.v1"

    def __init__(self, dev: Int8Device, name: str, priority: int = 0,
                 capture_safe: bool | None = None) -> None:
        self.dev, self.name, self.priority = dev, name, priority
        #: None: not declared (``fxbackend.cudagraphs``)
        self.capture_safe = capture_safe

    def why_not(self, node) -> str | None:
        """None when this kernel computes ``node``, else the reason (never raises)."""
        return quantize_node_why_not(node, self.dev.why_not_quantize)

    def supports(self, node) -> bool:
        return self.why_not(node) is None

    def compile(self, node) -> None:
        x = node.srcs[0].meta
        m = x.numel // x.shape[-1]
        self.dev.compile_quantize(x, m, padded_rows(m), node.params["group"], x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        x = inputs[0]
        if not x.is_contiguous():  # other strides than planned (the Dynamo path): stay right
            x = x.contiguous()
        k = x.shape[-1]
        quantize_packed(self.dev, x, node.params["group"], out, x.numel() // k, k)


class _LinearState:
    """Per-step state: the shapes, and for ``w_kind="float"`` the weight this step quantized
    (``weight``: a :class:`WeightState` on the step's device)."""

    __slots__ = ("M", "K", "N", "weight")

    def __init__(self, M: int, K: int, N: int, w_kind: str, device: torch.device) -> None:
        self.M, self.K, self.N = M, K, N
        self.weight = WeightState(N, K, device) if w_kind == "float" else None


class LinearKernel:
    """The registry kernel of ``sd.linear_i8.v1`` on one device (``dev``), for the weight kinds
    ``w_kinds`` (None: both): x quantized into the workspace (``x_kind="float"``), a float
    weight quantized into the step's state (:class:`WeightState`), the GEMM, the epilogue
    (:func:`run_linear`).  Workspace: the packed x (``packed_nbytes(M, K)`` bytes) for
    ``x_kind="float"``, else none."""

    op = "sd.linear_i8.v1"

    def __init__(self, dev: Int8Device, name: str, w_kinds: tuple | None = None,
                 priority: int = 0, capture_safe: bool | None = None) -> None:
        self.dev, self.name, self.w_kinds, self.priority = dev, name, w_kinds, priority
        #: None: not declared (``fxbackend.cudagraphs``)
        self.capture_safe = capture_safe

    def why_not(self, node) -> str | None:
        """None when this kernel computes ``node``, else the reason (never raises)."""
        if self.w_kinds is not None:
            w_kind = getattr(node, "params", {}).get("w_kind")
            if w_kind not in self.w_kinds:
                return f"w_kind {w_kind!r} is not this kernel's ({', '.join(self.w_kinds)})"
        return self.dev.why_not_linear(node)

    def supports(self, node) -> bool:
        return self.why_not(node) is None

    def compile(self, node) -> None:
        s, M, K, N = compile_quantized_operands(self.dev, node)
        self.dev.compile_epilogue(M, N, None if s["bias"] is None else s["bias"].dtype,
                                  torch.float32, node.meta.device, node.params["w_kind"])

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
            qw, ws = state.weight.get(s["w"], p["group"], self.dev.quantize_weight)
            self.dev.between()
        else:
            qw, ws = s["w"], s["w_scale"]
        run_linear(self.dev, p["x_kind"], p["group"], state.M, state.K, state.N, x,
                   s["x_scale"], qw, ws, s["bias"], out, workspace)

# -- torch.library twins and their rewrite -------------------------------------------------------

@torch.library.custom_op("fxbackend::quantize_i8_convrot", mutates_args=())
def quantize_i8_convrot(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1`` as a torch op (eager: the reference): the packed layout."""
    return quantize_i8_convrot_reference(x, group)


@quantize_i8_convrot.register_fake
def _quantize_i8_convrot_fake(x, group=1):
    _check_quantize_x(x, group, "fxbackend::quantize_i8_convrot")
    K = x.shape[-1]
    return x.new_empty((packed_nbytes(x.numel() // K, K),), dtype=torch.int8)


@torch.library.custom_op("fxbackend::linear_i8", mutates_args=())
def linear_i8(x: torch.Tensor, w: torch.Tensor, w_scale: Optional[torch.Tensor],
              x_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], x_kind: str,
              w_kind: str, group: int = 1, m: int = -1,
              lead: Optional[list[int]] = None) -> torch.Tensor:
    """``sd.linear_i8.v1`` as a torch op (eager: the reference); ``lead`` None means ``()``.
    A float weight on the CPU is quantized with the codes this CPU's int8 kernels take
    (``fxbackend.cpu.int8_weight_max``: 63 where they add pairs in saturating 16 bits), as
    the compiled step quantizes it, so eager and compiled calls agree on every CPU class."""
    w_qmax = int8_weight_max() if w_kind == "float" and w.device.type == "cpu" else QMAX
    return linear_i8_reference(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                               group=group, m=m, lead=tuple(lead or ()), w_qmax=w_qmax)


@linear_i8.register_fake
def _linear_i8_fake(x, w, w_scale, x_scale, bias, x_kind, w_kind, group=1, m=-1, lead=None):
    _, _, N, lead_out = check_linear(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                                     group=group, m=m, lead=tuple(lead or ()),
                                     who="fxbackend::linear_i8")
    return x.new_empty(tuple(lead_out) + (N,), dtype=torch.float32)


_LIB_QUANTIZE = "fxbackend.quantize_i8_convrot.default"
_LIB_LINEAR = "fxbackend.linear_i8.default"
_LINEAR_ARGS = ("x", "w", "w_scale", "x_scale", "bias")


class Int8LibraryOps:
    """Rewrite rule ``int8_library_ops``: the lowered ``torch.ops.fxbackend.*`` calls become
    the ops of this module::

        # fxbackend.quantize_i8_convrot(x, group)  =>  sd.quantize_i8_convrot.v1(x) {group}
        # fxbackend.linear_i8(x, w, ws?, xs?, b?, ...)  =>  sd.linear_i8.v1(x, w, [ws], [xs], [b])

    A call whose operands the op rejects stays as it is (it runs the torch op, which raises
    the same error eagerly)."""

    name = "int8_library_ops"

    def rewrite(self, graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op == _LIB_QUANTIZE:
                found = ([node.srcs[0]], {"group": node.params.get("group", 1)})
            elif node.op == _LIB_LINEAR:
                found = self._linear(node)
            else:
                continue
            if found is None or not isinstance(node.meta, TensorMeta):
                continue
            srcs, attrs = found
            op = QuantizeI8ConvRot.name if node.op == _LIB_QUANTIZE else LinearI8.name
            try:
                new = fxbackend.op_create(graph, op, srcs, attrs, after=node)
            except (ValueError, TypeError):
                continue
            if new.meta.dtype != node.meta.dtype or \
                    tuple(new.meta.shape) != tuple(node.meta.shape):
                graph.nodes.remove(new)
                continue
            fxbackend.replace_uses(graph, node, new)
            count += 1
        return count

    @staticmethod
    def _linear(node):
        present = dict(node.tensor_layout)
        it = iter(node.srcs)
        srcs = {}
        for name in _LINEAR_ARGS:
            srcs[name] = next(it, None) if present.get(name, False) else None
        if srcs["x"] is None or srcs["w"] is None:
            return None
        p = node.params
        lead = p.get("lead")
        attrs = {"x_kind": p.get("x_kind"), "w_kind": p.get("w_kind"),
                 "group": p.get("group", 1), "m": p.get("m", -1),
                 "lead": tuple(lead) if lead is not None else (),
                 "has_bias": srcs["bias"] is not None}
        if any(not isinstance(v, int) or isinstance(v, bool) for v in attrs["lead"]):
            return None  # a symbolic size: not a plain attribute
        if (srcs["w_scale"] is not None) != (attrs["w_kind"] == "int8") or \
                (srcs["x_scale"] is not None) != (attrs["x_kind"] == "int8"):
            return None  # the torch op raises the error eagerly; the op would misread sources
        return [s for s in srcs.values() if s is not None], attrs


fxbackend.register_op(QuantizeI8ConvRot)
fxbackend.register_op(LinearI8)
fxbackend.register_rewrite(Int8LibraryOps)
