"""Helpers for the extension-API tests (custom ops, kernels, services, extension loading).

- hand-built graphs: :func:`contiguous_meta`, :func:`graph_of`, :func:`set_outputs`,
  :func:`compiled`;
- whole models: :func:`eager_and_compiled` (a diffusers model of ``fxbackend.models`` eager and
  through the backend), :func:`rel_err`;
- registrations that undo themselves: the ``reg`` fixture (``reg.op(...)``,
  ``reg.kernel(device, k)``, ``reg.fusion(device, rule)``) and :func:`rule_on_top` (a fusion
  rule registered above the shipped ones for a ``with`` block);
- ``registry_guard``: a fixture that fails a test which leaves an op, kernel or fusion rule
  registered (registrations are global: a leak would change what other tests select), and
  removes the leftovers so that later tests start clean.

Test modules import the fixtures by name (``from ext_util import reg, registry_guard``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import pytest
import torch

import fxbackend
import fxbackend.models
from fxbackend import Graph, Node, TensorMeta, contiguous_strides
from fxbackend import fusion as _fusion
from fxbackend import ops as _ops
from fxbackend import registry as _registry

CPU = torch.device("cpu")


def contiguous_meta(shape: Sequence[int], dtype: torch.dtype = torch.float32,
                    device: torch.device = CPU) -> TensorMeta:
    return TensorMeta(tuple(shape), contiguous_strides(shape), dtype, device)


def graph_of(*shapes: Sequence[int], dtype: torch.dtype = torch.float32) -> tuple[Graph, list]:
    """A graph with one contiguous CPU input per shape; returns ``(graph, input_nodes)``."""
    g = Graph()
    xs = [g.append(g.new_node("input", meta=contiguous_meta(s, dtype), is_input=True))
          for s in shapes]
    return g, xs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|, in float32."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def eager_and_compiled(family: str, size: str = "tiny", dtype: torch.dtype = torch.float32,
                       options: dict | None = None) -> tuple:
    """``(eager output, compiled output, model)``: the model ``family``/``size`` of
    ``fxbackend.models`` in ``dtype`` run on its inputs eagerly, then through
    ``torch.compile(backend="fxbackend", options=options)`` (which compiles on that call),
    without grad."""
    model = fxbackend.models.build_model(family, size, dtype=dtype)
    inputs = fxbackend.models.make_inputs(family, size, dtype=dtype)
    with torch.no_grad():
        ref = fxbackend.models.run_eager(model, inputs)
        out = fxbackend.models.run_eager(
            torch.compile(model, backend="fxbackend", options=options), inputs)
    return ref, out, model


def set_outputs(g: Graph, *nodes: Node) -> None:
    for n in nodes:
        n.is_output = True
    g.outputs = list(nodes)


def compiled(g: Graph, **options: Any) -> fxbackend.CompiledGraph:
    """A CompiledGraph with explicit options (the environment's FXB_* switches do not apply)."""
    return fxbackend.CompiledGraph(g, fxbackend.Options(**options))


class LikeFirst:
    """Op base: the output has the first source's shape and dtype, contiguous."""

    attrs: dict = {}

    def infer_meta(self, srcs, attrs):
        return contiguous_meta(srcs[0].shape, srcs[0].dtype, srcs[0].device)


# -- registrations ---------------------------------------------------------------------------------

class Registrations:
    """Registers through fxbackend and remembers how to undo it (last first)."""

    def __init__(self) -> None:
        self._undo: list = []

    def op(self, op: Any) -> Any:
        inst = fxbackend.register_op(op)
        self._undo.append(("op", inst.name, inst))
        return inst

    def kernel(self, device: str, kernel: Any) -> Any:
        kernel = fxbackend.register_kernel(device, kernel)  # the instance, for a class
        self._undo.append(("kernel", device, kernel))
        return kernel

    def fusion(self, device: str, rule: Any) -> Any:
        fxbackend.register_fusion(device, rule)
        self._undo.append(("fusion", device, rule))
        return rule

    def undo(self) -> None:
        while self._undo:
            kind, key, obj = self._undo.pop()
            # a test may have unregistered it already (that is what some tests check)
            if kind == "op" and fxbackend.get_op(key) is obj:
                fxbackend.unregister_op(key)
            elif kind == "kernel" and obj in _registry.kernels_for(key, obj.op):
                fxbackend.unregister_kernel(key, obj)
            elif kind == "fusion" and obj in _fusion.fusions_for(key):
                fxbackend.unregister_fusion(key, obj)


@contextlib.contextmanager
def rule_on_top(rule: Any, name: str, device: str = "cpu") -> Iterator[Any]:
    """``rule`` renamed ``name`` and registered for ``device`` above the shipped rules (priority
    100) for the ``with`` block (a pattern test's rule with the torch implementation, or one
    whose kernel declines); unregistered on the way out, also on an error."""
    rule.name, rule.priority = name, 100
    fxbackend.register_fusion(device, rule)
    try:
        yield rule
    finally:
        fxbackend.unregister_fusion(device, rule)


@pytest.fixture
def reg(registry_guard):
    # depends on registry_guard so that the undo runs before the leak check
    r = Registrations()
    yield r
    r.undo()


def registry_snapshot() -> dict:
    kernels = {(dev, op, id(k)): (dev, k) for dev, by_op in list(_registry._kernels.items())
               for op, ks in list(by_op.items()) for k in ks}
    rules = {(dev, id(r)): (dev, r) for dev, rs in list(_fusion._rules.items()) for r in rs}
    return {"ops": dict(_ops._ops), "kernels": kernels, "rules": rules}


def restore_registry(before: dict) -> list[str]:
    """Unregister everything registered since ``before``; returns what was removed."""
    now = registry_snapshot()
    removed = []
    for name in set(now["ops"]) - set(before["ops"]):
        fxbackend.unregister_op(name)
        removed.append(f"op {name}")
    for key in set(now["kernels"]) - set(before["kernels"]):
        dev, k = now["kernels"][key]
        fxbackend.unregister_kernel(dev, k)
        removed.append(f"kernel {k.name} for {k.op} on {dev}")
    for key in set(now["rules"]) - set(before["rules"]):
        dev, r = now["rules"][key]
        fxbackend.unregister_fusion(dev, r)
        removed.append(f"fusion rule {r.name} on {dev}")
    return sorted(removed)


@pytest.fixture
def registry_guard():
    before = registry_snapshot()
    yield
    leaked = restore_registry(before)
    assert not leaked, f"the test left registrations behind: {leaked}"
