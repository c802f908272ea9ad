"""Kernel registry: which kernel runs each node, per device type.

Every op has the native kernel (the ATen implementation, :class:`NativeKernel`) as its
lowest-priority entry.  Extension kernels are registered per device type ("cpu", "cuda", or a
test-only name) and op name; :func:`select_kernel` picks, in priority order (higher first), the
first extension kernel that ``supports`` the node and is ``preferred`` for it, else the native
kernel, else any supporting extension (when the native kernel cannot run the node, a supporting
extension runs it whatever its preference says).

A kernel is an object with:
- ``name`` (str), ``op`` (the op name it implements), ``priority`` (int, default 0);
- ``supports(node) -> bool``: computes the node correctly; reads metadata only, never raises;
- ``preferred(node) -> bool`` (optional; None/absent: always preferred over native);
- ``prepare(node) -> (state, workspace_bytes)`` (optional; plan time, metadata only);
- ``execute(ctx, node, state, inputs, out, workspace)`` writes the result into ``out``;
- ``compute(ctx, node, state, inputs, workspace) -> Tensor`` (optional): for a library call that
  allocates its own result (no ``out=`` form), the result as a new tensor with exactly the
  node's metadata (shape, strides, dtype, device), never a view of an input; the plan then
  gives the step no storage and calls ``compute`` instead of ``execute`` (no copy into an
  arena view), for single-output steps that are not views or in-place writes; a result of
  other metadata is a RuntimeError naming the kernel and the node (checked every call);
- ``destroy(state)`` (optional), when the plan is dropped.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from .generation import bump as _bump, generation
from .ir import Node
from .ops import get_op

__all__ = ["register_kernel", "unregister_kernel", "select_kernel", "kernels_for",
           "declined_kernels",
           "supports_op", "supports_native_op", "NativeKernel", "NATIVE", "generation"]

_lock = threading.RLock()
_kernels: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
# ``generation()`` and ``_bump()`` (which fusion and rewrite rules call too) are
# :mod:`fxbackend.generation`'s, shared with the op table


def register_kernel(device: str, kernel: Any) -> Any:
    """Register ``kernel`` (an instance, or a class: instantiated once) for its ``kernel.op`` on
    device type ``device``; returns the registered instance."""
    if isinstance(kernel, type):
        kernel = kernel()
    for attr in ("name", "op", "supports", "execute"):
        if not hasattr(kernel, attr):
            raise TypeError(f"kernel {kernel!r} has no {attr!r}; a kernel needs name, op, "
                            f"supports(node) and execute(ctx, node, state, inputs, out, workspace)")
    with _lock:
        entries = _kernels[device][kernel.op]
        if any(k.name == kernel.name for k in entries):
            raise ValueError(f"a kernel named {kernel.name!r} is already registered for "
                             f"{kernel.op} on {device!r}")
        entries.append(kernel)
        entries.sort(key=lambda k: -getattr(k, "priority", 0))
        _bump()
    return kernel


def unregister_kernel(device: str, kernel: Any) -> None:
    """Remove a kernel registered with :func:`register_kernel` (tests, plugin unloading)."""
    with _lock:
        _kernels[device][kernel.op].remove(kernel)
        _bump()


def kernels_for(device: str, op: str) -> list[Any]:
    """Extension kernels for ``op`` on ``device``, highest priority first."""
    return list(_kernels.get(device, {}).get(op, ()))


_local = threading.local()


class _Guard:
    """Catches a ``supports``/``preferred`` callback that asks about the same device and op
    again (directly or not): a clear error instead of unbounded recursion."""

    def __init__(self, device: str, op: str) -> None:
        self.key = (device, op)

    def __enter__(self):
        active = _local.__dict__.setdefault("active", set())
        if self.key in active:
            raise RuntimeError(f"supports_op({self.key[0]!r}, {self.key[1]}) was called "
                               f"recursively from a kernel callback for the same device and op; "
                               f"a supports/preferred callback must not ask about its own op")
        active.add(self.key)

    def __exit__(self, *exc):
        _local.active.discard(self.key)


def _supporting(device: str, node: Node) -> list[Any]:
    with _Guard(device, node.op):
        return [k for k in kernels_for(device, node.op) if k.supports(node)]


def supports_op(device: str, node: Node) -> bool:
    """Whether some kernel on ``device`` runs ``node`` alone: a single-node extension kernel or
    the native kernel.  (Fusion rules do not count: they claim node ranges.)"""
    return bool(_supporting(device, node)) or supports_native_op(device, node)


def supports_native_op(device: str, node: Node) -> bool:
    """Whether the native kernel runs ``node`` on ``device``, ignoring extensions."""
    return NATIVE.supports(node)


def select_kernel(device: str, node: Node) -> Any:
    """The kernel that runs ``node`` on device type ``device`` (see the module docstring)."""
    candidates = _supporting(device, node)
    with _Guard(device, node.op):
        for k in candidates:
            pref = getattr(k, "preferred", None)
            if pref is None or pref(node):
                return k
    if NATIVE.supports(node):
        return NATIVE
    if candidates:
        return candidates[0]
    raise NotImplementedError(f"no kernel on {device!r} can run {node.op} (node %{node.id})")


def declined_kernels(device: str, node: Node, chosen: Any) -> list[tuple[str, str]]:
    """``(kernel name, reason)`` for each extension kernel registered for ``node``'s op on
    ``device`` that ranks above ``chosen`` but did not take the node: its ``why_not(node)``
    (an optional capability returning a reason or None) or "supports() is False" or "not
    preferred".  For reports; never raises."""
    out = []
    for k in kernels_for(device, node.op):
        if k is chosen:
            break
        try:
            with _Guard(device, node.op):
                if k.supports(node):
                    why = "not preferred for this node"
                else:
                    why_not = getattr(k, "why_not", None)
                    why = (why_not(node) if callable(why_not) else None) or "supports() is False"
        except Exception as exc:  # a report never fails a plan
            why = f"its callbacks raised {type(exc).__name__}: {exc}"
        out.append((getattr(k, "name", repr(k)), str(why)))
    return out


class NativeKernel:
    """The ATen implementation of any op with a callable target, or the reference
    ``execute`` of a custom op that has one.

    It writes into the node's preassigned storage through the op's ``.out`` overload when one
    exists; otherwise it computes a fresh result and copies it in (a counted copy).  The executor
    binds it directly into generated code, so it has no generic ``execute`` hot path.
    """

    name = "native"
    op = "*"
    priority = -(10 ** 9)

    def supports(self, node: Node) -> bool:
        if node.target is not None:
            return True
        op = get_op(node.op)
        return op is not None and callable(getattr(op, "execute", None))

    def execute(self, ctx, node, state, inputs, out, workspace):  # pragma: no cover - bound in codegen
        raise RuntimeError("the native kernel is bound by the executor, not called generically")


NATIVE = NativeKernel()
