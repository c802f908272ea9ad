"""GroupNorm: the custom op ``sd.group_norm.v1`` with its idiom rewrite ``group_norm``, and the
fusion rule ``group_norm_silu`` (GroupNorm -> SiLU [-> clone]), with their torch reference.

The chain (UNet2DConditionModel's ResnetBlock2D ``norm1 -> silu -> conv1`` and ``norm2 -> silu
-> dropout -> conv2``, the final ``conv_norm_out -> conv_act``; and GroupNorm alone before a
transformer block's ``proj_in``), as Dynamo/aot_autograd give it::

    %a = aten.native_group_norm.default(x, weight, bias) {N, C, HxW, group, eps}  : (y, mean, rstd)
    %b = getitem(%a) {index=0}                      (mean and rstd must be unread: the engine
                                                     rejects the claim otherwise)
    %c = aten.silu.default(%b)
    %d = aten.clone.default(%c)                     optional: eval-mode dropout

becomes one ``fused.group_norm_silu`` step that reads x once from memory and writes the result
once.

GroupNorm alone (no SiLU: before a transformer's ``proj_in``) cannot be a fused range: it would
end in the getitem, which owns no storage.  The rewrite rule ``group_norm``
(:class:`GroupNormIdiom`) turns it into one single-output op instead::

    native_group_norm(x, w, b) {group, eps} -> getitem 0     =>  sd.group_norm.v1(x, w, b)
                                                                    {groups, eps}

``sd.group_norm.v1(x, weight, bias) {groups, eps}`` means ``native_group_norm(...)[0]``: x's
shape and dtype, contiguous (the custom-op contract).  Both weight and bias are required
(sources are tensors only, and a lowered ``native_group_norm`` with two sources does not say
which one is absent; diffusers' GroupNorms are affine).  The rule rewrites only where mean and
rstd are unread, the native output is contiguous too (dense NCHW x: a channels-last x gives a
channels-last output, which the op cannot express), and no single SiLU reads the result: that
chain stays for ``group_norm_silu``, which fuses the native form (including channels-last, which
is why the fusion rule keeps matching ``native_group_norm`` instead of the op).  The op's
reference ``execute`` runs ``native_group_norm``; ``cpu_kernels/groupnorm.py`` and
``cuda_kernels/groupnorm.py`` register the same kernels as for the fusion, without the SiLU.

The rule rewrites on the devices in its ``devices`` (default: CUDA only).  On the CPU the op's
numba kernel is level with ``native_group_norm`` (both read x once for the moments, once more
from cache, and write the result once: the minimum; SD1.5's 32x32 and 16x16 GroupNorms measured
0.94x and 0.90x of eager with a fresh output, 64x64 1.19x, in ``scripts/bench_groupnorm.py``),
so the CPU keeps ATen's own group norm (eager's bits, no copy).  Construct
``GroupNormIdiom(devices=("cpu", "cuda"))`` (or set ``devices`` on the registered rule) to
rewrite there too.

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

import math

import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.rewrite import AtenBuilder

__all__ = ["group_norm_silu_reference", "GroupNormSiluFusion", "ReferenceGroupNormSilu",
           "memory_format_of", "layout_why_not", "GroupNormOpKernel", "GroupNorm", "GroupNormIdiom",
           "GROUP_NORM_OP", "GROUP_NORM_CL_OP", "GroupNormChannelsLast",
           "GroupNormChannelsLastIdiom", "channels_first", "channels_first_meta",
           "channels_last_perm"]

GROUP_NORM = "aten.native_group_norm.default"
GROUP_NORM_OP = "sd.group_norm.v1"
GROUP_NORM_CL_OP = "sd.group_norm_channels_last.v1"
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


def layout_why_not(x, w, b, out, groups, eps) -> str | None:
    """The checks every GroupNorm kernel shares (metadata only; the caller has checked that the
    four are tensors on its device and x's dtype): out has x's dtype and shape, x has a channel
    dim, contiguous ``[C]`` weight and bias of float32 or x's dtype, groups dividing C, a finite
    eps >= 0, x dense NCHW or dense channels-last and out in the same layout."""
    if out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape):
        return f"out {out.dtype}{list(out.shape)} is not x's dtype and shape"
    if len(x.shape) < 2:
        return f"x has {len(x.shape)} dims (N, C, ...)"
    c = int(x.shape[1])
    for name, mt in (("weight", w), ("bias", b)):
        if mt.dtype not in (torch.float32, x.dtype):
            return f"{name} dtype {mt.dtype} (float32 or x's {x.dtype})"
        if tuple(mt.shape) != (c,) or (c > 1 and tuple(mt.stride) != (1,)):
            return f"{name} is not a contiguous [{c}] vector"
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or c % groups:
        return f"groups {groups!r} does not divide C={c}"
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or \
            not math.isfinite(eps):
        return f"eps {eps!r} (a finite float >= 0)"
    fx, fo = memory_format_of(x.shape, x.stride), memory_format_of(out.shape, out.stride)
    if fx is None:
        return f"x strides {tuple(x.stride)} are neither dense NCHW nor channels-last"
    if fo != fx:
        return f"out layout {fo} differs from x's {fx}"
    return None


class GroupNormSiluFusion:
    """Fusion rule ``group_norm_silu``: ``native_group_norm -> getitem 0 [-> silu [-> clone]]``
    as one kernel step (see the module docstring).  ``impl`` is the device kernel.

    GroupNorm alone (getitem not followed by SiLU) that the rewrite ``group_norm`` left native is
    recognised and declined: the range would end in the getitem, which the engine cannot claim
    (see ``match``).

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
            # engine only claims ranges whose final node owns its storage.  The rewrite
            # ``group_norm`` made sd.group_norm.v1 of every one it could; this one it left
            return (0, "GroupNorm without SiLU, not rewritten to sd.group_norm.v1 (a device "
                       "the rewrite leaves native, such as the CPU; mean/rstd read; no affine "
                       "weight and bias; or a non-contiguous output such as channels-last): it "
                       "stays native")
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


# -- GroupNorm alone: the op sd.group_norm.v1 and its rewrite -------------------------------------

class GroupNorm:
    """``sd.group_norm.v1(x, weight, bias) {groups, eps}``: ``native_group_norm(x, weight, bias,
    N, C, HxW, groups, eps)[0]`` (see the module docstring).  x is ``[N, C, ...]`` (float32,
    bf16, fp16 or float64, any strides); weight and bias are ``[C]`` of a floating dtype; the
    output has x's shape and dtype and is contiguous."""

    name = GROUP_NORM_OP
    attrs = {"groups": int, "eps": float}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) != 3:
            raise ValueError(f"{self.name}: takes (x, weight, bias), got {len(srcs)} sources")
        x, w, b = srcs
        if x.dtype not in _X_DTYPES:
            raise ValueError(f"{self.name}: x dtype {x.dtype} (float32, bfloat16, float16 or "
                             f"float64)")
        if len(x.shape) < 2:
            raise ValueError(f"{self.name}: x must be [N, C, ...], got shape {tuple(x.shape)}")
        c, groups = int(x.shape[1]), attrs["groups"]
        if groups < 1 or c % groups:
            raise ValueError(f"{self.name}: groups={groups} does not divide C={c}")
        for label, m in (("weight", w), ("bias", b)):
            if not m.dtype.is_floating_point or tuple(m.shape) != (c,):
                raise ValueError(f"{self.name}: {label} must be a floating [{c}] vector, got "
                                 f"{m.dtype}{list(m.shape)}")
        if not attrs["eps"] >= 0:
            raise ValueError(f"{self.name}: eps must be >= 0, got {attrs['eps']}")
        return TensorMeta.contiguous(x.shape, x.dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (the op's native kernel on any device)."""
        x, w, b = inputs
        out.copy_(group_norm_silu_reference(x, w, b, node.params["groups"], node.params["eps"],
                                            silu=False))

    def serialize(self, node) -> dict:
        """Attributes for a saved plan: ``{"groups": int, "eps": float}``."""
        return {"groups": node.params["groups"], "eps": node.params["eps"]}

    def deserialize(self, data: dict) -> dict:
        """The attributes of :meth:`serialize`'s data."""
        return {"groups": data["groups"], "eps": data["eps"]}


class GroupNormIdiom:
    """Rewrite rule ``group_norm``: GroupNorm alone as ``sd.group_norm.v1`` (module docstring)::

        native_group_norm(x, w, b) -> getitem 0   (mean, rstd unread; no lone SiLU reader;
                                                   contiguous output)  =>  sd.group_norm.v1

    Only GroupNorm *not* followed by SiLU: that chain is ``group_norm_silu``'s, in its native
    form, which also covers channels-last (the op's output is contiguous by contract).  Rewriting
    every group norm would need the fusion rule to match both forms; this keeps one form each.
    """

    name = "group_norm"

    def __init__(self, devices: tuple = ("cuda",)) -> None:
        if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
            raise TypeError(f"GroupNormIdiom: devices must be a tuple of device type names "
                            f"such as ('cuda',), got {devices!r}")
        self.devices = tuple(devices)

    def rewrite(self, graph) -> int:
        count = 0
        users = graph.users()
        for gn in list(graph.nodes):
            found = self._match(gn, users, self.devices)
            if found is None:
                continue
            get, attrs = found
            new = self._replacement(graph, gn, get, attrs)
            if new is None:
                continue
            fxbackend.replace_uses(graph, get, new)
            users = graph.users()
            count += 1
        return count

    @staticmethod
    def _same_result(new, get) -> bool:
        m, want = new.meta, get.meta
        return (m.dtype, tuple(m.shape), tuple(m.stride)) == \
            (want.dtype, tuple(want.shape), tuple(want.stride))

    def _replacement(self, graph, gn, get, attrs):
        """The node (inserted after ``get``) that gives ``get``'s value, or None (the graph
        unchanged)."""
        try:
            new = fxbackend.op_create(graph, GROUP_NORM_OP, list(gn.srcs), attrs, after=get)
        except (ValueError, TypeError):
            return None
        if not self._same_result(new, get):
            graph.nodes.remove(new)  # e.g. channels-last: the native output is not contiguous
            return None
        return new

    @staticmethod
    def _match(gn, users, devices: tuple):
        if gn.op != GROUP_NORM or len(gn.srcs) != 3 or gn.is_output:
            return None
        xm = gn.srcs[0].meta
        if not isinstance(xm, TensorMeta) or xm.device.type not in devices:
            return None
        readers = users.get(gn, [])
        if len(readers) != 1:
            return None  # mean or rstd read (or the tuple read twice): leave it native
        get = readers[0]
        if get.op != "getitem" or get.srcs != [gn] or get.params.get("index") != 0 or \
                not isinstance(get.meta, TensorMeta) or get.meta.is_symbolic:
            return None
        after = users.get(get, [])
        if len(after) == 1 and after[0].op == "aten.silu.default" and not get.is_output:
            return None  # GroupNorm -> SiLU: left to the fusion rule group_norm_silu
        x = gn.srcs[0].meta
        p = gn.params
        groups, eps = p.get("group"), p.get("eps")
        if not isinstance(x, TensorMeta) or len(x.shape) < 2 or \
                not isinstance(groups, int) or isinstance(groups, bool) or \
                not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return None
        n, c = int(x.shape[0]), int(x.shape[1])
        hw = 1
        for s in x.shape[2:]:
            hw *= int(s)
        if (p.get("N"), p.get("C"), p.get("HxW")) != (n, c, hw):
            return None  # sizes that are not x's own: not the plain group norm of x
        return get, {"groups": groups, "eps": float(eps)}


class GroupNormOpKernel:
    """Base of the kernels registered for ``sd.group_norm.v1``: ``supports`` asks the device's
    ``why_not(x, w, b, out, groups, eps)`` (set as ``why_not`` on the subclass) about the node
    with its contiguous output, and never raises."""

    op = GROUP_NORM_OP

    def supports(self, node) -> bool:
        try:
            if len(node.srcs) != 3:
                return False
            x, w, b = (s.meta for s in node.srcs)
            return type(self).why_not(x, w, b, node.meta, node.params.get("groups"),
                                      node.params.get("eps")) is None
        except Exception:  # never raise from supports: decline instead
            return False


# -- GroupNorm alone on a channels-last x: sd.group_norm_channels_last.v1 -------------------------

def channels_last_perm(nd: int) -> list:
    """The dims ``[0, 2, ..., nd-1, 1]``: ``x.permute`` of them puts the channels last."""
    return [0, *range(2, nd), 1]


def channels_first(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[N, *spatial, C]``) seen as ``[N, C, *spatial]`` (a view)."""
    return t.movedim(-1, 1)


def channels_first_meta(m: TensorMeta) -> TensorMeta:
    """:func:`channels_first` of a tensor with metadata ``m``."""
    return TensorMeta((m.shape[0], m.shape[-1], *m.shape[1:-1]),
                      (m.stride[0], m.stride[-1], *m.stride[1:-1]), m.dtype, m.device,
                      m.storage_offset)


class GroupNormChannelsLast:
    """``sd.group_norm_channels_last.v1(x, weight, bias) {groups, eps}``: GroupNorm of an image
    whose channels are its last dim.  x is ``[N, *spatial, C]`` (any strides; float32, bf16,
    fp16 or float64), weight and bias ``[C]``; the output, contiguous ``[N, *spatial, C]``, is
    ``native_group_norm(x.movedim(-1, 1), ...)[0].movedim(1, -1)``.  A channels-last
    ``[N, C, H, W]`` image permuted to ``[N, H, W, C]`` is contiguous, and so is this op's
    output, which permuted back is the channels-last result: the custom-op contract (one
    contiguous output) holds, and no step copies."""

    name = GROUP_NORM_CL_OP
    attrs = {"groups": int, "eps": float}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        if len(srcs) != 3:
            raise ValueError(f"{self.name}: takes (x, weight, bias), got {len(srcs)} sources")
        x = srcs[0]
        if len(x.shape) < 2:
            raise ValueError(f"{self.name}: x must be [N, ..., C], got shape {tuple(x.shape)}")
        # the channel-first checks of sd.group_norm.v1 on x with its channels moved to dim 1
        GroupNorm().infer_meta([channels_first_meta(x), srcs[1], srcs[2]], attrs)
        return TensorMeta.contiguous(x.shape, x.dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        """Reference execution (on any device)."""
        x, w, b = inputs
        channels_first(out).copy_(group_norm_silu_reference(
            channels_first(x), w, b, node.params["groups"], node.params["eps"], silu=False))

    serialize = GroupNorm.serialize
    deserialize = GroupNorm.deserialize


class GroupNormChannelsLastIdiom(GroupNormIdiom):
    """Rewrite rule ``group_norm_channels_last``: GroupNorm alone of a dense channels-last x
    (``channels_last_convs`` gives 16-bit UNets and VAEs such GroupNorms before each
    transformer and attention block)::

        native_group_norm(x, w, b) -> getitem 0         (mean, rstd unread; no lone SiLU reader)
          =>  permute(x) {[0, 2, ..., 1]}  ->  sd.group_norm_channels_last.v1(.., w, b)
              ->  permute {[0, nd-1, 1, ..., nd-2]}   (the channels-last result: views only)

    For bf16 and fp16 x (the layouts ``channels_last_convs`` makes; measured in bf16), on the
    devices in ``devices`` (default: the CPU), and only where an extension kernel runs the op
    there (its reference would copy).  Why: torch's channels-last CPU GroupNorm is much
    slower than its NCHW one on some shapes (one thread, bf16 ``[1, 256, 16, 16]``: 0.30 ms
    against 0.044), while ``cpu_kernels/groupnorm.py``'s channels-last kernel was level with
    it or faster on every shape measured (0.035 ms there).  GroupNorm -> SiLU stays with the
    fusion rule ``group_norm_silu``, which takes channels-last itself."""

    name = "group_norm_channels_last"

    def __init__(self, devices: tuple = ("cpu",)) -> None:
        super().__init__(devices)

    def _replacement(self, graph, gn, get, attrs):
        x = gn.srcs[0]
        nd = len(x.meta.shape)
        if x.meta.dtype not in (torch.bfloat16, torch.float16) or \
                memory_format_of(x.meta.shape, x.meta.stride) != "nhwc" or \
                x.meta.storage_offset or \
                memory_format_of(get.meta.shape, get.meta.stride) != "nhwc":
            return None
        made = []
        try:
            xv = AtenBuilder(graph, gn)("permute", [x], {"dims": channels_last_perm(nd)})
            made.append(xv)
            y = fxbackend.op_create(graph, GROUP_NORM_CL_OP, [xv] + list(gn.srcs[1:]), attrs,
                                    after=get)
            made.append(y)
            k = fxbackend.select_kernel(x.meta.device.type, y)
            back = AtenBuilder(graph, y)("permute", [y], {"dims": [0, nd - 1, *range(1, nd - 1)]})
            made.append(back)
            graph.nodes.remove(back)  # the builder inserts before its node: move it after y
            graph.insert(graph.nodes.index(y) + 1, back)
        except (ValueError, TypeError, KeyError):
            k = None
        if len(made) < 3 or getattr(k, "name", "native") == "native" or \
                not self._same_result(made[-1], get):
            for n in made:  # no kernel of its own, or strides not the native result's
                graph.nodes.remove(n)
            return None
        return back


fxbackend.register_op(GroupNorm)
fxbackend.register_op(GroupNormChannelsLast)
fxbackend.register_rewrite(GroupNormIdiom)
# GroupNormChannelsLastIdiom is registered by channels_last.py, after channels_last_convs, whose
# layouts it needs
