"""RoPE: the custom op ``sd.rope_apply.v1`` and its torch reference.

``sd.rope_apply.v1(x, cos, sin) {mode, n_rot}`` rotates the first ``n_rot`` features of every
row of ``x`` (rows of head features: ``x`` is ``[..., D]`` with unit stride in the last dim;
the other dims may be strided, e.g. a slice of a fused QKV output) and passes the rest through:

    out[..., :n_rot] = x * cos + rotate(x) * sin        (computed in float32)
    out[..., n_rot:] = x[..., n_rot:]

``cos`` and ``sin`` hold one value per rotated feature (``[..., n_rot]``, broadcast over the
batch and heads as the model gives them, e.g. ``[S, n_rot]`` against ``[B, H, S, D]``).
``rotate`` pairs features:
- ``mode="interleaved"``: pairs (2i, 2i+1): rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
  (Flux, CogVideoX, HunyuanDiT: ``reshape(..., -1, 2).unbind(-1)``, ``stack(-imag, real)``);
- ``mode="split_half"``: pairs (i, i + n_rot/2): rotate(x)[i] = -x[i + h], rotate(x)[i + h] = x[i]
  (``cat(-second half, first half)``).
The output has x's dtype and is contiguous.

``sd.rope_apply_rounded.v1(x, cos, sin) {mode, n_rot}`` is the same rotation with each product
and the sum rounded to x's dtype T, as a chain of 16-bit torch ops computes it (Wan writes its
RoPE in the model's dtype)::

    out[..., :n_rot] = round_T(round_T(x * cos) + round_T(rotate(x) * sin))

(each product and the sum in float32 first).  For float32 x it is ``sd.rope_apply.v1``.  A
separate op rather than an attribute: a kernel registered for ``sd.rope_apply.v1`` that did not
know the attribute would compute these nodes with one rounding.

``sd.rope_apply_f64.v1(x, cos, sin) {mode, n_rot}`` is the same rotation computed in float64
(x, cos and sin converted to float64, which is exact) and rounded once to x's dtype as torch
converts a float64 tensor to it: straight to float32, and to bf16/fp16 through float32 (c10
converts a double to float first; measured: 1 + 2^-8 + 2^-30 becomes bf16 1.0, not 1 + 2^-7),
the rounding eager has too.  Lumina 2 multiplies ``view_as_complex(x.float())`` by complex128
frequencies, which is this (the complex64 x promotes exactly; the complex128 product is
``(ac - bd) + i(ad + bc)`` in float64): float32 maths would round each product where float64
does not, so no float32 op gives eager's bits.  A separate op for the reason above; kernels:
``rope_apply_f64_cpu`` (the numba kernel on float64 tables), and on other devices the
reference (``execute``, the op's native kernel on any device).
Sources: Su et al., "RoFormer" (arXiv 2104.09864); diffusers ``apply_rotary_emb``.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

from .rmsnorm import RmsNorm, is_cast_to

RmsNormName = RmsNorm.name

__all__ = ["RopeApply", "RopeApplyRounded", "RopeApplyF64", "RopeTables", "RopeIdiom",
           "rope_reference", "rms_rope_reference", "RmsRopeFusion", "ReferenceRmsRope", "MODES"]

MODES = ("interleaved", "split_half")
#: how ``rope_reference`` rounds: once (``sd.rope_apply.v1``) or after each product and the sum
#: (``sd.rope_apply_rounded.v1``)
ROUNDINGS = ("once", "each_op")
_HALF = (torch.bfloat16, torch.float16)
#: the tables ``sd.rope_tables.v1`` makes from each complex dtype
_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _broadcasts(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str,
                   n_rot: int, rounding: str = "once",
                   compute: torch.dtype = torch.float32) -> torch.Tensor:
    """The meaning of ``sd.rope_apply.v1`` in plain torch (float32 maths, x's dtype out), or
    with ``rounding="each_op"`` that of ``sd.rope_apply_rounded.v1`` (each product and the sum
    rounded to x's dtype), or with ``compute=torch.float64`` that of ``sd.rope_apply_f64.v1``
    (float64 maths, rounded once)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rope_reference: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if compute not in (torch.float32, torch.float64) or \
            (compute == torch.float64 and rounding != "once"):
        raise ValueError(f"rope_reference: compute must be float32, or float64 with rounding "
                         f"'once', got {compute} with {rounding!r}")
    xf = x.to(compute)
    rot, rest = xf[..., :n_rot], xf[..., n_rot:]
    if mode == "interleaved":
        pairs = rot.reshape(*rot.shape[:-1], -1, 2)
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    elif mode == "split_half":
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    else:
        raise ValueError(f"sd.rope_apply.v1: mode must be one of {MODES}, got {mode!r}")
    if rounding == "once":
        out = rot * cos.to(compute) + rotated * sin.to(compute)
    else:  # the negation in ``rotated`` is exact, and rounding is symmetric
        t = x.dtype
        out = (rot * cos.float()).to(t).float() + (rotated * sin.float()).to(t).float()
    return torch.cat([out, rest], dim=-1).to(x.dtype).contiguous()


def rms_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float, mode: str, n_rot: int,
                       scale: float | None = None,
                       out_dtype: torch.dtype | None = None,
                       weight_in_float: bool = False) -> torch.Tensor:
    """The fused chain ``sd.rms_norm.v1(x, weight) -> sd.rope_apply.v1 [-> * scale]
    [-> .to(out_dtype)]`` in plain torch, each step with its own rounding:

        n = rms_norm_reference(x, weight, eps, weight_in_float)   dtype Tn (rms_norm_out_dtype)
        r = rope_reference(n, cos, sin, mode, n_rot)  dtype Tn, float32 maths
        r = r * scale                                  dtype Tn (float32 maths for 16-bit Tn)
        r = r.to(out_dtype)
    """
    from .rmsnorm import rms_norm_reference
    r = rope_reference(rms_norm_reference(x, weight, eps, weight_in_float), cos, sin, mode,
                       n_rot)
    if scale is not None:
        r = r * scale
    if out_dtype is not None:
        r = r.to(out_dtype)
    return r.contiguous()


class RopeApply:
    """``sd.rope_apply.v1``: see the module docstring."""

    name = "sd.rope_apply.v1"
    attrs = {"mode": str, "n_rot": int}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) != 3:
            raise ValueError(f"{self.name}: takes (x, cos, sin), got {len(srcs)} sources")
        x, cos, sin = srcs
        mode, n_rot = attrs["mode"], attrs["n_rot"]
        if mode not in MODES:
            raise ValueError(f"{self.name}: mode must be one of {MODES}, got {mode!r}")
        if not x.shape:
            raise ValueError(f"{self.name}: x must have a feature dimension, got a scalar")
        d = x.shape[-1]
        if d % 2:
            raise ValueError(f"{self.name}: the head size (x's last dim) must be even, got {d}")
        if not (0 < n_rot <= d) or n_rot % 2:
            raise ValueError(f"{self.name}: n_rot must be even and in 1..{d} (the head size), "
                             f"got {n_rot}")
        if x.stride[-1] != 1:
            raise ValueError(f"{self.name}: x's features must be contiguous (last stride 1), "
                             f"got strides {x.stride}")
        want = tuple(x.shape[:-1]) + (n_rot,)
        for label, m in (("cos", cos), ("sin", sin)):
            if not m.dtype.is_floating_point or not x.dtype.is_floating_point:
                raise ValueError(f"{self.name}: x, cos and sin must be floating point, got "
                                 f"{x.dtype}, {cos.dtype}, {sin.dtype}")
            if not _broadcasts(tuple(m.shape), want):
                raise ValueError(f"{self.name}: {label} of shape {tuple(m.shape)} does not "
                                 f"broadcast to {want} (x's rows by n_rot={n_rot})")
        return TensorMeta.contiguous(x.shape, x.dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x, cos, sin = inputs
        out.copy_(rope_reference(x, cos, sin, node.params["mode"], node.params["n_rot"]))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"mode": str, "n_rot": int}``."""
        return {"mode": node.params["mode"], "n_rot": node.params["n_rot"]}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data (the loader checks them against
        ``attrs``; ``infer_meta`` checks the values)."""
        return {"mode": data["mode"], "n_rot": data["n_rot"]}


class RopeApplyRounded(RopeApply):
    """``sd.rope_apply_rounded.v1``: the rotation of ``sd.rope_apply.v1`` with each product and
    the sum rounded to x's dtype (module docstring); the same inputs, attributes and checks."""

    name = "sd.rope_apply_rounded.v1"

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x, cos, sin = inputs
        out.copy_(rope_reference(x, cos, sin, node.params["mode"], node.params["n_rot"],
                                 "each_op"))


class RopeApplyF64(RopeApply):
    """``sd.rope_apply_f64.v1``: the rotation of ``sd.rope_apply.v1`` in float64, rounded once
    to x's dtype (module docstring); the same inputs, attributes and checks.  Its CPU kernel
    is ``cpu_kernels/rope.py``'s; no CUDA kernel is registered, so the reference below runs
    it there."""

    name = "sd.rope_apply_f64.v1"

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x, cos, sin = inputs
        out.copy_(rope_reference(x, cos, sin, node.params["mode"], node.params["n_rot"],
                                 compute=torch.float64))


class RopeTables:
    """``sd.rope_tables.v1(freqs) {part}``: the cos (``part="cos"``) or sin (``"sin"``) table of
    ``sd.rope_apply.v1`` (interleaved) from complex frequencies ``freqs`` (complex64,
    ``[..., n/2]``, e.g. ``torch.polar(1, angles)``): float32 ``[..., n]`` with
    ``out[..., 2p] = out[..., 2p+1] = freqs[..., p].real`` (``.imag`` for sin).  With these,
    ``view_as_real(view_as_complex(x) * freqs)`` is ``rope_apply(x, cos, sin)``: the complex
    product ``(a + ib)(c + id)`` is ``(ac - bd) + i(bc + ad)``.  Complex128 ``freqs`` give
    float64 tables, for ``sd.rope_apply_f64.v1``."""

    name = "sd.rope_tables.v1"
    attrs = {"part": str}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) != 1:
            raise ValueError(f"{self.name}: takes (freqs), got {len(srcs)} sources")
        f = srcs[0]
        if attrs["part"] not in ("cos", "sin"):
            raise ValueError(f"{self.name}: part must be 'cos' or 'sin', got {attrs['part']!r}")
        if f.dtype not in _REAL_OF or not f.shape:
            raise ValueError(f"{self.name}: freqs must be a complex64 or complex128 tensor with "
                             f"a feature dimension, got {f.dtype} of shape {tuple(f.shape)}")
        shape = tuple(f.shape[:-1]) + (2 * f.shape[-1],)
        return TensorMeta.contiguous(shape, _REAL_OF[f.dtype], f.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        part = torch.view_as_real(inputs[0])[..., 0 if node.params["part"] == "cos" else 1]
        pairs = out.view(*out.shape[:-1], -1, 2)
        pairs.copy_(part.unsqueeze(-1).expand(pairs.shape))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"part": "cos" | "sin"}``."""
        return {"part": node.params["part"]}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data."""
        return {"part": data["part"]}


def _only_user(users: dict, node, user) -> bool:
    """``node`` is read by ``user`` alone and is not a graph output."""
    return users.get(node, []) == [user] and not node.is_output


def _last_dim(node, dim) -> bool:
    return dim == -1 or dim == len(node.meta.shape) - 1


class RopeIdiom:
    """RoPE written out, as diffusers' ``apply_rotary_emb`` does (real form):

    # interleaved: view(x, [..., D/2, 2]) -> unbind(-1) -> stack([-odd, even], -1)
    #              -> view(x.shape) = rot;  x * cos + rot * sin
    #   =>  sd.rope_apply.v1(x, cos, sin) {mode=interleaved, n_rot=D}      (Flux, CogVideoX)
    # split_half:  view(x, [..., 2, D/2]) -> unbind(-2) -> cat([-second, first], -1) = rot;
    #              x * cos + rot * sin
    #   =>  sd.rope_apply.v1(x, cos, sin) {mode=split_half, n_rot=D}       (Stable Audio, CogView4)
    # strided writes (Wan): x1, x2 = view(x, [..., D/2, 2]).unbind(-1); out = empty_like(x);
    #              out[..., 0::2] = x1 * c - x2 * s;  out[..., 1::2] = x1 * s + x2 * c
    #              (functionalised: two copy + slice_scatter pairs), c = cos[..., 0::2] and
    #              s = sin[..., 1::2] as Wan gives them, or any [..., D/2] tables
    #   =>  sd.rope_apply.v1(x, C, S) {mode=interleaved, n_rot=D}, C and S each value of c
    #       and s repeated twice (unsqueeze, expand, clone, view: input-free tables fold into
    #       constants); exact: x1 * c - x2 * s is x1 * c + (-x2) * s and the sum of the odd
    #       features is the op's sum with its terms swapped, both exact in IEEE arithmetic.
    #       In bf16/fp16 each product and the sum rounds to that dtype: the chain becomes
    #       sd.rope_apply_rounded.v1, which rounds where the chain does
    # complex (Lumina): view_as_real(view_as_complex(view(x.float(), [..., D/2, 2])) * freqs)
    #              -> view(x.shape) [-> cast back to x's dtype]
    #   =>  sd.rope_apply.v1(x, C, S) {mode=interleaved, n_rot=D} with C, S =
    #       sd.rope_tables.v1(freqs) {part=cos|sin}                        (complex64 freqs)
    #   =>  sd.rope_apply_f64.v1(x, C, S), float64 tables: complex128 freqs (Lumina 2 builds
    #       them in float64) promote the product to complex128, float64 maths rounded once at
    #       the cast back to x's dtype, which must follow
    # rotation matrices (Flux's reference code, ComfyUI, HiDream): x_ = view(x.float(),
    #              [..., D/2, 1, 2]); a * x_[..., 0] + b * x_[..., 1] -> view(x.shape)
    #              [-> cast back to x's dtype], a = F[..., 0] and b = F[..., 1] of the
    #              [..., D/2, 2, 2] matrices F = [[cos, -sin], [sin, cos]]
    #   =>  sd.rope_apply.v1(x, C, S) {mode=interleaved, n_rot=D}, C = (a[..., 0], b[..., 1])
    #       and S = (-b[..., 0], a[..., 1]) interleaved (select, neg, stack, view: input-free
    #       tables fold into constants).  Exact for any a and b, rotations or not, so F needs
    #       no check: out[2i] = a[i, 0] x[2i] + b[i, 0] x[2i+1] is the op's
    #       x[2i] C[2i] - x[2i+1] S[2i] (the negations are exact and cancel), and
    #       out[2i+1] = a[i, 1] x[2i] + b[i, 1] x[2i+1] its x[2i+1] C[2i+1] + x[2i] S[2i+1]
    #       with the terms of the sum swapped

    Matched on dataflow; every intermediate must be read only inside the idiom and not be a
    graph output.  The output must have x's shape and dtype (no broadcast or promotion hidden
    in the multiplies), so the rewrite is exact: the kernels compute the same products and sum
    in the same order.  The complex form is :meth:`_match_complex`'s, the matrix form
    :meth:`_match_matrix`'s.
    """

    name = "rope"

    def rewrite(self, graph) -> int:
        users = graph.users()
        count = 0
        for add in list(graph.nodes):
            found = self._match_complex(add, users)
            if found is not None:
                x, freqs, last, op = found
                try:
                    tc = fxbackend.op_create(graph, RopeTables.name, [freqs], {"part": "cos"},
                                             after=last)
                    ts = fxbackend.op_create(graph, RopeTables.name, [freqs], {"part": "sin"},
                                             after=tc)
                    new = fxbackend.op_create(graph, op.name, [x, tc, ts],
                                              {"mode": "interleaved",
                                               "n_rot": x.meta.shape[-1]}, after=ts)
                except (ValueError, TypeError):
                    for n in [n for n in graph.nodes[graph.nodes.index(last) + 1:][:3]
                              if n.op in (RopeTables.name, op.name) and not users.get(n)]:
                        graph.nodes.remove(n)
                    continue
                fxbackend.replace_uses(graph, last, new)
                users = graph.users()
                count += 1
                continue
            found = self._built_tables(graph, add, users)
            if found is not None:
                x, op, tables, last = found
                try:
                    new = fxbackend.op_create(graph, op.name, [x, *tables()],
                                              {"mode": "interleaved",
                                               "n_rot": x.meta.shape[-1]}, after=last)
                except (ValueError, TypeError, RuntimeError):
                    continue  # the tables' nodes stay unread: dead code, removed later
                fxbackend.replace_uses(graph, last, new)
                users = graph.users()
                count += 1
                continue
            found = self._match(add, users)
            if found is None:
                continue
            x, cos, sin, mode, last = found
            try:
                new = fxbackend.op_create(graph, RopeApply.name, [x, cos, sin],
                                          {"mode": mode, "n_rot": x.meta.shape[-1]}, after=last)
            except (ValueError, TypeError):
                continue  # e.g. tables that do not broadcast, strided features: leave it
            fxbackend.replace_uses(graph, last, new)
            users = graph.users()
            count += 1
        return count

    def _built_tables(self, graph, add, users):
        """(x, op, tables, last) for the forms whose op tables are built from the model's
        (the matrix form, Wan's strided writes); ``tables()`` inserts their nodes before
        ``last`` and returns the two."""
        found = self._match_matrix(add, users)
        if found is not None:
            x, a, b, last = found
            return x, RopeApply, lambda: self._matrix_tables(graph, a, b, last), last
        found = self._match_strided(add, users)
        if found is None:
            return None
        x, c, sn, last = found
        # a 16-bit chain rounds each product and the sum: the rounded op
        op = RopeApply if x.meta.dtype == torch.float32 else RopeApplyRounded
        return x, op, lambda: [self._pairs_table(graph, t, last) for t in (c, sn)], last

    def _match(self, add, users):
        """(x, cos, sin, mode, last) when ``add`` sums the two products of a RoPE; ``last`` is
        the node the op replaces (``add``, or the cast back to x's dtype that follows it)."""
        if add.op != "aten.add.Tensor" or len(add.srcs) != 2 or add.params.get("alpha", 1) != 1:
            return None
        if not isinstance(add.meta, TensorMeta):
            return None
        for m_cos, m_sin in (add.srcs, add.srcs[::-1]):
            if not all(m.op == "aten.mul.Tensor" and len(m.srcs) == 2 and
                       _only_user(users, m, add) for m in (m_cos, m_sin)):
                continue
            for rot, sin in (m_sin.srcs, m_sin.srcs[::-1]):
                # 16-bit x: diffusers computes x.float() * cos + rot.float() * sin
                widened = is_cast_to(rot, torch.float32) and _only_user(users, rot, m_sin)
                found = self._rotated_source(rot.srcs[0] if widened else rot, users,
                                             rot if widened else m_sin)
                if found is None:
                    continue
                x, mode = found
                xs = [s for s in m_cos.srcs
                      if s is x or (widened and is_cast_to(s, torch.float32) and s.srcs[0] is x)]
                if len(xs) != 1:
                    continue
                cos = m_cos.srcs[1] if m_cos.srcs[0] is xs[0] else m_cos.srcs[0]
                if cos is x or sin is x or cos is xs[0] or sin is xs[0]:
                    continue
                if tuple(add.meta.shape) != tuple(x.meta.shape) or \
                        add.meta.dtype != torch.float32:
                    continue  # broadcast, or maths in another precision than the op's float32
                last = add
                if x.meta.dtype != torch.float32:
                    # float32 sum of a 16-bit x: exact only when converted straight back
                    back = users.get(add, [])
                    if not widened or x.meta.dtype not in _HALF or add.is_output or \
                            len(back) != 1 or not is_cast_to(back[0], x.meta.dtype):
                        continue
                    last = back[0]
                return x, cos, sin, mode, last
        return None

    @staticmethod
    def _pairs_table(graph, t, at):
        """Nodes before ``at`` making ``[..., D/2]`` table ``t`` a contiguous ``[..., D]`` one
        with every value twice (``t[..., i]`` at ``2i`` and ``2i + 1``)."""
        from fxbackend.rewrite import AtenBuilder
        make = AtenBuilder(graph, at)
        shape = list(t.meta.shape)
        u = make("unsqueeze", [t], {"dim": len(shape)})
        e = make("expand", [u], {"size": shape + [2]})
        c = make("clone", [e])
        return make("view", [c], {"size": shape[:-1] + [2 * shape[-1]]})

    @staticmethod
    def _matrix_tables(graph, a, b, at):
        """Nodes before ``at`` making the op's ``[..., D]`` cos and sin tables from the
        matrix form's ``[..., D/2, 2]`` tables: ``(a[..., 0], b[..., 1])`` and
        ``(-b[..., 0], a[..., 1])``, each pair interleaved (class doc)."""
        from fxbackend.rewrite import AtenBuilder
        make = AtenBuilder(graph, at)

        def part(t, r):
            return make("select.int", [t], {"dim": -1, "index": r})

        def interleave(even, odd):
            s = make("stack", [even, odd], {"dim": -1})
            return make("view", [s], {"size": list(s.meta.shape[:-2]) +
                                      [2 * s.meta.shape[-2]]})

        return (interleave(part(a, 0), part(b, 1)),
                interleave(make("neg", [part(b, 0)]), part(a, 1)))

    def _match_strided(self, ss1, users):
        """(x, c, s, last) for Wan's RoPE (see the class doc), ``last`` the second
        slice_scatter; one dtype throughout (float32, bf16 or fp16), every intermediate read
        inside the idiom only."""
        def scatter(n, start):
            p = n.params
            return n.op == "aten.slice_scatter.default" and len(n.srcs) == 2 and \
                isinstance(n.meta, TensorMeta) and _last_dim(n, p.get("dim", 0)) and \
                p.get("start", 0) == start and p.get("step", 1) == 2 and \
                p.get("end") in (None, n.meta.shape[-1], 2 ** 63 - 1)

        def strided_slice(n, base, start):
            p = n.params
            return n.op == "aten.slice.Tensor" and n.srcs == [base] and \
                _last_dim(n, p.get("dim", 0)) and p.get("start", 0) == start and \
                p.get("step", 1) == 2 and p.get("end") in (None, base.meta.shape[-1], 2 ** 63 - 1)

        def written(ss, base, start):
            """The value the ``start`` half of ``ss`` = slice_scatter(base, copy(slice(base),
            value)) gets, or None."""
            if not scatter(ss, start) or ss.srcs[0] is not base:
                return None
            cp = ss.srcs[1]
            if cp.op != "aten.copy.default" or len(cp.srcs) != 2 or cp.params or \
                    not _only_user(users, cp, ss):
                return None
            sl, value = cp.srcs
            if not strided_slice(sl, base, start) or not _only_user(users, sl, cp):
                return None
            return value

        def products(n, op):
            """((a, b), (c, d)) for ``op(mul(a, b), mul(c, d))``, each read only there."""
            if n.op != op or len(n.srcs) != 2 or n.params.get("alpha", 1) != 1 or \
                    any(k != "alpha" for k in n.params):
                return None
            if not all(m.op == "aten.mul.Tensor" and len(m.srcs) == 2 and not m.params and
                       _only_user(users, m, n) for m in n.srcs):
                return None
            return tuple(tuple(m.srcs) for m in n.srcs)

        def readers(n):
            return sorted(users.get(n, []), key=id)

        if not scatter(ss1, 1) or not isinstance(ss1.meta, TensorMeta) or \
                not ss1.meta.is_contiguous:
            return None
        ss0 = ss1.srcs[0]
        b = written(ss1, ss0, 1)
        if b is None or ss0.is_output or \
                readers(ss0) != sorted([ss1, ss1.srcs[1].srcs[0]], key=id):
            return None
        empty = ss0.srcs[0]
        a = written(ss0, empty, 0)
        if a is None or empty.op != "aten.empty_like.default" or empty.is_output or \
                readers(empty) != sorted([ss0, ss0.srcs[1].srcs[0]], key=id):
            return None
        pa, pb = products(a, "aten.sub.Tensor"), products(b, "aten.add.Tensor")
        if pa is None or pb is None or not _only_user(users, a, ss0.srcs[1]) or \
                not _only_user(users, b, ss1.srcs[1]):
            return None
        # a = x1 * c - x2 * s (each product's factors in either order); b = x1 * s + x2 * c
        # (its products and their factors in any order)
        got = {frozenset(pb[0]), frozenset(pb[1])}
        for (x1, c), (x2, sn) in ((f1, f2) for f1 in (pa[0], pa[0][::-1])
                                  for f2 in (pa[1], pa[1][::-1])):
            if x1.op != "getitem" or x2.op != "getitem" or x1.srcs != x2.srcs or \
                    x1.params.get("index") != 0 or x2.params.get("index") != 1:
                continue
            if got != {frozenset((x1, sn)), frozenset((x2, c))}:
                continue
            unbind = x1.srcs[0]
            if unbind.op != "aten.unbind.int" or unbind.is_output or \
                    readers(unbind) != sorted([x1, x2], key=id) or \
                    any(len(users.get(t, [])) != 2 or t.is_output for t in (x1, x2)):
                continue
            pairs = unbind.srcs[0]
            if pairs.op != "aten.view.default" or not _only_user(users, pairs, unbind) or \
                    not _last_dim(unbind, unbind.params.get("dim", 0)):
                continue
            x = pairs.srcs[0]
            xm = x.meta if isinstance(x.meta, TensorMeta) else None
            if xm is None or not xm.shape or xm.shape[-1] % 2:
                continue
            d = xm.shape[-1]
            half = tuple(xm.shape[:-1]) + (d // 2,)
            if tuple(pairs.meta.shape) != half + (2,) or \
                    tuple(ss1.meta.shape) != tuple(xm.shape) or \
                    tuple(a.meta.shape) != half or tuple(b.meta.shape) != half:
                continue  # c or s broadcast x: not a rotation of x
            metas = [getattr(n, "meta", None) for n in (x, c, sn, a, b, ss1, empty)]
            if not all(isinstance(m, TensorMeta) for m in metas) or \
                    len({m.dtype for m in metas}) != 1 or \
                    xm.dtype not in (torch.float32,) + _HALF:
                continue  # one dtype throughout: no promotion hidden in the products
            if not c.meta.shape or not sn.meta.shape or c.meta.shape[-1] != d // 2 or \
                    sn.meta.shape[-1] != d // 2:
                continue
            return x, c, sn, ss1
        return None

    def _match_complex(self, mul, users):
        """(x, freqs, last, op) for ``view(view_as_real(view_as_complex(view(xf, [..., D/2, 2]))
        * freqs), [..., D])`` [-> cast back to x's dtype], xf = x or x.float(); ``op``
        ``RopeApply`` for complex64 freqs, ``RopeApplyF64`` for complex128 ones (the product
        promotes to complex128: float64 maths, and the cast back is where it rounds)."""
        if mul.op != "aten.mul.Tensor" or len(mul.srcs) != 2 or \
                not isinstance(mul.meta, TensorMeta) or mul.meta.dtype not in _REAL_OF:
            return None
        for vc, freqs in (mul.srcs, mul.srcs[::-1]):
            if vc.op != "aten.view_as_complex.default" or not _only_user(users, vc, mul):
                continue
            if not isinstance(freqs.meta, TensorMeta) or freqs.meta.dtype != mul.meta.dtype:
                continue
            pairs = vc.srcs[0]
            if pairs.op not in ("aten.view.default", "aten._unsafe_view.default",
                                "aten.reshape.default") or not _only_user(users, pairs, vc):
                continue
            xf = pairs.srcs[0]
            if not isinstance(xf.meta, TensorMeta) or xf.meta.dtype != torch.float32 or \
                    not xf.meta.shape:
                continue
            d = xf.meta.shape[-1]
            if d % 2 or tuple(pairs.meta.shape) != tuple(xf.meta.shape[:-1]) + (d // 2, 2):
                continue
            if tuple(mul.meta.shape) != tuple(vc.meta.shape):
                continue  # freqs broadcast x: not a rotation of x
            vr = users.get(mul, [])
            if len(vr) != 1 or mul.is_output or vr[0].op != "aten.view_as_real.default":
                continue
            vr = vr[0]
            flat = users.get(vr, [])
            if len(flat) != 1 or vr.is_output or flat[0].op not in (
                    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
                continue
            flat = flat[0]
            if tuple(flat.meta.shape) != tuple(xf.meta.shape):
                continue
            x, last = xf, flat
            back = users.get(flat, [])
            if xf.srcs and is_cast_to(xf, torch.float32) and \
                    xf.srcs[0].meta.dtype in _HALF and len(back) == 1 and \
                    not flat.is_output and is_cast_to(back[0], xf.srcs[0].meta.dtype):
                x, last = xf.srcs[0], back[0]  # x.float() ... type_as(x): one op on x
            if mul.meta.dtype == torch.complex64:
                return x, freqs, last, RopeApply
            if last is flat:  # a float64 result: only a cast to float32 makes it x's dtype
                if len(back) != 1 or flat.is_output or not is_cast_to(back[0], torch.float32):
                    continue
                last = back[0]
            return x, freqs, last, RopeApplyF64
        return None

    def _match_matrix(self, add, users):
        """(x, a, b, last) for ``add(mul(a, x_[..., 0]), mul(b, x_[..., 1]))`` (either order,
        each product's factors in either order) with ``x_ = view(xf, [..., D/2, 1, 2])``,
        read by the two selects only, then ``view`` to xf's shape [-> cast back to x's
        dtype], xf = x or x.float(); float32 products (a and b float32, or 16-bit and widened
        by the product), ``[..., D/2, 2]`` tables, no broadcast of x."""
        if add.op != "aten.add.Tensor" or len(add.srcs) != 2 or add.params or \
                not isinstance(add.meta, TensorMeta) or add.meta.dtype != torch.float32:
            return None
        coef, xv = {}, None  # pair element (0: x[2i], 1: x[2i+1]) -> its table
        for m in add.srcs:
            if m.op != "aten.mul.Tensor" or len(m.srcs) != 2 or m.params or \
                    not _only_user(users, m, add) or \
                    tuple(m.meta.shape) != tuple(add.meta.shape):
                return None
            for sel, t in (m.srcs, m.srcs[::-1]):
                # x_ ends in (1, 2): a select of the matrices F (the tables) does not
                if sel.op == "aten.select.int" and _only_user(users, sel, m) and \
                        sel.params.get("index") in (0, 1, -2, -1) and \
                        sel.srcs[0] is not t and (xv is None or sel.srcs[0] is xv) and \
                        tuple(sel.srcs[0].meta.shape[-2:]) == (1, 2) and \
                        _last_dim(sel.srcs[0], sel.params.get("dim", 0)):
                    xv = sel.srcs[0]
                    coef[sel.params["index"] % 2] = t
                    break
            else:
                return None
        if len(coef) != 2 or xv.op not in ("aten.view.default", "aten._unsafe_view.default",
                                           "aten.reshape.default") or xv.is_output or \
                len(users.get(xv, [])) != 2:
            return None  # both selects read the one view x_, which nothing else reads
        xf = xv.srcs[0]
        if not isinstance(xf.meta, TensorMeta) or xf.meta.dtype != torch.float32 or \
                not xf.meta.shape or xf.meta.shape[-1] % 2:
            return None
        d = xf.meta.shape[-1]
        pairs = tuple(xf.meta.shape[:-1]) + (d // 2, 2)
        if tuple(xv.meta.shape) != tuple(xf.meta.shape[:-1]) + (d // 2, 1, 2) or \
                tuple(add.meta.shape) != pairs:
            return None  # the tables broadcast x: not a rotation of x
        a, b = coef[0], coef[1]
        if any(not isinstance(t.meta, TensorMeta) or not t.meta.dtype.is_floating_point or
               tuple(t.meta.shape[-2:]) != (d // 2, 2) or t in (xv, xf) for t in (a, b)):
            return None
        flat = users.get(add, [])
        if len(flat) != 1 or add.is_output or flat[0].op not in (
                "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default") or \
                tuple(flat[0].meta.shape) != tuple(xf.meta.shape):
            return None
        x, last = xf, flat[0]
        back = users.get(last, [])
        if xf.srcs and is_cast_to(xf, torch.float32) and xf.srcs[0].meta.dtype in _HALF and \
                len(back) == 1 and not last.is_output and \
                is_cast_to(back[0], xf.srcs[0].meta.dtype):
            x, last = xf.srcs[0], back[0]  # x.float() ... type_as(x): one op on x
        return x, a, b, last

    def _rotated_source(self, rot, users, reader):
        """(x, mode) when ``rot`` is x's features rotated pairwise in one of the two forms."""
        if not _only_user(users, rot, reader):
            return None
        if rot.op == "aten.view.default":  # interleaved: view(stack([-odd, even], -1))
            mode, unbind_dim, join = "interleaved", -1, rot.srcs[0]
            if join.op != "aten.stack.default" or not _only_user(users, join, rot):
                return None
        elif rot.op == "aten.cat.default":  # split_half: cat([-second, first], -1)
            mode, unbind_dim, join = "split_half", -2, rot
        else:
            return None
        if len(join.srcs) != 2 or not _last_dim(join, join.params.get("dim", 0)):
            return None
        neg, first = join.srcs
        if neg.op != "aten.neg.default" or not _only_user(users, neg, join):
            return None
        second = neg.srcs[0]
        if not (first.op == second.op == "getitem" and first.params["index"] == 0
                and second.params["index"] == 1 and first.srcs[0] is second.srcs[0]):
            return None
        if not (_only_user(users, first, join) and _only_user(users, second, neg)):
            return None
        unbind = first.srcs[0]
        if unbind.op != "aten.unbind.int" or unbind.is_output or \
                sorted(users.get(unbind, []), key=id) != sorted([first, second], key=id):
            return None
        pairs = unbind.srcs[0]
        dim = unbind.params.get("dim", 0)
        if pairs.op != "aten.view.default" or not _only_user(users, pairs, unbind):
            return None
        if dim != unbind_dim and dim != len(pairs.meta.shape) + unbind_dim:
            return None
        x = pairs.srcs[0]
        if not isinstance(x.meta, TensorMeta) or not x.meta.shape:
            return None
        d = x.meta.shape[-1]
        split = (d // 2, 2) if mode == "interleaved" else (2, d // 2)
        if d % 2 or tuple(pairs.meta.shape) != tuple(x.meta.shape[:-1]) + split:
            return None
        if tuple(rot.meta.shape) != tuple(x.meta.shape):
            return None
        return x, mode


class RmsRopeFusion:
    """Fusion rule ``rms_rope``: ``sd.rms_norm.v1(x, w) -> sd.rope_apply.v1 [-> mul(scalar)]
    [-> cast to fp16/bf16 | copy or copy_ into an fp16/bf16 tensor]`` as one kernel that reads
    each row of x once and writes each output row once (meaning: :func:`rms_rope_reference`).

    ``impl`` is the device kernel: an object with ``name``,
    ``why_not(x, w, cos, sin, out_dtype, mode, n_rot) -> str | None`` (metadata only; a reason
    declines the range), optional ``compile(x, w, cos, sin, out_dtype, mode, n_rot, scale)``
    (plan time; metadata) and
    ``run(x, w, cos, sin, out, eps=, mode=, n_rot=, scale=)`` writing a contiguous ``out``
    that overlaps no input.  A kernel with ``weight_in_float = True`` also takes a
    ``weight_in_float=True`` keyword in ``compile`` and ``run`` (the norm's
    ``torch.nn.RMSNorm`` order); the rule declines that norm for other kernels.  ``cpu_kernels/rms_rope.py`` and ``cuda_kernels/rms_rope.py``
    register one rule each.

    ``optimize`` makes the chain consecutive where the model interleaves q and k (Flux:
    ``norm_q(q); norm_k(k); rope(q); rope(k)``): it moves each norm down to just before its
    RoPE with ``graph_delay``, which refuses any move that would change the result.

    A terminal ``copy_`` may write into storage that overlaps x (e.g. back into the QKV
    buffer): then the kernel writes to workspace first and the copy follows.
    """

    priority = 10

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "rms_rope"

    # -- matching ----------------------------------------------------------------------------
    @staticmethod
    def _is_scale(n, prev) -> bool:
        other = n.params.get("other")
        return n.op == "aten.mul.Tensor" and n.srcs == [prev] and \
            isinstance(other, (int, float)) and not isinstance(other, bool) and \
            isinstance(n.meta, TensorMeta) and n.meta.dtype == prev.meta.dtype

    @staticmethod
    def _is_half_copy(n, prev, rope) -> bool:
        if any(is_cast_to(n, dt) for dt in _HALF) and n.srcs == [prev]:
            return True
        if n.op == "aten.copy.default" and len(n.srcs) == 2 and n.srcs[1] is prev and \
                n.srcs[0] is not prev and isinstance(n.meta, TensorMeta) and \
                n.meta.dtype in _HALF and tuple(n.meta.shape) == tuple(rope.meta.shape) and \
                not n.params.get("non_blocking"):
            return True  # functionalised x.copy_(y): a cast into x's dtype (x gives no values)
        return n.op == "aten.copy_.default" and len(n.srcs) == 2 and n.srcs[1] is prev and \
            n.inplace_of is n.srcs[0] and isinstance(n.meta, TensorMeta) and \
            n.meta.dtype in _HALF and tuple(n.meta.shape) == tuple(rope.meta.shape)

    def _chain(self, graph, i: int) -> list | None:
        """The nodes of the chain starting at ``i`` (norm, rope[, scale][, cast/copy])."""
        nodes = graph.nodes
        if i + 1 >= len(nodes):
            return None
        norm, rope = nodes[i], nodes[i + 1]
        if norm.op != RmsNormName or len(norm.srcs) != 2 or rope.op != RopeApply.name or \
                rope.srcs[0] is not norm or norm in rope.srcs[1:]:
            return None
        chain = [norm, rope]
        k = i + 2
        if k < len(nodes) and self._is_scale(nodes[k], rope):
            chain.append(nodes[k])
            k += 1
        if k < len(nodes) and self._is_half_copy(nodes[k], chain[-1], rope):
            chain.append(nodes[k])
        return chain

    def match(self, graph, i: int) -> int:
        chain = self._chain(graph, i)
        if chain is None:
            return 0
        norm, rope = chain[0], chain[1]
        x, w = norm.srcs
        _, cos, sin = rope.srcs
        if norm.params.get("weight_in_float", False) and \
                not getattr(self.impl, "weight_in_float", False):
            return 0, f"{self.impl.name}: no kernel for the norm's weight_in_float order yet"
        why = self.impl.why_not(x.meta, w.meta, cos.meta, sin.meta, chain[-1].meta.dtype,
                                rope.params["mode"], rope.params["n_rot"])
        return (0, f"{self.impl.name}: {why}") if why is not None else len(chain)

    def optimize(self, graph) -> None:
        """Make each norm -> rope [-> scale] [-> cast] chain consecutive (see the class doc)."""
        users = graph.users()
        for rope in [n for n in graph.nodes if n.op == RopeApply.name]:
            norm = rope.srcs[0]
            if norm.op != RmsNormName:
                continue
            chain = [norm, rope]
            nxt = users.get(rope, [])
            if len(nxt) == 1 and self._is_scale(nxt[0], rope):
                chain.append(nxt[0])
            nxt = users.get(chain[-1], [])
            if len(nxt) == 1 and self._is_half_copy(nxt[0], chain[-1], rope):
                chain.append(nxt[0])
            # move the done prefix down to just before the next node of the chain
            for k in range(1, len(chain)):
                start = graph.nodes.index(chain[0])
                j = graph.nodes.index(chain[k])
                if j != start + k and not fxbackend.graph_delay(graph, start, start + k, j - 1):
                    break

    # -- running -----------------------------------------------------------------------------
    def _parts(self, node) -> dict:
        chain = node.annotations["fused"]
        norm, rope = chain[0], chain[1]
        scale = next((float(c.params["other"]) for c in chain[2:]
                      if c.op == "aten.mul.Tensor"), None)
        last = chain[-1]
        return dict(x=norm.srcs[0], w=norm.srcs[1], cos=rope.srcs[1], sin=rope.srcs[2],
                    dst=last.srcs[0] if last.op == "aten.copy_.default" else None,
                    eps=norm.params["eps"], mode=rope.params["mode"],
                    weight_in_float=norm.params.get("weight_in_float", False),
                    n_rot=rope.params["n_rot"], scale=scale, out_dtype=last.meta.dtype)

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            extra = {"weight_in_float": True} if p["weight_in_float"] else {}
            comp(p["x"].meta, p["w"].meta, p["cos"].meta, p["sin"].meta, p["out_dtype"],
                 p["mode"], p["n_rot"], p["scale"], **extra)

    def prepare(self, node):
        p = self._parts(node)
        ws = 0
        if p["dst"] is not None:  # terminal copy: stage the result (dst may overlap x)
            m = node.meta
            n = 1
            for d in m.shape:
                n *= int(d)
            ws = n * m.itemsize
        return p, ws

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        x, w, cos, sin = (value[p[k]] for k in ("x", "w", "cos", "sin"))
        kw = dict(eps=p["eps"], mode=p["mode"], n_rot=p["n_rot"], scale=p["scale"])
        if p["weight_in_float"]:
            kw["weight_in_float"] = True
        if p["dst"] is None:
            self.impl.run(x, w, cos, sin, out, **kw)
            return
        tmp = workspace[:out.numel() * out.element_size()].view(out.dtype).view(out.shape)
        self.impl.run(x, w, cos, sin, tmp, **kw)
        out.copy_(tmp)


class ReferenceRmsRope:
    """A torch implementation of the ``rms_rope`` kernel interface (for tests of the rule and
    as a model for device kernels); not registered."""

    name = "rms_rope_reference"
    weight_in_float = True

    def why_not(self, x, w, cos, sin, out_dtype, mode, n_rot):
        return None

    def run(self, x, w, cos, sin, out, *, eps, mode, n_rot, scale, weight_in_float=False):
        out.copy_(rms_rope_reference(x, w, cos, sin, eps, mode, n_rot, scale, out.dtype,
                                     weight_in_float))


fxbackend.register_op(RopeApply)
fxbackend.register_op(RopeApplyRounded)
fxbackend.register_op(RopeApplyF64)
fxbackend.register_op(RopeTables)
fxbackend.register_rewrite(RopeIdiom)
