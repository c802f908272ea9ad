"""Example extension: a custom op with a torch reference and a CPU kernel.

    example.scaled_tanh.v1(x) {scale}  =  scale * tanh(x)

Written only against fxbackend's public API (``register_op``, ``register_kernel``,
``TensorMeta``), the way an out-of-tree extension would be.  Importing this module registers
nothing with fxbackend: call :func:`register` (and :func:`unregister` when done).

How a model reaches the op: the same versioned name is also defined as a ``torch.library`` op
(``torch.ops.example.scaled_tanh.v1``, overload name ``v1``), so Dynamo keeps the call, the
lowered node's op is ``example.scaled_tanh.v1`` and fxbackend's kernel registry picks the kernel
registered for that name.  Hand-built graphs create the node with ``fxbackend.op_create``.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend import TensorMeta

OP_NAME = "example.scaled_tanh.v1"
KERNEL_NAME = "example_scaled_tanh_cpu"


def reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The op's meaning, in plain torch."""
    return scale * torch.tanh(x)


class ScaledTanh:
    """The op: name, attribute schema, metadata inference and a reference ``execute``.

    Contract (fxbackend custom node): one tensor source ``x``; attribute ``scale`` (float,
    default 1.0); one contiguous output with ``x``'s shape, dtype and device.
    """

    name = OP_NAME
    attrs = {"scale": (float, 1.0)}

    def infer_meta(self, srcs: list, attrs: dict) -> TensorMeta:
        (x,) = srcs
        return TensorMeta.contiguous(x.shape, x.dtype, x.device)

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        # the reference implementation doubles as the op's native kernel on any device
        out.copy_(reference(inputs[0], node.params["scale"]))

    def serialize(self, node) -> dict:
        """The serialize capability (saved plans): attributes as plain JSON data."""
        return {"scale": node.params.get("scale", 1.0)}

    def deserialize(self, data: dict) -> dict:
        """Inverse of :meth:`serialize`; fxbackend checks the result against ``attrs``."""
        return {"scale": data.get("scale", 1.0)}


class ScaledTanhCPU:
    """CPU kernel: ``tanh`` straight into the output, then scaled in place (no temporary).

    Supports float32 only (a deliberate limit, so that tests can see the fallback to the
    op's reference ``execute`` for other dtypes).
    """

    name = KERNEL_NAME
    op = OP_NAME
    priority = 10

    def supports(self, node) -> bool:
        # metadata only; never raises
        x = node.srcs[0].meta if len(node.srcs) == 1 else None
        return isinstance(x, TensorMeta) and x.dtype == torch.float32

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        torch.tanh(inputs[0], out=out)
        out.mul_(node.params.get("scale", 1.0))


# -- the torch.library twin, so that torch.compile'd models can call the op -------------------

_LIB = torch.library.Library("example", "FRAGMENT")  # noqa: the library must stay alive
try:
    _LIB.define("scaled_tanh.v1(Tensor x, float scale=1.0) -> Tensor")
except RuntimeError:  # defined already (this module imported under a second name)
    pass
else:
    _LIB.impl("scaled_tanh.v1", lambda x, scale=1.0: reference(x, scale),
              "CompositeExplicitAutograd")
    torch.library.register_fake("example::scaled_tanh.v1", lib=_LIB)(
        lambda x, scale=1.0: torch.empty_like(x, memory_format=torch.contiguous_format))


def scaled_tanh(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Call the op from model code (eager: the reference; compiled: fxbackend's kernel)."""
    return torch.ops.example.scaled_tanh.v1(x, scale)


# -- registration ------------------------------------------------------------------------------

_registered: list = []


def register() -> None:
    """Register the op and its CPU kernel with fxbackend (once; see :func:`unregister`)."""
    if _registered:
        return
    op = fxbackend.register_op(ScaledTanh)
    try:
        kernel = fxbackend.register_kernel("cpu", ScaledTanhCPU())
    except Exception:
        fxbackend.unregister_op(op.name)
        raise
    _registered.extend([("op", op.name), ("kernel", kernel)])


def unregister() -> None:
    """Undo :func:`register` (kernel first, then the op)."""
    while _registered:
        kind, what = _registered.pop()
        if kind == "kernel":
            fxbackend.unregister_kernel("cpu", what)
        else:
            fxbackend.unregister_op(what)
