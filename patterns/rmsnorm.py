"""RMSNorm: the custom op ``sd.rms_norm.v1``, its torch reference, and its recognition.

``sd.rms_norm.v1(x[, weight]) {eps}`` normalises every row of ``x`` (``[..., D]``, unit stride
in the last dim, other dims may be strided) over its last dim, with the float32 maths and the
dtype rules of diffusers' ``RMSNorm`` (and of ``F.rms_norm`` in float32)::

    n   = x * rsqrt(mean(float(x)^2, -1) + eps)          (float32)
    out = n.to(x.dtype)                                   no weight
    out = n.to(w.dtype) * w                               weight bf16/fp16 (w's dtype out)
    out = n * w                                           weight float32 (float32 out)
    out = (n * float(w)).to(x.dtype)                      weight_in_float=True (any weight)

``weight_in_float`` is the rounding order of ``torch.nn.RMSNorm`` / ``F.rms_norm`` on 16-bit
inputs (their decomposition multiplies the weight in float32, then casts back to x's dtype).

``weight`` is 1-D (``[D]``).  x is float32, bf16 or fp16.  The output is contiguous.  Source:
Zhang and Sennrich, "Root Mean Square Layer Normalization" (arXiv 1910.07467); diffusers
``models/normalization.py``.

Recognition (:class:`RmsNormIdiom`, rewrite rule ``"rms_norm"``): the written-out chain as
ATen gives it,

    pow(xf, 2) -> mean(-1, keepdim) -> add(eps) -> rsqrt = r;  mul(x or xf, r)
      [-> _to_copy(w.dtype)] [-> mul(_, w)]

where ``xf`` is ``x`` or ``x`` converted to float32, and ``aten.rms_norm`` when it reaches the
graph undecomposed.  Every intermediate must be read only inside the chain.  The op sums the
squares in its own order, so results may differ from the written-out chain by float32 rounding
of the mean (about 1e-7 relative).
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

__all__ = ["RmsNorm", "RmsNormIdiom", "rms_norm_reference", "rms_norm_out_dtype", "is_cast_to",
           "is_widening", "is_narrowing"]

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


def rms_norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype | None,
                       weight_in_float: bool = False) -> torch.dtype:
    """The output dtype of ``sd.rms_norm.v1`` for these input dtypes (see the module docstring)."""
    if w_dtype is None or weight_in_float:
        return x_dtype
    return w_dtype if w_dtype in _HALF else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_in_float: bool = False) -> torch.Tensor:
    """The meaning of ``sd.rms_norm.v1`` in plain torch."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    n = x * torch.rsqrt(var + eps)
    if weight is None:
        return n.to(x.dtype).contiguous()
    if weight_in_float:
        return (n * weight.float()).to(x.dtype).contiguous()
    if weight.dtype in _HALF:
        n = n.to(weight.dtype)
    return (n * weight).contiguous()


class RmsNorm:
    """``sd.rms_norm.v1``: see the module docstring."""

    name = "sd.rms_norm.v1"
    attrs = {"eps": float, "weight_in_float": (bool, False)}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) not in (1, 2):
            raise ValueError(f"{self.name}: takes (x) or (x, weight), got {len(srcs)} sources")
        x = srcs[0]
        w = srcs[1] if len(srcs) == 2 else None
        if x.dtype not in _X_DTYPES:
            raise ValueError(f"{self.name}: x must be float32, bfloat16 or float16, got {x.dtype}")
        if not x.shape:
            raise ValueError(f"{self.name}: x must have a feature dimension, got a scalar")
        if x.stride[-1] != 1:
            raise ValueError(f"{self.name}: x's features must be contiguous (last stride 1), "
                             f"got strides {x.stride}")
        if not attrs["eps"] >= 0:
            raise ValueError(f"{self.name}: eps must be >= 0, got {attrs['eps']}")
        if w is not None:
            if w.dtype not in _X_DTYPES:
                raise ValueError(f"{self.name}: weight must be float32, bfloat16 or float16, "
                                 f"got {w.dtype}")
            if tuple(w.shape) != (x.shape[-1],):
                raise ValueError(f"{self.name}: weight must be 1-D of x's last dim "
                                 f"({x.shape[-1]},), got shape {tuple(w.shape)}")
        wif = attrs.get("weight_in_float", False)
        if wif and w is None:
            raise ValueError(f"{self.name}: weight_in_float needs a weight")
        dtype = rms_norm_out_dtype(x.dtype, None if w is None else w.dtype, wif)
        return TensorMeta.contiguous(x.shape, dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x = inputs[0]
        w = inputs[1] if len(inputs) == 2 else None
        out.copy_(rms_norm_reference(x, w, node.params["eps"],
                                     node.params.get("weight_in_float", False)))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"eps": float, "weight_in_float": bool}``."""
        return {"eps": node.params["eps"],
                "weight_in_float": node.params.get("weight_in_float", False)}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data (``weight_in_float`` defaults to
        False)."""
        return {"eps": data["eps"], "weight_in_float": data.get("weight_in_float", False)}


def _only_user(users: dict, node, user) -> bool:
    return users.get(node, []) == [user] and not node.is_output


def is_cast_to(n, dtype) -> bool:
    """``n`` only converts its source to ``dtype``: ``_to_copy`` / ``convert_element_type``
    with no device, layout or memory-format change (``.float()``, ``.to(dtype)``,
    ``type_as``)."""
    if n.op not in ("aten._to_copy.default", "prims.convert_element_type.default"):
        return False
    if not isinstance(n.meta, TensorMeta) or n.meta.dtype != dtype or not n.srcs or \
            not isinstance(n.srcs[0].meta, TensorMeta):
        return False
    p = n.params
    return all(k in ("dtype", "memory_format", "non_blocking", "layout", "device") for k in p) \
        and p.get("memory_format") in (None, torch.preserve_format) \
        and p.get("layout") in (None, torch.strided) \
        and (p.get("device") is None or torch.device(p["device"]) == n.srcs[0].meta.device)


def is_widening(n) -> bool:
    """``n`` is ``.float()`` of a bf16/fp16 tensor (:func:`is_cast_to` float32)."""
    return is_cast_to(n, torch.float32) and n.srcs[0].meta.dtype in _HALF


def is_narrowing(n) -> bool:
    """``n`` casts a float32 tensor to bf16/fp16 (:func:`is_cast_to`)."""
    return any(is_cast_to(n, d) for d in _HALF) and n.srcs[0].meta.dtype == torch.float32


def _scalar(n, key="other"):
    v = n.params.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class RmsNormIdiom:
    """RMSNorm written out in ATen (see the module docstring) => ``sd.rms_norm.v1``."""

    name = "rms_norm"

    def rewrite(self, graph) -> int:
        count = 0
        users = graph.users()
        for node in list(graph.nodes):
            found = self._match(node, users)
            if found is None:
                continue
            last, srcs, attrs = found
            try:
                new = fxbackend.op_create(graph, RmsNorm.name, srcs, attrs, after=last)
            except (ValueError, TypeError):
                continue
            if new.meta.dtype != last.meta.dtype or tuple(new.meta.shape) != tuple(last.meta.shape):
                graph.nodes.remove(new)
                continue
            fxbackend.replace_uses(graph, last, new)
            users = graph.users()
            count += 1
        return count

    def _match(self, node, users):
        if node.op == "aten.rms_norm.default":
            return self._match_aten(node)
        if node.op != "aten.rsqrt.default":
            return None
        r = node
        add = r.srcs[0]
        if add.op not in ("aten.add.Scalar", "aten.add.Tensor") or len(add.srcs) != 1 or \
                _scalar(add) is None or add.params.get("alpha", 1) != 1 or \
                not _only_user(users, add, r):
            return None
        eps = float(_scalar(add))
        mean = add.srcs[0]
        if mean.op != "aten.mean.dim" or not _only_user(users, mean, add) or \
                not mean.params.get("keepdim") or mean.params.get("dtype") is not None:
            return None
        dims = mean.params.get("dim")
        pw = mean.srcs[0]
        nd = len(pw.meta.shape) if isinstance(pw.meta, TensorMeta) else 0
        if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] not in (-1, nd - 1):
            return None
        if pw.op != "aten.pow.Tensor_Scalar" or pw.params.get("exponent") != 2 or \
                not _only_user(users, pw, mean):
            return None
        xf = pw.srcs[0]
        x = xf.srcs[0] if is_cast_to(xf, torch.float32) else xf
        if not isinstance(x.meta, TensorMeta) or x.meta.dtype not in _X_DTYPES:
            return None
        if xf is not x and xf.meta.dtype != torch.float32:
            return None
        if xf is x and x.meta.dtype != torch.float32:
            return None  # pow in half precision: not the float32 maths of the op
        ru = users.get(r, [])
        if len(ru) != 1 or r.is_output:
            return None
        mul = ru[0]
        if mul.op != "aten.mul.Tensor" or len(mul.srcs) != 2:
            return None
        other = mul.srcs[1] if mul.srcs[0] is r else mul.srcs[0]
        if other is not x and other is not xf:
            return None
        if mul.meta.dtype != torch.float32 or tuple(mul.meta.shape) != tuple(x.meta.shape):
            return None
        last, srcs = mul, [x]
        mu = users.get(mul, [])
        if len(mu) == 1 and not mul.is_output:
            nxt = mu[0]
            w = self._weight(nxt, mul, x)
            back = users.get(nxt, []) if w is not None and not nxt.is_output else []
            if w is not None and w.meta.dtype in _HALF and nxt.meta.dtype == torch.float32 and \
                    len(back) == 1 and is_cast_to(back[0], x.meta.dtype) and \
                    x.meta.dtype in _HALF:
                # torch.nn.RMSNorm on 16-bit x: weight multiplied in float32, then cast back
                return back[0], [x, w], {"eps": eps, "weight_in_float": True}
            cast = None
            if is_cast_to(nxt, torch.bfloat16) or is_cast_to(nxt, torch.float16):
                cast = nxt
                cu = users.get(cast, [])
                nxt = cu[0] if len(cu) == 1 and not cast.is_output else None
            w = self._weight(nxt, cast or mul, x)
            if w is not None and (cast is None or w.meta.dtype == cast.meta.dtype):
                last, srcs = nxt, [x, w]
            elif cast is not None and w is None and cast.meta.dtype == x.meta.dtype:
                last = cast  # no weight: converted back to x's dtype
        if len(srcs) == 1 and last.meta.dtype != x.meta.dtype:
            return None
        return last, srcs, {"eps": eps}

    @staticmethod
    def _weight(nxt, prev, x):
        if nxt is None or nxt.op != "aten.mul.Tensor" or len(nxt.srcs) != 2:
            return None
        w = nxt.srcs[1] if nxt.srcs[0] is prev else nxt.srcs[0]
        if w is prev or not isinstance(w.meta, TensorMeta):
            return None
        if tuple(w.meta.shape) != (x.meta.shape[-1],) or tuple(nxt.meta.shape) != tuple(x.meta.shape):
            return None
        return w

    @staticmethod
    def _match_aten(node):
        shape = node.params.get("normalized_shape")
        x = node.srcs[0] if node.srcs else None
        if x is None or not isinstance(x.meta, TensorMeta) or list(shape or []) != [x.meta.shape[-1]]:
            return None
        # float32 only: for 16-bit inputs torch's own op rounds where diffusers' RMSNorm does not
        if any(s.meta.dtype != torch.float32 for s in node.srcs[:2]) or len(node.srcs) > 2:
            return None
        eps = node.params.get("eps")
        if eps is None:
            return None  # torch's default eps depends on the dtype; keep the native op
        return node, list(node.srcs[:2]), {"eps": float(eps)}


fxbackend.register_op(RmsNorm)
fxbackend.register_rewrite(RmsNormIdiom)
