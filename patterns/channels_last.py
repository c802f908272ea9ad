"""16-bit convolutional networks run channels-last on the CPU (2-D and 3-D convolutions).

On the CPU a bfloat16 or float16 convolution is much faster when its input and weight are
channels-last (NHWC) than in the default NCHW layout: oneDNN's 16-bit kernels want the channels
innermost (one thread, ``[1, 256, 16, 16]`` bf16 3x3 256 -> 256: 0.47 ms against 0.75 ms NCHW;
``[1, 128, 32, 32]`` 128 -> 128: 0.30 against 0.59 ms), and a 3-D (video) one when they are
channels-last-3d, NDHWC (``[1, 96, 4, 32, 32]`` 3x3x3: 1.29 against 3.44 ms; bit-identical).
In float32 it gains nothing there, so float32 graphs are left alone.  A UNet or a VAE is a chain of convolutions with GroupNorms, SiLUs,
residual adds, upsamplings and concatenations between them, all of which compute the same values
in either layout, so the whole chain can stay channels-last: only the network's input (4 latent
channels), and whatever leaves the convolutional part in a layout ATen cannot follow, is copied.

The rewrite rule ``channels_last_convs`` (CPU, bf16/fp16; a graph with concrete sizes: a static
compile's, or each plan of a dynamic compile)::

    # y = convolution(x, w, b)                    x, w NCHW
    #   =>  w_cl = clone(w) {memory_format=channels_last}     from the weight alone: the plan
    #                                                          keeps it between calls
    #       x_cl = clone(x) {memory_format=channels_last}     only where x is not channels-last
    #       y = convolution(x_cl, w_cl, b)                     channels-last
    #   every step downstream takes the layout ATen gives for its new input layouts (its
    #   fake-tensor implementation, run here): adds, GroupNorm, SiLU, cat, the token view of a
    #   transformer block's input (now contiguous: its copy goes); a nearest upsampling's
    #   gather (``_unsafe_index``) of a channels-last image is given a channels-last result,
    #   which ``index_upsample`` then writes in one copy

A step whose op cannot take the new layout (a ``view`` that needs the old strides, a
Python-level or custom op, ``as_strided``) reads a copy in the old layout instead, and so does
the graph's output: the caller gets eager's layout, whatever dense order it had (a graph that
returns an NHWC view of an NCHW result gets those strides back).  The weight copies are steps
computed from weights alone, which the executor keeps between calls and redoes only when the
weight changes (``Plan.cached``).  The rule declines (the plan's report says why) when an old
layout to restore is not a dense one (a slice's, say).

Values: a channels-last convolution sums the same products; on the shapes tested its bf16
results were bit-identical to NCHW, and in general they differ only by oneDNN's summation
order.  The other steps compute the same values in any layout (reductions, e.g. GroupNorm's
statistics, in the order their kernels use for that layout).
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta, contiguous_strides
from fxbackend.ir import same_layout, same_strides
from fxbackend.native import call_args, out_is_copy, out_overload
from fxbackend.rewrite import AtenBuilder

from .conv_layout import channels_last_strides, is_cpu_conv
from .groupnorm import GroupNormChannelsLastIdiom
from .scale_cast import is_dense

__all__ = ["ChannelsLastConvs", "is_channels_last"]

_16BIT = (torch.bfloat16, torch.float16)
#: dims of the tensors laid out channels-last: 2-D (NHWC) and 3-D (NDHWC) convolutions
_NDIMS = (4, 5)
#: ops whose result depends on the source's strides, not just its values
_STRIDED_OPS = frozenset({"aten.as_strided.default", "aten.as_strided_copy.default",
                          "aten.as_strided_scatter.default"})
#: CPU kernels that require their first input dense in NCHW or channels-last (the functional
#: op makes it so before calling them; the traced graph holds no such copy when it was a no-op)
_DENSE_INPUT_OPS = frozenset({"aten.native_group_norm.default"})
#: nearest upsampling, decomposed: a channels-last image upsamples into a channels-last result
_GATHER_OP = "aten._unsafe_index.Tensor"
_COPY_OPS = ("aten._to_copy.default", "aten.clone.default")


def is_channels_last(m) -> bool:
    """``m`` is a dense 4-D or 5-D channels-last tensor (strides compared on dims of size >
    1)."""
    return isinstance(m, TensorMeta) and not m.is_symbolic and len(m.shape) in _NDIMS and \
        m.storage_offset == 0 and \
        same_strides(m.shape, m.stride, channels_last_strides(m.shape))


def _canonical(m) -> bool:
    """``m`` has exactly the strides of a dense channels-last tensor, size-1 dims included:
    torch's memory-format rule (a convolution's, a GroupNorm's) does not take a batch of one
    whose stride is smaller than the image's for channels-last, as ATen's elementwise ops
    can give it (the batch dim ordered between the channels and the width)."""
    return isinstance(m, TensorMeta) and len(m.shape) in _NDIMS and m.storage_offset == 0 \
        and tuple(m.stride) == channels_last_strides(m.shape)


def _writes_planned(n: Node) -> bool:
    """The plan writes ``n``'s result into storage laid out as its metadata says (a native op
    with a ``.out`` kernel of its own, or a copy), so its strides on size-1 dims are ours to
    choose."""
    t = n.target
    if n.view_of is not None or n.inplace_of is not None or \
            not isinstance(t, torch._ops.OpOverload):
        return False
    return n.op in _COPY_OPS or (out_overload(t) is not None and not out_is_copy(t, "cpu"))


def _cl(m: TensorMeta) -> TensorMeta:
    return TensorMeta(tuple(m.shape), channels_last_strides(m.shape), m.dtype, m.device)


class _Decline(Exception):
    pass


class ChannelsLastConvs:
    """Rewrite rule ``channels_last_convs`` (see the module docstring)."""

    name = "channels_last_convs"

    @staticmethod
    def _eligible(conv: Node) -> bool:
        if not is_cpu_conv(conv, _16BIT, _NDIMS) or len(conv.srcs) < 2:
            return False
        x, w = conv.srcs[0].meta, conv.srcs[1].meta
        return isinstance(w, TensorMeta) and not w.is_symbolic and \
            len(w.shape) == len(x.shape) and x.dtype == w.dtype == conv.meta.dtype

    def rewrite(self, graph, ctx) -> int:
        convs = [n for n in graph.nodes if self._eligible(n)]
        if not convs or graph.has_symbolic_metas:  # a dynamic compile's plans are concrete
            return 0
        try:
            new, copies = self._layouts(graph, set(convs))
        except _Decline as e:
            ctx.decline(convs, str(e))
            return 0
        self._apply(graph, new, copies)
        return len(convs)

    # -- planning: which layout each step gets, which copies are needed ----------------------
    def _layouts(self, graph, convs: set) -> tuple[dict, list]:
        """``(new metas of the steps whose layout changes, copies)``; a copy is
        ``(kind, source, reader or None for a graph output)``, kind ``"cl"`` (the
        convolution's input or weight made channels-last) or ``"back"`` (the old layout)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        new: dict = {}
        copies: list = []
        with FakeTensorMode():
            fakes: dict = {}

            def fake(s: Node, meta=None):
                m = meta if meta is not None else new.get(s, s.meta)
                return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)

            def run(n: Node, srcs: dict):
                a, kw = call_args(n, lambda s: srcs[s] if s in srcs else fake(s), lambda v: v)
                return n.target(*a, **kw)

            for n in graph.nodes:
                if n in convs:
                    srcs = {}
                    for s in n.srcs[:2]:
                        m = new.get(s, s.meta)
                        if not _canonical(m):
                            copies.append(("cl", s, n))
                            m = _cl(m)
                        srcs[s] = fake(s, m)
                    out = run(n, srcs)
                    m = TensorMeta(tuple(out.shape), tuple(out.stride()), out.dtype,
                                   n.meta.device)
                    if not is_channels_last(m):
                        raise _Decline(f"the fake convolution of %{n.id} on channels-last "
                                       f"operands does not return channels-last")
                    if not same_layout(m, n.meta):
                        new[n] = m
                    continue
                if self._relayout_clone(n, new):
                    new[n] = _cl(n.meta)
                    continue
                changed = [s for s in n.srcs if s in new]
                if not changed:
                    continue
                if n.op == "getitem":
                    got = new[n.srcs[0]][n.params["index"]]
                    if not same_layout(got, n.meta):
                        new[n] = got
                    continue
                m = self._follow(n, run, new)
                if m is None:  # the step reads its sources in their old layouts
                    if n.inplace_of in changed:
                        raise _Decline(f"%{n.id} writes in place into %{n.inplace_of.id}, "
                                       f"which would be channels-last, and cannot take that "
                                       f"layout")
                    for s in changed:
                        self._restorable(s)
                        copies.append(("back", s, n))
                    continue
                if isinstance(m, TensorMeta) and is_channels_last(m) and not _canonical(m) \
                        and _writes_planned(n):
                    m = _cl(m)
                if not same_layout(m, n.meta) or (isinstance(m, TensorMeta) and
                                                   _canonical(m) and not _canonical(n.meta)):
                    new[n] = m
        for o in graph.outputs:
            if isinstance(o, Node) and o in new:
                self._restorable(o)
                copies.append(("back", o, None))
        return new, copies

    @staticmethod
    def _relayout_clone(n: Node, new: dict) -> bool:
        """``n`` is ``x.contiguous()`` of a channels-last 16-bit image ``x`` (token rows seen
        as an image again: ``rows.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous()`` after a
        transformer block): it becomes a channels-last clone, which the plan then elides."""
        if n.op != "aten.clone.default" or len(n.srcs) != 1 or \
                n.params.get("memory_format") != torch.contiguous_format:
            return False
        m = n.meta
        return isinstance(m, TensorMeta) and not m.is_symbolic and len(m.shape) in _NDIMS and \
            m.dtype in _16BIT and m.device.type == "cpu" and not is_channels_last(m) and \
            is_channels_last(new.get(n.srcs[0], n.srcs[0].meta))

    @staticmethod
    def _follow(n: Node, run, new: dict):
        """``n``'s metadata for its sources' new layouts, or None when it cannot follow them
        (not an ATen op, a stride-dependent op, one that fails on them: a ``view``, or a
        kernel that needs a dense NCHW or channels-last input and would not get one)."""
        if not isinstance(n.target, torch._ops.OpOverload) or n.op in _STRIDED_OPS or \
                not isinstance(n.meta, (TensorMeta, tuple)):
            return None
        if n.op in _DENSE_INPUT_OPS:
            x = new.get(n.srcs[0], n.srcs[0].meta)
            if not (x.is_contiguous or is_channels_last(x)):
                return None
        if n.op == _GATHER_OP and isinstance(n.meta, TensorMeta) and len(n.meta.shape) == 4 \
                and is_channels_last(new.get(n.srcs[0], n.srcs[0].meta)) and \
                all(s not in new for s in n.srcs[1:]):
            return _cl(n.meta)  # a gather by pixel index writes any layout (index_upsample)
        try:
            out = run(n, {})
        except Exception:
            return None
        dev = (n.meta[0] if isinstance(n.meta, tuple) else n.meta).device

        def meta(t, old):
            if not isinstance(old, TensorMeta):
                return old
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(old.shape) or \
                    t.dtype != old.dtype:
                raise ValueError
            return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, dev,
                              t.storage_offset())
        try:
            if isinstance(n.meta, tuple):
                if not isinstance(out, (tuple, list)) or len(out) != len(n.meta):
                    return None
                # a statistics output (a layer norm's mean and rstd) whose dtype the fake
                # kernel gives otherwise than the traced graph (bf16 for float32 on the CPU)
                # keeps its traced metadata: its layout does not follow the input's
                metas = tuple(old if i and isinstance(t, torch.Tensor) and
                              isinstance(old, TensorMeta) and t.dtype != old.dtype and
                              tuple(t.shape) == tuple(old.shape) else meta(t, old)
                              for i, (t, old) in enumerate(zip(out, n.meta)))
                if n.op in _DENSE_INPUT_OPS and _canonical(new.get(n.srcs[0], n.srcs[0].meta)) \
                        and is_channels_last(metas[0]):
                    # the CPU kernel returns exact channels-last strides for such an input
                    # (its fake implementation orders a batch of one differently)
                    metas = (_cl(metas[0]),) + metas[1:]
                return metas
            return meta(out, n.meta)
        except ValueError:
            return None

    @staticmethod
    def _restorable(s: Node) -> None:
        m = s.meta
        if not isinstance(m, TensorMeta) or m.storage_offset or \
                not is_dense(m.shape, m.stride):
            raise _Decline(f"%{s.id} would need a copy back to its old layout, which is not "
                           f"a dense one ({m.short() if isinstance(m, TensorMeta) else m})")

    # -- applying ---------------------------------------------------------------------------
    @staticmethod
    def _apply(graph, new: dict, copies: list) -> None:
        old = {n: n.meta for n in new}
        for n, m in new.items():
            n.meta = m
            if n.op == "aten.clone.default" and \
                    n.params.get("memory_format") == torch.contiguous_format:
                n.params = dict(n.params, memory_format=torch.channels_last)
        # one copy per source and kind, unless something writes in place (then per reader)
        shared = not any(n.inplace_of is not None for n in graph.nodes)
        made: dict = {}
        for kind, s, reader in copies:
            key = (kind, s) if shared else (kind, s, reader)
            c = made.get(key)
            if c is None:
                fmt = torch.channels_last if kind == "cl" else torch.contiguous_format
                m = s.meta if kind == "cl" else old.get(s, s.meta)
                # back: the old strides, any dense order (a copy into planned storage is
                # ``copy_``, which writes whatever layout the plan gives it)
                meta = _cl(m) if kind == "cl" else \
                    TensorMeta(tuple(m.shape), tuple(m.stride), m.dtype, m.device)
                if kind == "back" and not m.is_contiguous:
                    fmt = torch.preserve_format
                if reader is None:  # a graph output: copied last
                    c = graph.new_node("aten.clone.default", [s], {"memory_format": fmt}, meta,
                                       target=torch.ops.aten.clone.default,
                                       tensor_layout=(("self", True),))
                    graph.append(c)
                else:
                    c = AtenBuilder(graph, reader)("clone", [s], {"memory_format": fmt})
                    c.meta = meta
                made[key] = c
            if reader is None:
                graph.outputs = [c if o is s else o for o in graph.outputs]
                if s.is_output:
                    s.is_output = False
                    c.is_output = True
            else:
                reader.srcs = [c if x is s else x for x in reader.srcs]
                if reader.view_of is s:
                    reader.view_of = c

fxbackend.register_rewrite(ChannelsLastConvs)
# GroupNorm alone on the channels-last images this rule makes (``patterns/groupnorm.py``)
fxbackend.register_rewrite(GroupNormChannelsLastIdiom)
