"""Whole-plan CUDA graphs: ``options={"cuda_graphs": True}`` / ``FXB_CUDA_GRAPHS=1``.

A CUDA plan (with its concurrent regions and their auxiliary stream) is captured once into one
CUDA graph; each call copies the user inputs into static buffers, replays the graph and hands
back copies of the outputs (the caller owns them: the graph's own output storage is rewritten by
the next replay).  Weights (inputs marked ``is_weight``) are captured by address: an in-place
update (a LoRA swap with ``copy_``) is seen by the next replay; a weight replaced by another
tensor (another address) triggers a new capture.  Plans are per input-shape signature already,
so one capture per signature.

Capture-safety is declared, never guessed: an extension kernel (or the implementation object of
a fusion rule) says ``capture_safe = True`` when its ``execute`` neither synchronises with the
host nor allocates; absent means unsafe.  Native ATen steps are safe except the ones that read
device values on the host (:data:`SYNCING_OPS`), steps placed on the CPU, and Python numbers
computed per call.  A plan with an unsafe step runs uncaptured; :func:`capture_blocker` gives the
step and the reason, which the plan's report shows.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import registry
from .ir import Node

__all__ = ["SYNCING_OPS", "capture_blocker", "is_capture_safe", "GraphRunner"]

#: ATen ops whose results depend on device values read on the host (a synchronisation)
SYNCING_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
    "aten.masked_select.default", "aten.unique.default", "aten._unique2.default",
    "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor",
    "aten.bincount.default", "aten.equal.default", "aten.is_nonzero.default",
})


def is_capture_safe(kernel: Any) -> bool:
    """A kernel's declaration (``capture_safe``), else its implementation object's (``impl``:
    fusion rules built around one); absent: False."""
    flag = getattr(kernel, "capture_safe", None)
    if flag is None:
        flag = getattr(getattr(kernel, "impl", None), "capture_safe", None)
    return bool(flag)


def capture_blocker(nodes: list, kernels: dict, per_call_scalar: Callable[[Node], bool],
                    device_type: str, has_callback: bool = False) -> str | None:
    """Why a plan cannot be captured, naming the step, or None when it can."""
    if device_type != "cuda":
        return f"not a CUDA plan (device {device_type})"
    if has_callback:
        return "a per-node evaluation callback is set"
    for n in nodes:
        k = kernels.get(n)
        if k is None:
            continue
        if n.annotations.get("placed"):
            return f"%{n.id} ({n.op}) runs on the CPU"
        if per_call_scalar(n):
            return f"%{n.id} ({n.op}) computes a Python number on every call"
        if k is registry.NATIVE:
            if n.op in SYNCING_OPS:
                return f"%{n.id} ({n.op}) reads device values on the host"
            if n.target is None:  # a custom op's reference execute
                from .ops import get_op
                if not is_capture_safe(get_op(n.op)):
                    return f"%{n.id} ({n.op}): its reference execute is not declared capture-safe"
        elif not is_capture_safe(k):
            return (f"%{n.id} ({n.op}): kernel {getattr(k, 'name', k)!r} is not declared "
                    f"capture_safe")
    return None


class GraphRunner:
    """Captures ``run(args)`` (the plan's generated steps) into a CUDA graph and replays it.

    ``weight_mask[i]``: argument i is a weight (captured by address; a new address re-captures);
    other tensor arguments are copied into static buffers on every call."""

    def __init__(self, run: Callable[[list], list], weight_mask: list, device: torch.device):
        self._run = run
        self._weights = weight_mask
        self._device = device
        self.graph = None
        self.captures = 0
        self._static: list = []
        self._outs: list = []
        self._weight_ptrs: tuple = ()

    def _ptrs(self, args: list) -> tuple:
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else None
                     for a, w in zip(args, self._weights) if w)

    def _capture(self, args: list) -> None:
        static = []
        for a, w in zip(args, self._weights):
            if isinstance(a, torch.Tensor) and not w:
                s = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                s.copy_(a)
                static.append(s)
            else:
                static.append(a)
        # warm up off the capturing stream (lazy initialisations must not be captured)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._run(list(static))
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = self._run(list(static))
        self.graph, self._static, self._outs = graph, static, outs
        self._weight_ptrs = self._ptrs(args)
        self.captures += 1

    def __call__(self, args: list) -> list:
        if self.graph is None or self._ptrs(args) != self._weight_ptrs:
            self._capture(args)
        for s, a, w in zip(self._static, args, self._weights):
            if isinstance(a, torch.Tensor) and not w and s is not a:
                s.copy_(a)
        self.graph.replay()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self._outs]
