"""GroupNorm -> SiLU [-> clone]: the fusion rule ``group_norm_silu`` and its torch reference.

The chain (UNet2DConditionModel's ResnetBlock2D ``norm1 -> silu -> conv1`` and ``norm2 -> silu
-> dropout -> conv2``, the final ``conv_norm_out -> conv_act``; and GroupNorm alone before a
transformer block's ``proj_in``), as Dynamo/aot_autograd give it::

    %a = aten.native_group_norm.default(x, weight, bias) {N, C, HxW, group, eps}  : (y, mean, rstd)
    %b = getitem(%a) {index=0}                      (mean and rstd must be unread: the engine
                                                     rejects the claim otherwise)
    %c = aten.silu.default(%b)
    %d = aten.clone.default(%c)                     optional: eval-mode dropout

becomes one ``fused.group_norm_silu`` step that reads x once from memory and writes the result
once.  GroupNorm alone (no SiLU: before ``proj_in``) is recognised but declined with a reason: the
range would end in the getitem, which owns no storage, and the engine claims only ranges whose
final node owns its storage (an idiom rewrite to a single-output group-norm op would lift this).
Meaning (:func:`group_norm_silu_reference`, each step with its own rounding)::

    y   = group_norm(x, weight, bias)   per (sample n, group g) over its C/G channels x HxW:
          mean, biased variance in float32 (opmath), rstd = 1/sqrt(var + eps),
          y = x * (rstd * w[c]) + (b[c] - (rstd * w[c]) * mean), rounded to x's dtype
    out = silu(y) = y / (1 + exp(-y))   (float32 maths, rounded to x's dtype)

Sources: Wu and He, "Group Normalization" (arXiv 1803.08494); torch's CPU kernel
``aten/src/ATen/native/cpu/group_norm_kernel.cpp`` (the scale/bias form above); diffusers
``ResnetBlock2D`` (``models/resnet.py``).

The rule is parameterised by a device kernel object (as ``RmsRopeFusion`` in ``rope.py``):
``name``, ``why_not(x, w, b, out) -> str | None`` (metadata only; a reason declines the chain),
optional ``compile(x, w, b, out, groups, silu)`` (plan time; metadata) and
``run(x, w, b, out, *, groups, eps, silu)`` writing ``out`` (x's shape, dtype and memory format;
no overlap with the inputs).  ``cpu_kernels/groupnorm.py`` and ``cuda_kernels/groupnorm.py``
register one rule each.
"""
from __future__ import annotations

import torch

from fxbackend import TensorMeta

__all__ = ["group_norm_silu_reference", "GroupNormSiluFusion", "ReferenceGroupNormSilu",
           "memory_format_of"]

GROUP_NORM = "aten.native_group_norm.default"


def group_norm_silu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                              groups: int, eps: float, silu: bool = True) -> torch.Tensor:
    """The unfused chain in plain torch: ``native_group_norm(...)[0]``, then ``silu`` (each op
    with its own rounding; the result has x's dtype and memory format)."""
    n, c = x.shape[0], x.shape[1]
    hw = x.numel() // max(n * c, 1)
    y = torch.ops.aten.native_group_norm(x, weight, bias, n, c, hw, groups, eps)[0]
    return torch.ops.aten.silu(y) if silu else y


def memory_format_of(shape, stride) -> str | None:
    """``"nchw"`` when a tensor of this shape/stride is dense in (N, C, spatial...) order,
    ``"nhwc"`` when dense in channels-last order (N, spatial..., C), else None.  Dims of size 1
    are ignored (their stride is arbitrary); "nchw" wins when both hold (C == 1 or HxW == 1)."""
    shape, stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
    if len(shape) < 2 or len(shape) != len(stride):
        return None

    def dense(order) -> bool:
        acc = 1
        for d in reversed(order):
            if shape[d] != 1 and stride[d] != acc:
                return False
            acc *= shape[d]
        return True

    nd = len(shape)
    if dense(tuple(range(nd))):
        return "nchw"
    if dense((0, *range(2, nd), 1)):
        return "nhwc"
    return None


class GroupNormSiluFusion:
    """Fusion rule ``group_norm_silu``: ``native_group_norm -> getitem 0 [-> silu [-> clone]]``
    as one kernel step (see the module docstring).  ``impl`` is the device kernel.

    GroupNorm alone (getitem not followed by SiLU) is recognised and declined: the range would end
    in the getitem, which the engine cannot claim (see ``match``).

    ``match`` recognises the chain on dataflow alone (ops, sources, the getitem index, dtypes and
    shapes) and declines, with the kernel's reason, what its kernel does not take (a layout other
    than NCHW-dense / channels-last-dense, an unsupported dtype, no affine weight and bias).  The
    engine judges legality (mean/rstd read elsewhere, intermediates used outside).
    """

    priority = 10

    def __init__(self, impl) -> None:
        self.impl = impl
        self.name = "group_norm_silu"

    @staticmethod
    def _same_meta(n, prev) -> bool:
        return isinstance(n.meta, TensorMeta) and isinstance(prev.meta, TensorMeta) and \
            n.meta.dtype == prev.meta.dtype and tuple(n.meta.shape) == tuple(prev.meta.shape)

    def _chain(self, graph, i: int) -> list | None:
        """The chain's nodes from ``i`` (group norm, getitem[, silu[, clone]]), or None."""
        nodes = graph.nodes
        gn = nodes[i]
        if gn.op != GROUP_NORM or i + 1 >= len(nodes):
            return None
        get = nodes[i + 1]
        if get.op != "getitem" or get.srcs != [gn] or get.params.get("index") != 0:
            return None
        chain = [gn, get]
        k = i + 2
        if k < len(nodes) and nodes[k].op == "aten.silu.default" and nodes[k].srcs == [get] \
                and self._same_meta(nodes[k], get):
            chain.append(nodes[k])
            k += 1
            c = nodes[k] if k < len(nodes) else None
            # eval-mode dropout lowers to a clone: same values, storage of its own
            if c is not None and c.op == "aten.clone.default" and c.srcs == [chain[-1]] and \
                    c.params.get("memory_format") in (None, torch.preserve_format) and \
                    self._same_meta(c, chain[-1]) and \
                    tuple(c.meta.stride) == tuple(chain[-1].meta.stride):
                chain.append(c)
        return chain

    def match(self, graph, i: int):
        try:
            chain = self._chain(graph, i)
        except Exception:  # malformed node: not ours
            return 0
        if chain is None:
            return 0
        gn = chain[0]
        if len(chain) == 2:
            # GroupNorm alone ends in the getitem, which aliases the group norm's storage: the
            # engine only claims ranges whose final node owns its storage (a single-output
            # group-norm op from an idiom rewrite would lift this; not done yet)
            return (0, "GroupNorm without SiLU: the range would end in getitem, which does not "
                       "own its storage (not claimable); it stays native")
        if len(gn.srcs) != 3:
            return (0, f"{self.impl.name}: group norm without both an affine weight and bias")
        x, w, b = (s.meta for s in gn.srcs)
        why = self.impl.why_not(x, w, b, chain[-1].meta, gn.params.get("group"),
                                gn.params.get("eps"))
        return (0, f"{self.impl.name}: {why}") if why is not None else len(chain)

    # -- running -----------------------------------------------------------------------------
    @staticmethod
    def _parts(node) -> dict:
        chain = node.annotations["fused"]
        gn = chain[0]
        x, w, b = gn.srcs
        return dict(x=x, w=w, b=b, groups=int(gn.params["group"]), eps=float(gn.params["eps"]),
                    silu=any(c.op == "aten.silu.default" for c in chain))

    def compile(self, node) -> None:
        comp = getattr(self.impl, "compile", None)
        if comp is not None:
            p = self._parts(node)
            comp(p["x"].meta, p["w"].meta, p["b"].meta, node.meta, p["groups"], p["silu"])

    def prepare(self, node):
        return self._parts(node), 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        p = state
        value = dict(zip(node.srcs, inputs))
        self.impl.run(value[p["x"]], value[p["w"]], value[p["b"]], out, groups=p["groups"],
                      eps=p["eps"], silu=p["silu"])


class ReferenceGroupNormSilu:
    """A torch implementation of the kernel interface (for tests of the rule and as a model for
    device kernels); not registered."""

    name = "group_norm_silu_reference"

    def why_not(self, x, w, b, out, groups, eps):
        return None

    def run(self, x, w, b, out, *, groups, eps, silu):
        out.copy_(group_norm_silu_reference(x, w, b, groups, eps, silu))
