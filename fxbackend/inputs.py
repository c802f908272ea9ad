"""Call arguments checked against a plan's input metadata: one validator for every plan.

:func:`check_inputs` is what a compiled plan (``executor.concretize``, ``Plan.__call__``) and
a replayed one (:class:`fxbackend.exported.ExportedPlan`) check a call with.  It reads
metadata only and never runs a kernel; a tensor it copies (``strides="relayout"``) is the only
tensor it makes.

Contract: every failure is an ``error`` (a ``ValueError`` unless the caller names a subclass)
whose message starts with the input's label (``input 0 (x)``, ``input 'x'``) and says what was
expected and what was given.  The checks, in order: the count; per input its kind (tensor or
Python number), dtype, device type, number of dims and every fixed size; symbolic sizes bound
from the first input that has them (the same symbol must have one value, inside its
:class:`SymbolRange` where one is given); sizes that are expressions of symbols (``2*s0``)
solved or checked once every plain symbol is bound; last, strides (``"check"`` or
``"relayout"``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from .ir import Node, ScalarMeta, TensorMeta

__all__ = ["check_inputs", "SymbolRange", "substitute", "is_dense", "relaid"]

#: what ``check_inputs(strides=...)`` does with a tensor laid out otherwise than its metadata
#: says (size-1 dims are free): ``ignore`` it, ``check`` (an error), or ``relayout`` (a dense
#: copy in the expected layout; an error where that layout is not dense)
STRIDE_RULES = ("ignore", "check", "relayout")


@dataclasses.dataclass(frozen=True)
class SymbolRange:
    """The range a symbolic size was exported for: ``min <= value <= max`` (``max`` None: no
    upper bound), and ``hint``, the value it had in the example inputs (None: unknown)."""

    min: int
    max: int | None
    hint: int | None = None


def substitute(d: Any, bind: Mapping) -> Any:
    """``d`` (an int or a sympy expression) with the symbols of ``bind`` replaced by their
    ints: an int when every symbol of ``d`` is bound."""
    if type(d) is int:
        return d
    import sympy
    v = d.xreplace({s: sympy.Integer(x) for s, x in bind.items()})
    return int(v) if getattr(v, "is_Integer", False) else v


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely without overlap (a permutation of
    contiguous strides; size-1 dims are free)."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def relaid(v: torch.Tensor, stride: tuple) -> torch.Tensor:
    """A copy of ``v`` with the dense layout ``stride``."""
    return torch.empty_strided(v.shape, stride, dtype=v.dtype, device=v.device).copy_(v)


def check_inputs(nodes: Sequence[Node], values: Sequence[Any], labels: Sequence[str], *,
                 metas: Mapping[Node, Any] | None = None,
                 ranges: Mapping[Any, SymbolRange] | None = None,
                 strides: str = "ignore",
                 fixed: Mapping[Node, Any] | None = None,
                 scalar_tensors: bool = False,
                 error: type[ValueError] = ValueError) -> tuple[list, dict]:
    """Check ``values`` (one per node of ``nodes``, the plan's input nodes) against the
    nodes' metadata; returns ``(values, bind)``: a new list of the values (a tensor relaid as
    ``strides="relayout"`` asks, a 0-dim tensor given for a number read as its value with
    ``scalar_tensors``) and ``{symbol: int}`` for every symbolic size.

    - ``labels[i]`` names input i in errors (``"input 0 (x)"``, ``"input 'x'"``).
    - ``metas`` (default: each node's ``meta``): the metadata to check against; sizes and
      strides may be sympy expressions.
    - ``ranges``: the range each symbol must lie in (None: any value).
    - ``strides``: one of :data:`STRIDE_RULES`.
    - ``fixed``: scalar inputs with the one value this plan was built for.
    - ``error``: the exception class raised (a ``ValueError`` subclass).
    """
    if strides not in STRIDE_RULES:
        raise ValueError(f"check_inputs: strides must be one of {STRIDE_RULES}, got {strides!r}")
    if len(values) != len(nodes):
        raise error(f"expected {len(nodes)} inputs, got {len(values)}")
    check = _Check(ranges or {}, error)
    values = list(values)
    # checked last, once every symbol is bound: the tensors whose strides are not the
    # metadata's as they stand (a plan's call pays only this comparison)
    laid_out = []
    for i, (n, what) in enumerate(zip(nodes, labels)):
        m = n.meta if metas is None else metas[n]
        if isinstance(m, TensorMeta):
            check.tensor(what, m, values[i])
            if strides != "ignore" and values[i].stride() != m.stride:
                laid_out.append((i, what, m))
        elif isinstance(m, ScalarMeta):
            values[i] = check.scalar(what, m, values[i], n.annotations.get("expr"),
                                     scalar_tensors)
            if fixed is not None and n in fixed and values[i] != fixed[n]:
                raise error(f"{what}: this plan was built for {fixed[n]}, got {values[i]}")
    if check.pending:
        check.pending_sizes()
    for i, what, m in laid_out:
        values[i] = check.layout(what, m, values[i], strides == "relayout")
    return values, check.bind


class _Check:
    """The state of one :func:`check_inputs` call: the symbols bound so far and the sizes
    that are expressions of symbols, checked once every plain symbol is bound."""

    def __init__(self, ranges: Mapping[Any, SymbolRange], error: type[ValueError]) -> None:
        self.ranges = ranges
        self.error = error
        self.bind: dict = {}
        self.pending: list = []  # (label, dim, expression, size given)

    def tensor(self, what: str, m: TensorMeta, v: Any) -> None:
        err = self.error
        if not isinstance(v, torch.Tensor):
            raise err(f"{what}: expected a tensor {m.short()}, got {type(v).__name__}")
        if v.dtype != m.dtype:
            raise err(f"{what}: expected dtype {m.dtype}, got {v.dtype}")
        if v.device.type != m.device.type:
            raise err(f"{what}: expected a tensor on {m.device}, got {v.device}")
        shape = tuple(v.shape)
        if shape == m.shape:
            return  # every size fixed and equal (a symbolic size never equals an int)
        if len(shape) != len(m.shape):
            raise err(f"{what}: expected {len(m.shape)} dims ({m.short()}), got shape "
                      f"{shape}")
        for d, (want, got) in enumerate(zip(m.shape, shape)):
            if type(want) is int:
                if want != got:
                    raise err(f"{what}: dim {d} is {got}, expected {want} (expected shape "
                              f"{m.short()}, got {shape})")
            elif getattr(want, "is_Symbol", False):
                self.symbol(f"{what}: dim {d}", want, int(got))
            else:
                self.pending.append((what, d, want, int(got)))

    def scalar(self, what: str, m: ScalarMeta, v: Any, expr: Any, from_tensor: bool) -> Any:
        if from_tensor and isinstance(v, torch.Tensor) and v.dim() == 0:
            v = v.item()
        if not isinstance(v, (int, float, bool)) or \
                (m.kind is int and (isinstance(v, bool) or not isinstance(v, int))):
            raise self.error(f"{what}: expected a Python {m.kind.__name__}, got "
                             f"{type(v).__name__}")
        if getattr(expr, "is_Symbol", False):
            self.symbol(what, expr, v)
        return v

    def symbol(self, what: str, sym: Any, value: int) -> None:
        bind = self.bind
        if sym in bind and bind[sym] != value:
            raise self.error(f"{what} is {value}, but the same symbolic size {sym} is "
                             f"{bind[sym]} elsewhere")
        rng = self.ranges.get(sym)
        if rng is not None and (value < rng.min or (rng.max is not None and value > rng.max)):
            hi = "inf" if rng.max is None else rng.max
            raise self.error(f"{what} is {value}, outside the range [{rng.min}, {hi}] the plan "
                             f"was exported for ({sym})")
        bind[sym] = value

    def pending_sizes(self) -> None:
        for what, d, expr, got in self.pending:
            unbound = [s for s in expr.free_symbols if s not in self.bind]
            if len(unbound) == 1:
                self.solve(what, d, expr, unbound[0], got)
            elif unbound:
                raise self.error(f"{what}: dim {d} is {got}, but the plan's size {expr} "
                                 f"depends on {sorted(map(str, unbound))}, which no other input "
                                 f"determines")
            want = substitute(expr, self.bind)
            if want != got:
                bound = ", ".join(f"{s}={v}" for s, v in self.bind.items()) or "no sizes bound"
                raise self.error(f"{what}: dim {d} is {got}, but the plan needs {expr} = {want} "
                                 f"here ({bound})")

    def solve(self, what: str, d: int, expr: Any, sym: Any, got: int) -> None:
        """Bind ``sym`` from ``expr(sym) == got`` for an expression linear in it (the derived
        dims of ``torch.export``: ``a * s + b``)."""
        import sympy
        partial = expr.xreplace({s: sympy.Integer(v) for s, v in self.bind.items()})
        b = partial.xreplace({sym: sympy.Integer(0)})
        a = partial.xreplace({sym: sympy.Integer(1)}) - b
        if not (getattr(a, "is_Integer", False) and getattr(b, "is_Integer", False)) or a == 0 \
                or sympy.expand(partial - (a * sym + b)) != 0:
            raise self.error(f"{what}: dim {d} is {got}; cannot solve {expr} = {got} for {sym}")
        q, rem = divmod(got - int(b), int(a))
        if rem:
            raise self.error(f"{what}: dim {d} is {got}, but the plan needs it to be {expr} for "
                             f"an integer {sym}")
        rng = self.ranges.get(sym)
        if rng is not None and (q < rng.min or (rng.max is not None and q > rng.max)):
            hi = "inf" if rng.max is None else rng.max
            lo_size = substitute(expr, {sym: rng.min})
            hi_size = "inf" if rng.max is None else substitute(expr, {sym: rng.max})
            raise self.error(f"{what}: dim {d} is {got}, outside the range the plan was "
                             f"exported for: {expr} with {sym} in [{rng.min}, {hi}], i.e. "
                             f"{lo_size} to {hi_size}")
        self.symbol(f"{what}: dim {d}", sym, q)

    def layout(self, what: str, m: TensorMeta, v: torch.Tensor, relayout: bool) -> torch.Tensor:
        stride = tuple(substitute(s, self.bind) for s in m.stride)
        if all(sz <= 1 or a == b for sz, a, b in zip(v.shape, v.stride(), stride)):
            return v
        if not relayout or not is_dense(v.shape, stride):
            raise self.error(f"{what}: expected strides {stride}, got {v.stride()}")
        return relaid(v, stride)
