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

__all__ = ["AttentionDtype", "AttentionKVContiguous", "ATTENTION_OPS", "CPU_ATTENTION_OP"]

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


#: torch's CPU flash attention: its tensor inputs are q, k, v [, mask]
CPU_ATTENTION_OP = ATTENTION_OPS[0]


class AttentionKVContiguous:
    """Rewrite rule ``attention_kv_contiguous``: torch's CPU flash attention gets its keys and
    values in contiguous ``[B, H, S, D]`` rows.

    Diffusers hands attention q, k and v as ``[B, S, H, D]`` tensors transposed to
    ``[B, H, S, D]`` (Flux, PixArt): each head's rows lie ``H * D`` elements apart.  The kernel
    walks all of k and v once per block of queries, and it does so measurably faster over
    contiguous rows than over those strided ones (one thread, float32: 2-6% of the attention's
    time at ``[1, 6-24, 1101-4096, 64-128]``, bit-identical results), more than the one copy of
    k and v costs.  q is left as it is: the output takes q's layout, which the ops after
    attention (``transpose(1, 2).reshape``) read as rows without a copy.

    A k or v already contiguous is left alone; a ``_to_copy`` or ``clone`` that only this
    attention reads (the casts of the ``attention_dtype`` option) writes the contiguous layout
    itself instead of being copied again; otherwise a ``clone`` is inserted before the step.
    """

    name = "attention_kv_contiguous"

    def rewrite(self, graph) -> int:
        users = graph.users()
        outputs = {o for o in graph.outputs if isinstance(o, Node)}
        done = 0
        for n in [x for x in graph.nodes if x.op == CPU_ATTENTION_OP and len(x.srcs) >= 3]:
            changed, made = False, {}
            for i in (1, 2):
                s = n.srcs[i]
                if s in made:  # k and v are one tensor
                    n.srcs = [made[s] if j == i else x for j, x in enumerate(n.srcs)]
                    continue
                m = s.meta
                if not isinstance(m, TensorMeta) or m.is_symbolic or m.is_contiguous or \
                        m.device.type != "cpu":
                    continue
                want = TensorMeta(m.shape, contiguous_strides(m.shape), m.dtype, m.device)
                if s.op in ("aten._to_copy.default", "aten.clone.default") and \
                        s.view_of is None and s not in outputs and \
                        all(u is n for u in users.get(s, ())):
                    s.meta = want
                else:
                    c = graph.new_node("aten.clone.default", [s],
                                       {"memory_format": torch.contiguous_format}, want,
                                       target=torch.ops.aten.clone.default,
                                       tensor_layout=(("self", 1),))
                    graph.insert(graph.nodes.index(n), c)
                    n.srcs = [c if j == i else x for j, x in enumerate(n.srcs)]
                    made[s] = c
                changed = True
            done += changed
        return done


fxbackend.register_rewrite(AttentionKVContiguous)
