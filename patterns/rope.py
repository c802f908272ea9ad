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
The output has x's dtype and is contiguous.  Sources: Su et al., "RoFormer" (arXiv 2104.09864);
diffusers ``apply_rotary_emb``.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

__all__ = ["RopeApply", "RopeIdiom", "rope_reference", "MODES"]

MODES = ("interleaved", "split_half")


def _broadcasts(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str,
                   n_rot: int) -> torch.Tensor:
    """The meaning of ``sd.rope_apply.v1`` in plain torch (float32 maths, x's dtype out)."""
    xf = x.float()
    rot, rest = xf[..., :n_rot], xf[..., n_rot:]
    if mode == "interleaved":
        pairs = rot.reshape(*rot.shape[:-1], -1, 2)
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    elif mode == "split_half":
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    else:
        raise ValueError(f"sd.rope_apply.v1: mode must be one of {MODES}, got {mode!r}")
    out = rot * cos.float() + rotated * sin.float()
    return torch.cat([out, rest], dim=-1).to(x.dtype).contiguous()


def _contiguous(shape: tuple) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


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
        return TensorMeta(tuple(x.shape), _contiguous(tuple(x.shape)), x.dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x, cos, sin = inputs
        out.copy_(rope_reference(x, cos, sin, node.params["mode"], node.params["n_rot"]))


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

    Matched on dataflow; every intermediate must be read only inside the idiom and not be a
    graph output.  The output must have x's shape and dtype (no broadcast or promotion hidden
    in the multiplies), so the rewrite is exact: the kernels compute the same products and sum
    in the same order.  The complex form (view_as_complex) is not recognised yet.
    """

    name = "rope"

    def rewrite(self, graph) -> int:
        users = graph.users()
        count = 0
        for add in list(graph.nodes):
            found = self._match(add, users)
            if found is None:
                continue
            x, cos, sin, mode = found
            try:
                new = fxbackend.op_create(graph, RopeApply.name, [x, cos, sin],
                                          {"mode": mode, "n_rot": x.meta.shape[-1]}, after=add)
            except (ValueError, TypeError):
                continue  # e.g. tables that do not broadcast, strided features: leave it
            fxbackend.replace_uses(graph, add, new)
            users = graph.users()
            count += 1
        return count

    def _match(self, add, users):
        if add.op != "aten.add.Tensor" or len(add.srcs) != 2 or add.params.get("alpha", 1) != 1:
            return None
        if not isinstance(add.meta, TensorMeta):
            return None
        for m_cos, m_sin in (add.srcs, add.srcs[::-1]):
            if not all(m.op == "aten.mul.Tensor" and len(m.srcs) == 2 and
                       _only_user(users, m, add) for m in (m_cos, m_sin)):
                continue
            for rot, sin in (m_sin.srcs, m_sin.srcs[::-1]):
                found = self._rotated_source(rot, users, m_sin)
                if found is None or found[0] not in m_cos.srcs:
                    continue
                x, mode = found
                cos = m_cos.srcs[1] if m_cos.srcs[0] is x else m_cos.srcs[0]
                if cos is x or sin is x:
                    continue
                if tuple(add.meta.shape) != tuple(x.meta.shape) or add.meta.dtype != x.meta.dtype:
                    continue
                return x, cos, sin, mode
        return None

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


fxbackend.register_op(RopeApply)
fxbackend.register_rewrite(RopeIdiom)
