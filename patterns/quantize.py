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

A second rule, ``merge_w8a8_linears`` (:class:`MergeSharedInputLinears`), then runs the linears
of one quantized input with the same weight shape (Q, K and V) as one GEMM over their
concatenated weights, each layer's value a column slice of its result.
"""
from __future__ import annotations

from typing import Any

import torch

import fxbackend
from fxbackend import Node, TensorMeta
from fxbackend.ir import same_layout, storage_root
from fxbackend.ops import infer_node_meta
from fxbackend.rewrite import AtenBuilder, result_meta

from .attention import _cast

__all__ = ["QuantizeW8A8", "MergeSharedInputLinears", "linear_parts", "why_not_quantize",
           "group_for", "follow_column_slice"]

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


# -- one GEMM for the linears of one input --------------------------------------------------------

def _reader_meta(r: Node, metas: dict) -> Any:
    """``r``'s result metadata (a tuple for a multi-output step) with its sources laid out as
    ``metas`` says (else as now); None when it cannot be computed."""
    if isinstance(r.target, torch._ops.OpOverload):
        return result_meta(r, metas)
    op = fxbackend.get_op(r.op)
    if op is None:
        return None
    try:
        return infer_node_meta(op, [metas.get(s, s.meta) for s in r.srcs], r.params)
    except Exception:  # the op rejects the layout: its step keeps its source as it was
        return None


def follow_column_slice(users: dict, n: Node, meta: TensorMeta,
                        known: dict | None = None) -> dict | str:
    """The new metadata of ``n`` and of the views that read it (and views of those) when
    ``n``'s value becomes ``meta``, a column slice of a wider result (row stride larger than
    its width); every other reader must give the same result layout as before (each output's,
    for a multi-output step: attention reading a UNet's Q directly).  A dict
    ``{node: meta}``, or why the readers cannot take the slice (a graph output, an in-place
    write, a view that cannot follow it, a step whose result would change layout).
    ``known``: new metadata of other nodes already decided (the group's other slices and
    their views), which a reader of several of them sees too; included in the dict."""
    new = dict(known or {})
    new[n] = meta
    todo = [n]
    while todo:
        v = todo.pop()
        if v.is_output:
            return f"%{v.id} is a graph output"
        for r in users.get(v, ()):
            if r.inplace_of is not None:
                return f"%{r.id} writes in place into %{r.inplace_of.id}"
            if v not in r.srcs:
                return f"%{r.id} reads %{v.id} otherwise than as a tensor source"
            m = _reader_meta(r, new)
            if r.is_multi:  # its outputs must keep their layouts
                if r.view_of is not None or not isinstance(m, tuple) or \
                        len(m) != len(r.meta) or \
                        not all(same_layout(a, b) for a, b in zip(m, r.meta)
                                if isinstance(b, TensorMeta)):
                    return f"%{r.id} ({r.op}) would lay its results out otherwise"
                continue
            if r.view_of is v:
                if m is None or tuple(m.shape) != tuple(r.meta.shape) or \
                        m.dtype != r.meta.dtype:
                    return f"the view %{r.id} ({r.op}) cannot follow a column slice"
                new[r] = m
                todo.append(r)
            elif not isinstance(m, TensorMeta) or not same_layout(m, r.meta):
                return f"%{r.id} ({r.op}) would lay its result out otherwise"
    return new


class MergeSharedInputLinears:
    """Rewrite rule ``merge_w8a8_linears``: the W8A8 linears that read one quantized input
    with the same output width (attention's Q, K and V projections) become one GEMM over the
    concatenated weights::

        # sd.linear_i8.v1(q, W1, b1), sd.linear_i8.v1(q, W2, b2), ...   (each [M, N])
        #   =>  Wc = aten.cat([W1, W2, ...]), bc = aten.cat([b1, b2, ...])  weight-derived
        #       y = sd.linear_i8.v1(q, Wc, bc)                               [M, k * N]
        #       aten.slice(y, 1, i * N, (i + 1) * N) for each linear         its old value

    A small-N GEMM keeps the machine's vectors less busy than one k times as wide (oneDNN's
    int8 GEMM on an AVX2 CPU: 1101 x 384 x 384 in 1.6 ms, 1101 x 384 x 1536 in 4.2 ms), and
    the epilogue runs once.  The concatenated weight is a weight-derived step (computed once,
    again when a weight changes: its weights' fingerprints are checked every call), and the
    quantized weight is keyed on it by serial number (``fxbackend.weights.mark_derived``), so
    the bytes read per call for the weight check do not grow.  Per-channel weight scales make
    the result equal to the separate linears' (the same codes and scales per output column).

    A 16-bit layer's linear is merged with its cast to the layer's dtype (one cast of the
    merged result, which the CPU fuses into the GEMM's epilogue as before, then the slices).
    Only linears of equal width are merged: a wider one reading the same input (Flux's MLP
    projection beside Q, K and V) keeps its own step and its fused activation epilogue.  Left
    alone: weights that are not parameters or buffers, a linear whose result (or a view of
    it) is a graph output or written in place, or whose readers would lay their results out
    otherwise on a column slice (``follow_column_slice``); the report says why.  Runs only
    with the option ``quantize="w8a8"``."""

    name = "merge_w8a8_linears"

    @staticmethod
    def _candidate(n: Node, users: dict) -> tuple | None:
        """``(grouping key, the node holding the layer's value)`` of a mergeable
        ``sd.linear_i8.v1`` node, else None.  The value is the linear's, or for a 16-bit
        layer that of the cast to its dtype that its one reader is (``QuantizeW8A8``)."""
        if n.op != _LINEAR_I8:
            return None
        p = n.params
        if p.get("x_kind") != "packed" or p.get("w_kind") != "float" or \
                len(n.srcs) != 2 + bool(p.get("has_bias")):
            return None
        w = n.srcs[1]
        m = n.meta
        if not (w.is_input and w.is_weight) or not isinstance(m, TensorMeta) or \
                m.is_symbolic or len(m.shape) != 2 or not m.is_contiguous or \
                tuple(p.get("lead") or ()) != (m.shape[0],):
            return None
        bias = n.srcs[2] if p.get("has_bias") else None
        if bias is not None and not (bias.is_input and bias.is_weight):
            return None
        tail = n
        readers = users.get(n, [])
        if len(readers) == 1 and readers[0].op == "aten._to_copy.default" and \
                set(readers[0].params) == {"dtype"} and not n.is_output and \
                isinstance(readers[0].meta, TensorMeta) and readers[0].meta.is_contiguous:
            tail = readers[0]  # a 16-bit layer: one cast of the merged result, sliced
        key = (n.srcs[0], p["group"], p["m"], w.meta.dtype, w.meta.device,
               None if bias is None else bias.meta.dtype, tuple(w.meta.shape), tail.meta.dtype)
        return key, tail

    def rewrite(self, graph, ctx) -> int:
        if ctx.options.quantize != "w8a8":
            return 0
        if not any(n.op == _LINEAR_I8 for n in graph.nodes):
            return 0
        users = graph.users()
        groups: dict = {}
        for n in graph.nodes:
            got = self._candidate(n, users)
            if got is not None:
                groups.setdefault(got[0], []).append((n, got[1]))
        done = 0
        for group in groups.values():
            if len(group) > 1 and self._merge(graph, ctx, group, users):
                done += len(group)
        return done

    @staticmethod
    def _merge(graph, ctx, group: list, users: dict) -> bool:
        """Merge ``group`` (``[(linear, its value node)]``, in graph order); False (with the
        reason declined) when a reader cannot take a column slice."""
        first, tail = group[0]
        m_rows, n_cols = first.meta.shape
        total = n_cols * len(group)
        dtype = tail.meta.dtype
        metas = {}
        for i, (n, t) in enumerate(group):
            sliced = TensorMeta((m_rows, n_cols), (total, 1), dtype, first.meta.device,
                                i * n_cols)
            got = follow_column_slice(users, t, sliced, metas)
            if isinstance(got, str):
                ctx.decline([n for n, _ in group], f"not merged into one GEMM: {got}")
                return False
            metas = got
        make = AtenBuilder(graph, first)
        srcs = [first.srcs[0], make("cat", [n.srcs[1] for n, _ in group], {"dim": 0})]
        if first.params.get("has_bias"):
            srcs.append(make("cat", [n.srcs[2] for n, _ in group], {"dim": 0}))
        merged = fxbackend.op_create(graph, _LINEAR_I8, srcs,
                                     dict(first.params, m=m_rows, lead=(m_rows,)), after=first)
        if tail is not first:  # one rounding to the layers' dtype, of the whole result
            merged = _cast(graph, merged, dtype, TensorMeta.contiguous((m_rows, total), dtype,
                                                                       first.meta.device),
                           graph.nodes.index(merged) + 1)
        for i, (n, t) in enumerate(group):
            at = graph.nodes[graph.nodes.index(merged) + 1 + i]
            piece = AtenBuilder(graph, at)("slice.Tensor", [merged],
                                           {"dim": 1, "start": i * n_cols,
                                            "end": (i + 1) * n_cols, "step": 1})
            fxbackend.replace_uses(graph, t, piece)
        old = {t for _, t in group}
        for r, m in metas.items():
            if r not in old:
                r.meta = m
        return True


fxbackend.register_rewrite(MergeSharedInputLinears)
