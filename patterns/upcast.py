"""16-bit GEMMs and convolutions computed in float32 on CPUs without 16-bit dot products.

On a CPU without AVX-512 BF16 / AMX (or AVX-512 FP16 for float16), torch's 16-bit GEMM and
convolution crawl: on an AVX2-only CPU a bf16 ``mm`` ran ~170x and an NCHW 3x3 bf16
convolution ~180x slower than in float32.  Where the CPU profile decides so
(:func:`fxbackend.cpu_profile`, decisions ``bfloat16`` / ``float16``), the rewrite rule
``compute_in_float32`` (CPU only) computes them in float32 and rounds once::

    # y = op(a, b[, c]) {params}                     a 16-bit mm, addmm, bmm, baddbmm or
    #                                                convolution; every tensor source 16-bit
    #   =>  a32 = _to_copy(a) {dtype=float32}        one per source; a weight's (or a view's
    #       ...                                      of a weight) is computed from the weight
    #                                                alone: kept between calls, once per model
    #       y32 = op(a32, b32[, c32]) {params}       float32 maths
    #       y   = _to_copy(y32) {dtype=16-bit}       one rounding, as the 16-bit kernel rounds
    #                                                its float32 accumulator

Values: the 16-bit kernels accumulate in float32 and round once too, so the results differ from
16-bit eager by summation order only, and from a float32 reference by no more than 16-bit
eager's error (tests: ``tests/test_cpu_profile.py``).  Where the CPU has the 16-bit dot
products nothing changes; the plan's report shows the decision either way (``cpu decision
bfloat16: ...``).  ``disable_rewrites=["compute_in_float32"]`` keeps the 16-bit kernels.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta
from fxbackend.rewrite import result_meta

__all__ = ["ComputeInFloat32", "UPCAST_OPS"]

#: the ops computed in float32 (ATen's functional GEMMs and convolution)
UPCAST_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                        "aten.baddbmm.default", "aten.convolution.default"})
_16BIT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TO_COPY = torch.ops.aten._to_copy.default


def _cast(graph, x: Node, dtype: torch.dtype, index: int) -> Node | None:
    """``_to_copy(x) {dtype}`` inserted at ``index`` with the layout ATen gives it, or None."""
    node = graph.new_node("aten._to_copy.default", [x], {"dtype": dtype}, None,
                          target=_TO_COPY, tensor_layout=(("self", 1),))
    node.meta = result_meta(node, fake=True)
    if node.meta is None:
        return None
    graph.insert(index, node)
    return node


class ComputeInFloat32:
    """Rewrite rule ``compute_in_float32`` (module docstring)."""

    name = "compute_in_float32"

    @staticmethod
    def eligible(n: Node) -> torch.dtype | None:
        """The 16-bit dtype of ``n`` when it is a statically shaped CPU GEMM or convolution
        whose tensor sources and result all have that dtype, else None."""
        m = n.meta
        if n.op not in UPCAST_OPS or not isinstance(m, TensorMeta) or m.is_symbolic or \
                m.device.type != "cpu" or m.dtype not in _16BIT or not n.srcs:
            return None
        for s in n.srcs:
            sm = s.meta
            if not isinstance(sm, TensorMeta) or sm.dtype != m.dtype or sm.is_symbolic or \
                    sm.device != m.device:
                return None
        return m.dtype

    def rewrite(self, graph, ctx) -> int:
        profile = None
        done = 0
        for n in list(graph.nodes):
            dtype = self.eligible(n)
            if dtype is None:
                continue
            if profile is None:
                profile = fxbackend.cpu_profile()
            if profile.decide(_16BIT[dtype]).choice != "float32":
                continue
            at = graph.nodes.index(n)
            ups = []
            for s in n.srcs:
                c = _cast(graph, s, torch.float32, at + len(ups))
                if c is None:
                    break
                ups.append(c)
            old_srcs, meta16 = n.srcs, n.meta
            n.srcs = ups
            wide = result_meta(n, fake=True) if len(ups) == len(old_srcs) else None
            if wide is None or tuple(wide.stride) != tuple(meta16.stride):
                n.srcs = old_srcs  # no float32 result in the 16-bit one's layout: leave it
                for c in ups:
                    graph.nodes.remove(c)
                ctx.decline(n, "its float32 form has no result in the 16-bit layout")
                continue
            n.meta = wide
            back = graph.new_node("aten._to_copy.default", [n], {"dtype": dtype}, meta16,
                                  target=_TO_COPY, tensor_layout=(("self", 1),))
            graph.insert(graph.nodes.index(n) + 1, back)
            fxbackend.replace_uses(graph, n, back)
            done += 1
        return done


fxbackend.register_rewrite(ComputeInFloat32)
