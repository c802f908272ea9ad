"""The small callables a plan's step function calls around an extension kernel's step.

- :class:`_AddressWatch`: calls the kernels' ``update_args(node, state, inputs)`` when the
  addresses of a step's inputs change (a weight replaced, an input of another storage);
- :class:`_Computed`: calls a kernel's ``compute`` and checks the tensor it returns against the
  step's metadata, since the plan reads that result through views planned on it.

:mod:`fxbackend.codegen` puts them in the step function's namespace as constants.
"""
from __future__ import annotations

from typing import Any

import torch

from .ir import Node, TensorMeta
from .planning import layout_matches

__all__: list = []


class _AddressWatch:
    """Calls ``update_args(node, state, inputs)`` when a step's input addresses change."""

    __slots__ = ("node", "state", "callbacks", "last")

    def __init__(self, node: Node, state: Any, callbacks: list) -> None:
        self.node, self.state, self.callbacks, self.last = node, state, callbacks, None

    def __call__(self, inputs: list) -> None:
        ptrs = tuple(t.data_ptr() for t in inputs)
        if ptrs != self.last:
            if self.last is not None:
                for cb in self.callbacks:
                    cb(self.node, self.state, inputs)
            self.last = ptrs


class _Computed:
    """Calls an extension kernel's ``compute`` and checks that the tensor it returns has the
    step's metadata (shape, strides where a dimension has more than one element, dtype,
    device): the plan reads the result through views and steps planned on that metadata, so a
    result of another layout would give wrong values, not an error."""

    __slots__ = ("compute", "node", "kernel")

    def __init__(self, kernel: Any, node: Node) -> None:
        self.compute, self.node, self.kernel = kernel.compute, node, kernel

    def __call__(self, ctx, node, state, inputs, workspace) -> torch.Tensor:
        t = self.compute(ctx, node, state, inputs, workspace)
        m = self.node.meta
        if not layout_matches(t, m) or t.dtype != m.dtype or t.device != m.device:
            got = TensorMeta.of(t).short() if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(
                f"kernel {getattr(self.kernel, 'name', self.kernel)!r}: compute() for node "
                f"%{self.node.id} ({self.node.op}) returned {got} with strides "
                f"{tuple(t.stride()) if isinstance(t, torch.Tensor) else None}; expected "
                f"{m.short()} with strides {tuple(m.stride)} (a new tensor of exactly the "
                f"node's metadata)")
        return t
