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
    # sd.linear_i8 -> views* -> split(N/2) -> getitem x2 -> act(half) -> mul(other half)
    #   -> [clone] -> views* -> quantize                    =>  fused.int8_linear_glu_quantize
    # sd.linear_i8 -> views* -> gelu|gelu_tanh|silu|sigmoid =>  fused.int8_linear_act
    # sd.linear_i8 -> _to_copy bf16|fp16                    =>  fused.int8_linear_cast
    # norm [no affine] -> [add(s, c) -> views] -> mul -> add -> views* -> quantize
    #                                                       =>  fused.modulation_quantize
    # sd.rms_norm.v1(x[, w]) -> views* -> quantize          =>  fused.rms_norm_quantize
    # gelu|gelu_tanh|silu|sigmoid(x) [-> mul(b)] [-> clone] -> views* -> quantize
    #                                                       =>  fused.act_quantize
    # mul|div(x, scalar) [-> clone] -> views* -> quantize   =>  fused.scale_quantize

Rules are data.  The five rules after an ``sd.linear_i8.v1`` step are rows of
:data:`EPILOGUES` (how the chain is found, the rule's reasons, how ``optimize`` gathers it),
all run by :class:`Int8EpilogueFusion`: the device's GEMM (``patterns/int8.Int8Device``, shared
with the linear kernel) into an int32 accumulator, then one kernel pass.  The rules ending at a
quantize step share :class:`QuantizeFeedFusion`; ``act_quantize`` and ``scale_quantize`` are
rows of :data:`PROLOGUES`.  Each device gives one :class:`FusedKernel` record per rule (the
numba kernels of ``cpu_kernels/int8_fusions.py``, the Triton kernels of
``cuda_kernels/int8_fusions.py``: their ``KERNELS``), so a new fused epilogue is a row of
:data:`EPILOGUES` and a kernel on each device.  Rules match on dataflow (ops, sources, shapes,
dtypes, strides), never on names, and decline a recognised chain with a reason (``match``
returns ``(0, why)``; it never raises).  The engine (``fusion.check_claim``) judges legality:
an intermediate read outside the chain (a modulation output that is also used in float) makes
the engine decline.

Priorities (higher is tried first at a node; the rules here start at different ops, so they
compete only with the float rules that start at the same node):

- ``modulation_quantize`` 6, above ``modulation`` (5), which would otherwise claim the shorter
  ``norm -> mul -> add`` prefix and leave the quantize step alone;
- ``rms_norm_quantize`` 6, above ``rms_rope`` and ``modulation`` (the three start at an
  ``sd.rms_norm.v1`` node; their chains end differently, so at most one matches);
- ``int8_gated_residual``, ``int8_linear_act_quantize``, ``int8_linear_glu_quantize``,
  ``act_quantize``, ``scale_quantize`` 6 (the first three start at ``sd.linear_i8.v1`` and
  their chains end differently, so at most one matches; no other rule starts at a standalone activation or at a scalar multiply
  followed by a quantize step; ``scale_cast`` starts at a scalar multiply followed by a cast).
  ``int8_linear_act_quantize`` is tried at the linear, before ``act_quantize`` sees the
  activation (matching goes left to right), so it takes the longer chain, as
  ``int8_linear_glu_quantize`` takes a GEGLU's whole chain before ``act_quantize`` sees its
  activation and multiply;
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
- ``int8_linear_glu_quantize``: ``linear_i8``'s epilogue over the whole row, then
  ``act_quantize``'s maths with the activated half and its multiplier: equal to
  ``sd.linear_i8.v1`` followed by ``fused.act_quantize``;
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
import functools
from typing import Any, Callable

import torch

import fxbackend
from fxbackend import TensorMeta, contiguous_strides

from .activation import _act_of, act_reference, is_split_in_halves
from .gated_residual import (GatedResidualFusion, _broadcasts, _is_number, _is_scale, _other,
                             _overlaps, _tensor, exact_scale, gated_residual_reference)
from .int8 import (REGULAR_HADAMARD_GROUPS, Int8Device, WeightState, check_linear,
                   compile_quantized_operands, linear_i8_reference, linear_srcs, packed_nbytes,
                   quantize_i8_convrot_reference, x_operand)
from .modulation import (_LAYER_NORM, ModulationFusion, _reshaped, _scalar, expanded_meta,
                         modulation_reference)
from .rmsnorm import RmsNorm, rms_norm_reference

__all__ = ["QUANTIZE", "LINEAR_I8", "PRE_ACTS", "SCALE_OPS", "ACT_IDS", "FusedKernel",
           "Epilogue", "EPILOGUES", "Int8EpilogueFusion", "QuantizeFeedFusion",
           "ModulationQuantizeFusion", "RmsNormQuantizeFusion", "PrologueQuantizeFusion",
           "PROLOGUES", "QUANTIZE_FEEDS", "register_int8_fusions", "never_raises", "bias_dtype",
           "direct_gemm",
           "int8_gated_residual_reference", "int8_linear_act_quantize_reference",
           "int8_linear_glu_quantize_reference", "packed_out",
           "expand_scale_shift", "modulation_quantize_reference", "rms_norm_quantize_reference",
           "act_quantize_reference", "prologue_reference", "ReferenceQuantizeImpl",
           "row_view_chain"]

QUANTIZE = "sd.quantize_i8_convrot.v1"
LINEAR_I8 = "sd.linear_i8.v1"
#: activations before a quantize step: gelu with the tanh approximation, gelu (erf), silu, sigmoid
PRE_ACTS = ("gelu_tanh", "gelu", "silu", "sigmoid")
#: the kernels' codes (both devices) of a chain's scale by a Python number and of its activation
#: (0: none; 1.. PRE_ACTS in order, sigmoid last)
SCALE_OPS = {None: 0, "mul": 1, "div": 2}
ACT_IDS = {None: 0, **{a: k + 1 for k, a in enumerate(PRE_ACTS)}}
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


def int8_linear_glu_quantize_reference(x, w, w_scale=None, x_scale=None, bias=None, *, act,
                                       gate, x_kind, w_kind, group=1, m=-1, lead=(),
                                       out_group=1) -> torch.Tensor:
    """The unfused chain: ``sd.linear_i8.v1`` (``linear_i8_reference``) split into two halves
    of its last dim, torch's activation ``act`` of half ``gate`` times the other half, then
    ``sd.quantize_i8_convrot.v1 {out_group}``."""
    y = linear_i8_reference(x, w, w_scale, x_scale, bias, x_kind=x_kind, w_kind=w_kind,
                            group=group, m=m, lead=lead)
    if gate not in (0, 1):
        raise ValueError(f"gate must be 0 or 1 (the activated half), got {gate!r}")
    halves = y.chunk(2, dim=-1)
    return quantize_i8_convrot_reference(_act_torch(halves[gate], act) * halves[1 - gate],
                                         out_group)


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
    if act not in PRE_ACTS:
        raise ValueError(f"activation must be one of {PRE_ACTS}, got {act!r}")
    return torch.sigmoid(v) if act == "sigmoid" else act_reference(v, act)


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


def _quantize_tail(nodes: list, k: int, last) -> tuple | None:
    """``[clone] -> views* -> quantize`` of ``last`` from ``nodes[k]``: ``(the value the views
    read, the quantize step, the index after it)``, or None."""
    if k < len(nodes) and _is_clone_of(nodes[k], last):
        last = nodes[k]
        k += 1
    views, quant = row_view_chain(nodes, k, last)
    return None if quant is None else (last, quant, k + len(views) + 1)


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


def never_raises(why_not: Callable[..., str | None]) -> Callable[..., str | None]:
    """``why_not`` as a kernel's check that never raises: an exception becomes the reason
    ``metadata not understood (...)``."""
    @functools.wraps(why_not)
    def checked(*args, **kw) -> str | None:
        try:
            return why_not(*args, **kw)
        except Exception as exc:  # never raise: decline with the reason
            return f"metadata not understood ({type(exc).__name__}: {exc})"
    return checked


def bias_dtype(linear) -> torch.dtype | None:
    """The dtype of the ``sd.linear_i8.v1`` node's bias (None: no bias), for a kernel's
    ``compile``."""
    return linear.srcs[-1].meta.dtype if linear.params.get("has_bias") else None


# -- the device kernels: one record per rule and device -------------------------------------------

@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """One device's kernel for one rule of this file: the ``impl`` the rule is built with
    (``cpu_kernels/int8_fusions.py`` and ``cuda_kernels/int8_fusions.py`` give one per rule in
    their ``KERNELS``).  The arguments of ``why_not``, ``compile`` and ``run`` are the rule's:
    :class:`Int8EpilogueFusion` for the rules after an ``sd.linear_i8.v1`` step,
    :class:`QuantizeFeedFusion` for those ending at a quantize step."""

    #: prefixes the kernel's reasons in the plan's report
    name: str
    #: the chain's metadata -> the reason the kernel declines it, None when it computes it;
    #: never raises
    why_not: Callable[..., str | None]
    run: Callable[..., None]
    #: plan-time compilation or warm-up (None: nothing to compile)
    compile: Callable[..., None] | None = None
    #: the chain dtypes it fuses after a linear (a 16-bit layer's cast rounds the linear's value)
    dtypes: tuple = (torch.float32,)
    #: it writes rows of any stride (a slice of a concatenation: ``fxbackend.concat``)
    strided_out: bool = False
    #: ``fxbackend.cudagraphs``: None, not declared
    capture_safe: bool | None = None

    def __post_init__(self) -> None:
        # the module of the kernel (its run function), where a kernel class's __module__ would
        # point: what tools and tests ask of a rule's impl (e.g. the project's CUDA kernels)
        object.__setattr__(self, "__module__", getattr(self.run, "__module__", __name__))


# -- the rules after an sd.linear_i8.v1 step: one class, a table of epilogues ---------------------

@dataclasses.dataclass(frozen=True)
class Epilogue:
    """One fused epilogue of ``sd.linear_i8.v1``: a row of :data:`EPILOGUES`, which
    :class:`Int8EpilogueFusion` runs on a device.

    ``find(nodes, i)`` gives the chain starting at the linear ``nodes[i]`` or None: a dict with
    ``linear`` (the node), ``srcs`` (its sources by name, ``linear_srcs``), ``nodes`` (the
    chain), ``dtype`` (the chain's: float32, or a 16-bit layer's cast after the linear),
    ``y_shape`` (the linear's value as the epilogue reads it), ``operands`` (nodes the epilogue
    reads besides the accumulator, external inputs of the step) and ``args`` (the kernel's
    keyword arguments).  ``why_not(chain, kernel, dev)`` the rule's reasons, then the kernel's
    (:func:`_kernel_why_not`).  ``outside(graph, chain)``: a reason that reads the rest of the
    graph (None: none), checked first.  ``gather(users, linear)``: the nodes ``optimize`` makes
    consecutive (None: no reordering), down to the views and quantize step that read the last
    one with ``to_quantize``.  ``acc_in_out``: the int32 accumulator goes into a contiguous
    float32 output's own storage (else into workspace)."""

    name: str
    priority: int
    find: Callable[[list, int], dict | None]
    why_not: Callable[[dict, FusedKernel, Int8Device], str | None]
    outside: Callable[[Any, dict], str | None] | None = None
    gather: Callable[[dict, Any], list | None] | None = None
    to_quantize: bool = False
    acc_in_out: bool = False


def _y_meta(ch: dict) -> TensorMeta:
    """The linear's value as the epilogue reads it: contiguous, the chain's dtype and shape."""
    return dataclasses.replace(ch["linear"].meta, shape=ch["y_shape"],
                               stride=contiguous_strides(ch["y_shape"]), dtype=ch["dtype"])


def _kernel_why_not(ch: dict, kernel: FusedKernel, dev: Int8Device) -> str | None:
    """The device's reason on the linear, then the kernel's on the chain: ``kernel.why_not(y,
    out, *operands, **args)`` (``y``: :func:`_y_meta`; ``out``: the step's output)."""
    return dev.why_not_linear(ch["linear"]) or kernel.why_not(
        _y_meta(ch), ch["nodes"][-1].meta, *(n.meta for n in ch["operands"]), **ch["args"])


def _prefixed(kernel: FusedKernel, why: str | None) -> str | None:
    return None if why is None else f"{kernel.name}: {why}"


def _no_dtype_kernel(kernel: FusedKernel, dt: torch.dtype) -> str | None:
    return None if dt in kernel.dtypes else f"{kernel.name}: no kernel for {dt} chains"


class Int8EpilogueFusion:
    """The fusion rule of one :class:`Epilogue` (``spec``) on one device: the integer GEMM of
    the chain's ``sd.linear_i8.v1`` (``dev``: the device's ``patterns/int8.Int8Device``) into an
    int32 accumulator, then ONE pass of the device's ``impl`` (a :class:`FusedKernel`) from the
    accumulator to the step's output, so the float [M, N] linear output is never written and
    read back.

    The linear may be any ``sd.linear_i8.v1`` the device's linear kernel computes
    (``dev.why_not_linear``; every ``x_kind``): a float x is quantized into the step's
    workspace, a float weight once per model into the step's state (``WeightState``, with the
    device's own quantizer), as the linear kernel does.  The kernel's interface:

    - ``why_not(y, out, *operands, **args)``: ``y`` the linear's value as the epilogue reads it
      (contiguous, the chain's dtype, the shape the chain sees), ``out`` the step's output,
      ``operands`` the metadata of the epilogue's other tensors (the gate and residual), ``args``
      the rule's attributes (its :data:`EPILOGUES` row); never raises;
    - optional ``compile(linear, y, out, *operands, **args)`` (plan time; the quantize kernels of
      the float operands are the rule's to compile);
    - ``run(acc, x_scale, w_scale, bias, out, *operands, **args)``: the epilogue from the int32
      accumulator ``acc [M, N]`` (the output's own storage when ``spec.acc_in_out`` and the
      output is contiguous float32, else workspace; none reserved where the device's GEMM
      returns a new tensor, ``dev.gemm_writes_acc``) into ``out``, or from that new float32
      tensor;
    - ``dtypes``: the chain dtypes it fuses (a 16-bit layer's chain: the cast after the linear
      rounds the linear's value, each operation rounds to that dtype, as the unfused steps
      do); ``strided_out``: out may have any row stride; ``capture_safe``.

    The device's ``between()`` runs after the operands are quantized and after the GEMM (the
    CPU's cancellation check)."""

    def __init__(self, spec: Epilogue, dev: Int8Device, impl: FusedKernel) -> None:
        self.spec, self.dev, self.impl = spec, dev, impl
        self.name, self.priority = spec.name, spec.priority
        #: the kernel writes rows of any stride (a slice of a concatenation)
        self.strided_out = bool(getattr(impl, "strided_out", False))

    def match(self, graph, i: int):
        spec = self.spec

        def find():
            ch = spec.find(graph.nodes, i)
            if ch is not None and spec.outside is not None:
                ch["outside"] = spec.outside(graph, ch)
            return ch
        return _match_answer(find, lambda ch: ch.get("outside") or
                             spec.why_not(ch, self.impl, self.dev))

    def optimize(self, graph) -> None:
        """Make each chain consecutive (``spec.gather``): ATen puts the gate's ``unsqueeze``
        between the linear and the gate multiply, and Flux's/SD3's context stream projects long
        before its gated residual.  Never raises."""
        if self.spec.gather is None:
            return
        try:
            users = graph.users()
            for lin in [n for n in graph.nodes if n.op == LINEAR_I8]:
                chain = self.spec.gather(users, lin)
                if chain is None:
                    continue
                if self.spec.to_quantize:
                    _gather_to_quantize(graph, users, chain)
                else:
                    _gather(graph, chain)
        except Exception:  # an optimisation only: matching decides on whatever order is left
            return

    def _state(self, node) -> dict:
        ch = self.spec.find(node.annotations["fused"], 0)
        # no accumulator where the device's GEMM returns a new tensor (the CPU's prepacked
        # engines); else in a contiguous float32 output's own storage, or in the workspace
        acc = self.dev.gemm_writes_acc(ch["linear"].params["w_kind"])
        in_place = acc and self.spec.acc_in_out and node.meta.is_contiguous and \
            ch["dtype"] == torch.float32
        st = _linear_state(ch["linear"], ch["srcs"], acc_in_workspace=acc and not in_place)
        return dict(st, linear=ch["linear"], srcs=ch["srcs"], in_place=in_place, acc=acc,
                    operands=ch["operands"], args=ch["args"], y=_y_meta(ch))

    def compile(self, node) -> None:
        st = self._state(node)
        compile_quantized_operands(self.dev, st["linear"])
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            comp(st["linear"], st["y"], node.meta, *(n.meta for n in st["operands"]),
                 **st["args"])

    def prepare(self, node):
        st = self._state(node)
        return st, st["ws_bytes"]

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        st = state
        value = dict(zip(node.srcs, inputs))
        qx, xs, qw, ws, bias = _linear_operands(self.dev, st, st["srcs"], value, workspace)
        M, N = st["M"], st["N"]
        if not st["acc"]:
            acc = None
        elif st["in_place"] and not any(_overlaps(out, t) for t in inputs):
            acc = out.view(torch.int32).view(M, N)
        elif not st["in_place"]:
            acc = _acc_view(st, workspace)
        else:
            # out overlaps an input: the memory planner does not do this (inputs live through
            # the step), but the rule must stay correct if it ever did
            acc = torch.empty((M, N), dtype=torch.int32, device=out.device)
        self.dev.between()
        acc = self.dev.gemm(qx, qw, acc)
        self.dev.between()
        self.impl.run(acc, xs, ws, bias, out, *(value[n] for n in st["operands"]),
                      **st["args"])


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


def direct_gemm(dev: Int8Device, x_kind: str, group: int, M: int, K: int, N: int, x, x_scale,
                w, out) -> tuple:
    """The GEMM phase of a fused epilogue's direct call (tests, benchmarks) with an int8 weight
    ``w``: x quantized into a temporary (``x_kind="float"``) or read in place, the accumulator
    (as ``dev.gemm`` returned it) in a contiguous out's own storage (else a temporary);
    ``(acc, x_scale)``."""
    buf = None
    if x_kind == "float":
        x = x.reshape(M, K).contiguous()
        buf = torch.empty(packed_nbytes(M, K), dtype=torch.int8, device=x.device)
    elif x_kind == "int8":
        x, x_scale = x.reshape(M, K), x_scale.reshape(M)
    qx, xs = x_operand(dev, x_kind, group, M, K, x, x_scale, buf)
    acc = out.view(torch.int32).view(M, N) if out.is_contiguous() else \
        torch.empty(M, N, dtype=torch.int32, device=out.device)
    return dev.gemm(qx, w, acc), xs


def _acc_view(st: dict, workspace) -> torch.Tensor:
    M, N = st["M"], st["N"]
    return workspace[st["acc_off"]:st["acc_off"] + 4 * M * N].view(torch.int32).view(M, N)


def _linear_operands(dev: Int8Device, st: dict, srcs: dict, value: dict, workspace) -> tuple:
    """``(q_x, x_scale, q_w, w_scale, bias)`` of the linear at run time: x quantized into the
    workspace (``x_kind="float"``) or read in place (packed, int8); a float weight quantized
    into the step's state when it changed (``WeightState``)."""
    s = {k: (None if v is None else value[v]) for k, v in srcs.items()}
    x = s["x"]
    if not x.is_contiguous():  # other strides than planned (the Dynamo path): stay right
        x = x.contiguous()
    buf = workspace[:st["x_bytes"]].view(torch.int8) if st["x_kind"] == "float" else None
    qx, xs = x_operand(dev, st["x_kind"], st["group"], st["M"], st["K"], x, s["x_scale"], buf)
    if st["w_kind"] == "float":
        qw, ws = st["weight"].get(s["w"], st["group"], dev.quantize_weight)
    else:
        qw, ws = s["w"], s["w_scale"]
    return qx, xs, qw, ws, s["bias"]


def _starts(n) -> bool:
    """``n`` is an ``sd.linear_i8.v1`` step whose float32 output a fused epilogue can take."""
    m = _tensor(n)
    return n.op == LINEAR_I8 and m is not None and m.dtype == torch.float32 and \
        len(m.shape) >= 1 and m.is_contiguous


def _linear_chain(lin, cast, nodes: list, operands=(), shape=None, **args) -> dict:
    """The chain dict of an :class:`Epilogue` (its docstring): ``cast`` the 16-bit layer's
    cast after the linear (None: a float32 chain), ``shape`` the linear's value as the epilogue
    reads it (None: the linear's shape), ``args`` the kernel's (``dtype``: the chain's)."""
    dtype = torch.float32 if cast is None else cast.meta.dtype
    return dict(linear=lin, srcs=linear_srcs(lin.srcs, lin.params), nodes=nodes, dtype=dtype,
                y_shape=tuple(lin.meta.shape) if shape is None else shape,
                operands=list(operands), args=dict(args, dtype=dtype))


# -- int8_gated_residual

class _GatedChain(GatedResidualFusion):
    """``gated_residual``'s chain walk (passthrough views and clones, one optional scale by a
    Python number, the gate multiply and the residual add in either operand order), starting
    at an ``sd.linear_i8.v1`` step whose 16-bit layer's cast may follow it; no widening or
    narrowing casts around the gate (the 16-bit cast after the linear is its own)."""

    casts = False

    @staticmethod
    def _starts(n) -> bool:
        return _starts(n)

    def _chain(self, lin, next_of) -> list | None:
        if not self._starts(lin):
            return None
        nxt = next_of(lin)
        if nxt is not None and _is_cast_of(nxt, lin):
            return self._chain_from([lin, nxt], next_of)
        return self._chain_from([lin], next_of, nxt)


_GATED = _GatedChain(None)


def _gr_find(nodes, i):
    """``sd.linear_i8 -> [_to_copy bf16|fp16] -> view/clone* -> [mul|div scalar] -> mul(gate)
    -> add(residual)``; operands the gate and the residual, args ``y_shape`` (the linear's value
    as the gate multiply sees it), ``scale_op``/``scale`` (made exact where they can be, as in
    ``gated_residual``)."""
    pos = [i]

    def next_in_graph(_):
        pos[0] += 1
        return nodes[pos[0]] if pos[0] < len(nodes) else None
    chain = _GATED._chain(nodes[i], next_in_graph)
    if chain is None:
        return None
    lin, mul, add, y = chain[0], chain[-2], chain[-1], chain[-3]
    scale_node = next((c for p, c in zip(chain, chain[1:-2]) if _is_scale(c, p)), None)
    scale_op, scale = exact_scale(
        None if scale_node is None else
        ("mul" if scale_node.op == "aten.mul.Tensor" else "div"),
        None if scale_node is None else float(scale_node.params["other"]))
    y_shape = tuple(y.meta.shape)
    return _linear_chain(lin, chain[1] if _is_cast_of(chain[1], lin) else None, chain,
                         (_other(mul, y), _other(add, mul)), y_shape, y_shape=y_shape,
                         scale_op=scale_op, scale=scale)


def _gr_why_not(ch, kernel, dev) -> str | None:
    gate, residual = ch["operands"]
    metas = {"the linear": dataclasses.replace(ch["linear"].meta, dtype=ch["dtype"]),
             "the gate": gate.meta, "the residual": residual.meta,
             "the output": ch["nodes"][-1].meta}
    if not all(isinstance(m, TensorMeta) for m in metas.values()):
        return "an operand is not a tensor"
    why = _why_dtypes(metas) or _no_dtype_kernel(kernel, ch["dtype"])
    if why is not None:
        return why
    if any(m.is_symbolic for m in metas.values()):
        return "symbolic shapes"
    if not _broadcasts(tuple(gate.meta.shape), ch["y_shape"]) or \
            not _broadcasts(tuple(residual.meta.shape), ch["y_shape"]):
        return "gate or residual does not broadcast to the linear's shape"
    return _prefixed(kernel, _kernel_why_not(ch, kernel, dev))


def _gr_gather(users, lin) -> list | None:
    return _GATED._chain(lin, lambda n: _one_user(users, n))


# -- int8_linear_act_quantize, int8_linear_act

def _linear_head(nodes, i):
    """``(linear, cast or None, last node, index after it)`` for ``sd.linear_i8 -> [_to_copy
    bf16|fp16] -> row views*`` starting at ``nodes[i]``, or None where no fused epilogue can
    start there (``_starts``)."""
    lin = nodes[i]
    if not _starts(lin):
        return None
    k, prev, cast = i + 1, lin, None
    if k < len(nodes) and _is_cast_of(nodes[k], lin):  # a 16-bit layer
        cast = prev = nodes[k]
        k += 1
    while k < len(nodes) and _is_row_view(nodes[k], prev):
        prev = nodes[k]
        k += 1
    return lin, cast, prev, k


def _head_users(users, lin) -> tuple:
    """By dataflow (single users): ``([lin, cast?, row views*], the next single user or
    None)``."""
    chain, u = [lin], _one_user(users, lin)
    if u is not None and _is_cast_of(u, lin):
        chain.append(u)
        u = _one_user(users, u)
    while u is not None and _is_row_view(u, chain[-1]):
        chain.append(u)
        u = _one_user(users, u)
    return chain, u


def _linear_act_at(nodes, i):
    """``(linear, cast or None, activation node, act, its index)`` for the run ``sd.linear_i8
    -> [_to_copy bf16|fp16] -> row views* -> gelu|gelu_tanh|silu|sigmoid`` starting at
    ``nodes[i]``, or None."""
    head = _linear_head(nodes, i)
    if head is None or head[3] >= len(nodes):
        return None
    lin, cast, prev, k = head
    act_node = nodes[k]
    act = _pre_act_of(act_node)
    if act is None or act_node.srcs != [prev] or _tensor(act_node) is None or \
            (act_node.op == "aten.gelu.default" and set(act_node.params) - {"approximate"}):
        return None
    return lin, cast, act_node, act, k


def _activation_why_not(kernel, ch: dict) -> str | None:
    """The checks the two rules ending at an activation share: the activation a concrete tensor
    of the chain's dtype, a dtype the kernel lists, with the linear's rows."""
    lin, v, dt = ch["linear"].meta, ch["value"].meta, ch["dtype"]
    if not isinstance(v, TensorMeta) or v.dtype != dt or v.is_symbolic:
        return f"the activation is not a concrete {dt} tensor"
    why = _no_dtype_kernel(kernel, dt)
    if why is None and (v.numel != lin.numel or v.shape[-1] != lin.shape[-1]):
        why = "the activation's rows are not the linear's"
    return why


def _linear_act_users(users, lin) -> list | None:
    """By dataflow (single users): ``[lin, cast?, row views*, activation]`` after the
    ``sd.linear_i8`` node ``lin``, or None when no activation follows that way."""
    chain, u = _head_users(users, lin)
    return chain + [u] if u is not None and _pre_act_of(u) is not None else None


def _lactq_find(nodes, i):
    """``sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid ->
    [clone] -> views* -> quantize``; args ``act``, ``group`` (the quantize step's)."""
    found = _linear_act_at(nodes, i)
    if found is None:
        return None
    lin, cast, act_node, act, k = found
    tail = _quantize_tail(nodes, k + 1, act_node)
    if tail is None:
        return None
    value, quant, end = tail
    return dict(_linear_chain(lin, cast, nodes[i:end], act=act, group=quant.params.get("group")),
                value=value, quant=quant)


def _lactq_why_not(ch, kernel, dev) -> str | None:
    why = _activation_why_not(kernel, ch)
    if why is not None:
        return why
    return _prefixed(kernel, _quantize_why_not(ch["quant"], ch["value"].meta) or
                     _kernel_why_not(ch, kernel, dev))


def _lactq_gather(users, lin) -> list | None:
    chain = _linear_act_users(users, lin)
    if chain is not None:
        c = _one_user(users, chain[-1])
        if c is not None and _is_clone_of(c, chain[-1]):
            chain.append(c)
    return chain


def _lact_find(nodes, i):
    """``sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid``; args
    ``act``."""
    found = _linear_act_at(nodes, i)
    if found is None:
        return None
    lin, cast, act_node, act, k = found
    return dict(_linear_chain(lin, cast, nodes[i:k + 1], act=act), value=act_node)


def _lact_outside(graph, ch) -> str | None:
    users, last = graph.users(), ch["value"]
    c = _one_user(users, last)
    if c is not None and _is_clone_of(c, last):
        last = c
    if _follow_to_quantize(users, last) is not None:
        return "the activation feeds a quantize step (int8_linear_act_quantize or act_quantize " \
               "takes it)"
    return None


def _lact_why_not(ch, kernel, dev) -> str | None:
    return _activation_why_not(kernel, ch) or _prefixed(kernel, _kernel_why_not(ch, kernel, dev))


# -- int8_linear_cast

#: ``_to_copy`` keyword arguments a cast may carry (with these values) and still be a plain cast
_CAST_DEFAULTS = {"layout": (None, torch.strided), "pin_memory": (None, False),
                  "non_blocking": (None, False),
                  "memory_format": (None, torch.preserve_format, torch.contiguous_format)}


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


def _cast_find(nodes, i):
    """``sd.linear_i8 -> _to_copy`` (a float32 chain: the epilogue rounds once into the cast's
    dtype, the output's)."""
    lin = nodes[i]
    if not _starts(lin) or i + 1 >= len(nodes):
        return None
    cast = nodes[i + 1]
    if cast.op != "aten._to_copy.default" or cast.srcs != [lin]:
        return None
    return dict(_linear_chain(lin, None, nodes[i:i + 2]), cast=cast)


def _cast_why_not_chain(ch, kernel, dev) -> str | None:
    why = _cast_why_not(ch["cast"])
    if why is not None:
        return why
    lin, c = ch["linear"].meta, ch["cast"].meta
    if tuple(c.shape) != tuple(lin.shape) or not c.is_contiguous or c.device != lin.device:
        return f"the cast's output {c.short()} is not the linear's rows, contiguous"
    return _prefixed(kernel, _kernel_why_not(ch, kernel, dev))


# -- int8_linear_glu_quantize

def _glu_at(nodes, i):
    """``(linear, cast or None, the activation, the mul, act, gate, index after the mul)`` for
    ``sd.linear_i8 -> [_to_copy bf16|fp16] -> row views* -> split(N/2, -1) -> getitem x2 ->
    act(half gate) -> mul(other half, act)`` starting at ``nodes[i]``, or None."""
    head = _linear_head(nodes, i)
    if head is None:
        return None
    lin, cast, prev, k = head
    if k + 4 >= len(nodes) or not is_split_in_halves(nodes[k], prev):
        return None
    sp, i0, i1, a, mul = nodes[k:k + 5]
    items = (i0, i1)
    if any(t.op != "getitem" or t.srcs != [sp] for t in items) or \
            {t.params.get("index") for t in items} != {0, 1}:
        return None
    act = _pre_act_of(a)
    if act is None or len(a.srcs) != 1 or a.srcs[0] not in items or \
            (a.op == "aten.gelu.default" and set(a.params) - {"approximate"}):
        return None
    other = i1 if a.srcs[0] is i0 else i0
    if mul.op != "aten.mul.Tensor" or mul.params or len(mul.srcs) != 2 or \
            set(mul.srcs) != {a, other}:
        return None
    return lin, cast, a, mul, act, int(a.srcs[0].params["index"]), k + 5


def _gluq_find(nodes, i):
    """``sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> split(N/2, -1) -> getitem x2 ->
    gelu|gelu_tanh|silu|sigmoid(half gate) -> mul(other half, act) -> [clone] -> views* ->
    quantize``; args ``act``, ``gate`` (0: the first half is activated, 1: the second),
    ``group`` (the quantize step's)."""
    found = _glu_at(nodes, i)
    if found is None:
        return None
    lin, cast, act_node, mul, act, gate, k = found
    tail = _quantize_tail(nodes, k, mul)
    if tail is None:
        return None
    value, quant, end = tail
    return dict(_linear_chain(lin, cast, nodes[i:end], act=act, gate=gate,
                              group=quant.params.get("group")),
                value=value, act_node=act_node, quant=quant)


def _gluq_why_not(ch, kernel, dev) -> str | None:
    lin, dt = ch["linear"].meta, ch["dtype"]
    for label, node in (("the activation", ch["act_node"]), ("the product", ch["value"])):
        v = _tensor(node)
        if v is None or v.dtype != dt or v.is_symbolic:
            return f"{label} is not a concrete {dt} tensor"
        if 2 * v.numel != lin.numel or 2 * v.shape[-1] != lin.shape[-1]:
            return f"{label}'s rows are not halves of the linear's"
    return _no_dtype_kernel(kernel, dt) or _prefixed(
        kernel, _quantize_why_not(ch["quant"], ch["value"].meta) or
        _kernel_why_not(ch, kernel, dev))


def _gluq_gather(users, lin) -> list | None:
    """By dataflow (single users): ``[lin, cast?, row views*, split, getitem x2, act, mul,
    clone?]``, or None."""
    chain, u = _head_users(users, lin)
    if u is None or not is_split_in_halves(u, chain[-1]):
        return None
    items = users.get(u, [])
    acts = [n for it in items for n in users.get(it, []) if _pre_act_of(n) is not None]
    if len(items) != 2 or len(acts) != 1:
        return None
    mul = _one_user(users, acts[0])
    if mul is None:
        return None
    chain += [u, *items, acts[0], mul]
    c = _one_user(users, mul)
    if c is not None and _is_clone_of(c, mul):
        chain.append(c)
    return chain


#: The epilogues of ``sd.linear_i8.v1``, one row per fusion rule (a new fused epilogue: a row
#: here and a :class:`FusedKernel` in each device's ``KERNELS``).  Meaning and numerics: the
#: module docstring; per element the accumulator row goes through linear_i8's epilogue
#: ``y = float32(acc[m, n]) * x_scale[m] * w_scale[n] + bias[n]`` (each operation rounded,
#: no FMA), rounded to the chain's dtype T (a 16-bit layer's cast; nothing for float32), then:
EPILOGUES = (
    # sd.linear_i8 -> [_to_copy bf16|fp16] -> view/clone* -> [mul|div scalar]
    #   -> mul(gate) -> add(residual)  =>  fused.int8_gated_residual
    # The end of every quantized adaLN-Zero block (Flux/SD3 attention out-projections, their
    # feed-forwards' last linear, Flux's single-block proj_out):
    #   t = y * float32(s) | y / float32(s) | y;  g = gate * t;  out = residual + g
    # each rounded to T on its own: bit for bit the unfused chain (int8_gated_residual_reference).
    # A 16-bit gate or residual beside a float32 chain makes the chain promote: declined
    # ("dtypes differ").  The accumulator goes into the output's own storage (converted in
    # place, one pass that also reads the gate and residual rows) when that is contiguous
    # float32.  Kernel args: y_shape, scale_op, scale, dtype; operands gate, residual.
    Epilogue("int8_gated_residual", 6, _gr_find, _gr_why_not, gather=_gr_gather,
             acc_in_out=True),
    # sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid
    #   -> [clone] -> views* -> quantize  =>  fused.int8_linear_act_quantize
    # The feed-forward between two quantized linears (Flux's/SD3's ff.net[0].proj -> GELU(tanh)
    # -> ff.net[2]): v = round_T(act(y)) (act_quantize's activation maths), then the quantize
    # kernel's rotation and codes; bit for bit sd.linear_i8.v1 followed by fused.act_quantize.
    # Kernel args: act, group (the quantize step's), dtype.
    Epilogue("int8_linear_act_quantize", 6, _lactq_find, _lactq_why_not, gather=_lactq_gather,
             to_quantize=True),
    # sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> split(N/2, -1) -> getitem x2
    #   -> act(half gate) -> mul(other half, act) -> [clone] -> views* -> quantize
    #   =>  fused.int8_linear_glu_quantize
    # A GEGLU / packed SwiGLU between two quantized linears (UNet2DConditionModel's
    # ff.net[0].proj -> chunk -> hidden * gelu(gate) -> ff.net[2]): per row the epilogue of
    # all N columns, then v = round_T(round_T(act(y[gate half])) * y[other half]), then the
    # quantize kernel's rotation and codes over N/2 features; bit for bit sd.linear_i8.v1
    # followed by fused.act_quantize (with the other half as its multiplier).  Kernel args:
    # act, gate (0 or 1), group (the quantize step's), dtype.
    Epilogue("int8_linear_glu_quantize", 6, _gluq_find, _gluq_why_not, gather=_gluq_gather,
             to_quantize=True),
    # sd.linear_i8 -> [_to_copy bf16|fp16] -> views* -> gelu|gelu_tanh|silu|sigmoid
    #   =>  fused.int8_linear_act
    # An activation whose result is not quantized next (where it is, declined: one of the two
    # rules above takes it), e.g. Flux's single-stream MLP (proj_mlp -> GELU(tanh), written
    # into its slice of the concatenation with the attention output): v = round_T(act(y))
    # stored.  Priority 5: below the rules starting the same way that go further, above
    # int8_linear_cast.  Kernel args: act, dtype.
    Epilogue("int8_linear_act", 5, _lact_find, _lact_why_not, outside=_lact_outside,
             gather=_linear_act_users),
    # sd.linear_i8 -> _to_copy {dtype: bfloat16 | float16}  =>  fused.int8_linear_cast
    # A 16-bit linear under quantize="w8a8" (patterns/quantize.py): y rounded once into the
    # 16-bit output, bit for bit the pair.  Priority 4: the rules above take the cast too when
    # an activation (and a quantize step) follows it.  Kernel args: dtype (float32).
    Epilogue("int8_linear_cast", 4, _cast_find, _cast_why_not_chain),
)


# -- the rules ending at a quantize step ----------------------------------------------------------

def _operand_meta(op) -> TensorMeta | None:
    """The metadata a quantize-feeding kernel gets for ``(node, view, shape)``: the node's,
    viewed as ``view`` and expanded to ``shape`` (None: as it is); None for no node or where
    the expansion does not exist."""
    node, view, shape = op
    if node is None:
        return None
    m = node.meta if view is None else _reshaped(node.meta, view)
    return m if shape is None else expanded_meta(m, shape)


def _operand_value(op, value: dict):
    node, view, shape = op
    if node is None:
        return None
    t = value[node]
    if view is not None:
        t = t.view(view)
    return t if shape is None else t.expand(shape)


class QuantizeFeedFusion:
    """What the rules ending at a quantize step share: matching through ``_find(nodes, i)``
    (the chain: a dict with ``nodes``, ``quant`` (the quantize step), ``operands`` (``(node,
    view shape or None, shape to expand to or None)`` per kernel operand; node None: absent)
    and ``args`` (the kernel's keyword arguments), or None) and ``_why_not(chain)`` (the
    rule's reasons), then the kernel's; the step runs the kernel on the operands.  The float
    chain before the quantize step is never written: per row the kernel computes the chain's
    values (rounded as the chain rounds them) and quantizes them (the quantize kernel's
    rotation and codes) into the packed output.  The kernel (``impl``, a :class:`FusedKernel`):
    ``why_not(*operands, out, **args)`` (operand metadata, ``out`` the packed output's; never
    raises), optional ``compile(*operands, out, **args)``, ``run(*operands, out, **args)``
    writing the packed layout into ``out``."""

    priority = 6

    def match(self, graph, i: int):
        return _match_answer(lambda: self._find(graph.nodes, i), self._decline)

    def _decline(self, ch) -> str | None:
        why = self._why_not(ch)
        if why is None:
            why = _prefixed(self.impl, self.impl.why_not(
                *(_operand_meta(op) for op in ch["operands"]), ch["quant"].meta, **ch["args"]))
        return why

    def _step(self, node) -> dict:
        ch = self._find(node.annotations["fused"], 0)
        return dict(operands=ch["operands"], args=ch["args"])

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            st = self._step(node)
            comp(*(_operand_meta(op) for op in st["operands"]), node.meta, **st["args"])

    def prepare(self, node):
        return self._step(node), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        value = dict(zip(node.srcs, inputs))
        self.impl.run(*(_operand_value(op, value) for op in state["operands"]), out,
                      **state["args"])


class ModulationQuantizeFusion(QuantizeFeedFusion, ModulationFusion):
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
    last dim C), and the group must divide C.  Priority 6: above ``modulation`` (5).  Kernel
    operands x, scale, shift (expanded to x's shape); args ``norm``, ``eps``, ``add_c``,
    ``group``.
    """

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
        shape = tuple(ch["x"].meta.shape)
        view = tuple(ch["s_op"].meta.shape) if ch["add_c"] is not None else None
        return dict(ch, views=views, quant=quant, group=quant.params.get("group"),
                    nodes=nodes[i:k + len(views) + 1],
                    operands=[(ch["x"], None, None), (ch["s_src"], view, shape),
                              (ch["shift"], None, shape)],
                    args=dict(norm=ch["kind"], eps=ch["eps"], add_c=ch["c"],
                              group=quant.params.get("group")))

    _find = _match_at

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
        """``modulation``'s reasons, the quantize step's, then the expansion of scale/shift."""
        why = super()._why_not(ch) or _quantize_why_not(ch["quant"], ch["add"].meta)
        if why is None and any(_operand_meta(op) is None for op in ch["operands"][1:]):
            why = "scale/shift do not broadcast to x"
        return why

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


class RmsNormQuantizeFusion(QuantizeFeedFusion):
    """Fusion rule ``rms_norm_quantize``::

        # sd.rms_norm.v1(x[, w]) -> views* -> quantize  =>  fused.rms_norm_quantize

    RMSNorm (with or without its weight, ``patterns/rmsnorm.py``) read only by a quantize
    step: per row the RMSNorm kernel's statistic and roundings, then the quantize kernel's
    rotation and codes.  Bit-exact to the ``sd.rms_norm.v1`` kernel followed by the quantize
    kernel.  Priority 6.  Kernel operands x, w (None: no weight); args ``eps``,
    ``norm_dtype`` (the norm's output dtype, which the kernel rounds to), ``weight_in_float``
    (torch.nn.RMSNorm's order: the weight multiplied in float32 and the product rounded once
    to x's dtype), ``group``.
    """

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "rms_norm_quantize"

    def _find(self, nodes, i):
        norm = nodes[i]
        if norm.op != RmsNorm.name or len(norm.srcs) not in (1, 2) or _tensor(norm) is None:
            return None
        views, quant = row_view_chain(nodes, i + 1, norm)
        if quant is None:
            return None
        w = norm.srcs[1] if len(norm.srcs) == 2 else None
        return dict(norm=norm, quant=quant, nodes=nodes[i:i + len(views) + 2],
                    operands=[(norm.srcs[0], None, None), (w, None, None)],
                    args=dict(eps=float(norm.params["eps"]), norm_dtype=norm.meta.dtype,
                              weight_in_float=bool(norm.params.get("weight_in_float", False)),
                              group=quant.params.get("group")))

    def _why_not(self, ch) -> str | None:
        x = ch["norm"].srcs[0].meta
        if not isinstance(x, TensorMeta) or x.is_symbolic:
            return "symbolic or non-tensor x"
        return _quantize_why_not(ch["quant"], ch["norm"].meta)

    def optimize(self, graph) -> None:
        """Move each norm down to just before its views and quantize step.  Never raises."""
        try:
            users = graph.users()
            for norm in [n for n in graph.nodes if n.op == RmsNorm.name]:
                _gather_to_quantize(graph, users, [norm])
        except Exception:
            return


def _pre_act_of(n) -> str | None:
    if n.op == "aten.sigmoid.default":
        return "sigmoid"
    return _act_of(n)


def _act_head(nodes, i):
    """``gelu|gelu_tanh|silu|sigmoid(x) [-> mul(b)]``: ``(prologue, index after it)`` or
    None."""
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


def _scale_head(nodes, i):
    """``mul|div(x, scalar)``: ``(prologue, index after it)`` or None (the scale made exact
    where it can be, as in ``gated_residual``)."""
    n = nodes[i]
    if n.op not in ("aten.mul.Tensor", "aten.div.Tensor") or len(n.srcs) != 1 or \
            set(n.params) != {"other"} or not _is_number(n.params["other"]) or \
            _tensor(n) is None or _tensor(n.srcs[0]) is None or \
            tuple(n.meta.shape) != tuple(n.srcs[0].meta.shape):
        return None
    op, s = exact_scale("mul" if n.op == "aten.mul.Tensor" else "div", float(n.params["other"]))
    return dict(x=n.srcs[0], act=None, other=None, scale_op=op, scale=s), i + 1


class PrologueQuantizeFusion(QuantizeFeedFusion):
    """A rule of :data:`PROLOGUES`: ``prologue -> [clone] -> views* -> quantize`` where the
    prologue (``head(nodes, i) -> (dict, index after it) | None``) is elementwise on one tensor
    x, optionally times a second tensor (``takes_mul``), optionally scaled by a Python number.
    Per element, in x's dtype T with the chain's roundings::

        v = round_T(act(x))                (the project's activation maths: module docstring)
        v = round_T(v * b)                 (gated)
        v = round_T(v * float32(s)) | round_T(v / float32(s))        (scaled)

    then the quantize kernel's rotation and codes.  Priority 6.  Kernel operands x, the
    multiplier expanded to x's shape (None: none); args ``act``, ``scale_op``, ``scale``,
    ``group``."""

    def __init__(self, impl, name: str, head, takes_mul: bool) -> None:
        self.impl, self.name, self._head, self._takes_mul = impl, name, head, takes_mul

    def _find(self, nodes, i):
        head = self._head(nodes, i)
        if head is None:
            return None
        pro, k = head
        tail = _quantize_tail(nodes, k, nodes[k - 1])
        if tail is None:
            return None
        value, quant, end = tail
        other = None if pro["other"] is None else (pro["other"], None,
                                                   tuple(pro["x"].meta.shape))
        return dict(pro, value=value, quant=quant, nodes=nodes[i:end],
                    operands=[(pro["x"], None, None), other or (None, None, None)],
                    args=dict(act=pro["act"], scale_op=pro["scale_op"], scale=pro["scale"],
                              group=quant.params.get("group")))

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
        if ch["other"] is not None and _operand_meta(ch["operands"][1]) is None:
            return "the multiplier does not broadcast to x"
        return _quantize_why_not(ch["quant"], v)

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


#: The prologues before a quantize step, one row per rule: (name, head, takes a multiplier).
PROLOGUES = (
    # gelu|gelu_tanh|silu|sigmoid(x) [-> mul(b)] [-> clone] -> views* -> quantize
    #   =>  fused.act_quantize
    # The activation between two quantized linears (Flux's/SD3's feed-forward: linear_i8 ->
    # gelu(tanh) -> clone -> quantize -> linear_i8; the timestep embedders' SiLU), and the gated
    # forms act(a) * b (SwiGLU silu(gate) * up, GEGLU hidden * gelu(gate), silu | sigmoid ->
    # mul) where a and b may be strided (the two halves of one linear's output) and b may
    # broadcast.
    ("act_quantize", _act_head, True),
    # mul|div(x, scalar) [-> clone] -> views* -> quantize  =>  fused.scale_quantize
    # A scale by a Python number before a quantize step (a rescale factor before a projection),
    # computed as the native op computes it (division by a power of two becomes the exact
    # multiplication, and * 1 is dropped, as in gated_residual).
    ("scale_quantize", _scale_head, False),
)


# -- a torch implementation of the quantize-feeding interfaces (tests, and a model) ---------------

class ReferenceQuantizeImpl:
    """Torch implementations of the ``modulation_quantize``, ``rms_norm_quantize`` and
    ``act_quantize``/``scale_quantize`` kernel interfaces (for tests of the rules: it accepts
    everything unless built with a reason to decline); not registered."""

    name = "quantize_fusion_reference"

    def __init__(self, decline: str | None = None) -> None:
        self.decline = decline
        self.calls = 0

    def why_not(self, *args, **kw):
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


#: the rules ending at a quantize step: ``(rule name, the rule for its kernel)``
QUANTIZE_FEEDS = (("modulation_quantize", ModulationQuantizeFusion),
                  ("rms_norm_quantize", RmsNormQuantizeFusion)) + tuple(
    (name, functools.partial(PrologueQuantizeFusion, name=name, head=head, takes_mul=mul))
    for name, head, mul in PROLOGUES)


def register_int8_fusions(device: str, dev: Int8Device, kernels: dict) -> None:
    """Register this file's rules for ``device``: each rule that ``kernels`` (rule name ->
    :class:`FusedKernel`) names, with its kernel; the rules after a linear run its GEMM and
    quantize its float operands with ``dev`` (the device's ``patterns/int8.Int8Device``)."""
    for spec in EPILOGUES:
        if spec.name in kernels:
            fxbackend.register_fusion(device, Int8EpilogueFusion(spec, dev, kernels[spec.name]))
    for name, rule in QUANTIZE_FEEDS:
        if name in kernels:
            fxbackend.register_fusion(device, rule(kernels[name]))
