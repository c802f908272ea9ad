"""Fusions around the INT8 W8A8 ops (``patterns/int8.py``): the integer GEMM's gated-residual
epilogue, and the chains that feed the ConvRot quantizer.

With ``options={"quantize": "w8a8"}`` (``patterns/quantize.py``) every eligible linear becomes
``q = sd.quantize_i8_convrot.v1(x) {group}`` + ``sd.linear_i8.v1(q, W[, bias])``.  What comes
before the quantize step and after the integer GEMM is, in a diffusion transformer block, the
same few chains every time; this file fuses them so that the float activations in between never
go to memory:

    # sd.linear_i8 -> view/clone* -> [mul|div scalar] -> mul(gate) -> add(residual)
    #                                                       =>  fused.int8_gated_residual
    # sd.linear_i8 -> views* -> gelu|gelu_tanh|silu|sigmoid -> [clone] -> views* -> quantize
    #                                                       =>  fused.int8_linear_act_quantize
    # sd.linear_i8 -> views* -> gelu|gelu_tanh|silu|sigmoid =>  fused.int8_linear_act
    # sd.linear_i8 -> _to_copy bf16|fp16                    =>  fused.int8_linear_cast
    # norm [no affine] -> [add(s, c) -> views] -> mul -> add -> views* -> quantize
    #                                                       =>  fused.modulation_quantize
    # sd.rms_norm.v1(x[, w]) -> views* -> quantize          =>  fused.rms_norm_quantize
    # gelu|gelu_tanh|silu|sigmoid(x) [-> mul(b)] [-> clone] -> views* -> quantize
    #                                                       =>  fused.act_quantize
    # mul|div(x, scalar) [-> clone] -> views* -> quantize   =>  fused.scale_quantize

Each rule is one class below, parameterised by a device implementation object (``impl``: the
numba kernels of ``cpu_kernels/int8_fusions.py`` or the Triton kernels of
``cuda_kernels/int8_fusions.py``), matching on dataflow (ops, sources, shapes, dtypes, strides),
never on names, and declining a recognised chain with a reason (``match`` returns ``(0, why)``;
it never raises).  The engine (``fusion.check_claim``) judges legality: an intermediate read
outside the chain (a modulation output that is also used in float) makes the engine decline.

Priorities (higher is tried first at a node; the rules here start at different ops, so they
compete only with the float rules that start at the same node):

- ``modulation_quantize`` 6, above ``modulation`` (5), which would otherwise claim the shorter
  ``norm -> mul -> add`` prefix and leave the quantize step alone;
- ``rms_norm_quantize`` 6, above ``rms_rope`` and ``modulation`` (the three start at an
  ``sd.rms_norm.v1`` node; their chains end differently, so at most one matches);
- ``int8_gated_residual``, ``int8_linear_act_quantize``, ``act_quantize``, ``scale_quantize``
  6 (the first two start at ``sd.linear_i8.v1`` and their chains end differently, so at most
  one matches; no other rule starts at a standalone activation or at a scalar multiply
  followed by a quantize step; ``scale_cast`` starts at a scalar multiply followed by a cast).
  ``int8_linear_act_quantize`` is tried at the linear, before ``act_quantize`` sees the
  activation (matching goes left to right), so it takes the longer chain;
- ``int8_linear_act`` 5 and ``int8_linear_cast`` 4: the same start, shorter chains (a 16-bit
  layer's linear -> cast -> activation goes to ``int8_linear_act``, a cast alone to
  ``int8_linear_cast``).

Bit-exactness (what "the unfused chain" means for each):

- ``int8_gated_residual``: the integer GEMM is the same ``torch._int_mm`` call, then per element
  ``y = float32(acc) * x_scale[m] * w_scale[n] + bias[n]`` (``linear_i8``'s order), the scale,
  ``g = gate * t``, ``out = residual + g``, each rounded to float32 separately (no FMA): equal
  bit for bit to ``sd.linear_i8.v1`` followed by the native ops (on CUDA a division by a Python
  scalar is a multiplication by its float32 reciprocal, as CUDA's eager kernel does it);
- ``modulation_quantize``: the modulation kernel's own statistics (same reduction order) and
  roundings, then the quantize kernel's rotation and codes: equal to ``fused.modulation`` ->
  ``sd.quantize_i8_convrot.v1`` (the plan without this rule), not to a plan without any fusion
  (native LayerNorm's statistics differ from the kernel's by a float32 rounding);
- ``rms_norm_quantize``: equal to the ``sd.rms_norm.v1`` kernel followed by the quantize kernel;
- ``int8_linear_act_quantize``: ``linear_i8``'s epilogue, then ``act_quantize``'s maths: equal
  to ``sd.linear_i8.v1`` followed by ``fused.act_quantize``;
- ``int8_linear_act``: ``linear_i8``'s epilogue, then the same activation maths (a few float32
  ulp from torch's activation, as for ``act_quantize`` below), rounded to the chain's dtype;
- ``int8_linear_cast``: ``linear_i8``'s epilogue rounded once to the 16-bit dtype: equal to
  ``sd.linear_i8.v1`` followed by the cast;
- ``act_quantize``: the activation is computed by the project's activation maths
  (``cpu_kernels/activation.py`` / ``cuda_kernels/activation.py``: written-out exp/tanh/erf,
  a few float32 ulp from torch's vectorised ones), so a code may differ by one step from the
  native chain where a value sits on a rounding boundary; bit-exact to those kernels' activation
  followed by the quantize kernel;
- ``scale_quantize``: bit-exact to the native scalar multiply/divide and the quantize kernel
  (CUDA: division by the float32 reciprocal, as CUDA eager).

Sources: Huang et al., "ConvRot" (arXiv 2512.03673); Peebles & Xie, "Scalable Diffusion Models
with Transformers" (adaLN-Zero, arXiv 2212.09748); diffusers ``FluxTransformerBlock``,
``JointTransformerBlock``, ``FeedForward``, ``AdaLayerNormZero``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

import fxbackend
from fxbackend import TensorMeta, contiguous_strides

from .activation import _act_of
from .gated_residual import (GatedResidualFusion, _broadcasts, _is_number, _is_scale, _other,
                             _overlaps, _tensor, exact_scale, gated_residual_reference)
from .int8 import (REGULAR_HADAMARD_GROUPS, WeightState, check_linear, linear_i8_reference,
                   linear_srcs, packed_nbytes, padded_rows, quantize_i8_convrot_reference,
                   unpack)
from .modulation import (_LAYER_NORM, ModulationFusion, _reshaped, _scalar, expanded_meta,
                         modulation_reference)
from .rmsnorm import RmsNorm, rms_norm_reference

__all__ = ["QUANTIZE", "LINEAR_I8", "PRE_ACTS", "Int8GatedResidualFusion",
           "Int8LinearActQuantizeFusion", "int8_linear_act_quantize_reference",
           "Int8LinearCastFusion", "Int8LinearActFusion",
           "ModulationQuantizeFusion", "RmsNormQuantizeFusion", "ActQuantizeFusion",
           "ScaleQuantizeFusion", "register_int8_fusions", "int8_gated_residual_reference",
           "packed_out",
           "expand_scale_shift", "modulation_quantize_reference", "rms_norm_quantize_reference",
           "act_quantize_reference", "prologue_reference", "ReferenceQuantizeImpl",
           "row_view_chain"]

QUANTIZE = "sd.quantize_i8_convrot.v1"
LINEAR_I8 = "sd.linear_i8.v1"
#: activations before a quantize step: gelu with the tanh approximation, gelu (erf), silu, sigmoid
PRE_ACTS = ("gelu_tanh", "gelu", "silu", "sigmoid")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: views that give their source's elements in the same (row-major) order
_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
             "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
             "aten.squeeze.default", "aten.alias.default")
#: bytes between the workspace regions of one step (the packed x, the int32 accumulator)
_ALIGN = 64


# -- references ------------------------------------------------------------------------------------

def int8_gated_residual_reference(x, w, w_scale=None, x_scale=None, bias=None, *, gate,
                                  residual, x_kind, w_kind, group=1, m=-1, lead=(),
                                  y_shape=None, scale_op=None, scale=None,
                                  div_reciprocal=False) -> torch.Tensor:
    """The unfused chain: ``sd.linear_i8.v1`` (``linear_i8_reference``), viewed as ``y_shape``
    (None: as it is), then ``residual + gate * (y [* s | / s])`` with each op's own float32
    rounding (``gated_residual_reference``; ``div_reciprocal``: CUDA's division by a Python
    scalar)."""
    y = linear_i8_reference(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                            group=group, m=m, lead=lead)
    if y_shape is not None:
        y = y.reshape(y_shape)
    return gated_residual_reference(y, gate, residual, scale_op, scale, div_reciprocal)


def int8_linear_act_quantize_reference(x, w, w_scale=None, x_scale=None, bias=None, *, act,
                                       x_kind, w_kind, group=1, m=-1, lead=(),
                                       out_group=1) -> torch.Tensor:
    """The unfused chain: ``sd.linear_i8.v1`` (``linear_i8_reference``), torch's activation
    ``act``, then ``sd.quantize_i8_convrot.v1 {out_group}``."""
    y = linear_i8_reference(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                            group=group, m=m, lead=lead)
    return quantize_i8_convrot_reference(_act_torch(y, act), out_group)


def modulation_quantize_reference(x, scale, shift, eps, norm="layer", add_c=1.0, group=1):
    """``sd.quantize_i8_convrot.v1(norm(x) * (add_c + scale) + shift) {group}`` in plain torch
    (``modulation_reference``: torch's own LayerNorm statistics; the fused kernels use the
    modulation kernels' reductions, see the module docstring)."""
    y = modulation_reference(x, scale, shift, eps, norm, add_c)
    return quantize_i8_convrot_reference(y, group)


def rms_norm_quantize_reference(x, weight, eps, group=1):
    """``sd.quantize_i8_convrot.v1(sd.rms_norm.v1(x[, weight]))`` in plain torch."""
    return quantize_i8_convrot_reference(rms_norm_reference(x, weight, eps), group)


def _act_torch(v: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(v, approximate="tanh")
    if act == "gelu":
        return torch.nn.functional.gelu(v)
    if act == "silu":
        return torch.nn.functional.silu(v)
    if act == "sigmoid":
        return torch.sigmoid(v)
    raise ValueError(f"activation must be one of {PRE_ACTS}, got {act!r}")


def prologue_reference(x, *, act=None, other=None, scale_op=None, scale=None,
                       div_reciprocal=False) -> torch.Tensor:
    """The float chain before the quantize step, each op in x's dtype with its own rounding:
    ``act(x)`` (None: x), ``* other`` (None: none), ``* scale`` / ``/ scale`` (a Python scalar;
    ``div_reciprocal``: ``* (float32(1) / float32(scale))``, CUDA's eager division)."""
    v = x if act is None else _act_torch(x, act)
    if other is not None:
        v = v * other
    if scale_op == "mul":
        v = v * scale
    elif scale_op == "div":
        if div_reciprocal:
            inv = (torch.tensor(1.0, dtype=torch.float32) /
                   torch.tensor(float(scale), dtype=torch.float32)).item()
            v = (v.float() * inv).to(v.dtype)
        else:
            v = v / scale
    elif scale_op is not None:
        raise ValueError(f"scale_op must be None, 'mul' or 'div', got {scale_op!r}")
    return v


def act_quantize_reference(x, group=1, *, act=None, other=None, scale_op=None, scale=None,
                           div_reciprocal=False) -> torch.Tensor:
    """``sd.quantize_i8_convrot.v1(prologue_reference(x, ...)) {group}`` in plain torch (torch's
    own activations: see the module docstring for the fused kernels' activation maths)."""
    v = prologue_reference(x, act=act, other=other, scale_op=scale_op, scale=scale,
                           div_reciprocal=div_reciprocal)
    return quantize_i8_convrot_reference(v, group)


# -- shared matching helpers (dataflow only) -------------------------------------------------------

def packed_out(x: torch.Tensor, out: torch.Tensor | None = None,
               device: torch.device | None = None) -> torch.Tensor:
    """``out``, or where it is None a new packed int8 vector (``packed_nbytes``) for the rows
    of x's last dim, on ``device`` (None: torch's default): the output of a quantize-feeding
    fusion's direct call."""
    if out is None:
        d = x.shape[-1] if x.dim() else 0
        m = x.numel() // d if d else 0
        out = torch.empty(packed_nbytes(m, d), dtype=torch.int8, device=device)
    return out


def expand_scale_shift(who: str, x, scale, shift, not_tensor: str = "is not a tensor") -> tuple:
    """``(scale, shift)`` expanded to x's shape for a direct call of ``who``; ValueError
    (``f"{who}: {label} {not_tensor}"``) for an operand that is not a tensor, or where scale or
    shift does not broadcast to x."""
    for label, t in (("x", x), ("scale", scale), ("shift", shift)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{who}: {label} {not_tensor}")
    try:
        return scale.expand(x.shape), shift.expand(x.shape)
    except RuntimeError as e:
        raise ValueError(f"{who}: scale/shift do not broadcast to x: {e}") from None


def _is_row_view(n, prev) -> bool:
    """A reshape-like view of ``prev`` that keeps its last dim (so the same rows, in the same
    row-major order) and its dtype."""
    m, pm = _tensor(n), _tensor(prev)
    return (n.op in _RESHAPES and n.srcs == [prev] and n.view_of is prev and m is not None
            and pm is not None and m.dtype == pm.dtype and len(m.shape) >= 1
            and len(pm.shape) >= 1 and m.shape[-1] == pm.shape[-1] and m.numel == pm.numel)


def _is_quantize_of(n, prev) -> bool:
    return n.op == QUANTIZE and n.srcs == [prev] and _tensor(n) is not None


def row_view_chain(nodes: list, k: int, prev) -> tuple[list, Any]:
    """``(views, quantize)``: the row views of ``prev`` starting at ``nodes[k]`` and the
    quantize step right after them, or ``([], None)`` when the nodes from ``k`` are not
    ``views* -> sd.quantize_i8_convrot.v1``."""
    views = []
    while k < len(nodes) and _is_row_view(nodes[k], prev):
        views.append(nodes[k])
        prev = nodes[k]
        k += 1
    if k < len(nodes) and _is_quantize_of(nodes[k], prev):
        return views, nodes[k]
    return [], None


def _quantize_why_not(quant, value_meta: TensorMeta) -> str | None:
    """Declines on the quantize step of a chain whose float value (before the views) has
    metadata ``value_meta``: group, K, the packed output."""
    group = quant.params.get("group")
    if isinstance(group, bool) or group not in REGULAR_HADAMARD_GROUPS:
        return f"group {group!r}"
    qm, xm = quant.meta, quant.srcs[0].meta
    if not isinstance(qm, TensorMeta) or not isinstance(xm, TensorMeta):
        return "the quantize step's metadata is not a tensor's"
    k = value_meta.shape[-1] if value_meta.shape else 0
    if not k or xm.shape[-1] != k or k % group:
        return f"the quantized rows ({tuple(xm.shape)}) are not the chain's rows of {k} " \
               f"features, or {k} is not a multiple of group={group}"
    m = value_meta.numel // k
    if qm.dtype != torch.int8 or tuple(qm.shape) != (packed_nbytes(m, k),) or \
            not qm.is_contiguous:
        return f"the quantize step's output {qm.short()} is not the packed layout"
    return None


def _one_user(users, n):
    us = users.get(n, [])
    return us[0] if len(us) == 1 and not n.is_output else None


def _follow_to_quantize(users, last) -> list | None:
    """The single-user chain ``views* -> quantize`` after ``last`` (None when it is not one)."""
    out, prev = [], last
    while True:
        u = _one_user(users, prev)
        if u is None:
            return None
        if _is_row_view(u, prev):
            out.append(u)
            prev = u
            continue
        return out + [u] if _is_quantize_of(u, prev) else None


def _gather(graph, chain: list) -> None:
    """Make ``chain`` (nodes in dataflow order) consecutive by moving each done prefix down to
    just before the chain's next node with ``graph_delay`` (which refuses any move that would
    change a result); stops at the first refusal."""
    for k in range(1, len(chain)):
        start = graph.nodes.index(chain[0])
        j = graph.nodes.index(chain[k])
        if j == start + k:
            continue
        if j < start + k or not fxbackend.graph_delay(graph, start, start + k, j - 1):
            return


def _match_answer(find, why_not) -> Any:
    """A rule's ``match`` answer: 0 where ``find()`` finds no chain, ``(0, reason)`` where
    ``why_not(chain)`` declines it (or either raises: never raise from match), else the
    chain's node count."""
    try:
        ch = find()
        if ch is None:
            return 0
        why = why_not(ch)
    except Exception as exc:  # never raise from match: decline with the reason
        return 0, f"metadata not understood ({type(exc).__name__}: {exc})"
    return (0, why) if why is not None else len(ch["nodes"])


def _gather_to_quantize(graph, users, chain: list) -> None:
    """Move ``chain`` down to just before the views and quantize step that read its last node
    (nothing when no single quantize step does)."""
    tail = _follow_to_quantize(users, chain[-1])
    if tail is not None:
        _gather(graph, chain + tail)


def _why_dtypes(metas: dict) -> str | None:
    dtypes = {m.dtype for m in metas.values()}
    if len(dtypes) != 1:
        return "dtypes differ: " + ", ".join(f"{k} {m.dtype}" for k, m in metas.items())
    return None


# -- 1. int8_gated_residual -----------------------------------------------------------------------

@dataclasses.dataclass
class _I8Parts:
    """What the fused step needs from its chain (node references are external inputs)."""

    linear: Any  # the sd.linear_i8.v1 node
    srcs: dict  # its sources by name (linear_srcs)
    gate: Any
    residual: Any
    y_shape: tuple  # the GEMM result's shape as the gate multiply sees it
    scale_op: str | None
    scale: float | None
    out_meta: TensorMeta
    dtype: torch.dtype = torch.float32  # the chain's: a 16-bit layer's cast after the linear


class Int8GatedResidualFusion(GatedResidualFusion):
    """Fusion rule ``int8_gated_residual``::

        # sd.linear_i8 -> [_to_copy bf16|fp16] -> view/clone* -> [mul|div scalar]
        #   -> mul(gate) -> add(residual)
        #   =>  fused.int8_gated_residual: torch._int_mm, then ONE epilogue pass

    The end of every quantized adaLN-Zero block (Flux/SD3 attention out-projections, their
    feed-forwards' last linear, Flux's single-block ``proj_out``).  Meaning:
    :func:`int8_gated_residual_reference`; per element of the output (float32)::

        y   = float32(acc[m, n]) * x_scale[m] * w_scale[n] + bias[n]       (linear_i8's order)
        t   = y * float32(s)  |  y / float32(s)  |  y                      (the scale, if any)
        g   = gate * t
        out = residual + g

    each product and sum rounded to float32 on its own, so the step equals the unfused chain bit
    for bit.  The unfused chain writes the [M, N] float32 linear output and reads and writes it
    once per native op (the clone, the gate multiply, the residual add); the fused step writes
    the int32 accumulator into the output's own storage and converts it in place in one pass
    that also reads the gate and residual rows.

    The chain matching is ``gated_residual``'s (this class extends
    :class:`~fxbackend.patterns.gated_residual.GatedResidualFusion`: passthrough views/clones, one
    optional scale by a Python number made exact where it can be, the gate multiply and residual
    add in either operand order, gate/residual broadcast to the linear's shape).  The linear may
    be any ``sd.linear_i8.v1`` the device's linear kernel computes (every ``x_kind``; a float
    weight is quantized once per step state and again when it changes, as the linear kernel
    does).  The linear's output is float32, so a 16-bit gate or residual beside it makes the
    chain promote (declined: "dtypes differ"); a 16-bit layer's chain (its cast after the
    linear: T = bfloat16 or float16) rounds the linear's value to T and each operation to T, as
    the unfused steps do, and fuses only where ``impl.gr_dtypes`` lists T (then ``run`` also
    gets ``dtype=T``; the accumulator then goes to workspace).

    ``impl`` (the device kernel): ``name``; ``why_not_linear(node)`` (the device's conditions
    on the ``sd.linear_i8.v1`` node, never raises); ``why_not(y, gate, residual, out)``
    (``TensorMeta``s, y the contiguous GEMM result in the gate multiply's shape; never raises);
    optional ``compile(linear, y, gate, residual, out, scale_op)`` (plan time);
    ``quantize(x, group, q, scales, m, mp)`` (the device's row quantizer, for float operands);
    ``run(qx, xs, qw, ws, bias, acc, gate, residual, out, *, y_shape, scale_op, scale)``: the
    integer GEMM into ``acc`` (int32 ``[M, N]``, possibly ``out``'s own storage) and the
    epilogue into ``out``.
    """

    priority = 6
    casts = False  # no widened or narrowed operands (the 16-bit cast after the linear is its own)

    def __init__(self, impl) -> None:
        super().__init__(impl)
        self.name = "int8_gated_residual"

    # -- matching (``match`` is gated_residual's) ---------------------------------------------
    @staticmethod
    def _starts(n) -> bool:
        m = _tensor(n)
        return n.op == LINEAR_I8 and m is not None and m.dtype == torch.float32 and \
            len(m.shape) >= 1 and m.is_contiguous

    def _chain(self, lin, next_of) -> list | None:
        """gated_residual's chain, where a 16-bit layer's cast may follow the linear."""
        if not self._starts(lin):
            return None
        nxt = next_of(lin)
        if nxt is not None and _is_cast_of(nxt, lin):
            return self._chain_from([lin, nxt], next_of)
        return self._chain_from([lin], next_of, nxt)

    def _parts(self, chain: list) -> _I8Parts:
        lin, mul, add = chain[0], chain[-2], chain[-1]
        y = chain[-3]
        scale_node = next((c for p, c in zip(chain, chain[1:-2]) if _is_scale(c, p)), None)
        scale_op, scale = exact_scale(
            None if scale_node is None else
            ("mul" if scale_node.op == "aten.mul.Tensor" else "div"),
            None if scale_node is None else float(scale_node.params["other"]))
        cast = chain[1] if _is_cast_of(chain[1], lin) else None
        return _I8Parts(lin, linear_srcs(lin.srcs, lin.params), _other(mul, y), _other(add, mul),
                        tuple(y.meta.shape), scale_op, scale, add.meta,
                        torch.float32 if cast is None else cast.meta.dtype)

    def _why_not(self, chain: list) -> str | None:
        p = self._parts(chain)
        metas = {"the linear": dataclasses.replace(p.linear.meta, dtype=p.dtype),
                 "the gate": p.gate.meta, "the residual": p.residual.meta,
                 "the output": p.out_meta}
        if not all(isinstance(m, TensorMeta) for m in metas.values()):
            return "an operand is not a tensor"
        why = _why_dtypes(metas)
        if why is not None:
            return why
        if p.dtype not in getattr(self.impl, "gr_dtypes", (torch.float32,)):
            return f"{self.impl.name}: no kernel for {p.dtype} chains"
        if any(m.is_symbolic for m in metas.values()):
            return "symbolic shapes"
        if not _broadcasts(tuple(p.gate.meta.shape), p.y_shape) or \
                not _broadcasts(tuple(p.residual.meta.shape), p.y_shape):
            return "gate or residual does not broadcast to the linear's shape"
        why = self.impl.why_not_linear(p.linear)
        if why is None:
            y = dataclasses.replace(p.linear.meta, shape=p.y_shape,
                                    stride=contiguous_strides(p.y_shape), dtype=p.dtype)
            why = self.impl.why_not(y, p.gate.meta, p.residual.meta, p.out_meta)
        return None if why is None else f"{self.impl.name}: {why}"

    def optimize(self, graph) -> None:
        """Make each chain consecutive, as ``gated_residual`` does for its float linears (the
        gate's ``unsqueeze`` sits between the linear and the gate multiply; Flux's/SD3's
        context stream projects long before its gated residual).  Never raises."""
        try:
            users = graph.users()
            for lin in [n for n in graph.nodes if n.op == LINEAR_I8]:
                chain = self._chain(lin, lambda n: _one_user(users, n))
                if chain is not None:
                    _gather(graph, chain)
        except Exception:  # an optimisation only: matching decides on whatever order is left
            return

    # -- running -----------------------------------------------------------------------------
    def _state(self, node) -> dict:
        p = self._parts(node.annotations["fused"])
        # the int32 accumulator fits in a contiguous float32 output's own storage
        in_place = node.meta.is_contiguous and p.dtype == torch.float32
        st = _linear_state(p.linear, p.srcs, acc_in_workspace=not in_place)
        y_meta = dataclasses.replace(p.linear.meta, shape=p.y_shape,
                                     stride=contiguous_strides(p.y_shape), dtype=p.dtype)
        return dict(st, parts=p, in_place=in_place, y_meta=y_meta,
                    extra=_dtype_kwargs(p.dtype))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            st = self._state(node)
            p = st["parts"]
            comp(p.linear, st["y_meta"], p.gate.meta, p.residual.meta, p.out_meta, p.scale_op)

    def prepare(self, node):
        st = self._state(node)
        return st, st["ws_bytes"]

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        p = st["parts"]
        value = dict(zip(node.srcs, inputs))
        qx, xs, qw, ws, bias = _linear_operands(self.impl, st, p.srcs, value, workspace)
        M, N = st["M"], st["N"]
        if st["in_place"] and not any(_overlaps(out, t) for t in inputs):
            acc = out.view(torch.int32).view(M, N)
        elif not st["in_place"]:
            acc = _acc_view(st, workspace)
        else:
            # out overlaps an input: the memory planner does not do this (inputs live through
            # the step), but the rule must stay correct if it ever did
            acc = torch.empty((M, N), dtype=torch.int32, device=out.device)
        self.impl.run(qx, xs, qw, ws, bias, acc, value[p.gate], value[p.residual], out,
                      y_shape=p.y_shape, scale_op=p.scale_op, scale=p.scale, **st["extra"])


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """The ``dtype=`` keyword a kernel's ``run``/``compile`` gets for a 16-bit chain (none for
    float32, so implementations without 16-bit support keep their signatures)."""
    return {} if dtype == torch.float32 else {"dtype": dtype}


def _linear_state(lin, srcs: dict, acc_in_workspace: bool) -> dict:
    """Plan-time state of a fused step that runs the ``sd.linear_i8.v1`` node ``lin``: its
    sizes and kinds, the float weight's :class:`WeightState`, and the workspace: the packed x
    (``x_kind="float"``) at 0, then (``acc_in_workspace``) the int32 accumulator, aligned."""
    prm = lin.params
    metas = {k: (None if v is None else v.meta) for k, v in srcs.items()}
    M, K, N, _ = check_linear(**metas, x_kind=prm["x_kind"], w_kind=prm["w_kind"],
                              group=prm["group"], m=prm["m"], lead=prm["lead"])
    x_bytes = packed_nbytes(M, K) if prm["x_kind"] == "float" else 0
    acc_off = -(-x_bytes // _ALIGN) * _ALIGN
    weight = WeightState(N, K, lin.meta.device) if prm["w_kind"] == "float" else None
    return dict(M=M, K=K, N=N, x_kind=prm["x_kind"], w_kind=prm["w_kind"], group=prm["group"],
                x_bytes=x_bytes, acc_off=acc_off, weight=weight,
                ws_bytes=acc_off + 4 * M * N if acc_in_workspace else x_bytes)


def _acc_view(st: dict, workspace) -> torch.Tensor:
    M, N = st["M"], st["N"]
    return workspace[st["acc_off"]:st["acc_off"] + 4 * M * N].view(torch.int32).view(M, N)


def _linear_operands(impl, st: dict, srcs: dict, value: dict, workspace) -> tuple:
    """``(q_x, x_scale, q_w, w_scale, bias)`` of the linear at run time: x quantized into the
    workspace by ``impl.quantize`` (``x_kind="float"``) or read in place (packed, int8); a float
    weight quantized into the step's state when it changed (``WeightState``)."""
    s = {k: (None if v is None else value[v]) for k, v in srcs.items()}
    M, K, N, group = st["M"], st["K"], st["N"], st["group"]
    x = s["x"]
    if not x.is_contiguous():  # other strides than planned (the Dynamo path): stay right
        x = x.contiguous()
    if st["x_kind"] == "float":
        buf = workspace[:st["x_bytes"]].view(torch.int8)
        mp = padded_rows(M)
        impl.quantize(x, group, buf[:mp * K], buf[mp * K:].view(torch.float32), M, mp)
        qx, xs = unpack(buf, M, K)
    elif st["x_kind"] == "packed":
        qx, xs = unpack(x, M, K)
    else:
        qx, xs = x.view(M, K), s["x_scale"]
    if st["w_kind"] == "float":
        qw, ws = st["weight"].get(
            s["w"], group, lambda w, g, wi, wsc: impl.quantize(w, g, wi, wsc, N, N))
    else:
        qw, ws = s["w"], s["w_scale"]
    return qx, xs, qw, ws, s["bias"]


# -- 1b. int8_linear_act_quantize -----------------------------------------------------------------

class _Int8LinearRule:
    """What the rules running an ``sd.linear_i8.v1`` step with its GEMM into workspace share:
    ``_chain(nodes, i)`` (a dict with ``linear``, ``srcs``, ``nodes``; or None) and ``_why_not``
    come from each rule."""

    priority = 6
    rule_name = ""

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = self.rule_name

    def match(self, graph, i: int):
        return _match_answer(lambda: self._chain(graph.nodes, i), self._why_not)

    def _state(self, node) -> dict:
        ch = self._chain(node.annotations["fused"], 0)
        st = _linear_state(ch["linear"], ch["srcs"], acc_in_workspace=True)
        return dict(st, srcs=ch["srcs"], linear=ch["linear"], chain=ch)

    def prepare(self, node):
        st = self._state(node)
        return st, st["ws_bytes"]


def _linear_act_at(nodes, i):
    """``(linear, cast or None, activation node, act, its index)`` for the run ``sd.linear_i8
    -> [_to_copy bf16|fp16] -> row views* -> gelu|gelu_tanh|silu|sigmoid`` starting at
    ``nodes[i]``, or None."""
    lin = nodes[i]
    if not Int8GatedResidualFusion._starts(lin):
        return None
    k, prev, cast = i + 1, lin, None
    if k < len(nodes) and _is_cast_of(nodes[k], lin):  # a 16-bit layer
        cast = prev = nodes[k]
        k += 1
    while k < len(nodes) and _is_row_view(nodes[k], prev):
        prev = nodes[k]
        k += 1
    if k >= len(nodes):
        return None
    act_node = nodes[k]
    act = _pre_act_of(act_node)
    if act is None or act_node.srcs != [prev] or _tensor(act_node) is None or \
            (act_node.op == "aten.gelu.default" and set(act_node.params) - {"approximate"}):
        return None
    return lin, cast, act_node, act, k


def _activation_why_not(impl, ch: dict, dtypes_attr: str) -> str | None:
    """The checks the two rules ending at an activation share: the activation a concrete tensor
    of the chain's dtype, a dtype the implementation lists in ``impl.<dtypes_attr>`` (float32
    when it lists none), with the linear's rows."""
    lin, v, dt = ch["linear"].meta, ch["value"].meta, ch["dtype"]
    if not isinstance(v, TensorMeta) or v.dtype != dt or v.is_symbolic:
        return f"the activation is not a concrete {dt} tensor"
    if dt not in getattr(impl, dtypes_attr, (torch.float32,)):
        return f"{impl.name}: no kernel for {dt} chains"
    if v.numel != lin.numel or v.shape[-1] != lin.shape[-1]:
        return "the activation's rows are not the linear's"
    return None


def _linear_act_users(users, lin) -> list | None:
    """By dataflow (single users): ``[lin, cast?, row views*, activation]`` after the
    ``sd.linear_i8`` node ``lin``, or None when no activation follows that way."""
    chain, u = [lin], _one_user(users, lin)
    if u is not None and _is_cast_of(u, lin):
        chain.append(u)
        u = _one_user(users, u)
    while u is not None and _is_row_view(u, chain[-1]):
        chain.append(u)
        u = _one_user(users, u)
    return chain + [u] if u is not None and _pre_act_of(u) is not None else None


class Int8LinearActQuantizeFusion(_Int8LinearRule):
    """Fusion rule ``int8_linear_act_quantize``::

        # sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid
        #   -> [clone] -> views* -> quantize
        #   =>  fused.int8_linear_act_quantize: torch._int_mm, then ONE pass per row

    The feed-forward between two quantized linears (Flux's/SD3's ``ff.net[0].proj`` -> GELU(tanh)
    -> ``ff.net[2]``): the GEMM's int32 accumulator goes to workspace, then each row is scaled
    (``linear_i8``'s epilogue), activated (``act_quantize``'s activation maths) and quantized
    (the quantize kernel's rotation and codes) without the float [M, N] hidden ever being
    written; the unfused pair (``sd.linear_i8.v1`` then ``act_quantize``) writes it and reads it
    back.  Bit-exact to that pair (the same operations in the same order); to the native
    activation as ``act_quantize`` is (module docstring).  Priority 6 (the only other rule
    starting at ``sd.linear_i8.v1`` is ``int8_gated_residual``, whose chain ends differently).

    ``impl``: as :class:`Int8GatedResidualFusion`'s for ``name``, ``why_not_linear``,
    ``quantize``; ``why_not_act(m, n, out, act, group)`` (``out`` the packed output; never
    raises); optional ``compile_act(linear, act, group)``; ``run_act(qx, xs, qw, ws, bias, acc,
    out, *, act, group)``: the GEMM into ``acc`` (int32 workspace) and the pass into ``out``.
    A 16-bit layer's chain (the cast after the linear: T = bfloat16 or float16) rounds the
    linear's value to T before the activation, and the activation's to T, as the unfused steps
    do; it fuses only where ``impl.act_dtypes`` lists T, and then ``compile_act`` and
    ``run_act`` also get ``dtype=T``.
    """

    rule_name = "int8_linear_act_quantize"

    def _chain(self, nodes, i):
        found = _linear_act_at(nodes, i)
        if found is None:
            return None
        lin, cast, act_node, act, k = found
        k, last = k + 1, act_node
        if k < len(nodes) and _is_clone_of(nodes[k], last):
            last = nodes[k]
            k += 1
        views, quant = row_view_chain(nodes, k, last)
        if quant is None:
            return None
        return dict(linear=lin, act=act, value=last, quant=quant,
                    group=quant.params.get("group"), nodes=nodes[i:k + len(views) + 1],
                    srcs=linear_srcs(lin.srcs, lin.params),
                    dtype=torch.float32 if cast is None else cast.meta.dtype)

    def _why_not(self, ch) -> str | None:
        lin, v = ch["linear"].meta, ch["value"].meta
        why = _activation_why_not(self.impl, ch, "act_dtypes")
        if why is not None:
            return why
        why = _quantize_why_not(ch["quant"], v)
        if why is None:
            why = self.impl.why_not_linear(ch["linear"])
        if why is None:
            n = lin.shape[-1]
            why = self.impl.why_not_act(lin.numel // n, n, ch["quant"].meta, ch["act"],
                                        ch["group"])
        return None if why is None else f"{self.impl.name}: {why}"

    def optimize(self, graph) -> None:
        """Move each linear (and its views, activation, clone) down to just before the views
        and quantize step that read the activation.  Never raises."""
        try:
            users = graph.users()
            for lin in [n for n in graph.nodes if n.op == LINEAR_I8]:
                chain = _linear_act_users(users, lin)
                if chain is None:
                    continue
                c = _one_user(users, chain[-1])
                if c is not None and _is_clone_of(c, chain[-1]):
                    chain.append(c)
                _gather_to_quantize(graph, users, chain)
        except Exception:
            return

    def _state(self, node) -> dict:
        st = super()._state(node)
        return dict(st, act=st["chain"]["act"], qgroup=st["chain"]["group"],
                    extra=_dtype_kwargs(st["chain"]["dtype"]))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile_act", None)
        if comp is not None:
            st = self._state(node)
            comp(st["linear"], st["act"], st["qgroup"], **st["extra"])

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        value = dict(zip(node.srcs, inputs))
        qx, xs, qw, ws, bias = _linear_operands(self.impl, st, st["srcs"], value, workspace)
        self.impl.run_act(qx, xs, qw, ws, bias, _acc_view(st, workspace), out, act=st["act"],
                          group=st["qgroup"], **st["extra"])


class Int8LinearActFusion(_Int8LinearRule):
    """Fusion rule ``int8_linear_act``::

        # sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid
        #   =>  fused.int8_linear_act: torch._int_mm into workspace, then ONE pass per row

    An activation after a quantized linear whose result is not quantized next (where it is,
    the rule declines: ``int8_linear_act_quantize`` or ``act_quantize`` takes it): Flux's
    single-stream MLP (``proj_mlp`` -> GELU(tanh), concatenated with the attention output
    before ``proj_out``).  Each row is scaled (``linear_i8``'s epilogue), activated
    (``int8_linear_act_quantize``'s activation maths) and stored, so the float linear output
    is never written and read back by a separate activation pass.  Equal to
    ``sd.linear_i8.v1`` followed by the project's activation kernels' maths (a few float32 ulp
    from torch's vectorised activation, as ``act_quantize`` is; see the module docstring).
    Priority 5: below ``int8_linear_act_quantize`` and ``int8_gated_residual`` (6), whose
    chains start the same way and go further; above ``int8_linear_cast`` (4), which would take
    a 16-bit layer's cast alone.

    ``impl``: as :class:`Int8GatedResidualFusion`'s for ``name``, ``why_not_linear``,
    ``quantize``; ``why_not_act_out(m, n, out, act, dtype)`` (``out`` the activation's
    metadata; never raises); ``act_out_dtypes`` (the chain dtypes it fuses); optional
    ``compile_linear_act(linear, act, dtype)``; ``run_linear_act(qx, xs, qw, ws, bias, acc,
    out, *, act, dtype)``: the GEMM into ``acc`` (int32 workspace) and the pass into ``out``
    (``strided_out`` on the implementation: any row stride).  A device registers this rule
    only when its implementation has these (``register_int8_fusions``'s ``linear_act``).
    """

    priority = 5
    rule_name = "int8_linear_act"

    def __init__(self, impl) -> None:
        super().__init__(impl)
        #: the kernel writes rows of any stride (a slice of a concatenation)
        self.strided_out = bool(getattr(impl, "strided_out", False))

    def _chain(self, nodes, i):
        found = _linear_act_at(nodes, i)
        if found is None:
            return None
        lin, cast, act_node, act, k = found
        return dict(linear=lin, act=act, value=act_node, nodes=nodes[i:k + 1],
                    srcs=linear_srcs(lin.srcs, lin.params),
                    dtype=torch.float32 if cast is None else cast.meta.dtype)

    def match(self, graph, i: int):
        def find():
            ch = self._chain(graph.nodes, i)
            if ch is not None:
                users, last = graph.users(), ch["value"]
                c = _one_user(users, last)
                if c is not None and _is_clone_of(c, last):
                    last = c
                ch["feeds_quantize"] = _follow_to_quantize(users, last) is not None
            return ch
        return _match_answer(find, self._why_not)

    def _why_not(self, ch) -> str | None:
        lin, v, dt = ch["linear"].meta, ch["value"].meta, ch["dtype"]
        if ch.get("feeds_quantize"):
            return ("the activation feeds a quantize step (int8_linear_act_quantize or "
                    "act_quantize takes it)")
        why = _activation_why_not(self.impl, ch, "act_out_dtypes")
        if why is not None:
            return why
        why = self.impl.why_not_linear(ch["linear"])
        if why is None:
            n = lin.shape[-1]
            why = self.impl.why_not_act_out(lin.numel // n, n, v, ch["act"], dt)
        return None if why is None else f"{self.impl.name}: {why}"

    def optimize(self, graph) -> None:
        """Move each linear (and its cast and views) down to just before the activation that
        reads it.  Never raises."""
        try:
            users = graph.users()
            for lin in [n for n in graph.nodes if n.op == LINEAR_I8]:
                chain = _linear_act_users(users, lin)
                if chain is not None:
                    _gather(graph, chain)
        except Exception:
            return

    def _state(self, node) -> dict:
        st = super()._state(node)
        return dict(st, act=st["chain"]["act"], extra=_dtype_kwargs(st["chain"]["dtype"]))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile_linear_act", None)
        if comp is not None:
            st = self._state(node)
            comp(st["linear"], st["act"], **st["extra"])

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        value = dict(zip(node.srcs, inputs))
        qx, xs, qw, ws, bias = _linear_operands(self.impl, st, st["srcs"], value, workspace)
        self.impl.run_linear_act(qx, xs, qw, ws, bias, _acc_view(st, workspace), out,
                                 act=st["act"], **st["extra"])


def _cast_why_not(n) -> str | None:
    """Why the ``_to_copy`` node ``n`` is not a plain cast to bfloat16/float16 (None: it is)."""
    for key, value in n.params.items():
        if key != "dtype" and value not in _CAST_DEFAULTS.get(key, (None,)):
            return f"the cast has {key}={value!r}"
    m = _tensor(n)
    if m is None or m.is_symbolic or m.dtype not in (torch.bfloat16, torch.float16):
        return "the cast is not to a concrete bfloat16/float16 tensor"
    return None


def _is_cast_of(n, prev) -> bool:
    """``n`` is a plain cast of ``prev`` to bfloat16/float16 (the 16-bit layers'
    ``quantize_w8a8`` form: ``sd.linear_i8.v1 -> _to_copy``)."""
    return n.op == "aten._to_copy.default" and n.srcs == [prev] and _cast_why_not(n) is None


def _is_clone_of(n, prev) -> bool:
    m, pm = _tensor(n), _tensor(prev)
    return n.op == "aten.clone.default" and n.srcs == [prev] and m is not None and \
        pm is not None and n.view_of is None and n.inplace_of is None and \
        tuple(m.shape) == tuple(pm.shape) and m.dtype == pm.dtype


# -- 1c. int8_linear_cast -------------------------------------------------------------------------

#: ``_to_copy`` keyword arguments a cast may carry (with these values) and still be a plain cast
_CAST_DEFAULTS = {"layout": (None, torch.strided), "pin_memory": (None, False),
                  "non_blocking": (None, False),
                  "memory_format": (None, torch.preserve_format, torch.contiguous_format)}


class Int8LinearCastFusion(_Int8LinearRule):
    """Fusion rule ``int8_linear_cast``::

        # sd.linear_i8 -> _to_copy {dtype: bfloat16 | float16}
        #   =>  fused.int8_linear_cast: the integer GEMM into workspace, then the epilogue
        #       writes the 16-bit output

    A 16-bit linear under ``quantize="w8a8"`` (``patterns/quantize.py``) is the float32
    ``sd.linear_i8.v1`` step followed by a cast to the layer's dtype; fused, the epilogue rounds
    each float32 value once into the 16-bit output, so the float32 [M, N] result is never
    written and read back.  Bit-exact to the pair.  Priority 4: below
    ``int8_linear_act_quantize`` (6) and ``int8_linear_act`` (5), which take the cast too when
    an activation (and a quantize step) follows it.

    ``impl``: as :class:`Int8GatedResidualFusion`'s for ``name``, ``why_not_linear``,
    ``quantize``; ``why_not_cast(out)`` (the cast's metadata; never raises); optional
    ``compile_cast(linear, dtype)``; ``run_cast(qx, xs, qw, ws, bias, acc, out)``: the GEMM into
    ``acc`` (int32 workspace) and the epilogue into ``out``.  A device registers this rule
    only when its implementation has these (``register_int8_fusions``'s ``linear_cast``).
    """

    priority = 4
    rule_name = "int8_linear_cast"

    def _chain(self, nodes, i):
        lin = nodes[i]
        if not Int8GatedResidualFusion._starts(lin) or i + 1 >= len(nodes):
            return None
        cast = nodes[i + 1]
        if cast.op != "aten._to_copy.default" or cast.srcs != [lin]:
            return None
        return dict(linear=lin, cast=cast, nodes=nodes[i:i + 2],
                    srcs=linear_srcs(lin.srcs, lin.params))

    def _why_not(self, ch) -> str | None:
        lin, c = ch["linear"].meta, ch["cast"].meta
        why = _cast_why_not(ch["cast"])
        if why is not None:
            return why
        if tuple(c.shape) != tuple(lin.shape) or not c.is_contiguous or c.device != lin.device:
            return f"the cast's output {c.short()} is not the linear's rows, contiguous"
        why = self.impl.why_not_linear(ch["linear"]) or self.impl.why_not_cast(c)
        return None if why is None else f"{self.impl.name}: {why}"

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile_cast", None)
        if comp is not None:
            comp(self._state(node)["linear"], node.meta.dtype)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        value = dict(zip(node.srcs, inputs))
        qx, xs, qw, ws, bias = _linear_operands(self.impl, st, st["srcs"], value, workspace)
        self.impl.run_cast(qx, xs, qw, ws, bias, _acc_view(st, workspace), out)


# -- 2. modulation_quantize -----------------------------------------------------------------------

class ModulationQuantizeFusion(ModulationFusion):
    """Fusion rule ``modulation_quantize``::

        # native_layer_norm -> getitem 0 -> [add(s, c) -> views] -> mul -> add
        #   | sd.rms_norm.v1(x) -> [add(s, c) -> views] -> mul -> add
        #   | native_layer_norm(x, [C], w, b) -> getitem 0      (scale = w, shift = b, no c)
        #   -> views* -> quantize  =>  fused.modulation_quantize (the packed int8 rows directly)

    The adaLN chain of ``modulation`` (this class extends
    :class:`~fxbackend.patterns.modulation.ModulationFusion`: same matching, same
    declines) followed by the quantize step of the linears that read it (Flux's/SD3's Q/K/V
    projections share one, the feed-forward's first linear has its own).  Per row: the
    modulation kernel's statistics and roundings give the float row (in registers or an L1
    scratch row), then the quantize kernel's rotation, scale and codes; the float [rows, C]
    tensor is never written.  Meaning: :func:`modulation_quantize_reference`, computed with the
    modulation kernels' reductions (module docstring).

    The quantize step must read the modulation output's rows as they are (views that keep the
    last dim C), and the group must divide C.  Priority 6: above ``modulation`` (5).

    ``impl``: ``name``; ``why_not(x, scale, shift, out, norm, group)`` (``scale``/``shift``
    expanded to x's shape, ``out`` the packed output; never raises); optional ``compile(x,
    scale, shift, out, norm, has_add, group)``; ``run(x, scale, shift, out, *, norm, eps,
    add_c, group)`` writing the packed layout into ``out``.
    """

    priority = 6
    casts = False  # the quantize step reads the float result: no widened x, no narrowing cast

    def __init__(self, impl) -> None:
        super().__init__(impl)
        self.name = "modulation_quantize"

    def _match_at(self, nodes, i):
        ch = super()._match_at(nodes, i)
        if ch is None:
            ch = self._affine_at(nodes, i)
        if ch is None:
            return None
        k = i + len(ch["nodes"])
        views, quant = row_view_chain(nodes, k, ch["add"])
        if quant is None:
            return None
        return dict(ch, views=views, quant=quant, group=quant.params.get("group"),
                    nodes=nodes[i:k + len(views) + 1])

    @staticmethod
    def _affine_at(nodes, i):
        """A LayerNorm with weight and bias (``native_layer_norm(x, [C], w, b)`` -> getitem 0,
        a UNet transformer block's norms): the chain with ``scale = w``, ``shift = b`` and no
        ``c``, in the same dict form (``mul`` and ``add`` are the getitem)."""
        norm = nodes[i]
        if norm.op != _LAYER_NORM or len(norm.srcs) != 3 or i + 1 >= len(nodes):
            return None
        x, w, b = norm.srcs
        shape, eps = norm.params.get("normalized_shape"), _scalar(norm.params.get("eps"))
        n = nodes[i + 1]
        if not isinstance(x.meta, TensorMeta) or not x.meta.shape or eps is None or \
                list(shape or []) != [x.meta.shape[-1]] or n.op != "getitem" or \
                n.srcs != [norm] or n.params.get("index") != 0:
            return None
        return dict(norm=norm, kind="layer", eps=float(eps), x=x, n=n, add_c=None, c=None,
                    s_src=w, s_op=w, mul=n, shift=b, add=n, nodes=nodes[i:i + 2], inner=[],
                    up=None, down=None, out=n)

    def _why_not(self, ch) -> str | None:
        why = super()._why_not(ch)
        if why is None:
            why = _quantize_why_not(ch["quant"], ch["add"].meta)
        return why

    def match(self, graph, i: int):
        return _match_answer(lambda: self._match_at(graph.nodes, i), self._match_why_not)

    def _match_why_not(self, ch) -> str | None:
        """:meth:`_why_not`, then the implementation's reason on the expanded scale/shift."""
        why = self._why_not(ch)
        if why is None:
            s, h = self._expanded(ch["x"].meta, ch["s_src"].meta, tuple(ch["s_op"].meta.shape),
                                  ch["add_c"] is not None, ch["shift"].meta)
            if s is None or h is None:
                why = "scale/shift do not broadcast to x"
            else:
                why = self.impl.why_not(ch["x"].meta, s, h, ch["quant"].meta, ch["kind"],
                                        ch["group"])
                why = None if why is None else f"{self.impl.name}: {why}"
        return why

    @staticmethod
    def _expanded(x, s_src, s_shape, has_add, shift):
        shape = tuple(x.shape)
        s = expanded_meta(_reshaped(s_src, s_shape) if has_add else s_src, shape)
        return s, expanded_meta(shift, shape)

    def optimize(self, graph) -> None:
        """``modulation``'s reordering (each norm chain consecutive), then each chain moved down
        to just before the views and quantize step that read it (Flux computes the context
        stream's modulation between the image stream's and its Q/K/V quantize step).  Never
        raises."""
        try:
            super().optimize(graph)
            users = graph.users()
            for norm in [x for x in graph.nodes if self._norm_of(x) is not None]:
                chain = self._chain_by_uses(norm, users)
                if chain is None:
                    continue
                _gather_to_quantize(graph, users, chain)
        except Exception:  # an optimisation only
            return

    # -- running -----------------------------------------------------------------------------
    def _parts(self, node) -> dict:
        ch = self._match_at(node.annotations["fused"], 0)
        return dict(x=ch["x"], s=ch["s_src"], shift=ch["shift"], kind=ch["kind"], eps=ch["eps"],
                    c=ch["c"], s_shape=tuple(ch["s_op"].meta.shape),
                    shape=tuple(ch["x"].meta.shape), group=ch["group"])

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            s, h = self._expanded(p["x"].meta, p["s"].meta, p["s_shape"], p["c"] is not None,
                                  p["shift"].meta)
            comp(p["x"].meta, s, h, node.meta, p["kind"], p["c"] is not None, p["group"])

    def _run_extra(self, p: dict) -> dict:  # prepare/execute: ModulationFusion's
        return {"group": p["group"]}


# -- 3. rms_norm_quantize -------------------------------------------------------------------------

class RmsNormQuantizeFusion:
    """Fusion rule ``rms_norm_quantize``::

        # sd.rms_norm.v1(x[, w]) -> views* -> quantize  =>  fused.rms_norm_quantize

    RMSNorm (with or without its weight, ``patterns/rmsnorm.py``) read only by a quantize
    step: per row the RMSNorm kernel's statistic and roundings, then the quantize kernel's
    rotation and codes.  Bit-exact to the ``sd.rms_norm.v1`` kernel followed by the quantize
    kernel.  Priority 6.

    ``impl``: ``name``; ``why_not(x, w, norm_out, out, group, weight_in_float)``
    (``norm_out``: the norm's own output metadata, whose dtype the kernel rounds to; ``out`` the
    packed output; never raises); optional ``compile(x, w, norm_out, out, group)``;
    ``run(x, w, out, *, eps, norm_dtype, weight_in_float, group)`` (``weight_in_float``:
    torch.nn.RMSNorm's order, the weight multiplied in float32 and the product rounded once to
    x's dtype).
    """

    priority = 6

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "rms_norm_quantize"

    def _chain(self, nodes, i):
        norm = nodes[i]
        if norm.op != RmsNorm.name or len(norm.srcs) not in (1, 2) or _tensor(norm) is None:
            return None
        views, quant = row_view_chain(nodes, i + 1, norm)
        if quant is None:
            return None
        return dict(norm=norm, x=norm.srcs[0], w=norm.srcs[1] if len(norm.srcs) == 2 else None,
                    eps=float(norm.params["eps"]), quant=quant, group=quant.params.get("group"),
                    nodes=nodes[i:i + len(views) + 2])

    def match(self, graph, i: int):
        return _match_answer(lambda: self._chain(graph.nodes, i), self._why_not)

    def _why_not(self, ch) -> str | None:
        x, nm = ch["x"].meta, ch["norm"].meta
        if not isinstance(x, TensorMeta) or x.is_symbolic:
            return "symbolic or non-tensor x"
        why = _quantize_why_not(ch["quant"], nm)
        if why is None:
            why = self.impl.why_not(x, None if ch["w"] is None else ch["w"].meta, nm,
                                    ch["quant"].meta, ch["group"],
                                    bool(ch["norm"].params.get("weight_in_float", False)))
            why = None if why is None else f"{self.impl.name}: {why}"
        return why

    def optimize(self, graph) -> None:
        """Move each norm down to just before its views and quantize step.  Never raises."""
        try:
            users = graph.users()
            for norm in [n for n in graph.nodes if n.op == RmsNorm.name]:
                _gather_to_quantize(graph, users, [norm])
        except Exception:
            return

    def _parts(self, node) -> dict:
        ch = self._chain(node.annotations["fused"], 0)
        return dict(x=ch["x"], w=ch["w"], eps=ch["eps"], group=ch["group"],
                    norm_meta=ch["norm"].meta,
                    weight_in_float=bool(ch["norm"].params.get("weight_in_float", False)))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            comp(p["x"].meta, None if p["w"] is None else p["w"].meta, p["norm_meta"],
                 node.meta, p["group"])

    def prepare(self, node):
        return self._parts(node), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        self.impl.run(value[p["x"]], None if p["w"] is None else value[p["w"]], out,
                      eps=p["eps"], norm_dtype=p["norm_meta"].dtype,
                      weight_in_float=p["weight_in_float"], group=p["group"])


# -- 4./5. act_quantize, scale_quantize -----------------------------------------------------------

def _pre_act_of(n) -> str | None:
    if n.op == "aten.sigmoid.default":
        return "sigmoid"
    return _act_of(n)


class _PrologueQuantize:
    """Shared matching and running of ``prologue -> [clone] -> views* -> quantize`` where the
    prologue is elementwise on one tensor x (optionally times a second tensor, optionally
    scaled by a Python number).  Subclasses define ``_head(nodes, i) -> (dict, k) | None``:
    the prologue's description and the index after its nodes.

    ``impl``: ``name``; ``why_not(x, other, out, act, scale_op, group)`` (``other`` expanded
    to x's shape or None; ``out`` the packed output; never raises); optional ``compile(x,
    other, out, act, scale_op, group)``; ``run(x, other, out, *, act, scale_op, scale,
    group)`` (``other`` expanded to x's shape or None) writing the packed layout.
    """

    priority = 6

    def __init__(self, impl, name: str) -> None:
        self.impl = impl
        self.name = name

    def _head(self, nodes, i):  # pragma: no cover - abstract
        raise NotImplementedError

    def _chain(self, nodes, i):
        head = self._head(nodes, i)
        if head is None:
            return None
        pro, k = head
        last = nodes[k - 1]
        if k < len(nodes) and _is_clone_of(nodes[k], last):
            last = nodes[k]
            k += 1
        views, quant = row_view_chain(nodes, k, last)
        if quant is None:
            return None
        return dict(pro, value=last, quant=quant, group=quant.params.get("group"),
                    nodes=nodes[i:k + len(views) + 1])

    def match(self, graph, i: int):
        return _match_answer(lambda: self._chain(graph.nodes, i), self._why_not)

    def _why_not(self, ch) -> str | None:
        x, v = ch["x"].meta, ch["value"].meta
        metas = {"x": x, "the result": v}
        if ch["other"] is not None:
            metas["the multiplier"] = ch["other"].meta
        if not all(isinstance(m, TensorMeta) for m in metas.values()):
            return "an operand is not a tensor"
        why = _why_dtypes(metas)
        if why is not None:
            return why
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype} (float32, bfloat16 or float16)"
        if any(m.is_symbolic for m in metas.values()):
            return "symbolic shapes"
        if tuple(v.shape) != tuple(x.shape):
            return f"the result's shape {tuple(v.shape)} is not x's {tuple(x.shape)}"
        other = None
        if ch["other"] is not None:
            other = expanded_meta(ch["other"].meta, tuple(x.shape))
            if other is None:
                return "the multiplier does not broadcast to x"
        why = _quantize_why_not(ch["quant"], v)
        if why is None:
            why = self.impl.why_not(x, other, ch["quant"].meta, ch["act"], ch["scale_op"],
                                    ch["group"])
            why = None if why is None else f"{self.impl.name}: {why}"
        return why

    def optimize(self, graph) -> None:
        """Move each prologue down to just before its clone, views and quantize step (Flux's
        FF writes the activation, then a clone, then the view the quantize step reads).  Never
        raises."""
        try:
            users = graph.users()
            for n in list(graph.nodes):
                if self._head([n], 0) is None:
                    continue
                chain = [n]
                u = _one_user(users, n)
                if u is not None and u.op == "aten.mul.Tensor" and self._takes_mul:
                    chain.append(u)
                    u = _one_user(users, u)
                if u is not None and u.op == "aten.clone.default":
                    chain.append(u)
                _gather_to_quantize(graph, users, chain)
        except Exception:
            return

    _takes_mul = False

    def _parts(self, node) -> dict:
        ch = self._chain(node.annotations["fused"], 0)
        return dict(x=ch["x"], other=ch["other"], act=ch["act"], scale_op=ch["scale_op"],
                    scale=ch["scale"], group=ch["group"], shape=tuple(ch["x"].meta.shape))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            other = None if p["other"] is None else expanded_meta(p["other"].meta, p["shape"])
            comp(p["x"].meta, other, node.meta, p["act"], p["scale_op"], p["group"])

    def prepare(self, node):
        return self._parts(node), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        other = None if p["other"] is None else value[p["other"]].expand(p["shape"])
        self.impl.run(value[p["x"]], other, out, act=p["act"], scale_op=p["scale_op"],
                      scale=p["scale"], group=p["group"])


class ActQuantizeFusion(_PrologueQuantize):
    """Fusion rule ``act_quantize``::

        # gelu|gelu_tanh|silu|sigmoid(x) [-> mul(b)] [-> clone] -> views* -> quantize
        #   =>  fused.act_quantize (writes the packed int8 rows directly)

    The activation between two quantized linears (Flux's/SD3's feed-forward: ``linear_i8 ->
    gelu(tanh) -> clone -> quantize -> linear_i8``; the timestep embedders' SiLU), and the gated
    forms ``act(a) * b`` (SwiGLU ``silu(gate) * up``, GEGLU ``hidden * gelu(gate)``, ``silu |
    sigmoid -> mul``) where ``a`` and ``b`` may be strided (the two halves of one linear's
    output) and ``b`` may broadcast.  Per element, in x's dtype T with the chain's roundings::

        v = round_T(act(x))                (the project's activation maths: module docstring)
        v = round_T(v * b)                 (gated)

    then the quantize kernel's rotation and codes.  Priority 6.
    """

    _takes_mul = True

    def __init__(self, impl) -> None:
        super().__init__(impl, "act_quantize")

    def _head(self, nodes, i):
        n = nodes[i]
        act = _pre_act_of(n)
        if act is None or len(n.srcs) != 1 or _tensor(n) is None or \
                (n.op == "aten.gelu.default" and set(n.params) - {"approximate"}):
            return None
        pro = dict(x=n.srcs[0], act=act, other=None, scale_op=None, scale=None)
        k = i + 1
        if k < len(nodes) and nodes[k].op == "aten.mul.Tensor" and not nodes[k].params:
            b = _other(nodes[k], n)
            if b is not None and _tensor(b) is not None and _tensor(nodes[k]) is not None and \
                    tuple(nodes[k].meta.shape) == tuple(n.meta.shape):
                pro["other"] = b
                k += 1
        return pro, k


class ScaleQuantizeFusion(_PrologueQuantize):
    """Fusion rule ``scale_quantize``::

        # mul|div(x, scalar) [-> clone] -> views* -> quantize  =>  fused.scale_quantize

    A scale by a Python number before a quantize step (a rescale factor before a projection),
    computed as the native op computes it (``round_T(x * float32(s))``, ``round_T(x /
    float32(s))``; division by a power of two becomes the exact multiplication, and ``* 1`` is
    dropped, as in ``gated_residual``), then the quantize kernel's rotation and codes.
    Priority 6."""

    def __init__(self, impl) -> None:
        super().__init__(impl, "scale_quantize")

    def _head(self, nodes, i):
        n = nodes[i]
        if n.op not in ("aten.mul.Tensor", "aten.div.Tensor") or len(n.srcs) != 1 or \
                set(n.params) != {"other"} or not _is_number(n.params["other"]) or \
                _tensor(n) is None or _tensor(n.srcs[0]) is None or \
                tuple(n.meta.shape) != tuple(n.srcs[0].meta.shape):
            return None
        op, s = exact_scale("mul" if n.op == "aten.mul.Tensor" else "div",
                            float(n.params["other"]))
        return dict(x=n.srcs[0], act=None, other=None, scale_op=op, scale=s), i + 1


# -- a torch implementation of the quantize-feeding interfaces (tests, and a model) ---------------

class ReferenceQuantizeImpl:
    """Torch implementations of the ``modulation_quantize``, ``rms_norm_quantize`` and
    ``act_quantize``/``scale_quantize`` kernel interfaces (for tests of the rules: it accepts
    everything unless built with a reason to decline); not registered."""

    name = "quantize_fusion_reference"

    def __init__(self, decline: str | None = None) -> None:
        self.decline = decline
        self.calls = 0

    def why_not(self, *args):
        return self.decline

    def run(self, *args, **kw):
        self.calls += 1
        out = args[-1]
        if "norm" in kw:  # modulation_quantize
            x, s, h = args[:3]
            y = modulation_reference(x, s, h, kw["eps"], kw["norm"], kw["add_c"])
        elif "norm_dtype" in kw:  # rms_norm_quantize
            y = rms_norm_reference(args[0], args[1], kw["eps"], kw["weight_in_float"])
        else:
            y = prologue_reference(args[0], act=kw["act"], other=args[1],
                                   scale_op=kw["scale_op"], scale=kw["scale"])
        out.copy_(quantize_i8_convrot_reference(y, kw["group"]))


def register_int8_fusions(device: str, gated_residual, linear_act_quantize, modulation_quantize,
                          rms_norm_quantize, prologue_quantize, linear_cast=None,
                          linear_act=None) -> None:
    """Register this file's rules for ``device`` with that device's implementation objects
    (``prologue_quantize`` serves both ``act_quantize`` and ``scale_quantize``;
    ``int8_linear_cast`` only when ``linear_cast`` is given, ``int8_linear_act`` only when
    ``linear_act`` is)."""
    if linear_cast is not None:
        fxbackend.register_fusion(device, Int8LinearCastFusion(linear_cast))
    if linear_act is not None:
        fxbackend.register_fusion(device, Int8LinearActFusion(linear_act))
    fxbackend.register_fusion(device, Int8GatedResidualFusion(gated_residual))
    fxbackend.register_fusion(device, Int8LinearActQuantizeFusion(linear_act_quantize))
    fxbackend.register_fusion(device, ModulationQuantizeFusion(modulation_quantize))
    fxbackend.register_fusion(device, RmsNormQuantizeFusion(rms_norm_quantize))
    fxbackend.register_fusion(device, ActQuantizeFusion(prologue_quantize))
    fxbackend.register_fusion(device, ScaleQuantizeFusion(prologue_quantize))
