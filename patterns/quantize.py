"""One option for users: ``options={"quantize": "w8a8", "convrot_group": 256}`` rewrites the
eligible linear layers of a graph into INT8 W8A8 steps (``sd.linear_i8.v1``, ``patterns/int8.py``).

The chain, as ATen gives a ``torch.nn.Linear`` on 2-D rows::

    wt  = aten.t.default(W)                      W a float weight graph input [N, K]
    y   = aten.addmm.default(bias, x, wt)        bias [N], beta = alpha = 1
        | aten.mm.default(x, wt)                 (no bias)

becomes (rule ``quantize_w8a8``; a rule that runs only when the option asks for it)::

    # addmm(bias, x, t(W)) | mm(x, t(W))
    #   =>  q = sd.quantize_i8_convrot.v1(x) {group}          one per x, shared by its linears
    #       sd.linear_i8.v1(q, W[, bias]) {x_kind=packed, w_kind=float, group, m=M, lead=(M,)}
    #       [-> _to_copy {dtype}]                             a bfloat16/float16 layer

x is rotated (ConvRot, ``convrot_group`` features) and quantized per row once, however many
linears read it (Q, K and V projections share one), and each linear runs the integer GEMM and
scales the int32 result by both scales; the same rotation is applied to W along K, so
``x W^T = (x H)(W H)^T``.  The linear's kernel quantizes W once per plan and again when W changes
in place (its version counter moves: a LoRA swap, ``update_weights``), so the weight stays a
float graph input and nothing else in the plan changes.  The explicit quantize step is also
what the fusions feeding the quantizer (a norm, an activation before it) claim.

Eligible: W a weight input (``is_weight``: a parameter or buffer, not an activation), 2-D on the
same device as x, x a 2-D [M, K], x, W and the bias (1-D [N]) all float32, all bfloat16 or all
float16, K and N multiples of 4, addmm's beta and alpha 1.  A 16-bit layer quantizes its 16-bit
x and W (the kernels read them as they are) and its float32 result is cast to the layer's dtype
(``_to_copy``): one rounding, as a 16-bit GEMM rounds its float32 accumulator; the CPU fuses
the cast into the linear's epilogue (``int8_linear_cast``).  The group of a layer is the largest ConvRot group up to
``convrot_group`` that divides its K (:func:`group_for`: Flux's K = 3072 takes 256, a K of 384
takes 64), so every eligible layer is rotated as much as its width allows.  Every other linear stays in float
and the plan's report says why (``rewrite quantize_w8a8 declined on %n: ...``).  The CPU
profile's ``int8_gemm`` decision (:func:`fxbackend.cpu_profile`) picks the GEMM: ``torch._int_mm``
with VNNI or AMX-INT8, the prepacked quantized linear engine with 7-bit weight codes without
them (AVX2-only CPUs); where it finds no int8 GEMM faster than float32 every CPU layer stays in
float32, with that reason: quantization there would make the model slower than float32.  Its
``w8a8_layers`` decision (:func:`fxbackend.cpu.w8a8_limits`) leaves the CPU layers too small to
gain in float32 too, each with its reason: a layer where the int8 GEMM saves less of its
float32 GEMM time than what a W8A8 layer adds to it (the quantize and epilogue passes, the
weight check).  The option
``quantize_min_size`` replaces that limit by a size in multiply-adds (0: every eligible layer,
on any device).
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta
from fxbackend.ir import storage_root

from .attention import _cast

__all__ = ["QuantizeW8A8", "linear_parts", "why_not_quantize", "group_for"]

_LINEAR_I8 = "sd.linear_i8.v1"
_QUANTIZE = "sd.quantize_i8_convrot.v1"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear_parts(n: Node) -> tuple[Node, Node, Node | None] | None:
    """``(x, W, bias)`` of a ``addmm(bias, x, t(W))`` / ``mm(x, t(W))`` node, else None
    (dataflow only: the weight operand must be a transpose view of a graph input)."""
    if n.op == "aten.addmm.default" and len(n.srcs) == 3:
        bias, x, wt = n.srcs
    elif n.op == "aten.mm.default" and len(n.srcs) == 2:
        (x, wt), bias = n.srcs, None
    else:
        return None
    if wt.op != "aten.t.default" or len(wt.srcs) != 1:
        return None
    w = wt.srcs[0]
    if not w.is_input:
        return None
    return x, w, bias


def group_for(k: int, group: int) -> int:
    """The largest ConvRot group ``<= group`` dividing ``k`` (1 when none but 1 does)."""
    from fxbackend.options import CONVROT_GROUPS
    return max(g for g in CONVROT_GROUPS if g <= group and k % g == 0)


def why_not_quantize(n: Node, x: Node, w: Node, bias: Node | None) -> str | None:
    """None when the linear ``n`` can become an INT8 step, else why not (never raises)."""
    try:
        if not w.is_weight:
            return f"weight %{w.id} is a user input, not a parameter or buffer"
        xm, wm = x.meta, w.meta
        if not isinstance(xm, TensorMeta) or not isinstance(wm, TensorMeta):
            return "operands are not tensors"
        if xm.is_symbolic or wm.is_symbolic:
            return "symbolic shapes"
        if xm.dtype not in _DTYPES or wm.dtype != xm.dtype:
            return f"dtype {xm.dtype}/{wm.dtype} (one of float32, bfloat16, float16 for both)"
        if xm.device != wm.device:
            return f"x on {xm.device}, weight on {wm.device}"
        if len(xm.shape) != 2 or len(wm.shape) != 2:
            return "x and the weight must be 2-D"
        (m, k), (nn, k2) = xm.shape, wm.shape
        if k != k2:
            return f"K mismatch {k} vs {k2}"
        if k % 4 or nn % 4:
            return f"K={k} and N={nn} must be multiples of 4"
        if bias is not None:
            bm = bias.meta
            if not isinstance(bm, TensorMeta) or tuple(bm.shape) != (nn,) \
                    or bm.dtype != xm.dtype or bm.device != xm.device:
                return f"bias is not a {xm.dtype} [N] vector on x's device"
        if n.op == "aten.addmm.default" and (n.params.get("beta", 1) != 1
                                             or n.params.get("alpha", 1) != 1):
            return "addmm with beta or alpha other than 1"
        return None
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _value_key(x: Node):
    """Equal for nodes holding the same values: each linear reads its input through a view of
    its own (``view(h, [M, K])``), so views of one storage with equal shape, strides and offset
    are one value (nothing in between writes into a functional graph's storage in place)."""
    if x.view_of is None:
        return x
    m = x.meta
    return (storage_root(x), tuple(m.shape), tuple(m.stride), m.storage_offset, m.dtype)


def _too_small(x: Node, w: Node, min_size: int | None, limits) -> str | None:
    """Why the linear ``x [M, K] @ W[N, K].T`` is too small to rewrite, or None: under the
    option ``quantize_min_size`` when it is set, else the CPU's ``limits``
    (``fxbackend.cpu.W8A8Limits``; None: no limit)."""
    (m, k), n = x.meta.shape, w.meta.shape[0]
    if min_size is not None:
        if m * k * n >= min_size:
            return None
        return f"too small: M*K*N={m * k * n:,} below the option quantize_min_size={min_size:,}"
    why = None if limits is None else limits.why_not(m, k, n)
    return None if why is None else f"too small to gain here (cpu decision w8a8_layers): {why}"


class QuantizeW8A8:
    """Rewrite rule ``quantize_w8a8`` (see the module docstring); active only with the option
    ``quantize="w8a8"``."""

    name = "quantize_w8a8"

    def rewrite(self, graph, ctx) -> int:
        if ctx.options.quantize != "w8a8":
            return 0
        if fxbackend.get_op(_LINEAR_I8) is None:  # the INT8 ops are not registered
            for n in list(graph.nodes):
                if linear_parts(n) is not None:
                    ctx.decline(n, f"{_LINEAR_I8} is not registered")
            return 0
        group = ctx.options.convrot_group
        done = 0
        int8 = None  # the CPU profile's int8 GEMM decision, read for the first CPU layer
        limits = None  # the CPU's layers that gain (its w8a8_layers decision)
        quantized: dict = {}  # x -> its quantize node (placed before x's first eligible linear)
        for n in list(graph.nodes):
            parts = linear_parts(n)
            if parts is None:
                continue
            x, w, bias = parts
            why = why_not_quantize(n, x, w, bias)
            if why is None and x.meta.device.type == "cpu":
                if int8 is None:
                    int8 = fxbackend.cpu_profile().decide("int8_gemm")
                    limits = fxbackend.cpu.w8a8_limits()
                if int8.choice == "float32":
                    why = f"int8 GEMM on this CPU: {int8.reason}"
                else:
                    why = _too_small(x, w, ctx.options.quantize_min_size, limits)
            elif why is None:  # another device: only the option's limit
                why = _too_small(x, w, ctx.options.quantize_min_size, None)
            if why is not None:
                ctx.decline(n, why)
                continue
            g = group_for(x.meta.shape[1], group)
            key = (_value_key(x), g)
            q = quantized.get(key)
            if q is None:
                before = graph.nodes[graph.nodes.index(n) - 1]
                q = quantized[key] = fxbackend.op_create(graph, _QUANTIZE, [x], {"group": g},
                                                         after=before)
            m = x.meta.shape[0]
            srcs = [q, w] + ([bias] if bias is not None else [])
            new = fxbackend.op_create(graph, _LINEAR_I8, srcs,
                                      {"x_kind": "packed", "w_kind": "float", "group": g,
                                       "m": m, "lead": (m,), "has_bias": bias is not None},
                                      after=n)
            if x.meta.dtype != torch.float32:  # the layer's own dtype: one rounding of the
                # float32 result, as a 16-bit GEMM rounds its float32 accumulator
                new = _cast(graph, new, x.meta.dtype, n.meta, graph.nodes.index(new) + 1)
            fxbackend.replace_uses(graph, n, new)
            done += 1
        return done


fxbackend.register_rewrite(QuantizeW8A8)
