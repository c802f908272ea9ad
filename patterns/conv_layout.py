"""Convolutions read as token rows compute in channels-last on the CPU.

Diffusion transformers embed the latent image with a strided convolution and read its result
as a sequence of tokens (diffusers' ``PatchEmbed``: SD3, PixArt, DiT)::

    y = aten.convolution(x, w, b) {stride=p}          [B, C, H, W], NCHW
    t = y.view(B, C, H*W).transpose(1, 2)              [B, H*W, C]: every token's C features
                                                       lie H*W elements apart

so the op that reads ``t`` (the position-embedding add, a LayerNorm) walks memory across
channels.  torch's CPU kernels do that slowly (SD3's small config: the add of a
``[1, 1024, 512]`` transposed view is about 7x the contiguous add).  A CPU convolution whose
input is channels-last returns a channels-last result, and of that ``t`` is contiguous.

The rewrite rule ``conv_channels_last`` (CPU only) therefore gives such a convolution a
channels-last copy of its input::

    # y = convolution(x, ...)                       (readers: views ending in token rows)
    #   =>  x_cl = clone(x) {memory_format=channels_last}
    #       y = convolution(x_cl, ...)              now channels-last; the views' metadata
    #                                               follows, the token view is contiguous

when every reader of the result is a view chain whose last view is not contiguous now and
becomes contiguous, nothing returns, writes or reads the result otherwise, and the input is
at most half the size of the result (its copy costs less than the transposed reads it saves;
a patch embedding's input has 4-16 channels against hundreds out).  The convolution computes
the same sums on reordered data: on the models tested its results were bit-identical, and in
general they differ only by the order oneDNN sums in (the tests compare to eager with 1e-5
relative).  The result's new layout is the one the fake-tensor implementation of the op gives
(what torch's CPU kernel returns); the rule declines when that is not channels-last.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta
from fxbackend.ir import storage_root

__all__ = ["ConvChannelsLast", "CONV_OP", "channels_last_strides"]

CONV_OP = "aten.convolution.default"
_CLONE = torch.ops.aten.clone.default
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def channels_last_strides(shape) -> tuple:
    """Strides of a dense channels-last (NHWC) tensor of 4-D ``shape`` ``[N, C, H, W]``."""
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _fake_result(conv: Node, x_meta: TensorMeta) -> TensorMeta | None:
    """The convolution's result for an input laid out as ``x_meta``, from the op's fake-tensor
    implementation (which follows the device's kernel: the meta device's does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxbackend.native import call_args

    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            def src(s: Node) -> torch.Tensor:
                m = x_meta if s is conv.srcs[0] else s.meta
                return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
            a, kw = call_args(conv, src, lambda v: v)
            out = conv.target(*a, **kw)
            return TensorMeta(tuple(out.shape), tuple(out.stride()), out.dtype, out.device)
    except Exception:  # no fake implementation for these arguments: leave the conv alone
        return None


def _view_meta(view: Node, metas: dict) -> TensorMeta | None:
    """A view node's metadata for its source laid out as ``metas`` says (run on the meta
    device, where views follow the same stride rules as on any other)."""
    from fxbackend.native import call_args

    def src(s: Node) -> torch.Tensor:
        m = metas.get(s, s.meta)
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")

    try:
        a, kw = call_args(view, src, lambda v: v)
        out = view.target(*a, **kw)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor):
        return None
    m = view.meta
    return TensorMeta(tuple(out.shape), tuple(out.stride()), m.dtype, m.device,
                      out.storage_offset())


class ConvChannelsLast:
    """Rewrite rule ``conv_channels_last`` (see the module docstring)."""

    name = "conv_channels_last"

    @staticmethod
    def _eligible(conv: Node) -> bool:
        m = conv.meta
        if conv.op != CONV_OP or not isinstance(m, TensorMeta) or m.is_symbolic or \
                len(m.shape) != 4 or m.device.type != "cpu" or m.dtype not in _DTYPES:
            return False
        x = conv.srcs[0].meta if conv.srcs else None
        return isinstance(x, TensorMeta) and len(x.shape) == 4 and x.is_contiguous and \
            not conv.params.get("transposed")

    def rewrite(self, graph, ctx) -> int:
        users = graph.users()
        written = {storage_root(m) for m in graph.nodes if m.inplace_of is not None}
        outputs = {o for o in graph.outputs if isinstance(o, Node)}
        done = 0
        for conv in [n for n in graph.nodes if self._eligible(n)]:
            # the views of the result, and those of them something other than a view reads
            views, ends, ok = [], [], True
            stack = [conv]
            while stack and ok:
                v = stack.pop()
                read = False
                for u in users.get(v, ()):
                    if u.view_of is v and u.inplace_of is None and len(u.srcs) == 1:
                        views.append(u)
                        stack.append(u)
                    else:
                        read = True
                if read and v is conv:
                    ok = False  # the result itself is read as it is laid out
                elif read or not users.get(v):
                    ends.append(v)
            if not ok or not ends or conv in outputs or \
                    any(n in outputs or storage_root(n) in written for n in [conv] + views):
                continue
            if any(ends_meta.is_contiguous for ends_meta in (e.meta for e in ends)):
                continue  # already read as token rows, or as an NCHW view
            x = conv.srcs[0]
            xm = x.meta
            x_cl = TensorMeta(xm.shape, channels_last_strides(xm.shape), xm.dtype, xm.device)
            new = _fake_result(conv, x_cl)
            if new is None or tuple(new.shape) != tuple(conv.meta.shape) or \
                    tuple(new.stride) != channels_last_strides(new.shape):
                continue
            metas = {conv: new}
            for v in views:  # users come after their sources in ``views``' order
                vm = _view_meta(v, metas)
                if vm is None or tuple(vm.shape) != tuple(v.meta.shape):
                    metas = None
                    break
                metas[v] = vm
            if metas is None or not all(metas[e].is_contiguous for e in ends):
                continue
            if xm.numel * 2 > conv.meta.numel:
                ctx.decline(conv, f"its input ({xm.numel} elements) is more than half the size "
                                  f"of its result ({conv.meta.numel}): a channels-last copy "
                                  f"would cost more than the transposed reads it saves")
                continue
            clone = graph.new_node("aten.clone.default", [x],
                                   {"memory_format": torch.channels_last}, x_cl,
                                   target=_CLONE, tensor_layout=(("self", 1),))
            graph.insert(graph.nodes.index(conv), clone)
            conv.srcs = [clone] + conv.srcs[1:]
            for n, m in metas.items():
                n.meta = m
            done += 1
        return done


fxbackend.register_rewrite(ConvChannelsLast)
