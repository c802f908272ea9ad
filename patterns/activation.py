"""Activations after a linear: the fusion rules ``linear_act`` and ``linear_glu`` and their torch
reference.

ATen lowers ``nn.Linear`` on a ``[B, S, K]`` input to ``view -> addmm(bias, x2d, t(W)) -> view``
(``mm`` without a bias); diffusers' feed-forwards follow it with an activation:

- ``linear_act``: ``addmm|mm [-> _to_copy] [-> view]* -> act [-> clone]`` with ``act`` one
  of ``gelu(approximate="tanh")`` (Flux, SD3, PixArt ``GELU(approximate="tanh")``),
  ``gelu`` (erf) and ``silu`` (timestep embeddings); the trailing ``clone`` is the contiguous
  copy that ``FeedForward``'s dropout/reshape leaves in the functional graph.  The
  ``_to_copy`` is the rounding of a float32 GEMM to a 16-bit dtype that ``compute_in_float32``
  (``patterns/upcast.py``) leaves where a 16-bit model computes its GEMMs in float32: the
  step's kernel then sees float32 ``x``/``w``/``bias`` and a 16-bit output.
- ``linear_glu``: ``addmm|mm [-> view]* -> split(N, -1) -> getitem, getitem -> act(one half)
  -> mul(other half, act) [-> clone]``: diffusers ``GEGLU`` (``hidden, gate = proj(x).chunk(2,
  -1); hidden * gelu(gate)``, UNet2DConditionModel's transformer blocks) and a packed SwiGLU
  (``silu(gate) * up``); either half may be the gate.

One fused step runs the GEMM natively (the same ``addmm``/``mm`` call the chain makes, into the
output or into workspace; a device kernel may instead call ``mm`` and add a ``[N]`` bias in its
pass, as the CPU kernel does in float32) and then one pass of the device kernel over the GEMM
result: the activation in place (``linear_act``) or activation and gate multiply into the
output (``linear_glu``), so the chain's intermediates (the activation before the clone, the
strided halves, the activation of the gate, the product before the clone) are never written.

Meaning (:func:`linear_act_reference`): each step's own rounding, as the unfused chain; for
16-bit dtypes the GEMM result is rounded to the dtype (a float32 GEMM followed by the cast: its
float32 result, rounded once), the activation computes in float32 and rounds, and (gated) the
product is ``round(float(act) * float(other))``.
"""
from __future__ import annotations

import torch

from fxbackend import TensorMeta

__all__ = ["ACTS", "LinearActFusion", "LinearGluFusion", "ReferenceLinearAct", "act_reference",
           "linear_act_reference", "gemm_into", "movable_bias", "register_gemm",
           "is_split_in_halves"]

#: activation names: gelu with the tanh approximation, gelu with erf, silu
ACTS = ("gelu_tanh", "gelu", "silu")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GEMMS = ("aten.addmm.default", "aten.mm.default")
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def act_reference(y: torch.Tensor, act: str) -> torch.Tensor:
    """The activation as torch computes it (the chain's own op)."""
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if act == "gelu":
        return torch.nn.functional.gelu(y)
    if act == "silu":
        return torch.nn.functional.silu(y)
    raise ValueError(f"activation must be one of {ACTS}, got {act!r}")


#: device type -> ``fn(y, x, w, bias, beta, alpha) -> bool``: a device's own GEMM for
#: :func:`gemm_into`, True when it wrote ``y`` (False: the torch call below)
_DEVICE_GEMMS: dict = {}


def register_gemm(device_type: str, fn) -> None:
    """Let ``fn(y, x, w, bias, beta, alpha) -> bool`` compute :func:`gemm_into` on
    ``device_type`` where it returns True (the CPU's: oneDNN's float32 linear where the profile
    chose it, ``cpu_kernels/gemm.py``)."""
    if not callable(fn):
        raise TypeError(f"register_gemm: fn must be callable, got {type(fn).__name__}")
    _DEVICE_GEMMS[str(device_type)] = fn


def gemm_into(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
              beta=1, alpha=1) -> torch.Tensor:
    """``y = addmm(bias, x, w, beta, alpha)`` (``mm(x, w)`` without a bias): the chain's own GEMM
    call, writing into ``y`` (on CUDA, on the current stream), by the device's registered GEMM
    where it takes the operands (:func:`register_gemm`), else torch's."""
    own = _DEVICE_GEMMS.get(y.device.type)
    if own is not None and own(y, x, w, bias, beta, alpha):
        return y
    if bias is None:
        return torch.mm(x, w, out=y)
    return torch.addmm(bias, x, w, beta=beta, alpha=alpha, out=y)


def movable_bias(out_dtype, bias_dtype, bias_shape: tuple, bias_contiguous: bool, n: int,
                 beta=1, alpha=1) -> bool:
    """Whether ``addmm(bias, x, w)`` with an ``[M, n]`` result of ``out_dtype`` may run as
    ``mm(x, w)`` with the bias added after the GEMM by the pass that reads its result (as
    Inductor does with an addmm only pointwise ops read): float32, a contiguous ``[n]`` bias,
    beta = alpha = 1.  16-bit results keep the addmm (a 16-bit GEMM rounds ``acc + bias``
    once).  Shared by the activation and gated_residual epilogues (tensors or metadata)."""
    return out_dtype == torch.float32 and bias_dtype == torch.float32 and beta == 1 and \
        alpha == 1 and bias_contiguous and tuple(bias_shape) == (n,)


def linear_act_reference(x, w, bias, act: str, gate: int | None = None, beta=1,
                         alpha=1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The unfused chain on 2-D tensors: ``act(addmm(bias, x, w))`` (``[M, N]``), or gated
    (``gate`` 0 or 1: which half of the ``[M, 2N]`` GEMM result is activated)
    ``act(half[gate]) * half[1 - gate]`` (``[M, N]``).  ``out_dtype`` other than x's: the
    GEMM result is cast to it first (the chain's ``_to_copy``)."""
    y = torch.mm(x, w) if bias is None else torch.addmm(bias, x, w, beta=beta, alpha=alpha)
    if out_dtype is not None and out_dtype != y.dtype:
        y = y.to(out_dtype)
    if gate is None:
        return act_reference(y, act)
    halves = y.chunk(2, dim=-1)
    return (act_reference(halves[gate], act) * halves[1 - gate]).contiguous()


# -- matching helpers (dataflow only) ----------------------------------------------------------

def _act_of(n) -> str | None:
    """The activation a node computes, or None."""
    if n.op == "aten.silu.default":
        return "silu"
    if n.op == "aten.gelu.default":
        a = n.params.get("approximate", "none")
        return {"tanh": "gelu_tanh", "none": "gelu"}.get(a)
    return None


def _dense(m) -> bool:
    return isinstance(m, TensorMeta) and m.is_contiguous


def _numel(m) -> int:
    return int(m.numel)


def _gemm_parts(g):
    """(x, w, bias, beta, alpha) of an addmm/mm node."""
    if g.op == "aten.mm.default":
        return g.srcs[0], g.srcs[1], None, 1, 1
    return g.srcs[1], g.srcs[2], g.srcs[0], g.params.get("beta", 1), g.params.get("alpha", 1)


def _is_rounding(n, g) -> bool:
    """Whether ``n`` is ``_to_copy(g) {dtype=16-bit}`` of the float32 GEMM ``g``: same shape,
    dense, nothing else changed."""
    return n.op == "aten._to_copy.default" and n.srcs == [g] and \
        g.meta.dtype == torch.float32 and set(n.params) == {"dtype"} and \
        n.params["dtype"] in (torch.bfloat16, torch.float16) and _dense(n.meta) and \
        n.meta.dtype == n.params["dtype"] and tuple(n.meta.shape) == tuple(g.meta.shape) and \
        n.meta.device == g.meta.device


def _users_after(graph, k: int, node) -> list:
    return [u for u in graph.nodes[k + 1:] if node in u.srcs]


class _LinearRule:
    """Shared matching of ``addmm|mm [-> view]*`` and running of the fused step.

    ``impl`` is the device kernel: an object with ``name``,
    ``why_not(x, w, bias, out_dtype, act, gated) -> str | None`` (``TensorMeta``s, bias may be
    None; metadata only, never raises), optional ``compile(x, w, bias, out_dtype, act, gated)``
    (plan time) and ``run(x, w, bias, y, out, *, act, gate, beta, alpha)``: the GEMM into
    ``y`` (2-D, contiguous; ``out`` itself for ``linear_act``) and the activation pass into
    ``out`` (2-D, contiguous, overlapping no input).  A rounded chain (the GEMM in float32,
    then ``_to_copy`` to 16 bits) gives float32 ``x``/``w``/``bias`` and a 16-bit
    ``out_dtype``, and ``y`` is float32 workspace: a kernel that does not round its float32
    GEMM result declines ``x`` of another dtype than the output's.
    """

    priority = 5

    def __init__(self, impl) -> None:
        self.impl = impl
        #: the engine may give the plain (not gated) step a strided output when the device
        #: kernel writes through any row stride (``impl.strided_out``)
        self.strided_out = not self.gated and bool(getattr(impl, "strided_out", False))

    def match(self, graph, i: int):
        try:
            head = self._head(graph, i)
            return 0 if head is None else self._match(graph, i, *head)
        except Exception as exc:  # never raise: a chain we could not read is no match
            return (0, f"chain not understood ({type(exc).__name__}: {exc})")

    @staticmethod
    def _head(graph, i: int):
        """(gemm, index after the views, last node so far) for a GEMM whose result is only
        rounded to 16 bits (a float32 GEMM's ``_to_copy``, see the module docstring) and
        reshaped (contiguous views of the same numel) before its consumer, or None."""
        nodes = graph.nodes
        g = nodes[i]
        if g.op not in _GEMMS or not isinstance(g.meta, TensorMeta) or len(g.meta.shape) != 2:
            return None
        if g.meta.dtype not in _DTYPES or not _dense(g.meta):
            return None
        k, prev = i + 1, g
        if k < len(nodes) and _is_rounding(nodes[k], g):
            k, prev = k + 1, nodes[k]
        while k < len(nodes) and nodes[k].op in _VIEWS and nodes[k].srcs == [prev] and \
                _dense(nodes[k].meta) and int(nodes[k].meta.shape[-1]) == \
                int(g.meta.shape[-1]) and _numel(nodes[k].meta) == _numel(g.meta):
            prev = nodes[k]
            k += 1
        return g, k, prev

    @staticmethod
    def _is_clone(n, prev) -> bool:
        return n.op == "aten.clone.default" and n.srcs == [prev] and \
            n.params.get("memory_format") in (None, torch.contiguous_format) and \
            _dense(n.meta) and n.meta.dtype == prev.meta.dtype

    def _decide(self, chain, gated: bool) -> int | tuple:
        g = chain[0]
        x, w, bias, _, _ = _gemm_parts(g)
        act = self._act(chain)
        why = self.impl.why_not(x.meta, w.meta, None if bias is None else bias.meta,
                                chain[-1].meta.dtype, act, gated)
        return (0, f"{self.impl.name}: {why}") if why is not None else len(chain)

    def _act(self, chain) -> str:
        return next(a for a in map(_act_of, chain) if a is not None)

    # -- running ---------------------------------------------------------------------------
    def _parts(self, node) -> dict:
        chain = node.annotations["fused"]
        g = chain[0]
        x, w, bias, beta, alpha = _gemm_parts(g)
        act_node = next(c for c in chain if _act_of(c) is not None)
        gate = None
        if self.gated:
            split = chain[next(k for k, c in enumerate(chain) if c.op.startswith("aten.split"))]
            item = act_node.srcs[0]
            gate = int(item.params["index"])
            assert item.srcs[0] is split
        return dict(x=x, w=w, bias=bias, beta=beta, alpha=alpha, act=_act_of(act_node),
                    gate=gate, m=int(g.meta.shape[0]), n2=int(g.meta.shape[1]),
                    dtype=g.meta.dtype, itemsize=g.meta.itemsize,
                    rounded=g.meta.dtype != act_node.meta.dtype)

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            comp(p["x"].meta, p["w"].meta, None if p["bias"] is None else p["bias"].meta,
                 node.meta.dtype, p["act"], self.gated)

    def prepare(self, node):
        p = self._parts(node)
        # the GEMM result in workspace: gated (the [M, 2N] halves) or rounded (float32)
        ws = p["m"] * p["n2"] * p["itemsize"] if self.gated or p["rounded"] else 0
        return p, ws

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        x, w = value[p["x"]], value[p["w"]]
        bias = None if p["bias"] is None else value[p["bias"]]
        m, n2 = p["m"], p["n2"]
        if self.gated:
            y = workspace[:m * n2 * p["itemsize"]].view(p["dtype"]).view(m, n2)
            o = out.view(m, n2 // 2)
        elif p["rounded"]:
            y = workspace[:m * n2 * p["itemsize"]].view(p["dtype"]).view(m, n2)
            o = out.view(m, n2)
        else:
            y = o = out.view(m, n2)
        self.impl.run(x, w, bias, y, o, act=p["act"], gate=p["gate"], beta=p["beta"],
                      alpha=p["alpha"])


def is_split_in_halves(sp, prev) -> bool:
    """``sp`` splits ``prev`` into two equal halves of its last dim (``chunk(2, -1)``:
    ``split`` or ``split_with_sizes``); the GLU rules' check (``linear_glu`` here,
    ``int8_linear_glu_quantize`` in ``patterns/int8_fusions.py``)."""
    pm = prev.meta if isinstance(prev.meta, TensorMeta) else None
    if pm is None or not pm.shape or sp.srcs != [prev] or not isinstance(sp.meta, tuple) or \
            len(sp.meta) != 2:
        return False
    n2 = int(pm.shape[-1])
    if sp.op == "aten.split.Tensor":
        ok = sp.params.get("split_size") == n2 // 2
    elif sp.op == "aten.split_with_sizes.default":
        ok = list(sp.params.get("split_sizes", ())) == [n2 // 2, n2 // 2]
    else:
        return False
    return ok and n2 % 2 == 0 and sp.params.get("dim", 0) in (-1, len(pm.shape) - 1)


class LinearActFusion(_LinearRule):
    """Fusion rule ``linear_act``: ``addmm|mm [-> _to_copy] [-> view]* -> gelu|gelu_tanh|silu
    [-> clone]``
    (see the module docstring).  Declines (with the kernel's reason) what ``impl.why_not``
    declines."""

    gated = False

    def __init__(self, impl) -> None:
        super().__init__(impl)
        self.name = "linear_act"

    def _match(self, graph, i: int, g, k: int, prev):
        """The chain after the GEMM ``g`` (``graph.nodes[i]``) and its views (``_head``)."""
        nodes = graph.nodes
        if k >= len(nodes):
            return 0
        a = nodes[k]
        if _act_of(a) is None or a.srcs != [prev] or not _dense(a.meta) or \
                a.meta.dtype != prev.meta.dtype:
            return 0
        chain = nodes[i:k + 1]
        if k + 1 < len(nodes) and self._is_clone(nodes[k + 1], a) and \
                len(_users_after(graph, k, a)) == 1:
            chain = nodes[i:k + 2]
        return self._decide(chain, False)


class LinearGluFusion(_LinearRule):
    """Fusion rule ``linear_glu``: ``addmm|mm [-> view]* -> split(N, -1) -> getitem x2 ->
    act(half g) -> mul(half 1-g, act) [-> clone]`` (GEGLU, packed SwiGLU; see the module
    docstring)."""

    gated = True

    def __init__(self, impl) -> None:
        super().__init__(impl)
        self.name = "linear_glu"

    def _match(self, graph, i: int, g, k: int, prev):
        """The chain after the GEMM ``g`` (``graph.nodes[i]``) and its views (``_head``)."""
        nodes = graph.nodes
        if k + 4 >= len(nodes):
            return 0
        sp, i0, i1, a, mul = nodes[k:k + 5]
        if not is_split_in_halves(sp, prev):  # prev's last dim is the GEMM's N (_head)
            return 0
        items = (i0, i1)
        if any(t.op != "getitem" or t.srcs != [sp] for t in items) or \
                {int(t.params.get("index", -1)) for t in items} != {0, 1}:
            return 0
        if prev.meta.dtype != g.meta.dtype:  # a rounded GEMM: no gated kernel for it
            return 0
        if _act_of(a) is None or len(a.srcs) != 1 or a.srcs[0] not in items or \
                a.meta.dtype != g.meta.dtype:
            return 0
        other = i1 if a.srcs[0] is i0 else i0
        if mul.op != "aten.mul.Tensor" or set(mul.srcs) != {a, other} or len(mul.srcs) != 2 or \
                mul.params or not isinstance(mul.meta, TensorMeta) or \
                mul.meta.dtype != g.meta.dtype or \
                tuple(mul.meta.shape) != tuple(a.meta.shape) or not _dense(mul.meta):
            return 0
        end = k + 5
        if end < len(nodes) and self._is_clone(nodes[end], mul) and \
                len(_users_after(graph, end - 1, mul)) == 1:
            end += 1
        return self._decide(nodes[i:end], True)


class ReferenceLinearAct:
    """A torch implementation of the kernel interface (tests of the rules; a model for device
    kernels); not registered."""

    name = "linear_act_reference"

    def why_not(self, x, w, bias, out_dtype, act, gated):
        return None

    def run(self, x, w, bias, y, out, *, act, gate, beta, alpha):
        out.copy_(linear_act_reference(x, w, bias, act, gate, beta, alpha, out.dtype))
