"""Attention in 16 bits inside a float32 model: ``options={"attention_dtype": "bfloat16"}``.

With the linear layers in INT8 (``quantize="w8a8"``) or not, scaled-dot-product attention is
what is left of a float32 diffusion transformer's time on the CPU (about 37% of the small Flux
model under W8A8), and torch's flash attention runs about 2x faster in bfloat16 there (AMX).
The rewrite rule ``attention_dtype`` (active only when the option asks for it) turns each
float32 attention step into::

    # out, lse = flash_attention(q, k, v)                                float32
    #   =>  q16, k16, v16 = _to_copy(q|k|v) {dtype}                      strides kept
    #       out16, lse = flash_attention(q16, k16, v16)                  the same op, 16 bits
    #       out = _to_copy(out16) {float32}                              out's own layout

so the softmax statistics and the accumulation follow torch's 16-bit kernel (float32
accumulators inside it), and everything around attention stays float32.  It changes results
(by about the 16-bit rounding of q, k, v and the output: cosine similarity to float32 about
0.9999 on the small Flux/SD3 configs, ``scripts/bench_int8.py``), which is why it is an
explicit option and never a default.

Rewritten: ``aten._scaled_dot_product_flash_attention_for_cpu``, and on CUDA
``aten._scaled_dot_product_flash_attention`` and ``_scaled_dot_product_efficient_attention``
(what torch picks for float32 there), with float32 q, k, v and no mask or bias; other
attention ops and masked attention stay float32, and the plan's report says why.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import Node, TensorMeta, contiguous_strides

__all__ = ["AttentionDtype", "ATTENTION_OPS"]

#: the attention ops this rule rewrites (their tensor inputs are q, k, v [, mask])
ATTENTION_OPS = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "aten._scaled_dot_product_flash_attention.default",
                 "aten._scaled_dot_product_efficient_attention.default")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_TO_COPY = torch.ops.aten._to_copy.default


def _dense(m: TensorMeta) -> bool:
    return m.span_bytes == m.numel * m.itemsize


def _cast(graph, x: Node, dtype: torch.dtype, meta: TensorMeta, index: int) -> Node:
    """``_to_copy(x) {dtype}`` placed at ``index``, with the strides ``meta`` gives."""
    node = graph.new_node("aten._to_copy.default", [x], {"dtype": dtype}, meta,
                          target=_TO_COPY, tensor_layout=(("self", 1),))
    graph.insert(index, node)
    return node


class AttentionDtype:
    """Rewrite rule ``attention_dtype`` (module docstring)."""

    name = "attention_dtype"

    @staticmethod
    def why_not(n: Node) -> str | None:
        """None when ``n`` (an attention op) is rewritten, else why not."""
        if len(n.srcs) != 3:
            return "masked attention (a mask in 16 bits would change its meaning)"
        metas = [s.meta for s in n.srcs]
        if not all(isinstance(m, TensorMeta) and m.dtype == torch.float32 for m in metas):
            return "q, k, v are not all float32"
        if not isinstance(n.meta, tuple) or not isinstance(n.meta[0], TensorMeta):
            return "unexpected outputs"
        return None

    def rewrite(self, graph, ctx) -> int:
        dtype = _DTYPES.get(ctx.options.attention_dtype or "")
        if dtype is None:
            return 0
        done = 0
        users = graph.users()
        for n in [x for x in graph.nodes if x.op in ATTENTION_OPS]:
            why = self.why_not(n)
            if why is not None:
                ctx.decline(n, why)
                continue
            at = graph.nodes.index(n)
            low = []
            for s in n.srcs:
                m = s.meta
                stride = m.stride if _dense(m) else contiguous_strides(m.shape)
                low.append(_cast(graph, s, dtype, TensorMeta(m.shape, stride, dtype, m.device),
                                 at + len(low)))
            n.srcs = low
            out = n.meta[0]
            n.meta = (TensorMeta(out.shape, out.stride, dtype, out.device),) + tuple(n.meta[1:])
            for g in [u for u in users.get(n, ()) if u.op == "getitem"
                      and u.params.get("index") == 0]:
                g.meta = n.meta[0]
                back = _cast(graph, g, torch.float32, out, graph.nodes.index(g) + 1)
                fxbackend.replace_uses(graph, g, back)
            done += 1
        return done


fxbackend.register_rewrite(AttentionDtype)
