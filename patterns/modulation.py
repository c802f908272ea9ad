"""adaLN modulation: a norm without affine, then ``* (c + scale) + shift``, as one fused step.

The chain (DiT-style adaptive LayerNorm: Flux and SD3 ``AdaLayerNormZero``,
``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``, the feed-forward norms of their blocks;
PixArt's adaLN-single ``norm(x) * (1 + scale) + shift``), as ATen gives it::

    n  = getitem(native_layer_norm(x, [C], None, None, eps), 0)     LayerNorm, no affine
       | sd.rms_norm.v1(x) {eps}                                     RMSNorm, no weight
    s1 = add(s, c)  [-> unsqueeze / view ...]                        ``c + scale`` (optional)
    y  = mul(n, s1)                                                  (either operand order)
    out = add(y, shift)                                              (either operand order)

``scale`` and ``shift`` broadcast to x's shape (per sample and channel: ``[B, 1, C]`` or ``[B, C]``
unsqueezed, chunks of the adaLN linear output), so each token row of x is normalised and
modulated in one pass that writes the output once.

Meaning (:func:`modulation_reference`; every step in x's dtype T with its own rounding, the
maths in float32 as torch's CPU kernels do)::

    n   = round_T((x - mean) * rstd)            mean, biased var over C; rstd = 1/sqrt(var + eps)
    n   = round_T(x * rstd)                     rms: rstd = 1/sqrt(mean(x^2) + eps)
    s1  = round_T(s + c)                        when the ``c + scale`` add is part of the step
    out = round_T(round_T(n * s1) + shift)

``round_T`` is the identity for float32.

Casts (Wan computes its modulation in float32 around a bf16 stream:
``(norm(x.float()) * (1 + scale) + shift).type_as(x)``): the step may start with the widening
``x.float()`` of a bf16/fp16 x (exact: the kernel reads x and widens in registers) and end with
the cast of the float32 result to bf16/fp16 (one rounding, the cast's), so the float32 copies
of x and of the result are never written.  Both only around a float32 chain.  The narrowing
cast joins only when the float32 result has no other reader (the rule asks
``fxbackend.check_claim`` before claiming it).

The norm's statistics are float32 sums in the kernels' own order, so results differ from the
unfused chain by about one float32 rounding of mean/rstd (~2e-7 relative; 16-bit outputs then
within one unit in the last place).

The ``c + scale`` add joins the step when only the chain reads it: it is computed per element in
float32 and rounded to T, exactly as ``aten.add`` does, so including it costs no accuracy and
saves a launch and a tiny tensor per chain.  When something else reads it, it stays outside and
the step reads its result as the scale (``add_c`` None).

Legality (``fusion.check_claim``): the claimed range is ``[(x.float()), norm, getitem,
(add c), (views of the add), mul, add, (cast)]``; views of storage outside
(``unsqueeze(scale_chunk)``, ``unsqueeze(shift)``) must stay outside, and
``native_layer_norm``'s mean and rstd outputs must be unread (no getitem 1 or 2).  ``optimize``
moves the norm, the ``c + scale`` add and its views together with
``graph_delay`` (Flux/SD3 compute the scale/shift views between the norm and the mul).  SD3.5's
``AdaLayerNormZeroX`` reads one norm twice (two modulations): the engine declines it.

Sources: Peebles and Xie, "Scalable Diffusion Models with Transformers" (arXiv 2212.09748),
adaLN-Zero; Chen et al., "PixArt-alpha" (arXiv 2310.00426), adaLN-single; diffusers
``models/normalization.py`` and ``models/attention.py``.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

from .rmsnorm import RmsNorm, is_narrowing, is_widening, rms_norm_reference

__all__ = ["modulation_reference", "ModulationFusion", "ReferenceModulation", "NORMS",
           "expanded_meta", "dtypes_why_not"]

NORMS = ("layer", "rms")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYER_NORM = "aten.native_layer_norm.default"
#: views that keep the row-major order of the elements (so ``t.view(shape)`` redoes them)
_RESHAPES = ("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
             "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def modulation_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                         norm: str = "layer", add_c: float | None = 1.0) -> torch.Tensor:
    """The unfused chain in plain torch: ``norm(x) * (add_c + scale) + shift`` (``scale`` as is
    when ``add_c`` is None), each op in x's dtype with its own rounding (module docstring).  A
    bf16/fp16 ``x`` with float32 ``scale`` is widened first (``x.float()``, exact): the chain
    then runs in float32 (the caller narrows the result if the step does)."""
    if x.dtype != scale.dtype:
        if scale.dtype != torch.float32 or x.dtype not in _DTYPES:
            raise ValueError(f"modulation_reference: x is {x.dtype} and scale {scale.dtype}; "
                             f"only a bf16/fp16 x around float32 scale and shift is widened")
        x = x.float()
    if norm == "layer":
        n = torch.native_layer_norm(x, [x.shape[-1]], None, None, eps)[0]
    elif norm == "rms":
        n = rms_norm_reference(x, None, eps)
    else:
        raise ValueError(f"modulation_reference: norm must be one of {NORMS}, got {norm!r}")
    s = scale if add_c is None else scale + add_c
    return (n * s + shift).contiguous()


def dtypes_why_not(x: torch.dtype, scale: torch.dtype, shift: torch.dtype,
                   out: torch.dtype) -> str | None:
    """The dtypes a modulation kernel takes: one of float32/bf16/fp16 for all, or a bf16/fp16
    x (widened in the step) and out (narrowed) around float32 scale and shift; else the
    reason.  Shared by the CPU and CUDA kernels' ``why_not``."""
    if any(d not in _DTYPES for d in (x, scale, shift, out)) or shift != scale or \
            (scale != torch.float32 and (x != scale or out != scale)):
        return "dtypes " + ", ".join(str(d) for d in (x, scale, shift, out)) + \
            " (one of float32, bfloat16, float16 for all, or 16-bit x and out around float32" \
            " scale and shift)"
    return None


def _scalar(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def expanded_meta(m: TensorMeta, shape: tuple) -> TensorMeta | None:
    """The metadata of ``t.expand(shape)`` for a tensor ``t`` with metadata ``m`` (broadcast dims
    get stride 0), or None when it does not broadcast."""
    if len(m.shape) > len(shape):
        return None
    lead = len(shape) - len(m.shape)
    stride = []
    for i, n in enumerate(shape):
        j = i - lead
        if j < 0 or (m.shape[j] == 1 and n != 1):
            stride.append(0)
        elif m.shape[j] == n:
            stride.append(m.stride[j])
        else:
            return None
    return TensorMeta(tuple(shape), tuple(stride), m.dtype, m.device, m.storage_offset)


def _viewable(src: TensorMeta, shape: tuple) -> bool:
    """``t.view(shape)`` works (no copy) for a tensor with metadata ``src``."""
    try:
        t = torch.empty_strided(tuple(src.shape), tuple(src.stride), dtype=src.dtype,
                                device="meta")
        t.view(tuple(shape))
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


class ModulationFusion:
    """Fusion rule ``modulation``: ``norm(x) [no affine] -> [add c ->] mul(scale) -> add(shift)``
    as one kernel (meaning: :func:`modulation_reference`; the chain: module docstring).

    # native_layer_norm -> getitem 0 -> [add(s, c) -> views] -> mul -> add  =>  fused.modulation
    # sd.rms_norm.v1(x)          ->      [add(s, c) -> views] -> mul -> add  =>  fused.modulation

    ``impl`` is the device kernel: an object with ``name``, ``why_not(x, scale, shift, out,
    norm) -> str | None`` on metadata (``scale``/``shift`` as expanded to x's shape: broadcast
    dims have stride 0; ``out`` the contiguous output) that never raises, optional
    ``compile(x, scale, shift, out, norm, has_add)`` (plan time) and ``run(x, scale, shift, out,
    *, norm, eps, add_c)`` writing a contiguous ``out`` that overlaps no input (``scale`` and
    ``shift`` expanded views; ``add_c`` None: no ``c + scale`` in the step).
    ``cpu_kernels/modulation.py`` and ``cuda_kernels/modulation.py`` register one rule each.
    """

    priority = 5

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "modulation"

    # -- the chain ---------------------------------------------------------------------------
    @staticmethod
    def _norm_of(node):
        """``("layer" | "rms", eps)`` when ``node`` is a norm without affine, else None."""
        if node.op == _LAYER_NORM and len(node.srcs) == 1:
            x = node.srcs[0]
            shape = node.params.get("normalized_shape")
            eps = _scalar(node.params.get("eps"))
            if isinstance(x.meta, TensorMeta) and x.meta.shape and eps is not None and \
                    list(shape or []) == [x.meta.shape[-1]]:
                return "layer", float(eps)
        elif node.op == RmsNorm.name and len(node.srcs) == 1:
            return "rms", float(node.params["eps"])
        return None

    @staticmethod
    def _is_add_c(n) -> bool:
        return n.op in ("aten.add.Tensor", "aten.add.Scalar") and len(n.srcs) == 1 and \
            _scalar(n.params.get("other")) is not None and n.params.get("alpha", 1) == 1 and \
            isinstance(n.meta, TensorMeta)

    @staticmethod
    def _other(n, x):
        """The other source of a binary ``n`` that reads ``x`` once, else None."""
        if len(n.srcs) != 2 or (n.srcs[0] is x) == (n.srcs[1] is x):
            return None
        return n.srcs[1] if n.srcs[0] is x else n.srcs[0]

    #: whether chains may start with a widening cast of x and end with a narrowing cast of the
    #: result (rules extending this one that do not handle them set it False)
    casts = True

    def _match_at(self, nodes, i):
        """The chain starting at ``nodes[i]`` when its nodes are consecutive, as a dict, else
        None: the norm chain (:meth:`_core_at`), with ``casts``, after a widening ``x.float()``
        (``up``; then ``x`` is the 16-bit tensor) and before a cast of the float32 result to
        bf16/fp16 (``down``; ``out`` is the chain's last node either way)."""
        up = None
        if self.casts and i + 1 < len(nodes) and is_widening(nodes[i]) and \
                nodes[i + 1].srcs[:1] == [nodes[i]]:
            up, i = nodes[i], i + 1
        ch = self._core_at(nodes, i)
        if ch is None:
            return None
        k = i + len(ch["nodes"])
        down = None
        if self.casts and k < len(nodes) and nodes[k].srcs[:1] == [ch["add"]] and \
                is_narrowing(nodes[k]):
            down = nodes[k]
            k += 1
        first = i - 1 if up is not None else i
        return dict(ch, up=up, down=down, x=up.srcs[0] if up is not None else ch["x"],
                    out=down if down is not None else ch["add"], nodes=nodes[first:k])

    def _core_at(self, nodes, i):
        """The norm chain starting at ``nodes[i]`` when its nodes are consecutive, as a dict,
        else None.  Local: reads only the nodes of the range (the engine checks the uses)."""
        norm = nodes[i]
        kind = self._norm_of(norm)
        if kind is None:
            return None
        k = i + 1
        n = norm
        if kind[0] == "layer":
            if k >= len(nodes) or nodes[k].op != "getitem" or nodes[k].srcs != [norm] or \
                    nodes[k].params.get("index") != 0:
                return None
            n = nodes[k]
            k += 1
        if k >= len(nodes):
            return None
        add_c, s_src, inner = None, None, []
        if self._is_add_c(nodes[k]) and nodes[k].srcs[0] is not n:
            j, prev = k + 1, nodes[k]
            while j < len(nodes) and nodes[j].op in _RESHAPES and nodes[j].srcs == [prev]:
                prev = nodes[j]
                j += 1
            if j < len(nodes) and self._other(nodes[j], n) is prev:
                add_c, s_src = nodes[k], nodes[k].srcs[0]
                inner = nodes[k:j]
                k = j
        mul = nodes[k]
        if mul.op != "aten.mul.Tensor":
            return None
        s_op = self._other(mul, n)
        if s_op is None:
            return None
        if add_c is None:
            s_src = s_op
        if k + 1 >= len(nodes):
            return None
        add = nodes[k + 1]
        if add.op != "aten.add.Tensor" or add.params.get("alpha", 1) != 1:
            return None
        shift = self._other(add, mul)
        if shift is None:
            return None
        return dict(norm=norm, kind=kind[0], eps=kind[1], x=norm.srcs[0], n=n, add_c=add_c,
                    c=None if add_c is None else float(add_c.params["other"]), s_src=s_src,
                    s_op=s_op, mul=mul, shift=shift, add=add,
                    nodes=nodes[i:k + 2], inner=inner)

    def _why_not(self, ch) -> str | None:
        """Declines on dataflow metadata (before the kernel's own ``why_not``): a scale or shift
        that the chain computes; the chain's own nodes in one dtype; a widened x and a narrowed
        result only around float32."""
        inside = set(ch["nodes"])
        if ch["shift"] in inside or ch["s_src"] in inside:
            # x * norm(x) + norm(x), norm(x) * (c + s) + (c + s), ...: the kernel reads its
            # scale and shift from the step's inputs, which values of the chain are not
            return "the scale or shift is a value of the chain itself"
        x, out = ch["x"].meta, ch["out"].meta
        core = [ch["norm"].srcs[0].meta, ch["s_src"].meta, ch["s_op"].meta, ch["shift"].meta,
                ch["n"].meta, ch["mul"].meta, ch["add"].meta]
        metas = [x] + core + [out]
        if not all(isinstance(m, TensorMeta) for m in metas):
            return "an operand is not a tensor"
        if any(m.is_symbolic for m in metas):
            return "symbolic metadata"
        if len({m.dtype for m in core}) != 1 or core[0].dtype not in _DTYPES:
            return "mixed dtypes or a dtype other than float32/bfloat16/float16 (" + \
                ", ".join(str(m.dtype).replace("torch.", "") for m in core) + ")"
        if tuple(out.shape) != tuple(x.shape) or tuple(ch["mul"].meta.shape) != tuple(x.shape):
            return f"scale/shift broadcast x {tuple(x.shape)} to {tuple(out.shape)}"
        if not out.is_contiguous:
            return f"the output is not contiguous (strides {tuple(out.stride)})"
        if ch["add_c"] is not None and not _viewable(ch["s_src"].meta, tuple(ch["s_op"].meta.shape)):
            return "the scale's views are not a reshape of its storage"
        if ch.get("down") is not None and (not out.is_contiguous or
                                           tuple(out.shape) != tuple(ch["add"].meta.shape)):
            return "the narrowing cast changes the layout"
        return None

    def match(self, graph, i: int):
        ch = self._match_at(graph.nodes, i)
        if ch is None:
            return 0
        if ch["up"] is not None or ch["down"] is not None:
            ch = self._legal_casts(graph, i, ch)
            if ch is None:
                return 0
        why = self._why_not(ch)
        if why is None:
            x = ch["x"].meta
            shape = tuple(x.shape)
            s = expanded_meta(ch["s_op"].meta if ch["add_c"] is None else
                              _reshaped(ch["s_src"].meta, ch["s_op"].meta.shape), shape)
            h = expanded_meta(ch["shift"].meta, shape)
            if s is None or h is None:
                why = "scale/shift do not broadcast to x"
            else:
                why = self.impl.why_not(x, s, h, ch["out"].meta, ch["kind"])
                why = None if why is None else f"{self.impl.name}: {why}"
        return (0, why) if why is not None else len(ch["nodes"])

    @staticmethod
    def _legal_casts(graph, i: int, ch: dict) -> dict | None:
        """``ch``, or ``ch`` without its narrowing cast, whichever the engine would accept first
        (``fxbackend.check_claim``: the float32 result may have other readers); None when
        neither is legal with the widening cast (the chain is then matched from its norm, at
        the next index).  Only for chains with a cast, so the uses are computed rarely."""
        users = graph.users()
        if fxbackend.check_claim(graph, i, len(ch["nodes"]), users) is None:
            return ch
        if ch["down"] is not None:
            short = dict(ch, down=None, out=ch["add"], nodes=ch["nodes"][:-1])
            if fxbackend.check_claim(graph, i, len(short["nodes"]), users) is None:
                return short
        return None if ch["up"] is not None else ch

    def optimize(self, graph) -> None:
        """Make each chain consecutive, in the order norm, getitem, (add c, its views), mul,
        add, moving its nodes with ``graph_delay`` (which refuses any move that would change the
        result).  The ``c + scale`` add and its views join only when the chain alone reads
        them."""
        users = graph.users()
        for norm in [x for x in graph.nodes if self._norm_of(x) is not None]:
            chain = self._chain_by_uses(norm, users)
            if chain is None:
                continue
            for k in range(1, len(chain)):
                start = graph.nodes.index(chain[0])
                j = graph.nodes.index(chain[k])
                if j == start + k:
                    continue
                if j > start + k:
                    ok = fxbackend.graph_delay(graph, start, start + k, j - 1)
                else:  # the add c (or its view) comes before the norm: bring it down
                    ok = fxbackend.graph_delay(graph, j, j + 1, start + k - 1)
                if not ok:
                    break

    def _chain_by_uses(self, norm, users) -> list | None:
        def only(node):
            u = users.get(node, [])
            return u[0] if len(u) == 1 and not node.is_output else None

        n = norm
        chain = [norm]
        src = norm.srcs[0]
        if self.casts and is_widening(src) and only(src) is norm:
            chain.insert(0, src)
        if norm.op == _LAYER_NORM:
            n = only(norm)
            if n is None or n.op != "getitem" or n.params.get("index") != 0:
                return None
            chain.append(n)
        mul = only(n)
        if mul is None or mul.op != "aten.mul.Tensor":
            return None
        add = only(mul)
        if add is None or add.op != "aten.add.Tensor" or self._other(add, mul) is None:
            return None
        s_op = self._other(mul, n)
        if s_op is None:
            return None
        inner, v = [], s_op
        while v.op in _RESHAPES and len(v.srcs) == 1 and only(v) is (inner[0] if inner else mul):
            inner.insert(0, v)
            v = v.srcs[0]
        if self._is_add_c(v) and only(v) is (inner[0] if inner else mul) and v.srcs[0] is not n:
            chain += [v] + inner
        chain += [mul, add]
        down = only(add)
        if self.casts and down is not None and is_narrowing(down):
            chain.append(down)
        return chain

    # -- running -----------------------------------------------------------------------------
    def _parts(self, node) -> dict:
        ch = self._match_at(node.annotations["fused"], 0)
        return dict(x=ch["x"], s=ch["s_src"], shift=ch["shift"], kind=ch["kind"], eps=ch["eps"],
                    c=ch["c"], s_shape=tuple(ch["s_op"].meta.shape),
                    shape=tuple(ch["x"].meta.shape))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            s = expanded_meta(_reshaped(p["s"].meta, p["s_shape"]), p["shape"])
            comp(p["x"].meta, s, expanded_meta(p["shift"].meta, p["shape"]), node.meta,
                 p["kind"], p["c"] is not None)

    def prepare(self, node):
        return self._parts(node), 0

    def _run_extra(self, p: dict) -> dict:
        """Keyword arguments of ``impl.run`` beyond the chain's own (rules extending this one
        add theirs here)."""
        return {}

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        x = value[p["x"]]
        s = value[p["s"]].view(p["s_shape"]).expand(p["shape"])
        h = value[p["shift"]].expand(p["shape"])
        self.impl.run(x, s, h, out, norm=p["kind"], eps=p["eps"], add_c=p["c"],
                      **self._run_extra(p))


def _reshaped(m: TensorMeta, shape) -> TensorMeta:
    """``m`` viewed as ``shape`` (the caller checked that the view exists)."""
    t = torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=m.dtype, device="meta")
    v = t.view(tuple(shape))
    return TensorMeta(tuple(v.shape), tuple(v.stride()), m.dtype, m.device, m.storage_offset)


class ReferenceModulation:
    """A torch implementation of the ``modulation`` kernel interface (for tests of the rule and
    as a model for device kernels); not registered."""

    name = "modulation_reference"

    def why_not(self, x, scale, shift, out, norm):
        return None

    def run(self, x, scale, shift, out, *, norm, eps, add_c):
        out.copy_(modulation_reference(x, scale, shift, eps, norm, add_c))
