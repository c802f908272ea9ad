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
Elementwise steps reading the rows whose recorded result took the rows' old, transposed layout
(ATen's rule for an elementwise result: PixArt's position-embedding add, which no clone
follows) write contiguous rows too, down a chain of such steps, unless their result is
returned, written in place or viewed.

1x1 convolutions of one float32 image (UNet ``Transformer2DModel``'s ``proj_in`` and
``proj_out``, whose neighbours are token rows) become GEMMs over the pixels instead, which read
the transposed operand through its strides (BLAS takes a transposed matrix as it is)::

    # proj_in:  rows = conv1x1(x).permute(0, 2, 3, 1).reshape(1, H*W, C)
    #   =>  y = addmm(b, view(x, [Cin, H*W]).t(), view(w, [C, Cin]).t())     [H*W, C]
    #       the conv's readers read view(y, [1, H, W, C]).permute(0, 3, 1, 2): the rows are y
    # proj_out: out = conv1x1(clone(rows.reshape(1, H, W, C).permute(0, 3, 1, 2)))
    #   =>  out = view(addmm(view(b, [Cout, 1]), view(w, [Cout, C]), view(rows', [C, H*W])))
    #       where rows' is the clone's channels-last source: the NCHW copy is gone

No input copy is needed there, so the size condition does not apply.  BLAS sums in another
order than oneDNN's convolution: results differ by float32 rounding (about 1e-6 relative on
the small UNet).  A batch of several images keeps its convolutions.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta, contiguous_strides
from fxbackend.concat import POINTWISE_OPS
from fxbackend.ir import storage_root
from fxbackend.rewrite import AtenBuilder, result_meta

__all__ = ["ConvChannelsLast", "CONV_OP", "channels_last_strides", "is_cpu_conv"]

CONV_OP = "aten.convolution.default"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def channels_last_strides(shape) -> tuple:
    """Strides of a dense channels-last tensor of ``shape`` ``[N, C, *spatial]`` (NHWC for 4-D,
    NDHWC, torch's ``channels_last_3d``, for 5-D): the channels innermost."""
    n, c, *spatial = shape
    strides, step = [], c
    for size in reversed(spatial):
        strides.append(step)
        step *= size
    return (step, 1, *reversed(strides))


def is_cpu_conv(conv: Node, dtypes: tuple, ndims: tuple = (4,)) -> bool:
    """``conv`` is a not transposed, statically shaped CPU ``aten.convolution`` of one of
    ``dtypes`` whose input and result have one of ``ndims`` dims (4: a 2-D convolution)."""
    m = conv.meta
    if conv.op != CONV_OP or not isinstance(m, TensorMeta) or m.is_symbolic or \
            len(m.shape) not in ndims or m.device.type != "cpu" or m.dtype not in dtypes or \
            conv.params.get("transposed") or not conv.srcs:
        return False
    x = conv.srcs[0].meta
    return isinstance(x, TensorMeta) and len(x.shape) == len(m.shape) and not x.is_symbolic


def _pointwise_1x1(conv: Node) -> bool:
    """A 1x1 convolution over one float32 image: a GEMM over its pixels."""
    p = conv.params
    w = conv.srcs[1].meta if len(conv.srcs) > 1 else None
    return isinstance(w, TensorMeta) and len(w.shape) == 4 and tuple(w.shape[2:]) == (1, 1) \
        and w.is_contiguous and conv.meta.shape[0] == 1 and conv.meta.dtype == torch.float32 \
        and list(p.get("stride", ())) == [1, 1] and list(p.get("padding", ())) == [0, 0] \
        and list(p.get("dilation", ())) == [1, 1] and p.get("groups") == 1


def _gemm_token_rows(graph, conv: Node) -> Node:
    """A 1x1 convolution of NCHW ``x`` as the GEMM ``x^T W^T (+ b)`` over its pixels, whose
    ``[H*W, C]`` result is returned viewed as ``[1, C, H, W]`` (channels-last strides)."""
    x, w = conv.srcs[0], conv.srcs[1]
    _, c_in, h, wd = x.meta.shape
    c_out = conv.meta.shape[1]
    make = AtenBuilder(graph, conv)
    xt = make("t", [make("view", [x], {"size": [c_in, h * wd]})])
    wt = make("t", [make("view", [w], {"size": [c_out, c_in]})])
    y = make("addmm", [conv.srcs[2], xt, wt]) if len(conv.srcs) > 2 \
        else make("mm", [xt, wt])
    return make("permute", [make("view", [y], {"size": [1, h, wd, c_out]})],
                {"dims": [0, 3, 1, 2]})


def _gemm_from_rows(graph, conv: Node, v: Node) -> Node | None:
    """A 1x1 convolution of ``clone(v)``, ``v`` channels-last ``[1, C, H, W]`` (token rows
    seen as an image), as the GEMM ``W v (+ b)`` reading ``v`` transposed: no clone."""
    w = conv.srcs[1]
    _, c_in, h, wd = v.meta.shape
    c_out = conv.meta.shape[1]
    make = AtenBuilder(graph, conv)
    v2 = make("view", [v], {"size": [c_in, h * wd]})
    w2 = make("view", [w], {"size": [c_out, c_in]})
    if len(conv.srcs) > 2:
        b = make("view", [conv.srcs[2]], {"size": [c_out, 1]})
        y = make("addmm", [b, w2, v2])
    else:
        y = make("mm", [w2, v2])
    return make("view", [y], {"size": list(conv.meta.shape)})


class ConvChannelsLast:
    """Rewrite rule ``conv_channels_last`` (see the module docstring)."""

    name = "conv_channels_last"

    @staticmethod
    def _eligible(conv: Node) -> bool:
        return is_cpu_conv(conv, _DTYPES) and conv.srcs[0].meta.is_contiguous

    def rewrite(self, graph, ctx) -> int:
        users = graph.users()
        written = {storage_root(m) for m in graph.nodes if m.inplace_of is not None}
        outputs = {o for o in graph.outputs if isinstance(o, Node)}
        done = 0
        for conv in [n for n in graph.nodes if self._eligible(n)]:
            if conv in outputs:
                continue
            one = _pointwise_1x1(conv)
            if one and self._reads_rows(conv, users, written, outputs):
                fxbackend.replace_uses(graph, conv, _gemm_from_rows(graph, conv,
                                                                   conv.srcs[0].srcs[0]))
                done += 1
                continue
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
            if not ok or not ends or \
                    any(n in outputs or storage_root(n) in written for n in [conv] + views):
                continue
            if any(e.meta.is_contiguous for e in ends):
                continue  # already read as token rows, or as an NCHW view
            x = conv.srcs[0]
            xm = x.meta
            x_cl = TensorMeta(xm.shape, channels_last_strides(xm.shape), xm.dtype, xm.device)
            cm = conv.meta
            new = TensorMeta(cm.shape, channels_last_strides(cm.shape), cm.dtype, cm.device) \
                if one else result_meta(conv, {x: x_cl}, fake=True)
            if new is None or tuple(new.shape) != tuple(cm.shape) or \
                    tuple(new.stride) != channels_last_strides(new.shape):
                continue
            metas = {conv: new}
            for v in views:  # users come after their sources in ``views``' order
                vm = result_meta(v, metas)
                if vm is None or tuple(vm.shape) != tuple(v.meta.shape):
                    metas = None
                    break
                metas[v] = vm
            if metas is None or not all(metas[e].is_contiguous for e in ends):
                continue
            if one:  # the GEMM over the pixels reads x transposed: no copy of x
                fxbackend.replace_uses(graph, conv, _gemm_token_rows(graph, conv))
                del metas[conv]
            elif xm.numel * 2 > cm.numel:
                ctx.decline(conv, f"its input ({xm.numel} elements) is more than half the size "
                                  f"of its result ({cm.numel}): a channels-last copy "
                                  f"would cost more than the transposed reads it saves")
                continue
            else:
                clone = AtenBuilder(graph, conv)("clone", [x],
                                              {"memory_format": torch.channels_last})
                conv.srcs = [clone] + conv.srcs[1:]
            old = {e: e.meta for e in ends}
            for n, m in metas.items():
                n.meta = m
            self._rows_downstream(ends, old, users, written, outputs)
            done += 1
        return done

    @staticmethod
    def _rows_downstream(ends: list, old: dict, users: dict, written: set,
                         outputs: set) -> None:
        """Elementwise steps that read the token rows and took their old, transposed layout
        for their own result (as ATen does: PixArt's position-embedding add) write contiguous
        rows now, and so on down a chain of such steps.  Only where nothing returns, writes
        or views their result (views would need new metadata)."""
        work = list(ends)
        while work:
            v = work.pop()
            for r in users.get(v, ()):
                m = r.meta
                if r.op not in POINTWISE_OPS or r.view_of is not None or \
                        not isinstance(m, TensorMeta) or m.is_symbolic or m.is_contiguous or \
                        tuple(m.shape) != tuple(old[v].shape) or \
                        tuple(m.stride) != tuple(old[v].stride) or r in outputs or \
                        storage_root(r) in written or \
                        any(u.view_of is r for u in users.get(r, ())):
                    continue
                old[r] = m
                r.meta = TensorMeta(m.shape, contiguous_strides(m.shape), m.dtype, m.device)
                work.append(r)

    @staticmethod
    def _reads_rows(conv: Node, users: dict, written: set, outputs: set) -> bool:
        """The 1x1 convolution's input is a contiguous ``clone`` of a channels-last image that
        nothing else reads (token rows turned back into NCHW: UNet transformers' proj_out)."""
        c = conv.srcs[0]
        if c.op != "aten.clone.default" or len(c.srcs) != 1 or c in outputs or \
                users.get(c) != [conv] or storage_root(c) in written:
            return False
        v = c.srcs[0].meta
        return isinstance(v, TensorMeta) and not v.is_symbolic and \
            tuple(v.shape) == tuple(c.meta.shape) and v.dtype == c.meta.dtype and \
            v.storage_offset == 0 and \
            tuple(v.stride) == channels_last_strides(v.shape) and \
            storage_root(c.srcs[0]) not in written


fxbackend.register_rewrite(ConvChannelsLast)
