"""Moving a graph to another device type: device-specific attention made portable."""
from __future__ import annotations

from typing import Any

import torch

from ..ir import Graph, Node, TensorMeta
from ..rewrite import replace_uses
from .errors import ReplayError

__all__ = ["portable_attention"]

#: attention ops that exist for one device type only; a graph moved to another device type runs
#: ``aten.scaled_dot_product_attention`` instead (their first output, same maths), which
#: dispatches to that device's kernel
_DEVICE_SDPA = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "attn_mask",
    "aten._scaled_dot_product_flash_attention.default": None,
    "aten._scaled_dot_product_efficient_attention.default": "attn_bias",
    "aten._scaled_dot_product_cudnn_attention.default": "attn_bias",
}


def portable_attention(graph: Graph) -> int:
    """Replace device-specific attention nodes by ``aten.scaled_dot_product_attention`` (where
    only their first output is read); returns how many were replaced.  Applied when a plan is
    loaded on another device type than it was saved from.

    The replacement keeps the output's memory layout: a contiguous ``[B, H, S, D]`` output
    (the CPU kernel's) is the new node itself; a ``[B, S, H, D]``-major one (the CUDA kernels')
    is the new node's output transposed, made contiguous and transposed back, so that the views
    after it stay valid when a symbolic graph is re-planned.  Raises ReplayError for a node
    whose auxiliary outputs (log-sum-exp, ...) are read or whose layout is neither."""
    users = graph.users()
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    count = 0
    for n in list(graph.nodes):
        if n.op not in _DEVICE_SDPA:
            continue
        gets = users.get(n, [])
        if any(u.op != "getitem" for u in gets) or any(
                u.params["index"] != 0 and (u.is_output or users.get(u)) for u in gets):
            raise ReplayError(f"node %{n.id}: {n.op} runs on one device type only, and its "
                              f"auxiliary outputs are read, so the plan cannot move to another")
        layout = dict(n.tensor_layout)
        mask_arg = _DEVICE_SDPA[n.op]
        srcs = list(n.srcs[:3])
        new_layout = [("query", True), ("key", True), ("value", True)]
        if mask_arg is not None and layout.get(mask_arg):
            srcs.append(n.srcs[3])
            new_layout.append(("attn_mask", True))
        p = n.params
        params = {"dropout_p": p.get("dropout_p", 0.0), "is_causal": p.get("is_causal", False)}
        if p.get("scale") is not None:
            params["scale"] = p["scale"]
        want = n.meta[0]
        shape = tuple(want.shape)
        plain = TensorMeta.contiguous(shape, want.dtype, want.device)
        chain = [graph.new_node(str(sdpa), srcs, params, plain, tensor_layout=tuple(new_layout))]
        chain[0].target = sdpa
        if len(shape) == 4 and tuple(want.stride) != tuple(plain.stride):
            bshd = (shape[0], shape[2], shape[1], shape[3])
            dense = TensorMeta.contiguous(bshd, want.dtype, want.device)
            back = (dense.stride[0], dense.stride[2], dense.stride[1], dense.stride[3])
            if tuple(want.stride) != back:
                raise ReplayError(f"node %{n.id}: {n.op}'s output layout {want.short()} has no "
                                  f"portable equivalent")
            chain.append(_aten_node(graph, torch.ops.aten.transpose.int, chain[-1],
                                    {"dim0": 1, "dim1": 2},
                                    TensorMeta(bshd, (plain.stride[0], plain.stride[2],
                                                      plain.stride[1], plain.stride[3]),
                                               want.dtype, want.device), view=True))
            chain.append(_aten_node(graph, torch.ops.aten.clone.default, chain[-1],
                                    {"memory_format": torch.contiguous_format}, dense))
            chain.append(_aten_node(graph, torch.ops.aten.transpose.int, chain[-1],
                                    {"dim0": 1, "dim1": 2}, want, view=True))
        elif tuple(want.stride) != tuple(plain.stride):
            raise ReplayError(f"node %{n.id}: {n.op}'s output layout {want.short()} has no "
                              f"portable equivalent")
        for c in chain:
            c.annotations["name"] = n.annotations.get("name", "attention")
        i = graph.nodes.index(n)
        graph.nodes[i:i + 1] = chain
        for u in gets:
            graph.nodes.remove(u)
            if u.params["index"] == 0:
                replace_uses(graph, u, chain[-1])
        count += 1
    return count


def _aten_node(graph: Graph, op: Any, src: Node, params: dict, meta: TensorMeta,
               view: bool = False) -> Node:
    n = graph.new_node(str(op), [src], params, meta, tensor_layout=(("self", True),),
                       view_of=src if view else None)
    n.target = op
    return n
