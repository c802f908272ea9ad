"""Gated residual: ``residual + gate * (linear(x) [* s | / s])`` as one fused step.

This is the end of every adaLN-Zero transformer block (DiT; diffusers' Flux, SD3 and PixArt
blocks): ``hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output`` right after the
attention output projection, and ``+ gate_mlp * ff_output`` after the feed-forward's last
linear.  ATen writes it as::

    y2d = aten.addmm(bias, x2d, w_t)  |  aten.mm(x2d, w_t)          [M, N], M = B * S
    y   = aten.view(y2d, [B, S, N])   [-> aten.clone(y)]            views / clones: no values
    [y  = aten.mul.Tensor(y, s)  |  aten.div.Tensor(y, s)]          PixArt: / 1.0 (rescale factor)
    g   = aten.mul.Tensor(gate, y)                                  gate [B, 1, N] (per sample)
    out = aten.add.Tensor(residual, g)

Meaning (:func:`gated_residual_reference`; T the common dtype, every step rounded to T as the
unfused ops round it, float32 arithmetic inside each step)::

    t   = round(y * float32(s))            or round(y / float32(s))        (no scale: t = y)
    g   = round(gate * t)
    out = round(residual + g)

Casts (Wan's blocks on a bf16 stream with a float32 gate:
``(res.float() + y * gate).type_as(res)`` and ``(res.float() + y.float() * gate).type_as(res)``):
around a float32 gate multiply and residual add, the chain may widen y (``.float()`` after the
linear; or the multiply promotes it), take a 16-bit residual (its ``.float()`` joins the range,
moved just before the add by ``optimize``; or the add promotes it) and end with the cast of the
float32 result to bf16/fp16.  Widening is exact and the float32 steps round as float32 ops do,
so the step rounds once, where the cast does: bit for bit the chain.  The narrowing cast joins
only when the float32 result has no other reader (``match`` asks ``fxbackend.check_claim``).

The fused step runs the GEMM natively (the same ATen op with ``out=``: identical bits) into the
step's output (into workspace when the output has another dtype than y), then one elementwise
epilogue pass over it (a device kernel) that reads y, the gate and the residual once and writes
out once, where the unfused chain reads and writes the [M, N] tensor once per op (two or three
times more traffic; four with Flux's/SD3's clone).  The gate and the residual may be strided and broadcast (the gate usually is: a strided chunk of
the adaLN output, broadcast over tokens).

Sources: Peebles & Xie, "Scalable Diffusion Models with Transformers" (adaLN-Zero, arXiv
2212.09748); diffusers ``FluxTransformerBlock``, ``FluxSingleTransformerBlock``,
``JointTransformerBlock``, ``BasicTransformerBlock`` (ada_norm_single).
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Any, NamedTuple

import torch

import fxbackend
from fxbackend import TensorMeta, contiguous_strides

from .activation import gemm_into, movable_bias
from .rmsnorm import is_narrowing, is_widening

__all__ = ["gated_residual_reference", "GatedResidualFusion", "ReferenceGatedResidual",
           "DTYPES", "LINEAR_OPS", "EpilogueLayout", "epilogue_layout", "epilogue_why_not",
           "bias_in_epilogue"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LINEAR_OPS = ("aten.addmm.default", "aten.mm.default")
#: view ops that only reinterpret a contiguous result (checked further on the metadata)
_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
             "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
             "aten.alias.default")


def gated_residual_reference(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                             scale_op: str | None = None, scale: float | None = None,
                             div_reciprocal: bool = False,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The epilogue's meaning in plain torch: ``residual + gate * (y [* scale | / scale])``,
    each op rounded to its dtype as eager rounds it.  ``scale_op``: None, "mul" or "div".
    ``div_reciprocal``: compute the division as CUDA's eager kernel does for a CPU scalar
    divisor, ``y * (float32(1) / float32(scale))`` (``div_true_kernel_cuda``), instead of the
    CPU's true division.  ``bias`` (``[N]``, the last dim): ``y + bias`` (rounded) stands for
    ``y`` (a GEMM run without its bias, which the epilogue adds: see
    :class:`GatedResidualFusion`)."""
    if bias is not None:
        y = y + bias
    t = y
    if scale_op == "mul":
        t = y * scale
    elif scale_op == "div":
        if div_reciprocal:
            inv = (torch.tensor(1.0, dtype=torch.float32) /
                   torch.tensor(float(scale), dtype=torch.float32)).item()
            t = (y.float() * inv).to(y.dtype)
        else:
            t = y / scale
    elif scale_op is not None:
        raise ValueError(f"scale_op must be None, 'mul' or 'div', got {scale_op!r}")
    return residual + gate * t


# -- metadata helpers (pure) ---------------------------------------------------------------------

class EpilogueLayout(NamedTuple):
    """The epilogue's iteration space: rows (b, s) of ``nb * ns`` by ``c`` features; element
    strides of each operand along (b, s, c), broadcast dims 0; y is contiguous."""

    nb: int
    ns: int
    c: int
    g: tuple  # gate strides (b, s, c)
    r: tuple  # residual strides
    o: tuple  # out strides
    spans: tuple  # elements spanned by y, gate, residual, out


def _expanded(shape: tuple, stride: tuple, target: tuple) -> list:
    pad = len(target) - len(shape)
    return [0] * pad + [0 if sz == 1 else int(st) for sz, st in zip(shape, stride)]


@lru_cache(maxsize=512)
def epilogue_layout(shape: tuple, g_shape: tuple, g_stride: tuple, r_shape: tuple,
                    r_stride: tuple, o_stride: tuple) -> EpilogueLayout:
    """The layout of an epilogue over an output of ``shape`` (y contiguous): broadcast strides,
    leading dims merged where contiguous in every operand, at most two left.  ValueError for
    layouts the kernels do not take (symbolic or negative strides, more leading dims).
    Cached: pure metadata."""
    if not shape:
        raise ValueError("a 0-d output")
    for v in (*shape, *g_shape, *g_stride, *r_shape, *r_stride, *o_stride):
        if type(v) is not int:
            raise ValueError(f"shapes and strides must be concrete ints, got {v!r}")
        if v < 0:
            raise ValueError("negative strides")
    gs = _expanded(g_shape, g_stride, shape)
    rs = _expanded(r_shape, r_stride, shape)
    os_ = [0 if n == 1 else int(s) for n, s in zip(shape, o_stride)]
    if any(n > 1 and s == 0 for n, s in zip(shape, os_)):
        raise ValueError("out has a broadcast (stride 0) dim")
    ys, acc = [], 1
    for n in reversed(shape):
        ys.append(acc)
        acc *= n
    ys.reverse()
    c = int(shape[-1])
    last = (gs[-1], rs[-1], os_[-1]) if c > 1 else (1, 1, 1)
    merged: list = []
    for dim in ([n, a, b, d, e] for n, a, b, d, e in zip(shape[:-1], ys, gs, rs, os_) if n != 1):
        if merged and all(merged[-1][t] == dim[t] * dim[0] for t in (1, 2, 3, 4)):
            merged[-1] = [merged[-1][0] * dim[0]] + dim[1:]
        else:
            merged.append(dim)
    if len(merged) > 2:
        raise ValueError(f"{len(merged)} leading dims after merging (at most 2: [B, S, C])")
    merged = [[1, 0, 0, 0, 0]] * (2 - len(merged)) + merged
    (nb, _, gb, rb, ob), (ns, _, gss, rss, oss) = merged
    return EpilogueLayout(nb, ns, c, (gb, gss, last[0]), (rb, rss, last[1]),
                          (ob, oss, last[2]),
                          (_span(shape, ys), _span(g_shape, g_stride), _span(r_shape, r_stride),
                           _span(shape, o_stride)))


def epilogue_why_not(y: Any, gate: Any, residual: Any, out: Any, device_type: str,
                     layout=epilogue_layout, mixed: bool = False) -> str | None:
    """The ``why_not`` of both epilogue kernels: None when ``y``, ``gate``, ``residual`` and
    ``out`` (``TensorMeta``) are on one ``device_type`` device, of one dtype of ``DTYPES`` (or,
    with ``mixed``, a float32 gate and any of ``DTYPES`` for the others: float32 arithmetic
    on widened loads, the store rounding to out's dtype), out of y's shape, and
    ``layout(shape, g_shape, g_stride, r_shape, r_stride, o_stride)`` (the kernel's launch
    plan: :func:`epilogue_layout` or one built on it) accepts their layout; else a short
    reason (a ValueError's message).  Never raises."""
    try:
        for name, m in (("y", y), ("gate", gate), ("residual", residual), ("out", out)):
            if not isinstance(m, TensorMeta):
                return f"{name} is not a tensor"
            if m.device.type != device_type or m.device != y.device:
                return f"{name} is on {m.device}, not y's {device_type} device"
            if m.dtype not in DTYPES:
                return f"{name} has dtype {m.dtype} (float32, bfloat16 or float16)"
            if m.dtype != y.dtype and not (mixed and gate.dtype == torch.float32):
                return f"{name} has dtype {m.dtype}, y {y.dtype}" + \
                    (" (mixed only around a float32 gate)" if mixed else "")
        if tuple(out.shape) != tuple(y.shape):
            return f"out shape {tuple(out.shape)} is not y's {tuple(y.shape)}"
        layout(tuple(y.shape), tuple(gate.shape), tuple(gate.stride), tuple(residual.shape),
               tuple(residual.stride), tuple(out.stride))
        return None
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # never raise: decline with the reason
        return f"metadata not understood ({type(exc).__name__}: {exc})"


def _span(shape, stride) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))



def _broadcasts(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tensor(n) -> TensorMeta | None:
    return n.meta if isinstance(getattr(n, "meta", None), TensorMeta) else None


def _is_passthrough(n, prev) -> bool:
    """A node that gives prev's values in the same flat order: a reshape-like view of a
    contiguous tensor, or a clone, with a contiguous result."""
    m, pm = _tensor(n), _tensor(prev)
    if m is None or pm is None or n.srcs != [prev] or m.dtype != pm.dtype or \
            m.numel != pm.numel or not m.is_contiguous or not pm.is_contiguous:
        return False
    if n.op == "aten.clone.default":
        return n.inplace_of is None and n.view_of is None and tuple(m.shape) == tuple(pm.shape)
    return n.op in _RESHAPES and n.view_of is prev and m.storage_offset == pm.storage_offset


def _is_scale(n, prev) -> bool:
    m = _tensor(n)
    return n.op in ("aten.mul.Tensor", "aten.div.Tensor") and n.srcs == [prev] and \
        set(n.params) == {"other"} and _is_number(n.params["other"]) and m is not None and \
        m.dtype == prev.meta.dtype and tuple(m.shape) == tuple(prev.meta.shape)


def _other(n, prev):
    """The source of binary node ``n`` that is not ``prev`` (None when not exactly one is)."""
    if len(n.srcs) != 2 or (n.srcs[0] is prev) == (n.srcs[1] is prev):
        return None
    return n.srcs[1] if n.srcs[0] is prev else n.srcs[0]


def _is_widened(n, prev=None) -> bool:
    """``n`` is ``.float()`` of a bf16/fp16 tensor (of ``prev`` when given) in its layout."""
    m, src = _tensor(n), n.srcs[0] if n.srcs else None
    return is_widening(n) and (prev is None or src is prev) and \
        tuple(m.shape) == tuple(src.meta.shape) and m.is_contiguous == src.meta.is_contiguous


def _is_narrowed(n, prev) -> bool:
    """``n`` casts the float32 ``prev`` to bf16/fp16, keeping its shape, both contiguous."""
    m, pm = _tensor(n), _tensor(prev)
    return n.srcs[:1] == [prev] and is_narrowing(n) and tuple(m.shape) == tuple(pm.shape) \
        and m.is_contiguous and pm.is_contiguous


def _is_gate_mul(n, prev) -> bool:
    g = _other(n, prev) if n.op == "aten.mul.Tensor" and not n.params else None
    return g is not None and _tensor(g) is not None and _tensor(n) is not None and \
        tuple(n.meta.shape) == tuple(prev.meta.shape)


def _is_residual_add(n, prev) -> bool:
    if n.op != "aten.add.Tensor" or any(k != "alpha" for k in n.params) or \
            n.params.get("alpha", 1) != 1:
        return False
    r = _other(n, prev)
    return r is not None and _tensor(r) is not None and _tensor(n) is not None and \
        tuple(n.meta.shape) == tuple(prev.meta.shape)


def exact_scale(scale_op: str | None, scale: float | None) -> tuple[str | None, float | None]:
    """The same scaling with cheaper arithmetic, exactly: ``* 1`` is dropped, and division by a
    power of two becomes multiplication by its reciprocal (both exact in float32, so
    ``round(y / s) == round(y * (1 / s))`` for every y; PixArt's ``/ 1.0`` after its attention
    output costs a division per element otherwise).  Other scales are returned unchanged."""
    if scale_op is None or scale is None or not math.isfinite(scale) or scale == 0:
        return scale_op, scale
    mant, exp = math.frexp(scale)
    if abs(mant) == 0.5 and -125 <= exp - 1 <= 125:  # a power of two; 1/scale a float32 too
        if scale_op == "div":
            scale_op, scale = "mul", 1.0 / scale
        if scale_op == "mul" and scale == 1.0:
            return None, None
    return scale_op, scale


@dataclasses.dataclass
class _Parts:
    """What the fused step needs from its chain (node references are the external inputs)."""

    linear: Any  # the addmm/mm node (its params: beta/alpha)
    x: Any
    w: Any
    bias: Any  # None for mm
    gate: Any
    residual: Any
    y_shape: tuple  # the shape of the GEMM result as the gate multiply sees it
    scale_op: str | None
    scale: float | None
    out_meta: TensorMeta
    compute: torch.dtype  # the gate multiply's (and residual add's) dtype


class GatedResidualFusion:
    """Fusion rule ``gated_residual``:
    ``addmm|mm -> view/clone* -> [mul|div scalar] -> mul(gate) -> add(residual)`` as one step
    (meaning: the GEMM, then :func:`gated_residual_reference` on its result).

    ``impl`` is the device's epilogue kernel: an object with ``name``,
    ``why_not(y, gate, residual, out) -> str | None`` (``TensorMeta``s; never raises; y is the
    contiguous GEMM result in the gate multiply's shape), optional
    ``compile(y, gate, residual, out, scale_op)`` (plan time) and
    ``run(y, gate, residual, out, *, scale_op, scale[, bias])`` writing ``out`` where ``out``
    is either ``y`` itself (the epilogue then runs in place) or overlaps none of the inputs.
    An ``impl`` whose ``adds_bias`` attribute is true takes ``bias=`` (a contiguous ``[N]``
    tensor of y's dtype, or None) and computes the epilogue on ``y + bias``.
    ``cpu_kernels/gated_residual.py`` and ``cuda_kernels/gated_residual.py`` register one rule
    each.

    With ``casts`` (module docstring) the chain is
    ``addmm|mm -> view/clone* -> [.float()] -> mul(gate) -> [residual.float()] -> add(residual)
    [-> cast to bf16/fp16]`` and the epilogue's operands may have different dtypes around a
    float32 gate (``why_not`` then gets them as they are).

    ``optimize`` makes the chain consecutive: ATen often puts the gate's ``unsqueeze`` (a view of
    the adaLN output, which cannot be inside the claimed range) between the linear and the gate
    multiply, and Flux's and SD3's context stream computes its projections long before its
    gated residual.  It moves each chain's prefix down to just before the chain's next node with
    ``graph_delay``, which refuses any move that would change a result.

    The GEMM runs as the unfused step would (``patterns/activation.gemm_into``: ``torch.addmm``
    / ``torch.mm`` with ``out=``, or the device's own GEMM where the CPU profile chose oneDNN's
    float32 linear, as the unfused step's kernel then does) into the step's output when that is
    contiguous, else into workspace.

    Bias.  With an ``impl`` that ``adds_bias``, a float32 ``addmm(bias, x, w)`` with a
    contiguous ``[N]`` bias and beta = alpha = 1 runs as ``mm(x, w)`` and the epilogue adds the
    bias (as ``cpu_kernels/activation.py`` does for activations): addmm first writes the bias
    into every row of its result and the GEMM reads it back, a write and a read of the whole
    ``[M, N]`` result that the epilogue's read of one bias row replaces.  The float32 sum is
    the same operation in another place (the BLAS adds its partial products to the copied
    bias; here the bias is added to the finished product), so results differ from the unfused
    chain's by float32 rounding only.  16-bit chains keep the addmm (a 16-bit GEMM rounds
    ``acc + bias`` once).
    """

    priority = 5
    #: whether chains may widen y (``.float()`` before the gate multiply) and the residual
    #: (its ``.float()``, moved into the range) and narrow the result (a cast to bf16/fp16
    #: after the add) around a float32 gate multiply and add (rules extending this one that do
    #: not handle them set it False)
    casts = True

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "gated_residual"

    # -- matching ----------------------------------------------------------------------------
    @staticmethod
    def _starts(n) -> bool:
        m = _tensor(n)
        return n.op in LINEAR_OPS and m is not None and len(m.shape) == 2 and m.is_contiguous \
            and len(n.srcs) == (3 if n.op == "aten.addmm.default" else 2)

    def _chain(self, lin, next_of) -> list | None:
        """The chain from linear node ``lin``; ``next_of(node)`` gives the candidate next node
        (the next node in the graph for matching, the single user for ``optimize``)."""
        if not self._starts(lin):
            return None
        return self._chain_from([lin], next_of)

    def _chain_from(self, chain: list, next_of, nxt=None) -> list | None:
        """The rest of the chain after ``chain`` (the linear, and nodes a subclass took);
        ``nxt``: the next candidate when the caller already fetched it."""
        scaled = widened = False
        while True:
            if nxt is None:
                nxt = next_of(chain[-1])
            if nxt is None:
                return None
            prev = chain[-1]
            if not scaled and _is_passthrough(nxt, prev):
                chain.append(nxt)
            elif not scaled and not widened and _is_scale(nxt, prev):
                chain.append(nxt)
                scaled = True
            elif self.casts and not scaled and not widened and _is_widened(nxt, prev):
                chain.append(nxt)
                widened = True
            elif len(chain) > 1 and _is_gate_mul(nxt, prev):
                chain.append(nxt)
                break
            else:
                return None
            nxt = None
        mul = chain[-1]
        add = next_of(mul)
        widen_r = None
        if self.casts and add is not None and _is_widened(add):  # matching: graph order
            widen_r, add = add, next_of(add)
        if add is None or not _is_residual_add(add, mul) or \
                (widen_r is not None and _other(add, mul) is not widen_r):
            return None
        chain += [widen_r, add] if widen_r is not None else [add]
        if self.casts:
            down = next_of(add)
            if down is not None and _is_narrowed(down, add):
                chain.append(down)
        return chain

    @staticmethod
    def _roles(chain: list) -> dict:
        """The chain's nodes by role: ``mul`` (the gate multiply), ``y`` (the node it reads),
        ``widen_r`` (the residual's ``.float()`` inside the range, or None), ``add``, ``down``
        (the narrowing cast, or None), ``scale`` (the scale node, or None)."""
        j = next(j for j in range(1, len(chain)) if _is_gate_mul(chain[j], chain[j - 1]))
        a = j + 1
        widen_r = None
        if _is_widened(chain[a]) and a + 1 < len(chain) and \
                _is_residual_add(chain[a + 1], chain[j]):
            widen_r, a = chain[a], a + 1
        return dict(mul=chain[j], y=chain[j - 1], widen_r=widen_r, add=chain[a],
                    down=chain[a + 1] if a + 1 < len(chain) else None,
                    scale=next((c for p, c in zip(chain[:j], chain[1:j]) if _is_scale(c, p)),
                               None))

    def _parts(self, chain: list) -> _Parts:
        r = self._roles(chain)
        lin, mul, add, y, scale_node = chain[0], r["mul"], r["add"], r["y"], r["scale"]
        if lin.op == "aten.addmm.default":
            bias, x, w = lin.srcs
        else:
            (x, w), bias = lin.srcs, None
        scale_op, scale = exact_scale(
            None if scale_node is None else
            ("mul" if scale_node.op == "aten.mul.Tensor" else "div"),
            None if scale_node is None else float(scale_node.params["other"]))
        residual = _other(add, mul) if r["widen_r"] is None else r["widen_r"].srcs[0]
        return _Parts(lin, x, w, bias, _other(mul, y), residual, tuple(y.meta.shape),
                      scale_op, scale, (r["down"] or add).meta, mul.meta.dtype)

    def _why_not(self, chain: list) -> str | None:
        p = self._parts(chain)
        y = dataclasses.replace(chain[0].meta, shape=p.y_shape,
                                stride=contiguous_strides(p.y_shape))
        metas = {"the linear": chain[0].meta, "the gate": p.gate.meta,
                 "the residual": p.residual.meta, "the output": p.out_meta}
        dtypes = {m.dtype for m in metas.values()}
        if any(d not in DTYPES for d in dtypes):
            return "dtypes: " + ", ".join(f"{k} {m.dtype}" for k, m in metas.items()) + \
                " (float32, bfloat16 or float16)"
        # one dtype, or (casts) a float32 gate multiply and residual add around 16-bit values:
        # widened exactly, every step rounded to float32, the result narrowed once
        # (a float32 multiply makes the add float32: the residual adds into it)
        mixed = self.casts and p.compute == p.gate.meta.dtype == torch.float32
        if len(dtypes) != 1 and not mixed:
            return "dtypes differ: " + ", ".join(f"{k} {m.dtype}" for k, m in metas.items())
        if any(m.is_symbolic for m in metas.values()):
            return "symbolic shapes"
        if not _broadcasts(tuple(p.gate.meta.shape), p.y_shape) or \
                not _broadcasts(tuple(p.residual.meta.shape), p.y_shape):
            return "gate or residual does not broadcast to the linear's shape"
        why = self.impl.why_not(y, p.gate.meta, p.residual.meta, p.out_meta)
        return None if why is None else f"{self.impl.name}: {why}"

    def match(self, graph, i: int):
        nodes = graph.nodes
        pos = {"k": i}

        def next_in_graph(_):
            pos["k"] += 1
            return nodes[pos["k"]] if pos["k"] < len(nodes) else None

        try:
            chain = self._chain(nodes[i], next_in_graph)
            if chain is None:
                return 0
            if self.casts and self._roles(chain)["down"] is not None and \
                    fxbackend.check_claim(graph, i, len(chain)) is not None:
                chain = chain[:-1]  # the float32 result has other readers: the cast stays out
            why = self._why_not(chain)
        except Exception as exc:  # never raise from match: decline with the reason
            return 0, f"metadata not understood ({type(exc).__name__}: {exc})"
        return (0, why) if why is not None else len(chain)

    def optimize(self, graph) -> None:
        """Make each chain consecutive (see the class doc).  Never raises."""
        try:
            users = graph.users()

            def only_user(n):
                us = users.get(n, [])
                return us[0] if len(us) == 1 else None

            for lin in [n for n in graph.nodes if n.op in LINEAR_OPS]:
                chain = self._chain(lin, only_user)
                if chain is None:
                    continue
                r = self._roles(chain)
                wr = _other(r["add"], r["mul"])
                if self.casts and wr is not None and _is_widened(wr) and \
                        only_user(wr) is r["add"] and not wr.is_output:
                    # the residual's .float() joins the range, just before the add
                    chain.insert(chain.index(r["add"]), wr)
                # move the done prefix down to just before the next node of the chain (a
                # node of the chain found before the prefix moves down to its end instead)
                for k in range(1, len(chain)):
                    start = graph.nodes.index(chain[0])
                    j = graph.nodes.index(chain[k])
                    if j == start + k:
                        continue
                    ok = fxbackend.graph_delay(graph, start, start + k, j - 1) if j > start \
                        else fxbackend.graph_delay(graph, j, j + 1, start + k - 1)
                    if not ok:
                        break
        except Exception:  # an optimisation only: matching decides on whatever order is left
            return

    # -- running -----------------------------------------------------------------------------
    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            st = self._state(node)
            comp(st["y_meta"], st["parts"].gate.meta, st["parts"].residual.meta,
                 st["parts"].out_meta, st["parts"].scale_op)

    def _state(self, node) -> dict:
        p = self._parts(node.annotations["fused"])
        lin = p.linear
        m, n = lin.meta.shape
        # the GEMM writes into the output when it has y's layout and dtype (not narrowed or
        # widened), else into workspace
        in_place = node.meta.is_contiguous and node.meta.dtype == lin.meta.dtype
        y_meta = dataclasses.replace(lin.meta, shape=p.y_shape,
                                     stride=contiguous_strides(p.y_shape))
        kw = {k: lin.params[k] for k in ("beta", "alpha") if k in lin.params}
        return dict(parts=p, mn=(int(m), int(n)), in_place=in_place, y_meta=y_meta, gemm_kw=kw,
                    nbytes=int(m) * int(n) * lin.meta.itemsize,
                    bias_in_epilogue=bool(getattr(self.impl, "adds_bias", False)) and
                    bias_in_epilogue(p.bias, lin.meta, kw))

    def prepare(self, node):
        st = self._state(node)
        # a non-contiguous output cannot take the GEMM's [M, N] result: stage it in workspace
        return st, (0 if st["in_place"] else st["nbytes"])

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        p = st["parts"]
        value = dict(zip(node.srcs, inputs))
        x, w = value[p.x], value[p.w]
        gate, res = value[p.gate], value[p.residual]
        gemm_in = (x, w) if p.bias is None else (value[p.bias], x, w)
        m, n = st["mn"]
        if st["in_place"] and not any(_overlaps(out, t) for t in (*gemm_in, gate, res)):
            y2d = out.view(m, n)
        elif not st["in_place"]:
            y2d = workspace[:st["nbytes"]].view(st["y_meta"].dtype).view(m, n)
        else:
            # out overlaps an input: the memory planner does not do this (inputs live through
            # the step), but the rule must stay correct if it ever did
            y2d = torch.empty((m, n), dtype=st["y_meta"].dtype, device=out.device)
        bias = None if p.bias is None else gemm_in[0]
        if st["bias_in_epilogue"]:  # mm, and the epilogue adds the bias
            gemm_into(y2d, x, w, None)
            kw = {"bias": bias}
        else:
            gemm_into(y2d, x, w, bias, **st["gemm_kw"])
            kw = {}
        self.impl.run(y2d.view(p.y_shape), gate, res, out, scale_op=p.scale_op, scale=p.scale,
                      **kw)


def bias_in_epilogue(bias, linear_meta: TensorMeta, gemm_kw: dict) -> bool:
    """Whether the fused step runs ``addmm(bias, x, w)`` as ``mm(x, w)`` with the bias added by
    an epilogue that ``adds_bias`` (see the Bias section of :class:`GatedResidualFusion`):
    float32, a contiguous ``[N]`` bias (``bias``: its graph node, None for ``mm``), beta =
    alpha = 1."""
    b = _tensor(bias) if bias is not None else None
    return b is not None and b.device == linear_meta.device and \
        movable_bias(linear_meta.dtype, b.dtype, b.shape, b.is_contiguous,
                     linear_meta.shape[-1], gemm_kw.get("beta", 1), gemm_kw.get("alpha", 1))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges ``a`` and ``b`` span in their storage intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    sa, sb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    if sa != sb:
        return False

    def span(t):
        lo = t.storage_offset() * t.element_size()
        hi = lo + (1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))) * \
            t.element_size()
        return lo, hi

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class ReferenceGatedResidual:
    """A torch implementation of the ``gated_residual`` epilogue interface (for tests of the
    rule and as a model for device kernels); not registered."""

    name = "gated_residual_reference"
    adds_bias = True

    def why_not(self, y, gate, residual, out):
        return None

    def run(self, y, gate, residual, out, *, scale_op, scale, bias=None):
        out.copy_(gated_residual_reference(y, gate, residual, scale_op, scale, bias=bias))
